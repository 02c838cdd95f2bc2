"""Per-prompt rollout budgets (rlcore/rollout_budget.py): the completion chance hand-worked and against a Monte Carlo
oracle, the allocation's properties, and the plan's expectation against every draw enumerated."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.rollout_budget import (
    allocate,
    completion_chance,
    pass_rate_moment,
    step_expectation,
    wave_expectation,
)

NAN = float("nan")


def test_completion_chance_hand_worked():
    """First wave 2, groups of 4. No estimate (Jeffreys, Beta(1/2, 1/2)): after 2 right, Beta(5/2, 1/2) and
    E[p^2] = (5/2)(7/2) / (3 x 4) = 35/48, so c = 13/48; after 2 wrong the same by symmetry. Estimate 0.5 worth 2
    rollouts: Beta(3/2, 3/2) then Beta(7/2, 3/2), E[p^2] = (7/2)(9/2) / (5 x 6) = 21/40, c = 19/40. A mixed
    first wave: 1."""
    c = completion_chance(torch.tensor([2.0, 0.0, 1.0]), 2, 4, torch.tensor([NAN, NAN, NAN]), 2.0)
    assert c.tolist() == pytest.approx([13 / 48, 13 / 48, 1.0])
    c = completion_chance(torch.tensor([2.0, 0.0]), 2, 4, torch.tensor([0.5, 0.5]), 2.0)
    assert c.tolist() == pytest.approx([19 / 40, 19 / 40])
    # an estimate of 0.9 worth 8 rollouts: Beta(7.7, 1.3) + 2 right = Beta(9.7, 1.3): E[p^2] = 9.7 x 10.7 / (11 x 12)
    c = completion_chance(torch.tensor([2.0]), 2, 4, torch.tensor([0.9]), 8.0)
    assert float(c) == pytest.approx(1 - 9.7 * 10.7 / (11 * 12))


@pytest.mark.parametrize("first, n, p_hat, s", [(2, 4, 0.3, 2.0), (1, 8, 0.8, 5.0), (3, 8, NAN, 1.0)])
def test_completion_chance_matches_a_monte_carlo_oracle(first, n, p_hat, s):
    """Draw p from the prior, a first wave, keep the draws whose first wave agrees, and count how often the rest of
    the group breaks the agreement."""
    g = torch.Generator().manual_seed(0)
    a, b = (0.5, 0.5) if math.isnan(p_hat) else (s * p_hat + 0.5, s * (1 - p_hat) + 0.5)
    p = torch.distributions.Beta(torch.tensor(a), torch.tensor(b)).sample((400_000,))
    draws = (torch.rand(len(p), n, generator=g) < p.unsqueeze(1)).float()
    head, tail = draws[:, :first], draws[:, first:]
    for k in (0, first):
        agree = (head.sum(1) == k)
        broke = (tail[agree] != (1.0 if k else 0.0)).any(1).float().mean()
        c = completion_chance(torch.tensor([float(k)]), first, n, torch.tensor([p_hat]), s)
        assert float(c) == pytest.approx(float(broke), abs=0.005)


def test_allocate_hand_worked():
    c = torch.tensor([0.3, 1.0, 0.6, 1.0, 0.6, 0.2])
    assert allocate(c, 3, 0.5).nonzero().squeeze(1).tolist() == [1, 2, 3]  # ties to the earlier draw
    assert allocate(c, 10, 0.5).nonzero().squeeze(1).tolist() == [1, 2, 3, 4]
    assert allocate(c, 10, 0.0).all() and not allocate(c, 0, 0.0).any()
    with pytest.raises(ValueError, match="budget"):
        allocate(c, -1, 0.5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=0, max_size=20), st.integers(0, 25), st.floats(0, 1))
def test_allocate_takes_the_best_chances_within_budget_and_threshold(chances, budget, min_chance):
    c = torch.tensor(chances, dtype=torch.float64)
    take = allocate(c, budget, min_chance)
    eligible = int((c >= min_chance).sum())
    assert int(take.sum()) == min(budget, eligible)
    assert (c[take] >= min_chance).all()
    left = c[~take & (c >= min_chance)]
    if take.any() and left.numel():  # nothing left out beats anything taken
        assert float(left.max()) <= float(c[take].min())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 7), st.integers(0, 6), st.floats(0, 1), st.floats(0, 20))
def test_completion_chance_is_a_probability_that_falls_with_a_confident_estimate(first, extra, p_hat, s):
    n = first + 1 + extra
    k = torch.tensor([float(first), 0.0])
    c = completion_chance(k, first, n, torch.tensor([p_hat, p_hat]), s)
    assert ((c >= 0) & (c <= 1)).all()
    more = completion_chance(k, first, n + 1, torch.tensor([p_hat, p_hat]), s)
    assert (more >= c - 1e-12).all(), "a longer completion breaks an agreement more often"


def test_pass_rate_moment_is_the_chance_of_j_right_without_replacement():
    # 3 of 5 right: 2 drawn both right with chance C(3,2)/C(5,2) = 3/10; 4 drawn: 0
    assert pass_rate_moment(torch.tensor([3.0]), 5, 2).tolist() == pytest.approx([0.3])
    assert pass_rate_moment(torch.tensor([3.0]), 5, 4).tolist() == [0.0]
    # above g, the Jeffreys posterior Beta(3.5, 2.5): E[p^6] = prod (3.5 + i) / (6 + i), i < 6
    want = math.prod((3.5 + i) / (6 + i) for i in range(6))
    assert pass_rate_moment(torch.tensor([3.0]), 5, 6).tolist() == pytest.approx([want])


@pytest.mark.parametrize("g, first, n", [(6, 2, 4), (8, 2, 8), (5, 1, 3)])
def test_wave_expectation_matches_every_draw_enumerated(g, first, n):
    """Slow oracle: a prompt with s of g reference rollouts right; its candidate's n rollouts are n of the g drawn
    without replacement in every order; the rule completes a mixed first wave always and an agreeing one where told."""
    for s in range(g + 1):
        for t1, t0 in itertools.product((False, True), repeat=2):
            outcomes = [1.0] * s + [0.0] * (g - s)
            mixed = topped = informative = rollouts = 0.0
            orders = list(itertools.permutations(range(g), n))
            for order in orders:
                r = [outcomes[i] for i in order]
                head = r[:first]
                is_mixed = max(head) > min(head)
                complete = is_mixed or (t1 and head[0] == 1.0) or (t0 and head[0] == 0.0)
                mixed += is_mixed
                topped += complete and not is_mixed
                informative += complete and not is_mixed and max(r) > min(r)
                rollouts += n if complete else first
            e = wave_expectation(torch.tensor([float(s)]), g, first, n, torch.tensor([t1]), torch.tensor([t0]))
            k = len(orders)
            assert float(e.mixed) == pytest.approx(mixed / k)
            assert float(e.agree_topped) == pytest.approx(topped / k)
            assert float(e.agree_informative) == pytest.approx(informative / k)
            assert float(e.rollouts) == pytest.approx(rollouts / k)


def test_step_expectation_hand_worked():
    """30 candidates, budget 20: 0.5 mixed -> 15 completed first, 0.3 agreeing and completable -> 9 wanted, 5 fit
    (5/9 of them), 1/3 of the agreeing completed end mixed -> 30 x 0.1 x 5/9 = 5/3 informative of those."""
    out = step_expectation(30, 20, 0.5, 0.3, 0.1)
    assert out["topped"] == pytest.approx(20) and out["partial"] == pytest.approx(0)
    assert out["informative"] == pytest.approx(15 + 5 / 3) and out["trained"] == pytest.approx(20)
    # more mixed first waves than the budget: 20 completed, 5 trained as they are
    out = step_expectation(50, 20, 0.5, 0.3, 0.1)
    assert (out["topped"], out["partial"], out["informative"], out["trained"]) == pytest.approx((20, 5, 25, 25))
