"""Peak memory of each phase of a step: ``memory/<phase>_peak_mb`` metrics.

On a CUDA device the figure is PyTorch's peak of allocated device memory (``torch.cuda.max_memory_allocated``, its
peak reset when a phase starts); on a CPU it is the process's peak resident set (Linux's ``VmHWM``, reset when a
phase starts by writing 5 to ``/proc/self/clear_refs``). Where the reset is not allowed, the CPU figure is the
process's peak so far, and ``resettable`` says so.

What a phase's figure holds: everything this process allocated while the phase ran. With ``overlap.lag`` 1 the
next step's draw runs in a thread beside the update, so the update's peak includes what the draw allocated at the
same time; the in-process engine's generation then runs in its own process, whose peak is reported by
:func:`own_peak_mb` there (``memory/generator_peak_mb``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch

MB = 2.0 ** 20
_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _rss_peak_mb() -> float:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return 0.0
    return int(m.group(1)) / 1024 if m else 0.0


def _reset_rss_peak() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def own_peak_mb(device: torch.device | str) -> float:
    """This process's peak since the last reset: CUDA allocated memory on a CUDA ``device``, else resident set."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return _rss_peak_mb()


def reset_own_peak(device: torch.device | str) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return _reset_rss_peak()


class PeakMemory:
    """Per-phase peaks of one process on ``device`` (``CostMeter.stage`` calls :meth:`phase` around each phase)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.resettable = True
        self._peaks: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        self.resettable = reset_own_peak(self.device) and self.resettable
        try:
            yield
        finally:
            self._peaks[name] = max(self._peaks.get(name, 0.0), own_peak_mb(self.device))

    def peak(self) -> float:
        """The peak of the phase running now, so far."""
        return own_peak_mb(self.device)

    def record(self, name: str, mb: float) -> None:
        """A phase's peak measured by another process (a killed run's last checkpoint write, which its resume
        reports at the step it continues from, as an uninterrupted run does)."""
        self._peaks[name] = max(self._peaks.get(name, 0.0), mb)

    def take(self) -> dict[str, float]:
        """``memory/<phase>_peak_mb`` of the phases run since the last call (the largest of each), then forget them."""
        out = {f"memory/{name}_peak_mb": v for name, v in self._peaks.items()}
        self._peaks = {}
        return out
