"""Tests of DOTS prompt selection (rlcore/selection.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.selection import (
    dots_weights,
    guard_picks,
    informative_weights,
    observed_informative_weights,
    prescreen,
    sample_prompts,
    screen,
    uniform,
    uniform_weights,
)

rates = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40)


@st.composite
def pool(draw):
    p = draw(rates)
    mask = draw(st.lists(st.booleans(), min_size=len(p), max_size=len(p)))
    if not any(mask):
        mask[0] = True
    prior = draw(st.lists(st.floats(0.01, 100.0), min_size=len(p), max_size=len(p)))
    return torch.tensor(p, dtype=torch.float64), torch.tensor(mask), torch.tensor(prior, dtype=torch.float64)


def test_hand_worked_weights():
    # p = [0.5, 0.4, 0.9] -> d = [0.5, 0.6, 0.1]; |d - 0.5| = [0, 0.1, 0.4]; tau = 0.1
    # w = [e^0, e^-1, e^-4] = [1, 0.367879, 0.018316]; sum = 1.386195
    # P = [0.721399, 0.265388, 0.013213]
    probs = dots_weights(torch.tensor([0.5, 0.4, 0.9]), alpha=0.5, tau=0.1)
    assert probs.tolist() == pytest.approx([0.721399, 0.265388, 0.013213], abs=1e-6)
    # alpha = 0.2 targets d = 0.2, i.e. p = 0.8: |d - 0.2| = [0.3, 0.4, 0.1] -> w = [e^-3, e^-4, e^-1]
    w = [math.exp(-3), math.exp(-4), math.exp(-1)]
    probs = dots_weights(torch.tensor([0.5, 0.4, 0.9], dtype=torch.float64), alpha=0.2, tau=0.1)
    assert probs.tolist() == pytest.approx([x / sum(w) for x in w], abs=1e-9)


def test_prior_and_mask_hand_worked():
    # equal DOTS weights; prior [1, 3, 6] with the last prompt masked out -> [1/4, 3/4, 0]
    probs = dots_weights(
        torch.full((3,), 0.5), alpha=0.5, tau=1e-3, prior=torch.tensor([1.0, 3.0, 6.0]),
        mask=torch.tensor([True, True, False]),
    )
    assert probs.tolist() == pytest.approx([0.25, 0.75, 0.0])


def test_sharp_tau_does_not_underflow():
    # tau = 1e-3 (official): the farthest prompt has weight e^-500 relative to the best: 0 in float32, not float64
    probs = dots_weights(torch.tensor([0.5, 0.0, 1.0, 0.25]), alpha=0.5, tau=1e-3)
    assert (probs > 0).all() and probs[0] == pytest.approx(1.0)
    drawn = sample_prompts(probs, 4, torch.Generator().manual_seed(0), method="weighted")
    assert drawn.sort().values.tolist() == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(pool(), st.floats(0.0, 1.0), st.floats(1e-3, 10.0), st.booleans())
def test_probs_sum_to_one_non_negative_masked_zero(data, alpha, tau, use_prior):
    p, mask, prior = data
    probs = dots_weights(p, alpha=alpha, tau=tau, mask=mask, prior=prior if use_prior else None)
    assert probs.shape == p.shape and (probs >= 0).all()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
    assert (probs[~mask] == 0).all()


@settings(max_examples=60, deadline=None)
@given(rates, st.floats(0.0, 1.0), st.floats(1e-2, 10.0))
def test_weight_monotone_in_distance_to_target(p, alpha, tau):
    p = torch.tensor(p, dtype=torch.float64)
    probs = dots_weights(p, alpha=alpha, tau=tau)
    dist = ((1 - p) - alpha).abs()
    for i in range(len(p)):
        for j in range(len(p)):
            if dist[i] < dist[j]:
                assert probs[i] >= probs[j]


@settings(max_examples=30, deadline=None)
@given(rates)
def test_large_tau_is_uniform(p):
    probs = dots_weights(torch.tensor(p), alpha=0.5, tau=1e9)
    torch.testing.assert_close(probs, uniform_weights(len(p)), rtol=0, atol=1e-8)


@settings(max_examples=60, deadline=None)
@given(pool(), st.sampled_from(["weighted", "greedy", "gumbel"]), st.integers(0, 2**31 - 1), st.data())
def test_sample_distinct_in_range_never_masked(data, method, seed, draw):
    p, mask, prior = data
    probs = dots_weights(p, alpha=0.5, tau=0.05, mask=mask, prior=prior)
    k = draw.draw(st.integers(0, int((probs > 0).sum())))
    idx = sample_prompts(probs, k, torch.Generator().manual_seed(seed), method=method)
    assert idx.dtype == torch.long and idx.shape == (k,)
    assert len(set(idx.tolist())) == k
    assert all(0 <= i < len(p) and bool(mask[i]) for i in idx.tolist())


def test_greedy_is_top_k_ties_by_index():
    probs = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    assert sample_prompts(probs, 3, method="greedy").tolist() == [1, 2, 3]


@pytest.mark.parametrize("method", ["weighted", "gumbel"])
def test_single_draw_frequencies_match_probs(method):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[sample_prompts(probs, 1, gen, method=method)] += 1
    # binomial std at p = 0.5 is sqrt(0.25 / 4000) = 0.0079; allow about 4 std
    torch.testing.assert_close(counts.double() / n, probs, rtol=0, atol=0.03)


def test_uniform_selection():
    mask = torch.tensor([True, False, True, True, False])
    assert uniform_weights(5, mask).tolist() == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3, 0])
    idx = uniform(5, 3, torch.Generator().manual_seed(0), mask=mask)
    assert sorted(idx.tolist()) == [0, 2, 3]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="positive probability"):
        sample_prompts(torch.tensor([0.5, 0.5, 0.0]), 3, method="weighted")
    with pytest.raises(ValueError, match="method"):
        sample_prompts(torch.tensor([1.0]), 1, method="topk")
    with pytest.raises(ValueError, match="no eligible"):
        dots_weights(torch.tensor([0.5, 0.5]), alpha=0.5, tau=1e-3, mask=torch.tensor([False, False]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dots_weights(torch.tensor([1.2]), alpha=0.5, tau=1e-3)
    with pytest.raises(ValueError, match="tau"):
        dots_weights(torch.tensor([0.5]), alpha=0.5, tau=0.0)
    with pytest.raises(ValueError, match="prior"):
        dots_weights(torch.tensor([0.5]), alpha=0.5, tau=1e-3, prior=torch.tensor([-1.0]))


def test_informative_weights_hand_worked():
    """n = 2: a group has unequal rewards with probability 2p(1 - p): p = 0.5 -> 0.5, 0.9 -> 0.18, 0 and 1 -> 0."""
    w = informative_weights(torch.tensor([0.5, 0.9, 0.0, 1.0]), 2)
    assert w.tolist() == pytest.approx([0.5 / 0.68, 0.18 / 0.68, 0.0, 0.0])
    masked = informative_weights(torch.tensor([0.5, 0.9, 0.3]), 2, mask=torch.tensor([False, True, True]),
                                 prior=torch.tensor([1.0, 1.0, 2.0]))
    assert masked.tolist() == pytest.approx([0.0, 0.18 / 1.02, 0.84 / 1.02])  # 0.3 -> 0.42, doubled by the prior
    # groups of 4 and 8 at p = 0.9 against 0.5: 0.3438 / 0.875 and 0.5695 / 0.9922 (docs/algorithms.md 7.6)
    w4, w8 = informative_weights(torch.tensor([0.9, 0.5]), 4), informative_weights(torch.tensor([0.9, 0.5]), 8)
    assert (w4[0] / w4[1]).item() == pytest.approx(0.3438 / 0.875, abs=1e-4)
    assert (w8[0] / w8[1]).item() == pytest.approx(0.56953 / 0.99219, abs=1e-4)


@settings(deadline=None, max_examples=50)
@given(st.floats(0.01, 0.99).filter(lambda p: abs(p - 0.5) > 0.01), st.integers(4, 16))
def test_smaller_groups_concentrate_the_weights_near_one_half(p, n):
    """docs/algorithms.md 7.6 (dots_n4): with fewer rollouts a group, a prompt away from p = 0.5 loses more of its
    chance of a gradient than one at 0.5, so its weight against p = 0.5's falls (from n = 3 down to 2 it stays:
    both chances are proportional to p (1 - p))."""
    def against_half(k):
        w = informative_weights(torch.tensor([p, 0.5]), k)
        return (w[0] / w[1]).item()

    assert against_half(n - 1) < against_half(n)


@settings(deadline=None, max_examples=50)
@given(st.lists(st.one_of(st.just(0.0), st.just(1.0), st.floats(1e-6, 1 - 1e-6)), min_size=1, max_size=20)
       .filter(lambda p: any(0 < x < 1 for x in p)),
       st.integers(2, 16))
def test_informative_weights_match_a_binomial_loop(p, n):
    """Oracle: the chance of 1..n-1 successes of n, summed term by term over the binomial distribution."""
    def chance(q):
        return sum(math.comb(n, k) * q ** k * (1 - q) ** (n - k) for k in range(1, n))

    raw = [chance(q) for q in p]
    expected = [x / sum(raw) for x in raw]
    assert informative_weights(torch.tensor(p, dtype=torch.float64), n).tolist() == pytest.approx(expected, abs=1e-9)


def test_informative_weights_refuse_bad_input():
    with pytest.raises(ValueError, match="n must be >= 2"):
        informative_weights(torch.tensor([0.5]), 1)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        informative_weights(torch.tensor([1.5]), 8)
    with pytest.raises(ValueError, match="no eligible prompt"):
        informative_weights(torch.tensor([0.0, 1.0]), 8)  # every group certain to have equal rewards


def test_observed_informative_weights_hand_worked():
    """n = 2, 2 bins, strength 1. Seen: p 0.2 (informative), 0.3 (not) in bin 0; 0.8 (not) in bin 1.
    Query 0.25 -> bin 0: (1 + 0.375) / 3; 0.75 -> bin 1: (0 + 0.375) / 2; 0.5 -> bin 1: (0 + 0.5) / 2."""
    w = observed_informative_weights(torch.tensor([0.25, 0.75, 0.5]), 2, torch.tensor([0.2, 0.3, 0.8]),
                                     torch.tensor([True, False, False]), bins=2, strength=1.0)
    raw = [1.375 / 3, 0.1875, 0.25]
    assert w.tolist() == pytest.approx([x / sum(raw) for x in raw])


@settings(deadline=None, max_examples=40)
@given(st.lists(st.floats(1e-3, 1 - 1e-3), min_size=1, max_size=12), st.lists(
    st.tuples(st.floats(0.0, 1.0), st.booleans()), max_size=30), st.integers(2, 8), st.integers(1, 6),
    st.floats(0.5, 20.0))
def test_observed_informative_weights_match_a_loop(query, seen, n, bins, strength):
    """Oracle: per query, loop over the seen groups in the query's bin; with none seen it is the binomial chance."""
    def chance(q):
        return 1 - q ** n - (1 - q) ** n

    def bin_of(q):
        return min(int(q * bins), bins - 1)

    raw = []
    for q in query:
        same = [inf for p, inf in seen if bin_of(p) == bin_of(q)]
        raw.append((sum(same) + strength * chance(q)) / (len(same) + strength))
    got = observed_informative_weights(torch.tensor(query, dtype=torch.float64), n,
                                       torch.tensor([p for p, _ in seen], dtype=torch.float64),
                                       torch.tensor([inf for _, inf in seen], dtype=torch.bool),
                                       bins=bins, strength=strength)
    assert got.tolist() == pytest.approx([x / sum(raw) for x in raw], rel=1e-9)
    if not seen:
        assert got.tolist() == pytest.approx(informative_weights(torch.tensor(query, dtype=torch.float64), n).tolist())


def test_observed_informative_weights_refuse_bad_input():
    with pytest.raises(ValueError, match="bins must be >= 1"):
        observed_informative_weights(torch.tensor([0.5]), 8, torch.tensor([0.5]), torch.tensor([True]), bins=0,
                                     strength=1.0)
    with pytest.raises(ValueError, match="one length"):
        observed_informative_weights(torch.tensor([0.5]), 8, torch.tensor([0.5, 0.2]), torch.tensor([True]),
                                     bins=2, strength=1.0)


def test_screen_hand_worked():
    """n = 4: chances 1 - p^4 - (1 - p)^4 are 0.875 (p = 0.5), 0.6796875 (p = 0.25, twice: a tie kept in draw
    order), 0.5904 (p = 0.8) and 0 (p = 0 and 1); keeping 3 takes the 0.5, then the two tied candidates by index."""
    q = torch.tensor([1.0, 0.25, 0.0, 0.5, 0.25, 0.8])
    assert screen(q, 4, 3).tolist() == [3, 1, 4]
    assert screen(q, 4, 4).tolist() == [3, 1, 4, 5]
    assert screen(q, 4, 0).tolist() == [] and sorted(screen(q, 4, 6).tolist()) == [0, 1, 2, 3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(q=rates, n=st.integers(2, 8), data=st.data())
def test_screen_matches_a_loop(q, n, data):
    """Oracle: repeatedly take the first candidate (lowest index) of the highest chance not yet taken."""
    k = data.draw(st.integers(0, len(q)))
    chance = [1 - p ** n - (1 - p) ** n for p in q]
    left, want = list(range(len(q))), []
    for _ in range(k):
        best = max(left, key=lambda i: (round(chance[i], 12), -i))
        want.append(best)
        left.remove(best)
    got = screen(torch.tensor(q, dtype=torch.float64), n, k).tolist()
    assert len(got) == len(set(got)) == k
    assert [round(chance[i], 12) for i in got] == [round(chance[i], 12) for i in want]
    kept_min = min((chance[i] for i in got), default=1.0)
    assert all(chance[i] <= kept_min + 1e-12 for i in set(range(len(q))) - set(got)), "a better candidate was left"


def test_screen_refuses_bad_input():
    with pytest.raises(ValueError, match=r"k must be in \[0, 2\]"):
        screen(torch.tensor([0.1, 0.5]), 4, 3)
    with pytest.raises(ValueError, match="success rates in"):
        screen(torch.tensor([0.1, float("nan")]), 4, 1)
    with pytest.raises(ValueError, match="n must be >= 2"):
        screen(torch.tensor([0.1, 0.5]), 1, 1)


def test_prescreen_hand_worked():
    """n = 2: chances 2 q (1 - q) of the remembered rates 0.5, 1, 0, 0.9 are 0.5, 0, 0, 0.18, their mean 0.17; the
    never-scored candidate 1 counts at 0.17. Fresh (age 0): 0 (0.5), 4 (0.18), 1 (0.17), then 2 and 3 (0) by index.
    Candidate 2 remembered 1000 steps ago is back at the mean (0.17), tied with 1 and after it by index; candidate 4
    one half-life old is halfway back, 0.175."""
    last = torch.tensor([0.5, float("nan"), 1.0, 0.0, 0.9], dtype=torch.float64)
    fresh = torch.zeros(5)
    assert prescreen(last, fresh, 2, 5, 10.0).tolist() == [0, 4, 1, 2, 3]
    assert prescreen(last, fresh, 2, 3, 10.0).tolist() == [0, 4, 1]
    old = torch.tensor([0.0, 0.0, 1000.0, 0.0, 10.0])
    assert prescreen(last, old, 2, 4, 10.0).tolist() == [0, 4, 1, 2]
    assert prescreen(torch.full((4,), float("nan")), torch.zeros(4), 4, 2, 5.0).tolist() == [0, 1], \
        "nothing remembered: the draw's order"
    assert prescreen(last, fresh, 2, 0, 10.0).tolist() == []


@settings(max_examples=60, deadline=None)
@given(q=st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), min_size=1, max_size=30), n=st.integers(2, 8),
       half_life=st.floats(0.5, 50.0), data=st.data())
def test_prescreen_matches_a_loop(q, n, half_life, data):
    """Oracle: each candidate's priority computed one at a time, then repeatedly the first (lowest index) of the
    highest priority not yet taken."""
    ages = data.draw(st.lists(st.integers(0, 100), min_size=len(q), max_size=len(q)))
    k = data.draw(st.integers(0, len(q)))
    chance = [None if p is None else 1 - p ** n - (1 - p) ** n for p in q]
    known = [c for c in chance if c is not None]
    mean = sum(known) / len(known) if known else 0.0
    prio = [mean if c is None else mean + (c - mean) * 0.5 ** (a / half_life)
            for c, a in zip(chance, ages, strict=True)]
    left, want = list(range(len(q))), []
    for _ in range(k):
        best = max(left, key=lambda i: (round(prio[i], 10), -i))
        want.append(best)
        left.remove(best)
    last = torch.tensor([math.nan if p is None else p for p in q], dtype=torch.float64)
    got = prescreen(last, torch.tensor(ages, dtype=torch.float64), n, k, half_life).tolist()
    assert len(got) == len(set(got)) == k
    assert [round(prio[i], 10) for i in got] == [round(prio[i], 10) for i in want]


def test_prescreen_refuses_bad_input():
    q, age = torch.tensor([0.1, float("nan")]), torch.zeros(2)
    with pytest.raises(ValueError, match=r"k must be in \[0, 2\]"):
        prescreen(q, age, 4, 3, 10.0)
    with pytest.raises(ValueError, match="success rates in"):
        prescreen(torch.tensor([1.5, 0.2]), age, 4, 1, 10.0)
    with pytest.raises(ValueError, match="ages >= 0 and half_life > 0"):
        prescreen(q, torch.tensor([-1.0, 0.0]), 4, 1, 10.0)
    with pytest.raises(ValueError, match="ages >= 0 and half_life > 0"):
        prescreen(q, age, 4, 1, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        prescreen(q, torch.zeros(3), 4, 1, 10.0)
    with pytest.raises(ValueError, match="n must be >= 2"):
        prescreen(q, age, 1, 1, 10.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(-1, 35), st.integers(0, 2**31 - 1))
def test_guard_picks_matches_a_loop(eligible, n, seed):
    """Oracle: the eligible indices in order, permuted by the same generator, the first n taken one by one. The
    picks are distinct eligible prompts, min(n, eligible) of them; n <= 0 or none eligible: none."""
    mask = torch.tensor(eligible)
    got = guard_picks(mask, n, torch.Generator().manual_seed(seed))
    pool = [i for i, e in enumerate(eligible) if e]
    want = []
    if n > 0 and pool:
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
        for j in order:
            if len(want) == n:
                break
            want.append(pool[j])
    assert got == want
    assert len(set(got)) == len(got) == (min(n, len(pool)) if n > 0 else 0) and all(eligible[i] for i in got)
