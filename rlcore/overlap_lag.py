"""Whether generation of step t+1 runs while update t does (``overlap.lag`` 1, AReaL's and verl's one step off;
tasks/overlap/concurrent.py): :func:`choose_lag` (ours; docs/algorithms.md section 8.3).

Where the sampler and the trainer run on different devices (a vLLM server; CPU cores for each) the draw hides
behind the update, or the update behind the draw, at no cost to either: lag 1. Where they share one device they
slow each other down by an amount no rule predicts (the
issue's toy on one GPU: 1.43x the sequential time; a 1.5B model: 0.88x), so a probe times one draw and one update
alone and at once (:class:`OverlapProbe`), and lag 1 is chosen only when at once takes at most ``1 - min_gain`` of
alone one after the other: a gain smaller than the probe's own noise, bought with rollouts one update old, does
not pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LagChoice", "OverlapProbe", "choose_lag"]


@dataclass(frozen=True)
class OverlapProbe:
    """One draw and one update of the same work, timed (seconds) on the device they share: ``draw_s`` and
    ``update_s`` each alone, one after the other (lag 0), and ``at_once_s`` from the start of both at once (the draw
    in the generator process, the update in the trainer, lag 1) until both are done; each the median of ``repeats``."""

    draw_s: float
    update_s: float
    at_once_s: float
    repeats: int = 1

    def __post_init__(self) -> None:
        for name in ("draw_s", "update_s", "at_once_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"OverlapProbe.{name} must be finite and > 0, got {v!r}")
        if self.repeats < 1:
            raise ValueError(f"OverlapProbe.repeats must be >= 1, got {self.repeats!r}")

    @property
    def sequential_s(self) -> float:
        return self.draw_s + self.update_s

    @property
    def ratio(self) -> float:
        """At once over one after the other: below 1, running them at once is faster."""
        return self.at_once_s / self.sequential_s


@dataclass(frozen=True)
class LagChoice:
    """The overlap's lag and why: ``basis`` ``config`` (``overlap.lag`` 0 or 1 set), ``devices`` (the sampler and
    the trainer run on different devices) or ``probe`` (they share one; ``probe`` holds the timing); ``reason``: one
    line for the run's summary, the plan and MLflow."""

    lag: int
    basis: Literal["config", "devices", "probe"]
    reason: str
    probe: OverlapProbe | None = None

    def __post_init__(self) -> None:
        if self.lag not in (0, 1) or isinstance(self.lag, bool):
            raise ValueError(f"LagChoice.lag must be 0 or 1, got {self.lag!r}")
        if self.basis not in ("config", "devices", "probe"):
            raise ValueError(f"LagChoice.basis must be config, devices or probe, got {self.basis!r}")
        if (self.basis == "probe") != (self.probe is not None):
            raise ValueError("LagChoice: a probe's timing goes with basis probe, and only with it")


def choose_lag(separate: str | None, probe: OverlapProbe | None, min_gain: float) -> LagChoice:
    """``overlap.lag=auto`` (module docstring, Overlap): 1 when ``separate`` says why the sampler and the trainer run
    on different devices; else, from ``probe``, 1 when at once takes at most ``1 - min_gain`` of one after the
    other, and 0 otherwise."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    if separate:
        return LagChoice(1, "devices", f"lag 1: the sampler and the trainer run on different devices ({separate})")
    if probe is None:
        raise ValueError("choose_lag: the sampler and the trainer share a device, and there is no probe to decide by")
    pays = probe.ratio <= 1 - min_gain
    timing = (f"a draw and an update at once took {probe.at_once_s:.3g} s, {probe.ratio:.2f}x the "
              f"{probe.sequential_s:.3g} s of one after the other (draw {probe.draw_s:.3g} s, update "
              f"{probe.update_s:.3g} s; median of {probe.repeats}) on the device they share")
    if pays:
        return LagChoice(1, "probe", f"lag 1: {timing}, at least {min_gain:.0%} faster", probe)
    return LagChoice(0, "probe", f"lag 0: {timing}, not {min_gain:.0%} faster", probe)
