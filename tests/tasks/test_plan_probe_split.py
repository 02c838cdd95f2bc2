"""The plan's probe of the overlap's split (tasks/plan/probe_split.py): its call's size and its paces from its rounds'
timings."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.plan.probe_split import split_paces, split_prompts


def test_a_split_reads_each_pace_as_the_median_of_its_rounds_ratios_hand_worked():
    """Each round: (the call on all threads, the update on all threads, the call beside the update, the update beside
    the call). A round's pace is its timing beside over its timing alone; the pace the median over the rounds, so
    one round whose call was slowed alone (0.144 s) moves it no further than the middle round's."""
    rounds = [(0.080, 0.116, 0.103, 0.153), (0.144, 0.114, 0.102, 0.155), (0.070, 0.100, 0.105, 0.150)]
    generate, passes, spread = split_paces(rounds)
    g = [0.103 / 0.080, 0.102 / 0.144, 0.105 / 0.070]  # 1.2875, 0.7083, 1.5
    p = [0.153 / 0.116, 0.155 / 0.114, 0.150 / 0.100]  # 1.3190, 1.3596, 1.5
    assert generate == pytest.approx(0.103 / 0.080) and passes == pytest.approx(0.155 / 0.114)
    assert spread == pytest.approx(max((max(g) - min(g)) / (0.103 / 0.080), (max(p) - min(p)) / (0.155 / 0.114)))
    assert spread == pytest.approx((1.5 - 0.7083333) / 1.2875)  # the call's: 61 %, past SPLIT_SPREAD


def test_the_splits_call_is_half_the_baselines_and_never_smaller_than_the_small_one():
    assert split_prompts((3, 32)) == 16
    assert split_prompts((8, 12)) == 8  # half of 12 is 6, under the small call
    assert split_prompts((1, 1)) == 1


@given(st.integers(1, 512), st.integers(1, 512))
def test_the_splits_call_lies_between_the_probes_two(small, extra):
    large = small + extra - 1
    assert small <= split_prompts((small, large)) <= large
