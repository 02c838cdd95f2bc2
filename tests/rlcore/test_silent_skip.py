"""The pre-rollout skip (rlcore/silent_skip.py): its probability hand-worked and its properties, the evidence."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.silent_skip import skip_probability, update_streak


def test_skip_probability_hand_worked():
    """explore 0.5, cap 0.9: no evidence 0; one silent group 0.5; two 0.75; half a group (a first wave of 2 of 4)
    1 - 0.5^0.5; many: capped at 0.9."""
    p = skip_probability(torch.tensor([0.0, 1.0, 2.0, 0.5, 10.0]), 0.5, 0.9)
    assert p.tolist() == pytest.approx([0.0, 0.5, 0.75, 1 - 0.5 ** 0.5, 0.9])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 50), min_size=1, max_size=10), st.floats(0.01, 0.99), st.floats(0, 0.99))
def test_skip_probability_rises_with_the_evidence_and_lets_a_prompt_return(z, explore, cap):
    z = torch.tensor(sorted(z), dtype=torch.float64)
    p = skip_probability(z, explore, cap)
    assert ((p >= 0) & (p <= cap)).all(), "capped below 1: every prompt can come back"
    assert (p[1:] >= p[:-1] - 1e-15).all(), "more silent evidence, more likely skipped"
    assert (p[z == 0] == 0).all()


def test_update_streak_counts_agreeing_rollouts_and_resets_on_a_mixed_group():
    z = update_streak(0.0, torch.tensor([1.0, 1.0]), 4)  # a first wave of 2 that agreed: half a group
    assert z == 0.5
    z = update_streak(z, torch.ones(4), 4)
    assert z == 1.5
    assert update_streak(z, torch.tensor([1.0, 0.0, 1.0, 1.0]), 4) == 0.0


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="explore"):
        skip_probability(torch.zeros(2), 1.0, 0.5)
    with pytest.raises(ValueError, match="cap"):
        skip_probability(torch.zeros(2), 0.5, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        skip_probability(torch.tensor([-1.0]), 0.5, 0.5)


def test_the_plans_skip_counts_only_the_share_of_the_pool_a_run_has_seen():
    """x = 100 steps x 20 prompts / 2000 = 1: 1 - (1 - e^-1) = e^-1 of the pool seen on average; a silent reference
    prompt (z = 8 / 4 = 2: chance 0.75 of a skip once seen) keeps 1 - e^-1 x 0.75 of its weight; a mixed one all."""
    from rlcore.silent_skip import SkipRule

    seen = SkipRule.seen_share(100, 20, 2000)
    assert seen == pytest.approx(math.exp(-1))
    w = SkipRule(0.5, 0.9, seen).weigh(torch.tensor([0, 3, 8]), 8, 4, torch.ones(3, dtype=torch.float64))
    assert w.tolist() == pytest.approx([1 - seen * 0.75, 1.0, 1 - seen * 0.75])
    assert SkipRule.seen_share(10, 20, 0) == 1.0  # an unknown pool: every prompt counted as seen
