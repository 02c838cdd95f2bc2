"""The probe's timings, repeated until they hold still (tasks/plan/probe.py).

One timing of a piece of work on a shared machine can be anything: under load the plan's probe once timed a decode
step at 0.0 ms and, in another call, at 41.8 ms. :func:`time_until_stable` repeats the work until the relative spread
``(max - min) / median`` of the last ``window`` samples is at most ``spread`` and keeps their median (the median of
a few repeats, as pytest-benchmark and Python's ``timeit`` advise against the mean's sensitivity to one interrupted
run); at ``max_samples`` samples or ``max_seconds`` it stops and the timing says it is not stable (``stable``
False, ``note`` why), which the probe records among the estimates it cannot trust. A sample shorter than
``min_sample_s`` (far above the clock's resolution, ``time.get_clock_info``) is too short to time in one call: the
samples so far are dropped and each sample then runs the work ``calls`` times, ten times as many each time, so no
timing is ever 0: where even ``max_calls`` calls do not move the clock, the timing is the clock's resolution over
the calls, an upper bound, flagged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RepeatRule:
    """When a timing is stable (module docstring): the last ``window`` samples within ``spread`` of their median,
    at most ``max_samples`` samples and ``max_seconds`` in all; samples under ``min_sample_s`` re-measured over more
    calls, at most ``max_calls`` a sample."""

    window: int = 3
    spread: float = 0.15
    max_samples: int = 9
    max_seconds: float = 60.0
    min_sample_s: float = 1e-3
    max_calls: int = 100_000

    def __post_init__(self) -> None:
        if self.window < 1 or self.max_samples < self.window or self.max_calls < 1:
            raise ValueError(f"RepeatRule: window {self.window} >= 1, max_samples {self.max_samples} >= window and "
                             f"max_calls {self.max_calls} >= 1 needed")
        if not (self.spread > 0 and self.max_seconds > 0 and self.min_sample_s > 0):
            raise ValueError("RepeatRule: spread, max_seconds and min_sample_s must be > 0")


#: The probe's cheap fixed costs (an optimizer step, a step's bookkeeping): repeats cost little.
CHEAP = RepeatRule()
#: Its calls of real work (a generate call, an update, a screen pass: seconds each on a CPU): two samples that agree
#: within 15 %, at most four.
COSTLY = RepeatRule(window=2, spread=0.15, max_samples=4, max_seconds=120.0)
#: A round's checkpoint (a disk write): timed once. Its repeats do not agree whatever their count (the page cache
#: and the disk's queue: SmolLM2-135M's 1.6 GB checkpoint took 3.3 s a write, spread 45-79 % over four), it is a
#: few per cent of a step's cost, and on a large model each repeat costs seconds.
ONCE = RepeatRule(window=1, max_samples=1)


@dataclass(frozen=True)
class Timing:
    """Seconds of one call of some work (:func:`time_until_stable`): ``seconds``, the median of the samples it
    keeps; ``samples``, every sample's seconds a call; ``calls``, calls a sample; ``stable``, whether the rule's
    spread held; ``note``, why not (empty when stable)."""

    seconds: float
    samples: tuple[float, ...]
    calls: int
    stable: bool
    note: str = ""

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"Timing.seconds must be > 0, got {self.seconds!r}")


def relative_spread(xs) -> float:
    """``(max - min) / median`` of ``xs`` (0 for one sample)."""
    xs = list(xs)
    mid = statistics.median(xs)
    return (max(xs) - min(xs)) / mid if mid > 0 else float("inf")


def time_until_stable(work: Callable[[], object], rule: RepeatRule = CHEAP, what: str = "a timing",
                      clock: Callable[[], float] = time.perf_counter, resolution: float | None = None,
                      before: Callable[[], object] | None = None) -> tuple[Timing, object]:
    """Time ``work()`` under ``rule`` on ``clock`` (module docstring); ``before()``, where given, runs untimed before
    each call (e.g. the gradients an optimizer step needs). Returns the :class:`Timing` and the last call's result.
    ``resolution``: the clock's (default ``time.get_clock_info("perf_counter")``'s; give it with another clock)."""
    tick = resolution if resolution is not None else time.get_clock_info("perf_counter").resolution
    start, calls, samples, out = clock(), 1, [], None
    while True:
        elapsed = 0.0
        for _ in range(calls):
            if before is not None:
                before()
            t0 = clock()
            out = work()
            elapsed += clock() - t0
        if elapsed < rule.min_sample_s and calls < rule.max_calls:  # too short to time: more calls a sample
            calls, samples = min(calls * 10, rule.max_calls), []
            continue
        samples.append(max(elapsed, tick) / calls)  # a clock that never moved: its resolution, an upper bound
        last = samples[-rule.window:]
        if elapsed <= 0:
            return Timing(samples[-1], tuple(samples), calls, False,
                          f"{what}: {calls:,} calls did not move the clock; at most {samples[-1]:.2e} s"), out
        if len(last) == rule.window and relative_spread(last) <= rule.spread:
            return Timing(statistics.median(last), tuple(samples), calls, True), out
        if len(samples) >= rule.max_samples or clock() - start >= rule.max_seconds:
            spread = relative_spread(last)
            return Timing(statistics.median(samples), tuple(samples), calls, False,
                          f"{what}: samples still spread {spread:.0%} (over the last {len(last)} of {len(samples)}; "
                          f"stable at {rule.spread:.0%})"), out


class Untrusted(list):
    """The probe's notes on the estimates it cannot trust (``UnitCosts.untrusted``)."""

    def timed(self, work, rule, what: str, **kw) -> tuple[float, object]:
        """:func:`time_until_stable`'s seconds and result; its note kept when not stable."""
        timing, out = time_until_stable(work, rule, what, **kw)
        self.note(timing)
        return timing.seconds, out

    def note(self, timing: Timing) -> None:
        if not timing.stable:
            self.append(timing.note)
