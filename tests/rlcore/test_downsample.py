import itertools

import numpy as np
import pytest
import torch

from rlcore.downsample import DownsampleRule, downsample, max_variance_subset


def _brute_force_max_var(r: np.ndarray, m: int) -> float:
    combos = np.array(list(itertools.combinations(range(len(r)), m)))
    return float(r[combos].var(axis=1).max())


# ---------------------------------------------------------------- hand-worked


def test_binary_balances_successes_and_failures():
    # 3 failures, 5 successes, m = 4: best is 2 + 2 -> var = 0.5 * 0.5 = 0.25
    r = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    keep = max_variance_subset(r, 4)
    # stable ascending order: failures 0,1,2 then successes 3..7; bottom 2 = {0,1}, top 2 = {6,7}
    assert keep.tolist() == [0, 1, 6, 7]
    assert r[keep].var(unbiased=False).item() == 0.25


def test_graded_hand_worked():
    # rewards 0, 0.5, 0.6, 1.0, m = 2: extremes {0, 1.0} -> var 0.25 (any other pair is smaller)
    r = np.array([0.6, 0.0, 1.0, 0.5])
    assert max_variance_subset(r, 2).tolist() == [1, 2]
    # m = 3: splits k=0 {0,.5,.6} var .0689; k=1 {0,.5,1} var .1667; k=2 {0,.6,1} var .1689; k=3 {.5,.6,1} .0467
    # -> k=2: indices of 0, 0.6, 1.0 = 1, 0, 2
    assert max_variance_subset(r, 3).tolist() == [0, 1, 2]


def test_tie_prefers_more_top_rewards():
    # 2 failures, 2 successes, m = 3: {0,0,1} and {0,1,1} both have var 2/9; tie -> largest k (2 from the top)
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    keep = max_variance_subset(r, 3)
    assert sorted(r[keep].tolist()) == [0.0, 1.0, 1.0]
    # stable ascending order is [1, 3, 0, 2] (values 0, 0, 1, 1). k = 2 (bottom {1}, top {0, 2}) and k = 3
    # (top {3, 0, 2}) both give {0, 1, 1}; the largest k wins -> the last three of the sorted order
    assert keep.tolist() == [0, 2, 3]


def test_binary_closed_form():
    # docs/algorithms.md section 3.2: a = clamp(round(m/2), max(0, m-(n-k)), min(k, m)) successes kept;
    # var = (a/m)(1-a/m)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 13))
        m = int(rng.integers(1, n + 1))
        r = (rng.random(n) < rng.random()).astype(float)
        k = int(r.sum())
        a = min(max(int(np.floor(m / 2 + 0.5)), max(0, m - (n - k))), min(k, m))
        kept = r[max_variance_subset(r, m).numpy()]
        assert kept.var() == pytest.approx((a / m) * (1 - a / m), abs=1e-12)


# ---------------------------------------------------------------- brute force oracle


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kind", ["binary", "graded", "continuous"])
def test_matches_brute_force(kind, seed):
    rng = np.random.default_rng([seed, {"binary": 1, "graded": 2, "continuous": 3}[kind]])
    for _ in range(60):
        n = int(rng.integers(1, 11))
        if kind == "binary":
            r = (rng.random(n) < rng.random()).astype(float)
        elif kind == "graded":  # PODS-like: correctness + 0.1 format + 0.025 per tag, many ties
            r = rng.integers(0, 2, n) + 0.1 * rng.integers(0, 2, n) + 0.025 * rng.integers(0, 5, n)
        else:
            r = rng.normal(size=n) * 10 ** rng.uniform(-3, 3)
        for m in range(1, n + 1):
            keep = max_variance_subset(r, m)
            assert keep.dtype == torch.long and keep.shape == (m,)
            assert len(set(keep.tolist())) == m and keep.tolist() == sorted(keep.tolist())
            best = _brute_force_max_var(r, m)
            assert r[keep.numpy()].var() == pytest.approx(best, abs=1e-9, rel=1e-9)


def test_batched_matches_per_row_loop():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 4, (40, 9), generator=g).float() / 3
    keep, _ = downsample(r, 5, rule="max_variance")
    for i in range(40):
        assert keep[i].tolist() == max_variance_subset(r[i], 5).tolist()


def test_large_group_runs_and_beats_random():
    # n = 512 is far beyond brute force; the chosen variance must dominate the whole n and random subsets
    g = torch.Generator().manual_seed(5)
    r = torch.rand(8, 512, generator=g)
    keep, metrics = downsample(r, 64, rule="max_variance")
    rand_keep, rand_metrics = downsample(r, 64, rule="random", generator=g)
    assert metrics["pods/var_after"] > metrics["pods/var_before"] > 0
    assert metrics["pods/var_after"] > rand_metrics["pods/var_after"]


# ---------------------------------------------------------------- other rules, identity, metrics


def test_identity_when_m_equals_n_for_every_rule():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    for rule in DownsampleRule:
        g = torch.Generator().manual_seed(0)
        state = g.get_state()
        keep, metrics = downsample(r, 4, rule=rule, generator=g)
        assert torch.equal(keep, torch.arange(4).expand(2, -1))
        assert torch.equal(torch.gather(r, 1, keep), r)
        assert torch.equal(g.get_state(), state)  # nothing drawn
        assert metrics["pods/kept_frac"] == 1.0
        assert metrics["pods/var_before"] == metrics["pods/var_after"]


def test_random_rule_distinct_and_reproducible():
    r = torch.zeros(20, 10)
    a, _ = downsample(r, 4, rule="random", generator=torch.Generator().manual_seed(1))
    b, _ = downsample(r, 4, rule="random", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    for row in a.tolist():
        assert len(set(row)) == 4 and row == sorted(row) and all(0 <= i < 10 for i in row)
    # every index shows up somewhere (not a fixed subset)
    assert set(a.flatten().tolist()) == set(range(10))


def test_random_rule_is_uniform_over_indices():
    keep, _ = downsample(torch.zeros(4000, 6), 2, rule="random", generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(keep.flatten(), minlength=6).double()
    # each index kept with probability 2/6: expected 4000*2/6 = 1333.3, sd ~ sqrt(1333*(2/3)) ~ 30
    assert torch.all((counts - 4000 * 2 / 6).abs() < 150)


def test_max_reward_keeps_top_m():
    r = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.3], [1.0, 0.0, 1.0, 1.0, 0.0]])
    keep, _ = downsample(r, 2, rule="max_reward")
    assert keep[0].tolist() == [1, 3]  # 0.9 and 0.7
    assert keep[1].tolist() == [0, 2]  # three ties at 1.0: lowest indices first
    rng = np.random.default_rng(4)
    rr = torch.from_numpy(rng.integers(0, 5, (30, 8)).astype(float))
    keep, _ = downsample(rr, 3, rule=DownsampleRule.MAX_REWARD)
    for row, k in zip(rr, keep, strict=False):
        assert sorted(row[k].tolist()) == sorted(row.tolist())[-3:]


def test_metrics_hand_worked():
    # group 0: 1,1,0,0 -> var 0.25, max-var keeps {0, 1} pair -> var 0.25
    # group 1: 1,1,1,1 -> var 0, kept var 0, not effective
    r = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    _, m = downsample(r, 2, rule="max_variance")
    assert m == {
        "pods/kept_frac": 0.5,
        "pods/var_before": 0.125,  # mean(0.25, 0)
        "pods/var_after": 0.125,
        "pods/effective_before": 0.5,
        "pods/effective_after": 0.5,
    }
    # max_reward on group 0 keeps the two 1s: no longer effective
    _, m2 = downsample(r, 2, rule="max_reward")
    assert m2["pods/effective_after"] == 0.0 and m2["pods/var_after"] == 0.0


def test_errors():
    with pytest.raises(ValueError, match="valid names: max_variance, random, max_reward"):
        downsample(torch.zeros(2, 4), 2, rule="top")
    with pytest.raises(ValueError, match="1 <= m <= n"):
        downsample(torch.zeros(2, 4), 5, rule="max_variance")
    with pytest.raises(ValueError, match="1 <= m <= n"):
        max_variance_subset(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"\[B, n\]"):
        downsample(torch.zeros(4), 2, rule="max_variance")
    with pytest.raises(ValueError, match=r"\[n\]"):
        max_variance_subset(torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match="finite"):
        max_variance_subset(torch.tensor([0.0, float("nan"), 1.0]), 2)


@pytest.mark.parametrize("spread", [1e-3, 1e-7, 1e-12])
def test_tiny_spreads_still_pick_a_max_variance_subset(spread):
    # 6 equal rewards and 2 slightly higher ones: any m=4 subset with a high one has variance > 0; an absolute
    # tie tolerance made the all-equal split (variance 0) tie with the best for spreads below ~1e-6 / m.
    r = torch.tensor([[0.5] * 6 + [0.5 + spread] * 2], dtype=torch.float64)
    keep, _ = downsample(r, 4, rule=DownsampleRule.MAX_VARIANCE)
    kept = r[0, keep[0]]
    assert kept.var(unbiased=False) > 0
    assert sorted(kept.tolist()) == [0.5, 0.5, 0.5 + spread, 0.5 + spread]  # two low, two high: the largest variance


def test_one_kept_rollout_is_the_top_reward():
    """m = 1: every split has variance 0, so the tie rule (largest k) keeps the highest reward (the last of equal
    maxima), however the prefix sums round."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(500, 7, generator=g, dtype=torch.float64) * 3 - 1
    keep = torch.stack([max_variance_subset(r, 1) for r in rewards])  # [500, 1]
    assert torch.equal(keep.flatten(), rewards.argmax(dim=1))
    assert max_variance_subset(torch.tensor([0.0, 1.0, 1.0, 0.5]), 1).tolist() == [2]
