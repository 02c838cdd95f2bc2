"""The adaptive composition (rlcore/adaptive_composition.py): the signal against a loop over every subset, its
expectation against the closed form, and the plan's bounds, ends and monotonicity."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.adaptive_composition import AdaptiveComposition, CompositionPlan, subset_informative
from rlcore.advantages import effective_mask


def slow_subset_informative(rewards: torch.Tensor, m: int) -> list[float]:
    """The oracle: the share of the m-subsets of each row whose rewards are not all equal."""
    out = []
    for row in rewards.tolist():
        subsets = list(itertools.combinations(row, m))
        out.append(sum(len(set(s)) > 1 for s in subsets) / len(subsets))
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 7).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0]), min_size=n, max_size=n), min_size=1, max_size=4),
    st.integers(2, n))))
def test_subset_informative_matches_a_loop_over_every_subset(case):
    rows, m = case
    rewards = torch.tensor(rows)
    assert subset_informative(rewards, m).tolist() == pytest.approx(slow_subset_informative(rewards, m), abs=1e-12)


def test_subset_informative_hand_worked_and_equal_to_the_effective_mask_at_m_equal_n():
    r = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    # pairs: 2 of 6 equal -> 4/6; all equal -> 0; C(3, 2) = 3 of 6 equal -> 1/2
    assert subset_informative(r, 2).tolist() == pytest.approx([2 / 3, 0.0, 0.5])
    # triples: none of 4 all equal; all equal; 1 of 4 (the three zeros) all equal
    assert subset_informative(r, 3).tolist() == [1.0, 0.0, 0.75]
    assert subset_informative(r, 4).tolist() == effective_mask(r).double().tolist()


@pytest.mark.parametrize("n, m", [(4, 2), (6, 3), (8, 4), (8, 8)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.85])
def test_signal_measures_groups_of_m_whatever_n_was_generated(n, m, p):
    """Averaged over every reward vector of n Bernoulli(p) rollouts, the signal is the chance that a group of m
    is mixed, 1 - p^m - (1 - p)^m: so PODS's n cannot move the signal that sets it."""
    vectors = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)))
    prob = torch.tensor([p ** int(v.sum()) * (1 - p) ** (n - int(v.sum())) for v in vectors], dtype=torch.float64)
    expected = float((prob * subset_informative(vectors, m)).sum())
    assert expected == pytest.approx(1 - p ** m - (1 - p) ** m, abs=1e-12)


def test_subset_informative_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[B, n\]"):
        subset_informative(torch.ones(4), 2)
    with pytest.raises(ValueError, match="m must be"):
        subset_informative(torch.ones(2, 4), 5)
    with pytest.raises(ValueError, match="m must be"):
        subset_informative(torch.ones(2, 4), 1)
    with pytest.raises(ValueError, match="finite"):
        subset_informative(torch.tensor([[1.0, float("nan")]]), 2)


def rows_with_share(share_mixed: int, of: int) -> torch.Tensor:
    """[of, 2] rewards, ``share_mixed`` rows mixed (signal 1 at m = 2), the rest all right (signal 0)."""
    return torch.tensor([[1.0, 0.0]] * share_mixed + [[1.0, 1.0]] * (of - share_mixed))


def test_before_the_first_step_the_configured_composition_runs():
    c = AdaptiveComposition(0.5, 0.9, 0.8)
    plan = c.plan(16, 8, 0.5)
    assert plan == CompositionPlan(rollouts=16, fresh_frac=0.5, level=0.0) and c.informative is None
    assert plan.metrics() == {"adapt/level": 0.0, "adapt/rollouts": 16.0, "adapt/fresh_frac": 0.5}


def test_moving_average_and_plan_hand_worked():
    c = AdaptiveComposition(low=0.5, high=0.9, momentum=0.5)
    c.observe(rows_with_share(3, 4), 2)  # r = 0.75: the first step sets the average
    assert c.informative == 0.75
    c.observe(rows_with_share(4, 4), 2)  # r = 1: 0.5 * 0.75 + 0.5 * 1
    assert c.informative == 0.875
    u = (0.875 - 0.5) / 0.4  # 0.9375
    plan = c.plan(16, 8, 0.5)
    assert plan.level == pytest.approx(u)
    assert plan.rollouts == 9  # 8 + 8 (1 - u) = 8.5, halves round up
    assert plan.fresh_frac == pytest.approx(0.5 + 0.5 * u)
    c.observe(torch.zeros(0, 2), 2)  # a step without fresh groups changes nothing
    assert c.informative == 0.875


@pytest.mark.parametrize("share, expected", [(0, (16, 0.5)), (2, (16, 0.5)), (4, (8, 1.0))])
def test_ends_configured_at_or_below_low_and_both_off_at_or_above_high(share, expected):
    c = AdaptiveComposition(low=0.5, high=0.9, momentum=0.0)
    c.observe(rows_with_share(share, 4), 2)  # r = 0, 0.5 (= low), 1
    plan = c.plan(16, 8, 0.5)
    assert (plan.rollouts, plan.fresh_frac) == expected


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 0.95), st.floats(0.01, 1), st.integers(2, 16), st.integers(0, 16), st.floats(0.05, 1),
       st.lists(st.floats(0, 1), min_size=2, max_size=2))
def test_plan_stays_between_configured_and_off_and_turns_down_as_r_rises(low, width, m, extra, delta, rs):
    high = min(1.0, low + width)
    n = m + extra
    plans = []
    for r in sorted(rs):
        c = AdaptiveComposition(low, high, 0.0)
        c.informative = r
        plans.append(c.plan(n, m, delta))
    for p in plans:
        assert m <= p.rollouts <= n and delta - 1e-12 <= p.fresh_frac <= 1 + 1e-12 and 0 <= p.level <= 1
    assert plans[0].rollouts >= plans[1].rollouts and plans[0].fresh_frac <= plans[1].fresh_frac + 1e-12


def test_state_round_trip_and_argument_checks():
    c = AdaptiveComposition(0.5, 0.9, 0.8)
    c.observe(rows_with_share(3, 4), 2)
    d = AdaptiveComposition(0.5, 0.9, 0.8)
    d.load_state_dict(c.state_dict())
    assert d.plan(16, 8, 0.5) == c.plan(16, 8, 0.5) and d.informative == c.informative
    for low, high, momentum in [(0.9, 0.5, 0.8), (0.5, 0.5, 0.8), (-0.1, 0.9, 0.8), (0.5, 1.1, 0.8), (0.5, 0.9, 1.0)]:
        with pytest.raises(ValueError):
            AdaptiveComposition(low, high, momentum)
    with pytest.raises(ValueError, match="m <= n"):
        c.plan(4, 8, 0.5)
    with pytest.raises(ValueError, match="fresh_frac"):
        c.plan(16, 8, 0.0)
    assert math.isclose(c.informative, 0.75)
