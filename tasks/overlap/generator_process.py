"""The in-process engine in its own process: the overlap's generator (``overlap.lag`` 1; tasks/overlap/concurrent.py).

:class:`GeneratorProcess` is a :class:`tasks.generation.rollout.RolloutEngine`. It holds its own copy of the policy in
shared memory, and a child process samples from that copy with the trainer's :class:`HFEngine`
settings, so generation runs on other cores while the trainer updates. :meth:`GeneratorProcess.sync_weights`
copies the trainer's weights into the shared copy; the loop calls it only between requests (after the previous
step's rollouts came back, before the next ones are asked for), so every request samples from exactly the
weights synced last: the lag is exact, and a seed gives one result. On a GPU the copy lives on the same device
and the sync is a device copy.

How the child starts (:func:`start_method`): on a CPU with one torch thread it is forked, ready in about 0.3 s with
every module it needs already imported; elsewhere it is spawned, a new Python importing torch and transformers (about
4 s on a CPU, more on a GPU with its runtime). A fork is not safe past one thread: GNU OpenMP, which torch's CPU
build uses, keeps the parent's thread pool in a forked child, and the child's first parallel region with two threads
hangs (measured: a 512 x 512 matmul after a fork, never done); with one thread a parallel region runs inline, as
PyTorch's DataLoader workers run; CUDA cannot be used in a forked child at all. The default run on 2 cores forks: its
first 16 steps took 3.3-3.7 s against 4.5-4.8 s spawned, while the spawned child's imports took one of the two cores
(docs/performance.md). The calls asked while a spawned child starts are made in this process
(:meth:`GeneratorProcess.generate`) with the child's engine settings on the same shared weights, where that computes
the child's bits (a CPU, the child's thread count), so the trainer's first steps do not wait for it and a run is the
same whichever calls were made where.

Failure handling: a child that dies (killed, out of memory, an exception) is reported as :class:`GeneratorDied`,
one line naming its exit code or error, and the run stops at its last checkpoint. A parent that dies closes its
end of the pipe, and the child leaves at its next read: no process is left behind. :meth:`close` stops the
child (terminating it if it does not answer). The child ignores SIGINT (a Ctrl-C at the terminal reaches the whole
process group: the parent, stopping its run, closes it) and leaves cleanly on SIGTERM, removing its multiprocessing
temporary folder (``pymp-*``, with the listener socket its replies' tensors are shared through on a GPU; on a CPU
they are copied into the reply, :func:`_pickle`). Its replies name
that folder, so the run can remove it after a SIGKILL (tasks/run.py ``Run.note_temp``). The folder is the child's
own: a child (forked or spawned) inherits the name of its parent's folder where the parent has one (CPython's
``multiprocessing.process.BaseProcess`` copies the parent's ``_config``, ``util.get_temp_dir`` reads it), and a run
removing it once the child is gone would remove the folder of its parent and of every later child, whose next reply
then cannot be sent; so the child forgets the inherited name and makes its own. A reply the child cannot send (its
tensors cannot be shared) comes back as an error that says so; a closed process is an error that says it was closed.

Shutdown order on a GPU: the child's weights are the parent's CUDA memory, shared through CUDA IPC, and PyTorch
counts the child's references (torch.multiprocessing, "Sharing CUDA tensors": the producer must outlive its
consumers' references, or it warns "Producer process has been terminated before all shared CUDA tensors
released" at exit). So the child drops the shared tensors' every reference (its model, its engine, the arguments
it was started with) before it acknowledges ``("stop",)``; :meth:`close` waits for that acknowledgement, joins the
child, and only then collects the released blocks (``torch.cuda.ipc_collect``), while the parent still holds its
copy. A child killed by a signal releases nothing, and PyTorch then keeps the blocks until the parent exits.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import process as mp_process
from multiprocessing import util as mp_util
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TypeVar

import torch
import torch.multiprocessing as mp

from tasks.generation.rollout import Generation, HFEngine, RolloutEngine
from tasks.model.bf16_copy import Bf16Copy
from tasks.model.lora import plain_state_dict
from tasks.model.solution_logp import solution_logp
from tasks.records.memory import own_peak_mb, reset_own_peak

log = logging.getLogger(__name__)

T = TypeVar("T")


def _twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s module tree copied over the very same parameters and buffers (no tensor copied): what one
    caller patches on its modules (a hook, the chunked head) the other does not see, and a sync reaches both."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared)


class GeneratorDied(RuntimeError):
    """The generator process stopped or failed; the run stops at its last checkpoint."""


def _serve(model_class: type, config, weights: dict[str, torch.Tensor], tokenizer, settings: dict, conn,
           threads: int, share: bool | None = None) -> None:
    """The child's loop, after a ``("ready",)`` once its model and engine are built: ``("generate", prompts, n,
    seed, greedy)`` -> ``("ok", (Generation, peak MiB, temporary folder))``, ``("logp", prompts, completions, mask,
    temperature, micro_batch_tokens, bf16)`` -> ``("ok", ([N] float64 log-probs, peak MiB, temporary folder))``
    (the likelihood screen's pass, tasks/model/solution_logp.py ``solution_logp``, on a bf16 copy of the weights where
    ``bf16``, kept and refreshed at each pass) or ``("error", text)`` (the peak: the child's own memory during that
    request, tasks/records/memory.py; the folder: multiprocessing's, made for the reply's tensors); ``("stop",)`` or
    a closed pipe (the parent is gone) ends it.

    The model is rebuilt from its class and config, and its parameters become the parent's shared tensors
    (``load_state_dict(assign=True)``: no copy), so the parent's syncs are what it samples from. ``("stop",)``
    releases them before it is acknowledged with ``("stopped",)`` (module docstring). ``share``: whether a reply's
    tensors are shared rather than copied into it (:func:`_pickle`; None: by the device, shared on a GPU).
    """
    torch.set_num_threads(threads)
    model = model_class(config)
    model.load_state_dict(weights, assign=True)
    weights.clear()  # the process's own arguments hold this dict until exit: the model is the one reference left
    model.to(settings["device"]).eval().requires_grad_(False)
    engine = HFEngine(model, tokenizer, **settings)
    half = Bf16Copy()
    share = torch.device(settings["device"]).type != "cpu" if share is None else share
    try:
        conn.send(("ready",))  # started: the parent stops drawing in its own process (GeneratorProcess.generate)
    except (BrokenPipeError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            del engine, model, half
            gc.collect()
            if torch.device(settings["device"]).type == "cuda":
                torch.cuda.synchronize()  # nothing of this process still reads the parent's memory
            try:
                conn.send(("stopped",))
            except (BrokenPipeError, OSError):
                pass
            return
        try:
            reset_own_peak(settings["device"])
            if msg[0] == "logp":
                prompts, completions, mask, temperature, micro_batch_tokens, bf16 = msg[1:]
                done = solution_logp(half.of(model) if bf16 else model, prompts, completions, mask,
                                     tokenizer.pad_token_id, temperature, micro_batch_tokens, settings["device"])
            else:
                prompts, n, seed, greedy, first = msg[1:]
                done = engine.generate(prompts, n, seed, greedy, first=first)
            out = ("ok", (done, own_peak_mb(settings["device"]), mp_util.get_temp_dir()))
        except Exception as err:  # noqa: BLE001 - sent to the parent, which stops the run with it
            out = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=5)}")
        try:  # pickled first, before a byte is sent: a GPU's tensors shared (CUDA IPC), a CPU's copied in (_pickle)
            reply = _pickle(out, share)
        except Exception as err:  # noqa: BLE001 - the parent stops the run with it
            reply = ForkingPickler.dumps(("error", f"the reply could not be sent: {type(err).__name__}: {err} "
                                                   f"(temporary folder {mp_util.get_temp_dir()})\n"
                                                   f"{traceback.format_exc(limit=5)}"))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, OSError):  # the parent is gone
            return


def _pickle(reply, share: bool) -> bytes | memoryview:
    """The child's reply as bytes. Where ``share``, its tensors are shared (torch's reductions in
    ``ForkingPickler``: CUDA IPC handles on a GPU, no copy; on a CPU a file each in the temporary folder, through
    its listener); else copied into the bytes, as the child does on a CPU: a step's rollouts are tens of kilobytes,
    and sharing them cost 4.2 ms a reply against 1.2 ms copied (64 rollouts of the tiny policy, dumped and loaded in
    one process), and a default run's draws 8 ms a step (docs/performance.md)."""
    if share:
        return ForkingPickler.dumps(reply)
    return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)


def _child(parent_end, *args) -> None:
    """The child process: Ctrl-C is the parent's to handle (it closes the child), SIGTERM exits through the exit
    handlers (which remove the multiprocessing folder); its own multiprocessing temporary folder (not the parent's,
    whose name a child inherits: module docstring); a forked child closes the parent's end of the pipe it inherited
    (``parent_end``; None when spawned), so that the parent's death still ends its reads; then :func:`_serve`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    mp_process.current_process()._config.pop("tempdir", None)  # no public way to forget it
    if parent_end is not None:
        parent_end.close()
    _serve(*args)


def fork_safe(device: torch.device | str, threads: int) -> bool:
    """Whether a child on ``device`` with ``threads`` torch threads may be forked (module docstring): a CPU, one
    thread (GNU OpenMP and CUDA are not fork-safe)."""
    return torch.device(device).type == "cpu" and threads == 1


def start_method(device: torch.device | str, threads: int) -> str:
    """How the child starts (module docstring): ``fork`` where :func:`fork_safe` on Linux, else ``spawn`` (macOS
    forks, but a forked child of a process with threads may crash in its system libraries, so Python spawns there)."""
    return "fork" if fork_safe(device, threads) and sys.platform.startswith("linux") else "spawn"


class GeneratorProcess(RolloutEngine):
    """A rollout engine whose sampling runs in a child process on a shared-memory copy of the policy.

    Args:
        engine: the trainer's in-process engine (its sampling settings are kept).
        weights: the frozen plain model the child samples from (``Policy.merged_copy``: merged under LoRA); on a
            CPU it is moved to shared memory, on a GPU shared through CUDA IPC.
        threads: torch threads of the child.
        poll_s: how often a wait checks that the child is alive.
        on_temp_dir: called with the child's temporary folder and pid once a reply names it (the run records it).
        start: ``fork`` or ``spawn``; None: :func:`start_method`'s (a test spawns on a CPU to see the draws made here).
    """

    def __init__(self, engine: HFEngine, threads: int, weights: torch.nn.Module, poll_s: float = 0.5,
                 on_temp_dir: Callable[[str, int], None] | None = None, start: str | None = None):
        self.model = weights.requires_grad_(False)  # frozen, as the child's: a parameter's flag changes a pass's bits
        if next(self.model.parameters()).device.type == "cpu":
            self.model.share_memory()
        self.poll_s = poll_s
        #: the child's peak memory (MiB) during the last generation (tasks/records/memory.py); None before one
        self.peak_mb: float | None = None
        #: the child's multiprocessing temporary folder (None before its first reply)
        self.temp_dir: str | None = None
        self._on_temp_dir = on_temp_dir
        device = next(self.model.parameters()).device
        self.start = start or start_method(device, threads)
        if self.start == "fork" and not fork_safe(device, threads):
            raise ValueError(f"a forked generator process runs on a CPU with one torch thread (GNU OpenMP and CUDA are "
                             f"not fork-safe), not on {device} with {threads}")
        ctx = mp.get_context(self.start)
        self._conn, child = ctx.Pipe()
        args = (type(self.model), self.model.config, self.model.state_dict(), engine.tok, engine.settings(), child,
                threads)
        self._closed = False
        self._threads, self._ready, self._started = threads, False, time.perf_counter()
        #: on a CPU, the same sampling on the same shared weights in this process, for the draws asked for while the
        #: child starts: a module tree of its own (:func:`_twin`), as the screen patches ``self.model``'s head
        #: meanwhile, and a tokenizer of its own, as a fast tokenizer's padding state is not safe across threads
        self._here = (HFEngine(_twin(self.model), copy.deepcopy(engine.tok), **engine.settings())
                      if next(self.model.parameters()).device.type == "cpu" else None)
        #: generate calls made here, in this process, while the child was starting; whether the last one was
        self.drawn_here, self._last_here = 0, False
        #: the likelihood screen's passes asked of it (:meth:`solution_logp`); a bf16 copy for those made here
        self.passes, self._here_half = 0, Bf16Copy()
        self._proc = ctx.Process(target=_child, args=(self._conn if self.start == "fork" else None, *args),
                                 name="rlsift-generator", daemon=True)
        self._proc.start()
        child.close()
        log.info("generator process %d %s (%d torch thread%s)", self._proc.pid,
                 "forked" if self.start == "fork" else "started", threads, "s"[:threads != 1])

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        """The child's generation; while a spawned child is still starting (importing torch and transformers, about
        4 s on a CPU), this process's own, where that computes the same bits (:meth:`_here_alike`)."""
        return self._ask(("generate", prompts, n, seed, greedy, first),
                         lambda: self._here.generate(prompts, n, seed, greedy, first=first), generation=True)

    def solution_logp(self, prompts: list[torch.Tensor], completions: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float, micro_batch_tokens: int, bf16: bool) -> torch.Tensor:
        """[N] float64 the completions' log-probs (tasks/model/solution_logp.py ``solution_logp``) on the child's copy
        of the weights, a bf16 copy of it where ``bf16``: the likelihood screen's pass in this process's place
        (``select.screen_process``, tasks/selection/screen.py); while a spawned child is still starting, here, as
        :meth:`generate`. The child serves one request at a time: ask from the thread that draws."""
        def here() -> torch.Tensor:
            model = self._here_half.of(self._here.model) if bf16 else self._here.model
            return solution_logp(model, prompts, completions, completion_mask, self._here.tok.pad_token_id,
                                 temperature, micro_batch_tokens, self.model.device)

        self.passes += 1
        return self._ask(("logp", prompts, completions, completion_mask, temperature, micro_batch_tokens, bf16), here,
                         generation=False)

    def _ask(self, request: tuple, here: Callable[[], T], generation: bool) -> T:
        """The child's answer to ``request``; ``here()`` instead while a spawned child is still starting, where this
        process computes the child's bits (:meth:`_here_alike`). A ``generation`` sets what :meth:`metrics` reports
        (where it was made, the child's peak memory during it)."""
        if self._closed:
            raise GeneratorDied(f"the generator process (pid {self._proc.pid}) was closed (by its sampler): nothing "
                                "may generate with it any more")
        if not self._proc.is_alive():
            raise GeneratorDied(self._why())
        try:
            made_here = not self.ready(wait=not self._here_alike())  # the child is starting
            if generation:
                self._last_here = made_here
            if made_here:
                self.drawn_here += generation
                return here()
            self._conn.send_bytes(_pickle(request, share=False))  # a pass's token tensors copied in, not shared
            status, out = self._receive()
        except (EOFError, BrokenPipeError, ConnectionResetError) as err:
            raise GeneratorDied(self._why(err)) from None
        except OSError as err:  # its tensors could not be fetched (from the listener in the child's folder)
            raise GeneratorDied(f"the generator process (pid {self._proc.pid}): its reply could not be received: "
                                f"{type(err).__name__}: {err}") from err
        if status != "ok":
            raise GeneratorDied(f"the generator process failed: {out.strip().splitlines()[0]}\n{out}")
        done, peak_mb, temp_dir = out
        if generation:
            self.peak_mb = peak_mb
        if temp_dir != self.temp_dir:
            self.temp_dir = temp_dir
            if self._on_temp_dir is not None:
                self._on_temp_dir(temp_dir, self.pid)
        return done

    def _here_alike(self) -> bool:
        """Whether a generate call in this process computes the child's bits: the same engine on the same shared
        copy, on a CPU, with as many torch threads as the child (the sums' split follows the threads)."""
        return self._here is not None and torch.get_num_threads() == self._threads

    def ready(self, wait: bool = False) -> bool:
        """Whether the child has started and said so (``wait``: until it has)."""
        if not self._ready and (wait or self._conn.poll()):
            status = self._receive()[0]
            if status != "ready":
                raise GeneratorDied(f"the generator process (pid {self._proc.pid}) said {status!r} before it was "
                                    "ready")
            self._ready, self._here = True, None  # the child draws from now on: this process's engine goes
            log.info("generator process %d ready %.1f s after its start; %d generate call%s made here meanwhile",
                     self._proc.pid, time.perf_counter() - self._started, self.drawn_here,
                     "s"[:self.drawn_here != 1])
        return self._ready

    def _said_ready(self) -> bool:
        """:meth:`ready` for :meth:`close`: False where the child is still starting or said something else."""
        try:
            return self.ready()
        except (GeneratorDied, EOFError, OSError):
            return False

    def _receive(self):
        """The child's next message, checking every ``poll_s`` that it is alive."""
        while not self._conn.poll(self.poll_s):
            if not self._proc.is_alive():
                raise GeneratorDied(self._why())
        return self._conn.recv()

    def watch_temp(self, on_temp_dir: Callable[[str, int], None]) -> None:
        """Call ``on_temp_dir`` with the child's temporary folder and pid from now on, and at once where a reply has
        named it already (a process started by the overlap probe, handed to the training: tasks/overlap/concurrent.py
        ``SamplerHandover``)."""
        self._on_temp_dir = on_temp_dir
        if self.temp_dir is not None:
            on_temp_dir(self.temp_dir, self.pid)

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.is_alive()

    def metrics(self) -> dict[str, float]:
        """``memory/generator_peak_mb``: the child's own peak memory during its last generation; instead
        ``overlap/drawn_here`` 1.0 where that generation was made here while the child started."""
        if self._last_here:
            return {"overlap/drawn_here": 1.0}
        return {"memory/generator_peak_mb": self.peak_mb} if self.peak_mb is not None else {}

    def _why(self, err: BaseException | None = None) -> str:
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
        return f"the generator process (pid {self._proc.pid}) died ({how}{f'; {err}' if err else ''})"

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, tokenizer, folder: str | Path) -> float:
        """Copy ``model``'s weights (merged, under LoRA) into the shared copy (call only while no request is in
        flight)."""
        t0 = time.perf_counter()
        src = plain_state_dict(model)
        for name, dst in self.model.state_dict().items():
            dst.copy_(src[name])
        return time.perf_counter() - t0

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child (it releases the shared weights, acknowledges, exits), then collect what it released;
        terminate it (SIGTERM: it leaves cleanly) when it does not stop within ``timeout`` seconds (0: at once, e.g.
        for a run that is stopping, whose child may be in the middle of a generation). A child still starting (its
        imports, seconds: a run of a few steps ends before it is ready) is terminated at once: it has made no
        temporary folder and sampled nothing, and waiting for it to start only to stop it cost 2.6 s a short run."""
        self._closed = True
        if self._proc.is_alive() and timeout > 0 and self._said_ready():
            try:
                self._conn.send(("stop",))
                while self._conn.poll(timeout):  # a reply to a request abandoned by a failure may come first
                    if self._conn.recv()[0] == "stopped":  # the child holds no shared tensor any more
                        break
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()  # SIGKILL; a child that exited since the check is not an error
            self._proc.join()
        self._conn.close()
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.ipc_collect()  # the blocks the child released (module docstring: shutdown order)
