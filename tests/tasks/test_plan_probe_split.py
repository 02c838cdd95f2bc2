"""The plan's probe of the overlap's split (tasks/plan/probe_split.py): the size of its generate call, and each side's
time with the other running."""

from hypothesis import given
from hypothesis import strategies as st

from tasks.plan.probe_split import split_prompts


def test_the_splits_call_is_half_the_baselines_and_never_smaller_than_the_small_one():
    assert split_prompts((3, 32)) == 16  # the default pool: plain GRPO's 32 prompts, the smallest first call 3
    assert split_prompts((8, 12)) == 8  # half of 12 is 6, under the small call
    assert split_prompts((1, 1)) == 1


@given(st.integers(1, 512), st.integers(1, 512))
def test_the_splits_call_lies_between_the_probes_two(small, extra):
    large = small + extra - 1
    assert small <= split_prompts((small, large)) <= large


def test_a_repeated_sides_time_is_the_span_over_the_calls_worth_of_work_in_it():
    from tasks.plan.probe_split import _inside

    calls = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    # half of the first, all of the second, half of the third: two calls' work in 2 s
    assert _inside(calls, 0.5, 2.5) == 1.0
    # a 2 s call crossing the end counts for its half inside: 1 + 0.5 calls in 2 s
    assert _inside([(0.0, 1.0), (1.0, 3.0)], 0.0, 2.0) == 2.0 / 1.5
    # no call wholly inside: no pace from this span
    assert _inside([(0.0, 1.0), (1.0, 2.0)], 0.5, 1.5) is None
    assert _inside([], 0.0, 1.0) is None


def test_at_once_runs_the_long_side_once_and_repeats_the_other_beside_it():
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tasks.plan.probe_split import at_once

    calls = {"draw": 0, "update": 0}

    def work(name, seconds):
        def run():
            calls[name] += 1
            time.sleep(seconds)
        return run

    with ThreadPoolExecutor(max_workers=1) as pool:
        draw_s, update_s = at_once(work("draw", 0.3), work("update", 0.02), pool, draw_longer=True)
        assert calls["draw"] == 1 and calls["update"] >= 2  # the draw once, the update repeated beside it
        assert draw_s >= 0.3 and update_s >= 0.02
        calls.update(draw=0, update=0)
        draw_s, update_s = at_once(work("draw", 0.02), work("update", 0.3), pool, draw_longer=False)
        assert calls["update"] == 1 and calls["draw"] >= 2
        assert draw_s >= 0.02 and update_s >= 0.3
        # a wrong guess of the longer side: no update fits inside the draw, so the update is timed once beside the
        # draw's repeats, and both sides still get a time
        calls.update(draw=0, update=0)
        draw_s, update_s = at_once(work("draw", 0.02), work("update", 0.3), pool, draw_longer=True)
        assert calls["update"] >= 2 and calls["draw"] >= 2
        assert draw_s >= 0.02 and update_s >= 0.3
