"""Capturing a decode step as a CUDA graph, and what to do when a capture fails.

- :func:`capture` records a function into a ``torch.cuda.CUDAGraph`` on a side stream. Unlike the
  ``torch.cuda.graph`` context manager, whose ``__exit__`` restores the caller's stream only after ``capture_end``
  returned, the stream is restored whatever ``capture_end`` or the function raised, and a capture the function broke
  is ended before its error propagates (a stream left capturing would fail every later kernel on it).
- :class:`CapturePolicy` decides, from the failures so far, whether a step is captured: an out-of-memory error frees
  and retries the same graph at a later call (other graphs, smaller buckets among them, are captured meanwhile), up
  to ``oom_retries`` times; any other error means the model cannot be captured, and the steps run eagerly from then
  on, with one warning. It holds no CUDA state: tests/tasks/test_capture.py feeds it exceptions on the CPU.
- A failed capture leaves its memory pool unusable once its graph is gone: the next ``capture_begin`` into it fails
  PyTorch's internal assertion ``use_count > 0`` (in the device allocator, and in the pinned host allocator even
  with the pool held by a ``torch.cuda.MemPool``; seen on an H200 with torch 2.11, docs/performance.md). The
  decoder takes a new pool after a failure.
- :func:`capture_mode`: under several ranks ``"thread_local"``, so the NCCL watchdog's calls in its own thread do
  not invalidate the capture (``cudaStreamCaptureModeThreadLocal``); ``"global"`` for one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Literal

import torch

log = logging.getLogger(__name__)

#: What an allocation failure says when it is not a ``torch.OutOfMemoryError`` (a CUDA call or cuBLAS's workspace).
ALLOC_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")


def is_out_of_memory(err: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a RuntimeError whose message says memory ran out."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in ALLOC_MESSAGES))


def capture_mode(world_size: int) -> Literal["global", "thread_local"]:
    """The stream capture mode for a process among ``world_size`` ranks (module docstring)."""
    if world_size < 1:
        raise ValueError(f"capture_mode: world size {world_size} must be >= 1")
    return "thread_local" if world_size > 1 else "global"


def world_size() -> int:
    """The ranks of the default process group (1 without one)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def capture(graph: torch.cuda.CUDAGraph, fn: Callable[[], object], *, pool, stream: torch.cuda.Stream,
            mode: str) -> object:
    """``fn()`` recorded into ``graph`` on ``stream`` (its output's tensors live in ``pool``); the caller's stream is
    current again on return or raise, and the capture is ended either way (``fn``'s error is the one raised)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            out = fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture is void either way; fn's error says why
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class CapturePolicy:
    """Whether to capture a graph (a hashable key: bucket, width, sampling), from the failures so far (module
    docstring).

    Args:
        oom_retries: captures of one key that may run out of memory before that key stays eager.
    """

    def __init__(self, oom_retries: int = 2):
        if oom_retries < 0:
            raise ValueError(f"CapturePolicy: oom_retries {oom_retries} must be >= 0")
        self.oom_retries = oom_retries
        self.eager = False  # a failure other than memory: no more captures
        self.ooms: dict[Hashable, int] = {}
        self._deferred: set[Hashable] = set()

    def should_capture(self, key: Hashable) -> bool:
        """Capture ``key`` now: no failure but memory so far, none for this key in this call, and fewer than
        ``oom_retries + 1`` for it in all."""
        return not self.eager and key not in self._deferred and self.ooms.get(key, 0) <= self.oom_retries

    def failed(self, key: Hashable, err: BaseException) -> Literal["retry", "eager"]:
        """Record a failed capture of ``key``: ``"retry"`` (out of memory: free, run this step eagerly, try again at
        a later call) or ``"eager"`` (every step eagerly from now on). Warns once for the latter, once a key for the
        former."""
        first_line = (str(err).splitlines() or [type(err).__name__])[0][:200]
        if is_out_of_memory(err):
            self.ooms[key] = self.ooms.get(key, 0) + 1
            self._deferred.add(key)
            left = self.oom_retries + 1 - self.ooms[key]
            log.warning("decode: out of memory capturing the step %s (%s); eager in this call, %s", key, first_line,
                        f"retried at a later call ({left} more tries)" if left > 0 else "eager from now on")
            return "retry"
        if not self.eager:
            log.warning("decode: the step could not be captured as a CUDA graph (%s); eager from now on, slower",
                        first_line)
        self.eager = True
        return "eager"

    def new_call(self) -> None:
        """A call begins: keys that ran out of memory in the last one may be tried again."""
        self._deferred.clear()

    def new_shape(self) -> None:
        """The buffers were reallocated: memory counts start over (an ``eager`` verdict stays)."""
        self._deferred.clear()
        self.ooms.clear()
