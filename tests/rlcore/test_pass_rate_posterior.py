"""Tests of the Beta posterior of a prompt's pass rate (rlcore/pass_rate_posterior.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.pass_rate_posterior import (
    CONCENTRATION_GRID,
    beta_binomial_log_pmf,
    fit_concentration,
    informative_chance,
)
from rlcore.selection import informative_weights, posterior_informative_weights


def _pmf_loop(k: int, n: int, a: float, b: float) -> float:
    """Oracle: C(n, k) * a(a+1)...(a+k-1) * b(b+1)...(b+n-k-1) / ((a+b)(a+b+1)...(a+b+n-1))."""
    num = math.comb(n, k)
    for i in range(k):
        num *= a + i
    for j in range(n - k):
        num *= b + j
    den = 1.0
    for t in range(n):
        den *= a + b + t
    return num / den


def test_informative_chance_hand_worked():
    """Prediction 0.5, s = 2: Beta(1, 1), so every k of n = 4 has chance 1/5 and the gradient chance is 3/5.
    With own evidence 2 of 4: Beta(3, 3), P(0) = P(4) = 3*4*5*6 / (6*7*8*9) = 360/3024, chance 1 - 720/3024.
    With 0 of 4: Beta(1, 5), P(0) = 5*6*7*8 / (6*7*8*9) = 5/9, P(4) = 1*2*3*4 / 3024, chance 1 - 5/9 - 24/3024."""
    got = informative_chance(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.0, 2.0, 0.0]),
                             torch.tensor([0.0, 4.0, 4.0]), 4, concentration=2.0)
    assert got.tolist() == pytest.approx([3 / 5, 1 - 720 / 3024, 1 - 5 / 9 - 24 / 3024], rel=1e-12)


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 12), st.floats(0.05, 50.0), st.floats(0.05, 50.0), st.data())
def test_beta_binomial_pmf_matches_a_loop_and_sums_to_one(n, a, b, data):
    k = data.draw(st.integers(0, n))
    got = float(beta_binomial_log_pmf(torch.tensor(float(k)), n, torch.tensor(a, dtype=torch.float64),
                                      torch.tensor(b, dtype=torch.float64)).exp())
    assert got == pytest.approx(_pmf_loop(k, n, a, b), rel=1e-9)
    every = beta_binomial_log_pmf(torch.arange(n + 1.0), n, torch.tensor(a, dtype=torch.float64),
                                  torch.tensor(b, dtype=torch.float64)).exp()
    assert float(every.sum()) == pytest.approx(1.0, rel=1e-9)


@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=10),
       st.integers(2, 8), st.floats(0.1, 100.0))
def test_informative_chance_matches_a_loop(prompts, n, s):
    """Oracle per prompt: a = s * p + k, b = s * (1 - p) + (t - k) with p clamped to [1e-3, 1 - 1e-3]."""
    pred = [p for p, _, _ in prompts]
    succ = [min(k, t) for _, k, t in prompts]
    trials = [t for _, _, t in prompts]
    want = []
    for p, k, t in zip(pred, succ, trials, strict=True):
        p = min(max(p, 1e-3), 1 - 1e-3)
        a, b = s * p + k, s * (1 - p) + (t - k)
        want.append(1 - _pmf_loop(0, n, a, b) - _pmf_loop(n, n, a, b))
    got = informative_chance(torch.tensor(pred, dtype=torch.float64), torch.tensor(succ, dtype=torch.float64),
                             torch.tensor(trials, dtype=torch.float64), n, concentration=s)
    assert got.tolist() == pytest.approx(want, rel=1e-7, abs=1e-12)


def test_a_sharp_prior_is_the_binomial_chance_and_a_vague_one_is_lower():
    p = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    sharp = informative_chance(p, zero, zero, 8, concentration=1e7)
    assert sharp.tolist() == pytest.approx((1 - p ** 8 - (1 - p) ** 8).tolist(), rel=1e-5)
    vague = informative_chance(p, zero, zero, 8, concentration=1.0)
    assert (vague < sharp).all()


def test_own_evidence_moves_the_chance_of_a_gradient():
    """Same prediction: a prompt whose own group was mixed is likelier to carry a gradient than one never measured,
    and one whose groups were all wrong less likely; discounting the evidence to 0 gives back the prior."""
    p = torch.full((4,), 0.5, dtype=torch.float64)
    got = informative_chance(p, torch.tensor([0.0, 4.0, 0.0, 0.0]), torch.tensor([0.0, 8.0, 8.0, 0.0]), 4,
                             concentration=1.0)
    assert got[1] > got[0] > got[2]
    assert got[3] == got[0]


def test_fit_concentration_recovers_the_spread_it_was_drawn_with():
    """4000 prompts, predictions uniform on [0.1, 0.9], true pass rates Beta(s p, s (1 - p)) with s = 4, groups of 8:
    the maximum-likelihood s is within one grid step (2^(1/4)) of 4; with own evidence of the same prompts' earlier
    groups taken into account it is still."""
    gen = torch.Generator().manual_seed(0)
    m, n, s = 4000, 8, 4.0
    pred = 0.1 + 0.8 * torch.rand(m, generator=gen, dtype=torch.float64)
    true = torch.distributions.Beta(s * pred, s * (1 - pred)).sample()
    torch.manual_seed(1)
    earlier = torch.binomial(torch.full((m,), 4.0, dtype=torch.float64), true)
    k = torch.binomial(torch.full((m,), float(n), dtype=torch.float64), true)
    zero = torch.zeros(m, dtype=torch.float64)
    assert fit_concentration(pred, zero, zero, k, torch.full((m,), float(n))) == pytest.approx(s, rel=0.2)
    assert fit_concentration(pred, earlier, torch.full((m,), 4.0), k, torch.full((m,), float(n))) == pytest.approx(
        s, rel=0.2)


def test_fit_concentration_without_groups_is_the_grids_middle():
    empty = torch.zeros(0)
    got = fit_concentration(empty, empty, empty, empty, empty)
    assert got == pytest.approx(math.sqrt(min(CONCENTRATION_GRID) * max(CONCENTRATION_GRID)))


def test_posterior_weights_are_the_chance_normalised_and_respect_the_mask():
    p = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    succ, trials = torch.tensor([0.0, 2.0, 0.0]), torch.tensor([0.0, 4.0, 0.0])
    w = posterior_informative_weights(p, 4, succ, trials, concentration=3.0)
    chance = informative_chance(p, succ, trials, 4, concentration=3.0)
    assert w.tolist() == pytest.approx((chance / chance.sum()).tolist(), rel=1e-12)
    mask = torch.tensor([True, False, True])
    masked = posterior_informative_weights(p, 4, succ, trials, concentration=3.0, mask=mask)
    assert masked[1] == 0 and float(masked.sum()) == pytest.approx(1.0)
    sharp = posterior_informative_weights(p, 4, torch.zeros(3), torch.zeros(3), concentration=1e7)
    assert sharp.tolist() == pytest.approx(informative_weights(p, 4).tolist(), rel=1e-5)


def test_bad_input_is_refused_with_what_is_wrong():
    one, zero = torch.tensor([0.5]), torch.tensor([0.0])
    with pytest.raises(ValueError, match="n must be >= 2"):
        informative_chance(one, zero, zero, 1, concentration=1.0)
    with pytest.raises(ValueError, match="concentration must be a positive"):
        informative_chance(one, zero, zero, 4, concentration=0.0)
    with pytest.raises(ValueError, match="0 <= succ <= trials"):
        informative_chance(one, torch.tensor([3.0]), torch.tensor([2.0]), 4, concentration=1.0)
    with pytest.raises(ValueError, match=r"pred must be success rates"):
        informative_chance(torch.tensor([float("nan")]), zero, zero, 4, concentration=1.0)
    with pytest.raises(ValueError, match="one shape"):
        informative_chance(torch.tensor([0.5, 0.5]), zero, zero, 4, concentration=1.0)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        fit_concentration(one, zero, zero, torch.tensor([5.0]), torch.tensor([4.0]))
