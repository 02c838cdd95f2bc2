"""The GPU check's one-device overlap (run by infra/gpu-bench.py): the in-process sampler in a second process beside
update steps in this one, on one clock from a common start, against the two one after the other.

- One clock: both processes read ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, one clock for every process of
  the machine), so "at once" is the time from the common start to the later of the two ends, not the larger of the
  two sides' own durations.
- A common start: the sampler's process builds its model and warms up first, then sets ``ready`` and waits for
  ``go``; the update side takes its start time and sets ``go``. Nothing waits a fixed time.
- A dead child is noticed: every wait polls the child (``is_alive``) once a second and fails with its exit code;
  a child that runs out of memory reports it as its result.

Imports only torch and rlsift's modules that need no more than torch, transformers, peft, pydantic and numpy.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import torch

#: Messages of allocation failures that torch raises as plain RuntimeErrors (cuBLAS, the caching allocator; the
#: CPU allocator's, the CPU twin of the check).
ALLOC_MESSAGES = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "out of memory", "can't allocate memory")


def is_alloc_failure(err: BaseException) -> bool:
    """An allocation failure: ``torch.OutOfMemoryError``, or a RuntimeError that says so (cuBLAS's workspace)."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in ALLOC_MESSAGES))


class ChildDied(RuntimeError):
    """The sampler's process ended without a result."""


def _sampler(shape: dict, dtype, device: str, rows: int, new: int, repeats: int, ready, go, out) -> None:
    """The second process: its own model of the same shape on the same device; after ``go``, ``repeats`` draws;
    puts ``("ok", start, end)`` on one clock, or ``("oom", message)``."""
    import gpu_bench_generation as gen
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.model.attention import guard_attention

    try:
        guard_attention(device)  # a process of its own: the flags are per process
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype).eval()
        gen.draw(model, rows, 8, device)  # warm
        gen.sync(device)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides
        out.put(("oom", str(err)[:300]) if is_alloc_failure(err) else ("error", repr(err)[:300]))
        return
    ready.set()
    go.wait()
    start = time.perf_counter()
    try:
        for _ in range(repeats):
            gen.draw(model, rows, new, device)
        gen.sync(device)
    except Exception as err:  # noqa: BLE001
        out.put(("oom", str(err)[:300]) if is_alloc_failure(err) else ("error", repr(err)[:300]))
        return
    out.put(("ok", start, time.perf_counter()))


def _wait(proc, what, poll, timeout_s: float):
    """``poll()`` until it returns something, checking once a second that ``proc`` still lives."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        got = poll(1.0)
        if got is not None:
            return got
        if not proc.is_alive():
            got = poll(0.1)  # a result put just before exiting
            if got is not None:
                return got
            raise ChildDied(f"the sampler's process died while {what} (exit code {proc.exitcode})")
    proc.kill()
    raise ChildDied(f"the sampler's process took over {timeout_s:.0f} s while {what}")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_together(shape: dict, dtype, device, update_fn, *, rows: int, new: int, repeats: int, steps: int,
                 with_updates: bool, timeout_s: float = 900.0) -> dict[str, float]:
    """One measurement: the sampler's process (``repeats`` draws of ``rows`` x ``new`` tokens) started with
    ``steps`` calls of ``update_fn`` here (or none). Returns seconds from the common start: ``updates_end``,
    ``sampler_start``, ``sampler_end`` and ``together`` (the later end).

    Raises:
        ChildDied: the sampler's process died or hung; RuntimeError: it failed (``out of memory: ...`` for an
            allocation failure).
    """
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_sampler, args=(shape, dtype, str(device), rows, new, repeats, ready, go, out),
                       daemon=True)
    proc.start()

    def result(timeout: float):
        try:
            return out.get(timeout=timeout)
        except queue.Empty:
            return None

    try:
        early = _wait(proc, "building its model", lambda t: True if ready.wait(t) else result(0.0), timeout_s)
        if early is not True:  # it failed before it was ready
            raise RuntimeError(f"out of memory: {early[1]}" if early[0] == "oom" else early[1])
        t0 = time.perf_counter()
        go.set()
        updates_end = 0.0
        if with_updates:
            for _ in range(steps):
                update_fn()
            _sync(device)
            updates_end = time.perf_counter() - t0
        got = _wait(proc, "drawing", result, timeout_s)
        if got[0] != "ok":
            raise RuntimeError(f"out of memory: {got[1]}" if got[0] == "oom" else got[1])
        _, start, end = got
        return {"updates_end": updates_end, "sampler_start": start - t0, "sampler_end": end - t0,
                "together": max(updates_end, end - t0)}
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def overlap_rows(shape: dict, dtype, device, update_fn, *, rows: int, new: int, repeats: int,
                 steps: int) -> list[str]:
    """The table: update steps alone, the sampler alone, one after the other, and both from one start."""
    t0 = time.perf_counter()
    for _ in range(steps):
        update_fn()
    _sync(device)
    upd_alone = time.perf_counter() - t0
    alone = run_together(shape, dtype, device, update_fn, rows=rows, new=new, repeats=repeats, steps=steps,
                         with_updates=False)
    both = run_together(shape, dtype, device, update_fn, rows=rows, new=new, repeats=repeats, steps=steps,
                        with_updates=True)
    draw_alone = alone["sampler_end"] - alone["sampler_start"]
    seq = upd_alone + draw_alone
    return ["| update steps | draws | update alone s | sampler alone s | one after the other s | at once s "
            "(updates end, sampler end) | ratio |", "|---|---|---|---|---|---|---|",
            f"| {steps} | {repeats} x {rows} rows x {new} | {upd_alone:.2f} | {draw_alone:.2f} | {seq:.2f} | "
            f"{both['together']:.2f} ({both['updates_end']:.2f}, {both['sampler_end']:.2f}) | "
            f"{both['together'] / seq:.2f}x |"]
