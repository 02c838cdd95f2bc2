"""Generation and update at once: step t+1's rollouts are drawn while update t runs (``overlap.lag`` 1).

One-step-off asynchronous RL, as in AReaL (Fu et al. 2025, arXiv 2505.24298, with its decoupled loss, section 5),
verl's one-step-off policy and prime-rl's ``max_async_level`` 1. docs/algorithms.md section 8 says what every
decision sees. The timeline of iteration t (W_v: the weights after v updates)::

    main thread:        [sync W_t -> sampler] [update t: W_t -> W_{t+1}] [wait] [observe t, log, checkpoint]
    background thread:                        [draw t+1 with W_t: round start, select, generate, verify]
    its second thread:                                                  [look-ahead for t+2]

so step t+1 samples from W_t, one update behind the W_{t+1} a sequential loop would use, exactly: the sampler's
weights are synced only while nothing is in flight, so the lag never depends on which side finished first. Where
nothing between them reads or writes what a draw does, the draw of step t+2 is launched right after step t's observe,
beside its records (tasks/training/loop.py ``launch_ahead``): the same weights W_{t+1}, the same run.

The sampler is a :class:`Sampler`:

- the in-process engine: a :class:`tasks.overlap.generator_process.GeneratorProcess` (a child process with its own
  shared-memory copy of the policy, each side on its own torch threads);
- an engine outside this process (vLLM): requests in flight from the background thread; the weights are pushed
  to the server before every draw, not only at round boundaries.

A run starts one generator process at most: where ``overlap.lag=auto`` probes the overlap on a shared device
(tasks/overlap/lag.py ``decide_lag``), the probe's process is kept for the training stage when it chooses lag 1
(:class:`SamplerHandover`, held by the run, closed with it on every error path) and the training samples from it
(:func:`open_sampler`) instead of starting a second one; so is the process the plan's probe of the overlap's split
started (tasks/plan/probe_split.py).

The likelihood screen (tasks/selection/screen.py) reads the sampler's copy of the weights, never the model the update
is changing. A draw's look-ahead work (the next step's screen pass, a round started ahead: ``Selector.lookahead``)
runs beside its generate call but only once the update it runs beside has ended (:meth:`Overlap.launch`): on the
trainer's cores while the trainer waits for the draw, not as a third thread beside both sides. On 2 cores that took
`grpo_prescreen`'s training steps from 43.8 s to 40.1 s a run (seed means, 3 seeds, 100 steps, interleaved; the
update 0.24 s a step rather than 0.32 s, the generate call as before; docs/benchmarks.md, "Every idea tried").
The screen reads the same weights either way, so the run is the same.

Deviations: one step in flight at most (lag 0 or 1); the background draw's own phases (selection,
reference rollouts, rollout) are reported as ``overlap/draw_*_s`` metrics, and the cost meter counts the trainer's
wall time only (waiting for a draw is its ``rollout`` phase), so device hours stay wall-clock hours.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.generation.rollout import HFEngine, RolloutEngine
from tasks.overlap.generator_process import GeneratorProcess
from tasks.policy import Policy

log = logging.getLogger("rlsift.train")


def thread_split(total: int, generator_threads: int | None) -> tuple[int, int]:
    """The in-process engine with lag 1: (generator process, trainer) torch threads out of ``total``: the
    generator's ``generator_threads`` (``overlap.generator_threads``; None: half), the trainer the rest (at least 1)."""
    gen = generator_threads or max(1, total // 2)
    return gen, max(1, total - gen)


def separate_devices(engine: RolloutEngine, device: torch.device | str, generator_threads: int | None) -> str | None:
    """Why the sampler and the trainer would run on different devices with lag 1, or None where they share one:
    an engine outside this process (vLLM); an in-process engine on another device than the trainer's; on a CPU,
    the generator's and the trainer's threads (:func:`thread_split`) fitting the cores this process may use."""
    if not isinstance(engine, HFEngine):
        return f"the sampler is {type(engine).__name__}, outside this process"
    sampler, trainer = torch.device(engine.device), torch.device(device)
    if sampler.type != trainer.type or (sampler.index or 0) != (trainer.index or 0):
        return f"the sampler on {sampler}, the trainer on {trainer}"
    if trainer.type != "cpu":
        return None
    gen, rest = thread_split(torch.get_num_threads(), generator_threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if gen + rest > cores:
        return None
    return f"CPU cores for each: {gen} generator and {rest} trainer thread{'s'[:rest != 1]} on {cores} cores"


class Sampler:
    """The policy the rollouts are drawn from, and how the trainer's weights reach it.

    Attributes:
        policy: what the draw uses (its ``model`` is the sampler's copy when the sampler has one; the likelihood
            screen reads it), and its ``engine`` generates.
    """

    def __init__(self, trainer: Policy, lag: int, *, threads: int | None = None, needs_copy: bool = False,
                 on_temp_dir: Callable[[str, int], None] | None = None):
        self.trainer, self.lag, self._threads = trainer, lag, threads
        self._process: GeneratorProcess | None = None
        self._copy: torch.nn.Module | None = None
        if lag == 0:
            self.policy = trainer
        elif isinstance(trainer.engine, HFEngine):
            total = torch.get_num_threads()
            gen, rest = thread_split(total, threads)
            self._process = GeneratorProcess(trainer.engine, gen, trainer.merged_copy(), on_temp_dir=on_temp_dir)
            self._trainer_threads = (total, rest)
            torch.set_num_threads(self._trainer_threads[1])
            self.policy = Policy(model=self._process.model, tokenizer=trainer.tokenizer, engine=self._process,
                                 system_prompt=trainer.system_prompt)
        else:  # a server: in-flight requests; a frozen copy only where the draw reads the weights itself
            self._copy = copy.deepcopy(trainer.model).eval().requires_grad_(False) if needs_copy else None
            self.policy = Policy(model=self._copy if self._copy is not None else trainer.model,
                                 tokenizer=trainer.tokenizer, engine=trainer.engine,
                                 system_prompt=trainer.system_prompt)

    @property
    def overlapped(self) -> bool:
        return self.lag > 0

    @property
    def apart(self) -> bool:
        """Whether the rollouts are generated apart from the trainer's threads (a generator process, or an engine
        outside this process), so that work of the trainer's process can run beside a generate call."""
        return self._process is not None or not isinstance(self.trainer.engine, HFEngine)

    @property
    def process(self) -> GeneratorProcess | None:
        """The generator process the draws run in (None: lag 0, or a server)."""
        return self._process

    def wait(self) -> None:
        """The sampler waits for the training stage (:class:`SamplerHandover`): the stages before it get every torch
        thread back; :meth:`resume` splits them again."""
        if self._process is not None:
            torch.set_num_threads(self._trainer_threads[0])

    def resume(self, on_temp_dir: Callable[[str, int], None] | None = None) -> None:
        """Back from :meth:`wait`: the trainer keeps its share of the threads; ``on_temp_dir`` hears of the
        generator's temporary folder (``GeneratorProcess.watch_temp``)."""
        if self._process is not None:
            torch.set_num_threads(self._trainer_threads[1])
            if on_temp_dir is not None:
                self._process.watch_temp(on_temp_dir)

    def fits(self, trainer: Policy, lag: int, threads: int | None) -> bool:
        """Whether this sampler serves a training of ``trainer`` with ``lag`` and ``overlap.generator_threads``
        ``threads`` (its generator process alive)."""
        return (self._process is not None and self._process.alive and self.trainer is trainer and self.lag == lag
                and self._threads == threads)

    @torch.no_grad()
    def sync(self, folder: str | Path) -> float:
        """Bring the sampler to the trainer's current weights (nothing may be in flight); returns seconds."""
        t0 = time.perf_counter()
        if self._copy is not None:
            self._copy.load_state_dict(self.trainer.model.state_dict())
        source = self._copy if self._copy is not None else self.trainer.model
        self.policy.engine.sync_weights(source, self.trainer.tokenizer, folder)
        return time.perf_counter() - t0

    def close(self, now: bool = False) -> None:
        """Stop the generator process (``now``: without waiting for a generation in flight: a failing or stopping
        run's; the draw waiting for it ends with ``GeneratorDied``)."""
        if self._process is not None:
            self._process.close(timeout=0.0 if now else 10.0)
            torch.set_num_threads(self._trainer_threads[0])
            self._process = None


class SamplerHandover:
    """The run's one generator process between the probe that started it and the training stage that samples from
    it (module docstring). The overlap probe keeps its :class:`Sampler` (:meth:`keep`) where it chose lag 1, the
    plan's probe of the overlap's split (tasks/plan/probe_split.py) the one it timed; the training takes it
    (:meth:`take`); the run holding the handover closes what is still kept when it closes (tasks/run.py
    ``Run.close``), so a stage failing between the probe and the training leaves no process."""

    def __init__(self) -> None:
        self._kept: Sampler | None = None

    @property
    def kept(self) -> Sampler | None:
        return self._kept

    def keep(self, sampling: Sampler) -> None:
        """Hold ``sampling`` (it waits, :meth:`Sampler.wait`) for :meth:`take`; one kept before is closed."""
        self.close()
        sampling.wait()
        self._kept = sampling

    def take(self, trainer: Policy, lag: int, threads: int | None,
             on_temp_dir: Callable[[str, int], None] | None = None) -> Sampler | None:
        """The kept sampler, resumed, where it serves this training (:meth:`Sampler.fits`); else None, and a
        kept one that does not is closed."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None
        if not kept.fits(trainer, lag, threads):
            kept.close()
            return None
        kept.resume(on_temp_dir)
        return kept

    def close(self, now: bool = False) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close(now=now)


def open_sampler(trainer: Policy, lag: int, *, threads: int | None = None, needs_copy: bool = False,
                    on_temp_dir: Callable[[str, int], None] | None = None,
                    handover: SamplerHandover | None = None) -> Sampler:
    """The training's sampler: the one ``handover`` kept from a probe (the overlap's, or the plan's split) where it
    serves this training, else a new :class:`Sampler` (same arguments)."""
    kept = handover.take(trainer, lag, threads, on_temp_dir) if handover is not None else None
    if kept is not None:
        log.info("rollouts: from the generator process a probe started (kept for the training, not started again)")
    return kept or Sampler(trainer, lag, threads=threads, needs_copy=needs_copy, on_temp_dir=on_temp_dir)


@dataclass(frozen=True)
class OverlapTimes:
    """One overlapped step's timing (seconds).

    Attributes:
        draw_s: the background draw's busy time; trainer_idle_s: the trainer's wait for it after its update;
        generator_idle_s: the sampler's wait for the trainer, from the end of the previous draw to the start of
        this one (0 for the first); overlap_s: time both sides worked at once.
    """

    draw_s: float
    trainer_idle_s: float
    generator_idle_s: float
    overlap_s: float

    def metrics(self) -> dict[str, float]:
        return {f"overlap/{k}": v for k, v in self.__dict__.items()}


class Overlap:
    """One draw in flight in a background thread: :meth:`launch` before the update (or between two, ahead),
    :meth:`update_ended` when the trainer's next update ends, :meth:`collect` after it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsift-draw")
        self._future: Future | None = None
        self._launched = 0.0
        self._last_end: float | None = None
        self._update = threading.Event()  # set when the update the draw in flight runs beside has ended

    def launch(self, draw: Callable[[Callable[[], None]], object]) -> None:
        """Start ``draw(after_update)`` in the background; ``after_update()`` returns once the trainer's next update
        has ended (:meth:`update_ended`; at once after :meth:`collect` or :meth:`close`), and the draw's look-ahead
        work waits on it (module docstring)."""
        if self._future is not None:
            raise RuntimeError("a draw is already in flight: collect it first")
        self._update = update = threading.Event()

        def timed():
            t0 = time.perf_counter()
            out = draw(update.wait)
            return out, t0, time.perf_counter()

        self._launched = time.perf_counter()
        self._future = self._pool.submit(timed)

    def update_ended(self) -> None:
        """The trainer's update ended (or failed): the draw in flight may run its look-ahead work."""
        self._update.set()

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def collect(self) -> tuple[object, OverlapTimes]:
        """Wait for the draw in flight; its result (an exception in the draw is raised here) and the timing."""
        if self._future is None:
            raise RuntimeError("no draw in flight")
        t_wait = time.perf_counter()
        self._update.set()  # nothing updates while the trainer waits
        future, self._future = self._future, None
        out, start, end = future.result()
        done = time.perf_counter()
        idle = 0.0 if self._last_end is None else max(0.0, start - self._last_end)
        self._last_end = end
        return out, OverlapTimes(draw_s=end - start, trainer_idle_s=done - t_wait, generator_idle_s=idle,
                                 overlap_s=max(0.0, min(end, t_wait) - max(start, self._launched)))

    def close(self) -> None:
        """Wait for a draw in flight (a failing run's), then stop the thread."""
        self._update.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
