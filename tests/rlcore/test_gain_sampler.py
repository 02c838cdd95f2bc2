"""Tests of the GAIN-RL Gaussian window sampler (rlcore/gain_sampler.py)."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.gain_sampler import GaussianWindowSampler

acc = st.floats(0.0, 1.0)
angle = st.one_of(st.none(), st.floats(-1.0, 1.0))
# the knobs the config sets (tasks/config/techniques.py GainConfig) are required; these tests use the official code's
# ratios on GSM8K (1000 / 500 of 7,473 rank positions) and gamma = alpha
KNOBS = {"sigma_frac": 0.13, "step_frac": 0.065, "alpha": 2.0, "beta": 0.5, "gamma": None}


def _window(num_items, **kw):
    return GaussianWindowSampler(num_items, **(KNOBS | kw))


def test_rank_probs_hand_worked():
    s = _window(3, sigma=1.0)
    # mu = 0: w = [e^0, e^-1/2, e^-2] = [1, 0.606531, 0.135335]; sum = 1.741866; P = w / sum
    assert s.rank_probs().tolist() == pytest.approx([0.574097, 0.348207, 0.077696], abs=1e-6)
    # probs(order): order = [2, 0, 1] puts item 2 at rank 0, item 0 at rank 1, item 1 at rank 2
    assert s.probs(torch.tensor([2, 0, 1])).tolist() == pytest.approx([0.348207, 0.077696, 0.574097], abs=1e-6)


def test_delta_hand_worked_official_absolute_values():
    s = _window(7473, sigma=1000, step_size=500, adj_max=1000)
    # acc = 1: 500 tanh(2 (1 - 0.5)) = 500 tanh(1) = 380.797; with angle 0.1 add 500 tanh(0.2) = 98.688
    assert s.compute_delta(1.0) == pytest.approx(380.797, abs=1e-3)
    assert s.compute_delta(1.0, 0.1) == pytest.approx(479.485, abs=1e-3)
    # acc = 0: 500 tanh(-1) = -380.8, clamped to adj_min = 0 (the window never moves back)
    assert s.compute_delta(0.0) == 0.0
    # a perfect batch with 0/1 rewards moves the window forward (the code's acc/2 - 0.5 would give 0 here)
    assert s.update(1.0) > 0 and s.mu == pytest.approx(380.797, abs=1e-3)
    # paper's gamma = 0.5 for the angle term: 500 tanh(0.5 * 0.4) = 98.688
    p = _window(7473, sigma=1000, step_size=500, adj_max=1000, gamma=0.5)
    assert p.compute_delta(0.5, 0.4) == pytest.approx(98.688, abs=1e-3)


def test_fractions_scale_with_pool_size():
    s = _window(7473)
    # 0.13 * 7473 = 971.49; 0.065 * 7473 = 485.745
    assert (s.sigma, s.step_size, s.adj_max) == pytest.approx((971.49, 485.745, 971.49))
    assert _window(40000).sigma == pytest.approx(5200.0)


def test_mu_is_clipped_to_the_pool_and_window_far_away_is_finite():
    s = _window(10, sigma=0.01, step_size=100, adj_max=100)
    s.update(1.0)
    assert s.mu == 9.0
    p = s.rank_probs()
    assert torch.isfinite(p).all() and p[9] == pytest.approx(1.0)
    ranks = s.sample(5, torch.Generator().manual_seed(0))  # far ranks have weight exp(-4e5): still drawable
    assert ranks.tolist() == [5, 6, 7, 8, 9]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300), st.floats(0.005, 0.5), st.floats(0.0, 1.0))
def test_probs_sum_to_one(n, sigma_frac, mu_frac):
    s = _window(n, sigma_frac=sigma_frac, mu0=mu_frac * (n - 1))
    p = s.rank_probs()
    assert (p >= 0).all() and float(p.sum()) == pytest.approx(1.0, abs=1e-9)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    assert float(s.probs(order).sum()) == pytest.approx(1.0, abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(acc, angle), min_size=1, max_size=20))
def test_mean_never_moves_backward(updates):
    s = _window(500)
    for a, g in updates:
        before = s.mu
        delta = s.update(a, g)
        assert delta >= 0 and s.mu >= before and s.mu <= 499


@settings(max_examples=50, deadline=None)
@given(acc, acc, angle, st.floats(-0.5, 0.5), st.floats(0.0, 400.0))
def test_update_monotone_in_accuracy(a1, a2, g, adj_min, mu0):
    lo, hi = min(a1, a2), max(a1, a2)
    base = _window(500, adj_min=adj_min * 500 * 0.065, mu0=mu0)
    s_lo, s_hi = copy.deepcopy(base), copy.deepcopy(base)
    assert s_lo.update(lo, g) <= s_hi.update(hi, g)
    assert s_lo.mu <= s_hi.mu


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.integers(0, 2**31 - 1), st.data())
def test_sample_distinct_ascending_in_range(n, seed, data):
    k = data.draw(st.integers(0, n))
    s = _window(n, mu0=data.draw(st.floats(0, n - 1)))
    ranks = s.sample(k, torch.Generator().manual_seed(seed))
    assert ranks.shape == (k,) and ranks.dtype == torch.long
    assert ranks.tolist() == sorted(set(ranks.tolist()))
    assert all(0 <= r < n for r in ranks.tolist())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    items = s.sample(k, torch.Generator().manual_seed(seed), order=order)
    assert items.tolist() == order[ranks].tolist()


def test_single_draw_frequencies_match_rank_probs():
    s = _window(5, sigma=1.5, mu0=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(4000):
        counts[s.sample(1, gen)] += 1
    torch.testing.assert_close(counts / 4000, s.rank_probs(), rtol=0, atol=0.03)


def test_state_round_trip():
    s = _window(1000, gamma=0.5)
    s.update(0.8, 0.3)
    s.update(0.6)
    t = _window(1000)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    torch.testing.assert_close(t.rank_probs(), s.rank_probs(), rtol=0, atol=0)
    assert torch.equal(t.sample(50, torch.Generator().manual_seed(3)), s.sample(50, torch.Generator().manual_seed(3)))
    assert t.update(0.9, 0.1) == s.update(0.9, 0.1)
    assert t.metrics() == s.metrics()
    with pytest.raises(ValueError, match="items"):
        _window(10).load_state_dict(s.state_dict())


def test_errors():
    with pytest.raises(ValueError, match="accuracy"):
        _window(10).update(2.0)  # a reward of 2 must be scaled to [0, 1] by the caller
    with pytest.raises(ValueError, match="permutation"):
        _window(3).probs(torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="k must"):
        _window(3).sample(4)
    with pytest.raises(ValueError, match="adj_min"):
        _window(10, adj_min=5.0, adj_max=1.0)
    assert math.isfinite(_window(1).rank_probs().item())


@pytest.mark.parametrize("knob", ["step_size", "alpha", "mu0", "adj_max", "gamma", "sigma", "adj_min"])
def test_a_non_finite_knob_is_refused_at_its_entry(knob):
    """NaN passes every comparison, so unchecked it would make the window NaN or void the [0, N - 1] clip."""
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"{knob} must be finite"):
            _window(100, **{knob: bad})


def test_the_config_refuses_a_nan_gain_alpha():
    from tasks.config import ConfigError
    from tasks.config.load import validate

    with pytest.raises((ConfigError, ValueError), match="gain.alpha|alpha"):
        validate({"gain": {"alpha": float("nan")}})
