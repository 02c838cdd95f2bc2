"""The plan's probe of the overlap's split (tasks/plan/probe_split.py): its paces from its rounds' timings."""

import pytest

from tasks.plan.probe_split import split_paces


def test_a_split_reads_each_pace_as_its_median_beside_over_its_least_alone_hand_worked():
    """Each round: (the call on all threads, the update on all threads, the call beside the update, the update beside
    the call). A burst of load that slows one timing alone (0.144 s against 0.070-0.080 s) moves no pace: the pace
    is the median beside over the least alone; a ratio a round would have put the call's at 0.71x in that round."""
    rounds = [(0.080, 0.116, 0.103, 0.153), (0.144, 0.114, 0.102, 0.155), (0.070, 0.114, 0.105, 0.150)]
    generate, passes, spread = split_paces(rounds)
    assert generate == pytest.approx(0.103 / 0.070)
    assert passes == pytest.approx(0.153 / 0.114)
    assert spread == pytest.approx(max((0.105 - 0.102) / 0.103, (0.155 - 0.150) / 0.153))
    # what the spread flags: the timings beside the other side, not those alone
    assert split_paces([(0.07, 0.11, 0.10, 0.15), (0.07, 0.11, 0.20, 0.15), (0.07, 0.11, 0.10, 0.15)])[2] == \
        pytest.approx(1.0)
