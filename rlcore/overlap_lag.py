"""Whether generation of step t+1 runs while update t does (``overlap.lag`` 1, AReaL's and verl's one step off;
tasks/overlap/concurrent.py): :func:`choose_lag` (ours; docs/algorithms.md section 8.3).

Where the sampler and the trainer run on different devices (a vLLM server; CPU cores for each) the draw hides
behind the update, or the update behind the draw, at no cost to either: lag 1. Where they share one device they
slow each other down by an amount no rule predicts (docs/performance.md has the figures: slower than one after
the other for the tiny model on one GPU, faster for a 1.5B one), so a probe times one draw and one update
alone and at once (:class:`OverlapProbe`), and lag 1 is chosen only when at once takes at most ``1 - min_gain`` of
alone one after the other: a gain smaller than the probe's own noise, bought with rollouts one update old, does
not pay.

The probe pays for itself or is not run (:class:`ProbeWorth`): with the shorter phase hidden behind the longer, lag 1
saves at most min(draw, update) a step, so at most min(draw, update) x steps over the run's planned steps; a probe
predicted to cost more than that (:func:`probe_cost`: starting the generator process, its first call, the timed
repeats) cannot be earned back whatever it measures, and the run keeps lag 0 without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["LagChoice", "OverlapProbe", "ProbeWorth", "choose_lag", "probe_cost"]


@dataclass(frozen=True)
class OverlapProbe:
    """One draw and one update of the same work, timed (seconds) on the device they share: ``draw_s`` and
    ``update_s`` each alone, one after the other (lag 0), and ``at_once_s`` from the start of both at once (the draw
    in the generator process, the update in the trainer, lag 1) until both are done; each the median of ``repeats``."""

    draw_s: float
    update_s: float
    at_once_s: float
    repeats: int = 1
    start_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("draw_s", "update_s", "at_once_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"OverlapProbe.{name} must be finite and > 0, got {v!r}")
        if self.repeats < 1:
            raise ValueError(f"OverlapProbe.repeats must be >= 1, got {self.repeats!r}")
        if not math.isfinite(self.start_s) or self.start_s < 0:
            raise ValueError(f"OverlapProbe.start_s must be finite and >= 0, got {self.start_s!r}")

    @property
    def sequential_s(self) -> float:
        return self.draw_s + self.update_s

    @property
    def ratio(self) -> float:
        """At once over one after the other: below 1, running them at once is faster."""
        return self.at_once_s / self.sequential_s


def probe_cost(draw_s: float, update_s: float, start_s: float, budget_s: float, max_repeats: int) -> float:
    """Predicted seconds of the probe's work still to do once a draw and an update have been timed alone: starting
    the generator process and its first call (``start_s``), then R repeats of the draw and the update alone and both
    at once (at least the longer of the two), R = min(``max_repeats``, max(1, ceil(``budget_s`` / (draw + update)))):
    the probe repeats until the time one after the other adds up to ``budget_s``."""
    for name, v in (("draw_s", draw_s), ("update_s", update_s), ("start_s", start_s), ("budget_s", budget_s)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"probe_cost: {name} must be finite and >= 0, got {v!r}")
    if max_repeats < 1:
        raise ValueError(f"probe_cost: max_repeats must be >= 1, got {max_repeats!r}")
    sequential = draw_s + update_s
    repeats = min(max_repeats, max(1, math.ceil(budget_s / sequential))) if sequential > 0 else 1
    return start_s + repeats * (sequential + max(draw_s, update_s))


@dataclass(frozen=True)
class ProbeWorth:
    """Whether the overlap probe can pay for itself (module docstring): ``draw_s`` and ``update_s``, a step's draw
    and update alone (measured, or the plan's prediction); ``steps``: the steps the run plans; ``probe_s``: the
    probe's predicted cost (:func:`probe_cost`), of which ``start_s`` starts the generator process."""

    draw_s: float
    update_s: float
    steps: int
    probe_s: float
    start_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("draw_s", "update_s", "probe_s", "start_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"ProbeWorth.{name} must be finite and >= 0, got {v!r}")
        if self.steps < 0:
            raise ValueError(f"ProbeWorth.steps must be >= 0, got {self.steps!r}")

    @property
    def saving_s(self) -> float:
        """The most lag 1 could save over the run: the shorter phase hidden behind the longer every step."""
        return min(self.draw_s, self.update_s) * self.steps

    @property
    def pays(self) -> bool:
        return self.probe_s < self.saving_s

    def text(self) -> str:
        return (f"the probe, predicted at {self.probe_s:.3g} s ({self.start_s:.3g} s of it starting the generator "
                f"process), against at most {self.saving_s:.3g} s lag 1 could save (min(draw {self.draw_s:.3g} s, "
                f"update {self.update_s:.3g} s) x {self.steps} steps)")


@dataclass(frozen=True)
class LagChoice:
    """The overlap's lag and why: ``basis`` ``config`` (``overlap.lag`` 0 or 1 set), ``devices`` (the sampler and
    the trainer run on different devices), ``probe`` (they share one; ``probe`` holds the timing) or ``cost`` (they
    share one and the probe would cost more than lag 1 could save: lag 0, no probe); ``worth``: the probe's
    predicted cost against the saving (``probe`` and ``cost``; None in a choice saved without it); ``reason``: one
    line for the run's summary, the plan and MLflow."""

    lag: int
    basis: Literal["config", "devices", "probe", "cost"]
    reason: str
    probe: OverlapProbe | None = None
    worth: ProbeWorth | None = None

    def __post_init__(self) -> None:
        if self.lag not in (0, 1) or isinstance(self.lag, bool):
            raise ValueError(f"LagChoice.lag must be 0 or 1, got {self.lag!r}")
        if self.basis not in ("config", "devices", "probe", "cost"):
            raise ValueError(f"LagChoice.basis must be config, devices, probe or cost, got {self.basis!r}")
        if (self.basis == "probe") != (self.probe is not None):
            raise ValueError("LagChoice: a probe's timing goes with basis probe, and only with it")
        if self.basis == "cost" and (self.worth is None or self.worth.pays or self.lag != 0):
            raise ValueError("LagChoice: basis cost is lag 0 with the probe's worth, which does not pay")


def choose_lag(separate: str | None, probe: OverlapProbe | None, min_gain: float,
               worth: ProbeWorth | None = None) -> LagChoice:
    """``overlap.lag=auto`` (module docstring, Overlap): 1 when ``separate`` says why the sampler and the trainer run
    on different devices; else 0 when ``worth`` says the probe cannot pay for itself (then no ``probe``); else, from
    ``probe``, 1 when at once takes at most ``1 - min_gain`` of one after the other, and 0 otherwise."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    if separate:
        return LagChoice(1, "devices", f"lag 1: the sampler and the trainer run on different devices ({separate})")
    if worth is not None and not worth.pays:
        if probe is not None:
            raise ValueError("choose_lag: a probe that does not pay for itself is not run, so it has no timing")
        return LagChoice(0, "cost", f"lag 0 without the overlap probe: {worth.text()}; the probe could not pay for "
                                    "itself", worth=worth)
    if probe is None:
        raise ValueError("choose_lag: the sampler and the trainer share a device, and there is no probe to decide by")
    pays = probe.ratio <= 1 - min_gain
    timing = (f"a draw and an update at once took {probe.at_once_s:.3g} s, {probe.ratio:.2f}x the "
              f"{probe.sequential_s:.3g} s of one after the other (draw {probe.draw_s:.3g} s, update "
              f"{probe.update_s:.3g} s; median of {probe.repeats}) on the device they share")
    start = f"; starting the generator took {probe.start_s:.3g} s" if probe.start_s else ""
    if pays:
        return LagChoice(1, "probe", f"lag 1: {timing}, at least {min_gain:.0%} faster{start}", probe, worth)
    return LagChoice(0, "probe", f"lag 0: {timing}, not {min_gain:.0%} faster{start}", probe, worth)
