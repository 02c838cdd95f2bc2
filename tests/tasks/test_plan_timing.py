"""The probe's repeat rule (tasks/plan/timing.py), driven by a clock that the timed work itself moves by scripted
durations: it stops when the last samples agree, flags a timing that never does, re-measures one below the
clock's resolution over more calls, and never returns 0."""

import pytest

from tasks.plan.timing import CHEAP, COSTLY, ONCE, RepeatRule, time_until_stable


class ScriptedClock:
    """A clock whose time moves only when the timed work runs: each call of :meth:`work` takes the next of
    ``durations`` seconds (the last one again once they run out), each call of :meth:`before` ``before_s``."""

    def __init__(self, durations, before_s: float = 0.0):
        self.t, self.durations, self.calls, self.before_s = 1000.0, list(durations), 0, before_s

    def __call__(self) -> float:
        return self.t

    def work(self) -> int:
        self.t += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1
        return self.calls

    def before(self) -> None:
        self.t += self.before_s


def test_the_rule_stops_once_the_last_samples_agree_and_keeps_their_median():
    clock = ScriptedClock([0.10, 0.30, 0.12, 0.11, 0.115, 5.0])
    timing, out = time_until_stable(clock.work, CHEAP, clock=clock)
    # [0.10, 0.30, 0.12] and [0.30, 0.12, 0.11] spread too much; [0.12, 0.11, 0.115] is within 15 %
    assert timing.stable and timing.samples == pytest.approx((0.10, 0.30, 0.12, 0.11, 0.115))
    assert timing.seconds == pytest.approx(0.115) and timing.calls == 1 and out == 5 and timing.note == ""


def test_a_timing_that_never_agrees_stops_at_the_cap_and_says_so():
    clock = ScriptedClock([0.1, 0.2] * 10)
    timing, _ = time_until_stable(clock.work, CHEAP, "the optimizer step", clock=clock)
    assert not timing.stable and len(timing.samples) == CHEAP.max_samples
    assert timing.note.startswith("the optimizer step: samples still spread 100% (over the last 3 of 9")
    assert timing.seconds == pytest.approx(0.1)  # the median of all nine: five of 0.1, four of 0.2
    slow = ScriptedClock([40.0, 80.0] * 10)  # the time cap: 120 s
    timing, _ = time_until_stable(slow.work, COSTLY, clock=slow)
    assert not timing.stable and len(timing.samples) == 2 and slow() - 1000.0 == 120.0  # no third sample


def test_a_call_below_the_clocks_resolution_is_timed_over_more_calls():
    """A call of 20 us cannot be timed alone against a 1 ms floor: 10, then 100 calls a sample."""
    clock = ScriptedClock([2e-5])
    timing, _ = time_until_stable(clock.work, CHEAP, clock=clock)
    assert timing.stable and timing.calls == 100 and timing.seconds == pytest.approx(2e-5)
    assert clock.calls == 1 + 10 + 3 * 100  # the short samples were dropped


def test_a_clock_that_never_moves_gives_an_upper_bound_flagged_never_0():
    clock = ScriptedClock([0.0])
    rule = RepeatRule(max_calls=1000)
    timing, _ = time_until_stable(clock.work, rule, "a decode step", clock=clock, resolution=1e-6)
    assert timing.seconds == pytest.approx(1e-6 / 1000) and timing.seconds > 0 and not timing.stable
    assert timing.note == "a decode step: 1,000 calls did not move the clock; at most 1.00e-09 s"


def test_what_runs_before_each_call_is_not_timed():
    clock = ScriptedClock([0.05], before_s=3.0)
    timing, _ = time_until_stable(clock.work, CHEAP, clock=clock, before=clock.before)
    assert timing.stable and timing.seconds == pytest.approx(0.05)


def test_a_checkpoint_is_timed_once():
    """``ONCE`` (a round's checkpoint, a disk write whose repeats do not agree): one call, one sample."""
    clock = ScriptedClock([3.3, 1.2, 5.0])
    timing, out = time_until_stable(clock.work, ONCE, "a round's checkpoint", clock=clock)
    assert timing.seconds == pytest.approx(3.3) and timing.samples == pytest.approx((3.3,)) and out == 1
    assert clock.calls == 1
