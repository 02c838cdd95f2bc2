"""rlcore.plan_draw and rlcore.plan: the informative chance and DAPO's rounds against slow oracles, the probe's
lines, hand-worked draws, steps and clocks (fixed costs included), the choice rule, and the overlap's lag
(choose_lag) in each of its cases."""

import itertools
import math
from dataclasses import asdict, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.adaptive_composition import subset_informative
from rlcore.overlap_lag import LagChoice, OverlapProbe, ProbeWorth, choose_lag, probe_cost
from rlcore.plan import Prediction, call_rows, draw_calls, overlapped_step, predict
from rlcore.plan_choice import TIE, choose, dominated, out_of_reach, run_clock
from rlcore.plan_draw import (
    Composition,
    PoolStats,
    draw_ratio,
    group_chance,
    informative_chance,
    kept_mass,
    screen_calibration,
    screened_per_prompt,
)
from rlcore.rollout_budget import WaveRule
from rlcore.selection import Prescreen
from rlcore.silent_skip import SkipRule
from rlcore.step_costs import CallCost, FixedCosts, ThreadSplit, UnitCosts


def slow_chance(s: int, g: int, n: int) -> float:
    """Every n-subset of a group with s successes of g, counted (n <= g); the Beta integral by lgamma (n > g)."""
    if n <= g:
        rewards = [1] * s + [0] * (g - s)
        subsets = list(itertools.combinations(range(g), n))
        return sum(len({rewards[i] for i in sub}) > 1 for sub in subsets) / len(subsets)
    a, b = s + 0.5, g - s + 0.5

    def moment(x: float, y: float) -> float:  # E[p^n] for p ~ Beta(x, y)
        return math.exp(math.lgamma(x + n) + math.lgamma(x + y) - math.lgamma(x) - math.lgamma(x + y + n))

    return 1 - moment(a, b) - moment(b, a)


@pytest.mark.parametrize("g,n", [(8, 8), (8, 4), (8, 2), (4, 3), (8, 16), (4, 9), (8, 1)])
def test_informative_chance_matches_the_slow_oracle(g, n):
    s = torch.arange(g + 1)
    fast = informative_chance(s, g, n)
    slow = torch.tensor([slow_chance(int(k), g, n) if n > 1 else 0.0 for k in s], dtype=torch.float64)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)


def test_informative_chance_hand_worked_and_as_adaptive_composition_counts():
    # 4 successes of 8, groups of 4: 1 - C(4,4)/C(8,4) - C(4,4)/C(8,4) = 1 - 2/70
    assert informative_chance(torch.tensor([4]), 8, 4).item() == pytest.approx(68 / 70)
    assert informative_chance(torch.tensor([0, 8]), 8, 8).tolist() == [0.0, 0.0]
    rewards = torch.tensor([[1.0] * s + [0.0] * (8 - s) for s in range(9)])
    torch.testing.assert_close(informative_chance(torch.arange(9), 8, 3), subset_informative(rewards, 3))


POOL = PoolStats(successes=(0, 2, 4, 8), g=8, levels=(1, 1, 2, 2), screen=(0.0, 0.3, 0.5, 0.95))


def test_uniform_draw_is_the_mean_chance():
    c = Composition("grpo", prompts=32, n=8, m=8)
    assert draw_ratio(c, POOL) == pytest.approx(float(informative_chance(torch.tensor(POOL.successes), 8, 8).mean()))
    assert POOL.shares == {"solved": 0.25, "unsolved": 0.25, "mixed": 0.5}


def test_screen_keeps_the_top_share_of_the_draw_by_the_screened_chance():
    # uniform weights, f = 2: the top half by 1 - q^n - (1 - q)^n are q = 0.5 and q = 0.3 (prompts 2 and 1), each
    # with the chance the screen's calibration gives it
    c = Composition("screen", prompts=20, n=8, m=8, screen=2)
    w = group_chance(c, POOL)
    assert draw_ratio(c, POOL) == pytest.approx(float(w[[1, 2]].mean()))
    # f = 4 keeps the single best-screened prompt
    assert draw_ratio(Composition("s4", 20, 8, 8, screen=4), POOL) == pytest.approx(float(w[2]))
    assert float(w[2]) > float(w[[0, 3]].max()), "the calibration ranks as the screen does here"
    with pytest.raises(ValueError, match="worked solutions"):
        draw_ratio(c, PoolStats(successes=(1, 2), g=8, levels=(1, 1)))


def beta_pool(k: int, coef: tuple[float, float], spread: float, seed: int = 0, screen_noise: float = 0.0):
    """K reference prompts of g = 8 whose pass rates are Beta(spread mu, spread (1 - mu)) around mu = sigmoid(a + b
    x), x ~ N(0, 2) the logit of the screen's likelihood (plus noise the rates do not see), and the true chance
    that a group of 4 of each is mixed: the Beta moments, 1 - E[p^4] - E[(1 - p)^4]."""
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(k, generator=gen, dtype=torch.float64)
    mu = torch.sigmoid(coef[0] + coef[1] * x)
    p = torch.distributions.Beta(spread * mu, spread * (1 - mu)).sample()
    successes = torch.binomial(torch.full((k,), 8.0, dtype=torch.float64), p)
    a, b = spread * mu, spread * (1 - mu)
    moment = lambda u, v: torch.stack([(u + i) / (u + v + i) for i in range(4)]).prod(0)  # noqa: E731
    screen = torch.sigmoid(x + screen_noise * torch.randn(k, generator=gen, dtype=torch.float64))
    pool = PoolStats(successes=tuple(int(v) for v in successes), g=8, levels=(1,) * k, screen=tuple(screen.tolist()))
    return pool, 1 - moment(a, b) - moment(b, a)


def test_the_screens_calibration_recovers_a_known_line_and_spread():
    """4,000 reference prompts drawn from a known model: the fitted chance of a mixed group of 4 is the model's,
    prompt by prompt (mean absolute error under 0.02), and the draw's ratio at f = 4 is the model's mean chance over
    the top quarter by the screen within 0.01."""
    torch.manual_seed(0)
    pool, truth = beta_pool(4000, (-0.5, 1.2), 6.0)
    c = Composition("s4", 20, 4, 4, screen=4)
    w = group_chance(c, pool)
    assert float((w - truth).abs().mean()) < 0.02
    kept = kept_mass(c, pool)
    assert draw_ratio(c, pool) == pytest.approx(float((kept * truth).sum() / kept.sum()), abs=0.01)


def test_a_screen_that_says_nothing_predicts_the_pools_own_chance():
    """A screen independent of the pass rate (its likelihood pure noise): the line is flat and the spread is the
    pool's, so the top quarter by the screen gets the pool's mean measured chance, not the chance at its mean pass
    rate (0.875 at 0.5, where the pool's mixed groups are 0.58 of all)."""
    torch.manual_seed(1)
    pool, truth = beta_pool(4000, (0.0, 0.0), 1.0, seed=1)
    c = Composition("s4", 20, 4, 4, screen=4)
    measured = float(informative_chance(torch.tensor(pool.successes), 8, 4).mean())
    assert draw_ratio(c, pool) == pytest.approx(measured, abs=0.03)
    assert draw_ratio(c, pool) == pytest.approx(float(truth.mean()), abs=0.03) and draw_ratio(c, pool) < 0.7


def test_the_screens_calibration_weighs_each_prompt_by_its_pool_share():
    """Weights that give one level ten times the pool share of the other move the fitted line toward it: a pool
    whose level-2 prompts (every screen high, every rollout wrong) carry the weight predicts low rates there."""
    pool = PoolStats(successes=(8, 8, 0, 0, 4, 4), g=8, levels=(1, 1, 2, 2, 3, 3),
                     screen=(0.9, 0.8, 0.9, 0.8, 0.5, 0.5))
    light, heavy = screen_calibration(pool)[0], screen_calibration(replace(pool, weights=(1, 1, 10, 10, 1, 1)))[0]
    assert float(heavy[0]) < float(light[0]) and float(heavy[2]) < 0.3
    with pytest.raises(ValueError, match="screen likelihoods"):
        screen_calibration(PoolStats(successes=(1, 2), g=8, levels=(1, 1)))


def test_the_screens_calibration_is_fitted_once_a_reference_set_and_handed_out_as_a_copy():
    """The plan asks for the fit once per screened candidate: the same reference set is fitted once (an equal set
    built anew too), another set gets its own fit, and a caller that writes into its copy changes no later one."""
    from rlcore.plan_draw import _screen_fit

    pool = PoolStats(successes=(8, 6, 0, 1, 4, 4), g=8, levels=(1, 1, 2, 2, 3, 3),
                     screen=(0.9, 0.7, 0.1, 0.2, 0.5, 0.4))
    _screen_fit.cache_clear()
    first, spread = screen_calibration(pool)
    expected = first.clone()
    first.zero_()
    again, spread_again = screen_calibration(replace(pool))
    assert torch.equal(again, expected) and spread_again == spread
    assert _screen_fit.cache_info().misses == 1 and _screen_fit.cache_info().hits == 1
    other = screen_calibration(replace(pool, successes=(0, 0, 8, 8, 4, 4)))[0]
    assert _screen_fit.cache_info().misses == 2 and not torch.allclose(other, expected)


def test_dots_draw_weights_levels_by_their_pooled_rate():
    # level 1: (0 + 2 + 1) / (16 + 2) = 1/6; level 2: (4 + 8 + 1) / 18 = 13/18; target 0.5: level 2 is nearer,
    # and tau = 1e-3 puts all the weight there
    c = Composition("dots", 32, 8, 8, draw="dots", weighting="target", alpha=0.5, tau=1e-3)
    w = informative_chance(torch.tensor([4, 8]), 8, 8)
    assert draw_ratio(c, POOL) == pytest.approx(float(w.mean()))
    # informative weighting: q = 1 - p^8 - (1 - p)^8 of each level's rate
    inf = Composition("inf", 32, 8, 8, draw="dots", weighting="observed")
    q = [1 - p ** 8 - (1 - p) ** 8 for p in (1 / 6, 1 / 6, 13 / 18, 13 / 18)]
    w = informative_chance(torch.tensor(POOL.successes), 8, 8).tolist()
    assert draw_ratio(inf, POOL) == pytest.approx(sum(a * b for a, b in zip(q, w, strict=True)) / sum(q))


def test_a_reference_prompt_stands_for_its_share_of_the_pool():
    # a stratified set: the unsolved and the solved prompt stand for a tenth of the pool each, the mixed ones for 0.4
    pool = PoolStats(successes=(0, 2, 4, 8), g=8, levels=(1, 2, 3, 4), weights=(0.2, 0.8, 0.8, 0.2))
    assert pool.shares == pytest.approx({"solved": 0.1, "unsolved": 0.1, "mixed": 0.8})
    assert draw_ratio(Composition("grpo", 32, 8, 8), pool) == pytest.approx(0.8)  # equal shares: 0.5
    # DOTS with tau -> 0 keeps the levels nearest alpha (3/10 and 5/10 are equally near 0.4): mass 0.4 each
    dots = Composition("dots", 32, 8, 8, draw="dots", alpha=0.4, tau=1e-3)
    assert draw_ratio(dots, pool) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="weights"):
        PoolStats(successes=(1, 2), g=8, levels=(1, 1), weights=(0.0, 0.0))


def test_a_call_costs_a_line_in_its_tokens():
    line = CallCost.fit([100, 300], [1.5, 2.5])
    assert (line.fixed_s, line.token_s) == pytest.approx((1.0, 0.005))
    assert line.time(200) == pytest.approx(2.0) and line.time(0) == 0.0  # no tokens: no call
    assert line.per_token(100) == pytest.approx(0.015) and line.per_token(300) == pytest.approx(2.5 / 300)
    assert (line.tokens, line.seconds) == ((100.0, 300.0), (1.5, 2.5))
    # noise that would make a part negative, or one size only: the line through 0, the same cost at any batch
    for tokens, seconds, slope in (([100, 300], [2.0, 1.0], 500 / 100_000), ([100, 300], [0.5, 2.5], 800 / 100_000),
                                   ([200], [1.0], 0.005)):
        flat = CallCost.fit(tokens, seconds)
        assert (flat.fixed_s, flat.token_s) == pytest.approx((0.0, slope))
    with pytest.raises(ValueError, match="timed calls"):
        CallCost.fit([], [])
    with pytest.raises(ValueError, match="fixed_s"):
        CallCost(-1.0, 0.1)


def test_a_generate_call_costs_its_decode_steps_and_its_tokens():
    # two calls: 50 steps and 2000 tokens, 60 steps and 12000 tokens, at 2 ms a step and 70 us a token
    call = CallCost.fit([2000, 12000], [50 * 0.002 + 2000 * 7e-5, 60 * 0.002 + 12000 * 7e-5], steps=[50, 60])
    assert (call.fixed_s, call.step_s, call.token_s) == pytest.approx((0.0, 0.002, 7e-5))
    assert call.steps == (50.0, 60.0) and call.time(1000, 20) == pytest.approx(0.04 + 0.07)
    # the same tokens in fewer steps (shorter longest completion) cost less; a bigger batch less a token
    assert call.time(1000, 10) < call.time(1000, 20)
    assert call.per_token(12000, 60) < call.per_token(2000, 50)
    # noise that makes a part negative, or steps that cannot be told from tokens: the line through 0
    for tokens, seconds, steps in (([2000, 12000], [0.9, 0.5], [50, 60]), ([2000, 4000], [0.2, 0.4], [20, 40]),
                                   ([2000], [0.2], [20])):
        flat = CallCost.fit(tokens, seconds, steps=steps)
        through_0 = sum(t * s for t, s in zip(tokens, seconds, strict=True)) / sum(t * t for t in tokens)
        assert (flat.step_s, flat.fixed_s, flat.token_s) == pytest.approx((0.0, 0.0, through_0))
    with pytest.raises(ValueError, match="step counts"):
        CallCost.fit([1, 2], [1, 2], steps=[1])
    with pytest.raises(ValueError, match="step_s"):
        CallCost(0.0, 0.1, step_s=-1.0)


def slow_longest(lengths: dict, mix: dict, rows: int) -> float:
    """Every draw of ``rows`` lengths, each from the mix of the levels' lengths, enumerated with its chance."""
    total = sum(mix.values())
    chance: dict = {}
    for lv, share in mix.items():
        for x in lengths[lv]:
            chance[x] = chance.get(x, 0.0) + share / total / len(lengths[lv])
    return sum(math.prod(chance[x] for x in draw) * max(draw)
               for draw in itertools.product(list(chance), repeat=rows))


@pytest.mark.parametrize("mix", [{1: 1.0}, {2: 1.0}, {1: 0.5, 2: 0.5}, {1: 0.9, 2: 0.1}, {1: 3.0, 3: 1.0}])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_a_calls_longest_completion_matches_the_slow_oracle(mix, rows):
    lengths = {1: (3, 5, 5, 8), 2: (10, 20, 30)}
    costs = UnitCosts(**{**COSTS.__dict__, "completion_lengths": tuple(lengths.items())})
    every = {1: lengths[1], 2: lengths[2], 3: lengths[1] + lengths[2]}  # level 3: the probe drew none
    assert costs.longest(mix, rows) == pytest.approx(slow_longest(every, mix, rows))


def test_a_calls_longest_completion_hand_worked():
    costs = UnitCosts(**{**COSTS.__dict__, "completion_lengths": ((1, (1, 3)),)})
    # the longer of two draws from {1, 3}: 1 with chance 1/4, else 3
    assert costs.longest({1: 1.0}, 2) == pytest.approx(0.25 * 1 + 0.75 * 3)
    assert costs.longest({1: 1.0}, 0) == 0.0 and COSTS.longest({1: 1.0}, 8) == 0.0  # no lengths recorded: 0


def test_a_draw_of_short_completions_takes_fewer_decode_steps():
    # level 1: completions of 10 tokens; level 2: of 10 or 50 (the same mean as below, 30 at level 2 otherwise)
    generate = CallCost(0.0, 2.0, step_s=100.0)
    costs = UnitCosts(**{**COSTS.__dict__, "generate": generate, "levels": ((1, 10, 5), (2, 30, 5)),
                         "completion_lengths": ((1, (10, 10)), (2, (10, 50)))})
    base, (dots,) = predict([Composition("dots", 4, 8, 8, draw="dots", alpha=0.6)], Composition("grpo", 4, 8, 8),
                            POOL, costs)
    # DOTS near 0.6 draws level 2 only: one call of 32 rollouts whose longest is 50 unless all 32 are 10
    assert dots.generate_s == pytest.approx(32 * 30 * 2 + 100 * (50 - 40 * 0.5 ** 32))
    # uniform: level 2's long completions are a quarter of the rollouts
    assert base.generate_s == pytest.approx(32 * 20 * 2 + 100 * (50 - 40 * 0.75 ** 32))


def test_the_signal_counts_each_informative_group_s_trained_rows_less_one_hand_worked():
    """The choice's signal is the informative contrasts: a group of m trained rows centred on its own mean holds
    m - 1. At n = 8 half of 4 prompts are mixed (2 groups): 2 x 7 trained whole, 2 x 3 with PODS keeping 4 of 8;
    and with groups of 6 a 2-of-8 prompt's group is mixed unless its 6 rollouts are 6 of the 6 failures of its 8
    (1 of 28 subsets) and a 4-of-8 prompt's always: 27/28 + 1 informative groups of 5 contrasts each."""
    base, (pods, six) = predict([Composition("pods", 4, 8, 4), Composition("six", 4, 6, 6)],
                                Composition("grpo", 4, 8, 8), POOL, COSTS)
    assert base.informative == pytest.approx(2) and base.signal == pytest.approx(2 * 7)
    assert pods.informative == pytest.approx(2) and pods.signal == pytest.approx(2 * 3)
    assert six.informative == pytest.approx(27 / 28 + 1) and six.signal == pytest.approx((27 / 28 + 1) * 5)


def test_a_draw_is_cut_into_calls_of_the_engines_chunk():
    assert call_rows(32, 8, 512) == [256] and call_rows(80, 8, 512) == [512, 128]
    assert call_rows(5, 8, 16) == [16, 16, 8] and call_rows(5, 8, 0) == [40] and call_rows(0, 8, 512) == []
    assert call_rows(3, 600, 512) == [600, 600, 600]  # a prompt a call at least


COSTS = UnitCosts(generate=CallCost(0.0, 2.0), update=CallCost(0.0, 1.0), forward=CallCost(0.0, 0.5),
                  completion_tokens=10, prompt_tokens=5, solution_tokens=7)


def test_a_step_hand_worked():
    base, (grpo, replay, dyn, screen) = predict([
        Composition("grpo", 4, 8, 8), Composition("replay", 4, 8, 8, fresh_frac=0.5, steps=10, round_steps=5),
        Composition("dyn", 4, 8, 8, dynamic=(2.0, 1)), Composition("screen", 4, 8, 8, screen=2)],
        Composition("grpo", 4, 8, 8), POOL, COSTS)
    r = 0.5  # prompts of 2/8 and 4/8 are always mixed at n = 8, 0/8 and 8/8 never
    assert grpo.effective_ratio == pytest.approx(r) and grpo.informative == pytest.approx(4 * r)
    assert grpo.signal == pytest.approx(4 * r * 7)  # informative contrasts: each group's 8 rows less its mean
    # generated 4 x 8 rollouts x 10 tokens x 2 s; updated 2 informative groups x 8 rows x 15 tokens x 1 s
    assert grpo.step_s == pytest.approx(4 * 8 * 10 * 2 + 2 * 8 * 15)
    assert base.clock == grpo.clock == pytest.approx(1.0)
    # replay: round 0 (5 of 10 steps) is all fresh, the rest half: 3 fresh prompts (1.5 informative) + 1 replayed
    assert replay.informative == pytest.approx(2.5) and replay.effective_ratio == pytest.approx(2.5 / 4)
    assert replay.signal == pytest.approx(2.5 * 7)  # replayed groups count 7 contrasts as fresh ones do
    assert replay.step_s == pytest.approx(3 * 8 * 10 * 2 + 2.5 * 8 * 15)
    # dynamic, one round: asks ceil(2 x 4) = 8 prompts and keeps min(y, 4) of y ~ Binomial(8, 1/2) informative:
    # 4 - (4 x 1 + 3 x 8 + 2 x 28 + 1 x 56) / 256
    kept = 4 - 140 / 256
    assert dyn.generated == pytest.approx(64) and dyn.informative == pytest.approx(kept)
    assert dyn.effective_ratio == 1.0 and dyn.signal == pytest.approx(kept * 7)
    assert dyn.step_s == pytest.approx(64 * 10 * 2 + kept * 8 * 15)
    # screen f = 2: the two best-screened prompts at their calibrated chance r2; 8 candidates x (5 + 7) tokens x
    # 0.5 s forward
    r2 = float(group_chance(Composition("screen", 4, 8, 8, screen=2), POOL)[[1, 2]].mean())
    assert screen.informative == pytest.approx(4 * r2) and screen.signal == pytest.approx(4 * r2 * 7)
    assert screen.step_s == pytest.approx(4 * 8 * 10 * 2 + 4 * r2 * 8 * 15 + 2 * 4 * 12 * 0.5)
    assert screen.clock == pytest.approx(screen.step_s / grpo.step_s)


def test_the_prescreen_pays_for_the_candidates_it_scores_and_chooses_among_all_hand_worked():
    """select.prescreen: f = 4 candidates a prompt drawn, 1 scored. The pass costs one candidate a prompt (4 x 12
    tokens x 0.5 s, where f = 4 alone costs 16 x 12 x 0.5), and the draw's ratio is f = 4's: the top quarter of the
    screened mass, prompt 2 at its calibrated chance. The plan reads it from the technique's rule alone
    (rlcore/step_rules.py), as it reads a screen without one."""
    grpo = Composition("grpo", 4, 8, 8)
    pre_rule = Prescreen(1, 8, 20.0)
    _, (four, pre) = predict([Composition("s4", 4, 8, 8, screen=4),
                              Composition("pre", 4, 8, 8, screen=4, rules=(pre_rule,))], grpo, POOL, COSTS)
    assert (four.forward_tokens, pre.forward_tokens) == (16 * 12, 4 * 12)
    assert pre.forward_s == pytest.approx(4 * 12 * 0.5) and pre.step_s == pytest.approx(four.step_s - 12 * 12 * 0.5)
    w = float(group_chance(Composition("s4", 4, 8, 8, screen=4), POOL)[2])
    assert pre.effective_ratio == four.effective_ratio == pytest.approx(w)
    assert screened_per_prompt(Composition("s2", 4, 8, 8, screen=2, rules=(Prescreen(3, 8, 20.0),))) == 2, \
        "never more than the screen draws"
    with pytest.raises(ValueError, match="prescreen: need scored >= 1"):
        Prescreen(0, 8, 20.0)


def test_the_screen_run_ahead_costs_what_outlasts_the_generate_call_hand_worked():
    """The screen's pass beside the draw's generate call (select.screen_ahead): in rounds of 4 steps, the first step
    of each pays it whole and the other three pay only what outlasts the call; a pass longer than the call (a slow
    forward) shows through."""
    grpo = Composition("grpo", 4, 8, 8)
    _, (inline, ahead) = predict([Composition("screen", 4, 8, 8, screen=2, round_steps=4),
                                  Composition("ahead", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True)],
                                 grpo, POOL, COSTS)
    generate, forward = 4 * 8 * 10 * 2, 2 * 4 * 12 * 0.5  # 640 s of generation beside a 48 s pass
    assert inline.forward_s == pytest.approx(forward) and ahead.forward_s == pytest.approx(forward / 4)
    assert ahead.step_s == pytest.approx(inline.step_s - 3 / 4 * forward)
    assert ahead.forward_tokens == inline.forward_tokens and ahead.signal == inline.signal
    slow = UnitCosts(**{**COSTS.__dict__, "forward": CallCost(0.0, 20.0)})  # a pass of 1920 s
    _, (slow_ahead,) = predict([Composition("ahead", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True)],
                               grpo, POOL, slow)
    assert slow_ahead.forward_s == pytest.approx((1920 + 3 * (1920 - generate)) / 4)


def test_the_screen_run_ahead_of_an_overlapped_step_is_on_the_trainers_side_hand_worked():
    """Overlapped (lag 1), the screen's pass run ahead waits for the update it runs beside and then runs on the
    trainer's side (tasks/overlap/concurrent.py): in rounds of 4 steps, the first step of each scores its own
    candidates in its draw, before its generate call, and the other three score theirs after the update, so
    3/4 of the pass joins the update's side and 1/4 the draw's; each side at its pace on split cores. With the round
    started ahead too, every step's pass is on the trainer's side."""
    grpo = Composition("grpo", 4, 8, 8)
    split = ThreadSplit(generate=1.5, passes=1.25, threads=(1, 1))
    costs = UnitCosts(**{**COSTS.__dict__, "split": split})
    generate, forward = 4 * 8 * 10 * 2, 2 * 4 * 12 * 0.5  # 640 s of generation, a 48 s pass
    _, (inline, ahead, both) = predict([
        Composition("screen", 4, 8, 8, screen=2, round_steps=4, overlap=True),
        Composition("ahead", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, overlap=True),
        Composition("both", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, round_ahead=True, overlap=True)],
        grpo, POOL, costs)
    update, fixed = inline.update_s, inline.fixed_s  # as timed, the same for all three
    assert inline.ahead_s == 0 and inline.forward_s == pytest.approx(forward)
    assert inline.step_s == pytest.approx(max(generate * 1.5 + forward * 1.25, update * 1.25 + fixed))
    assert ahead.forward_s == pytest.approx(forward / 4) and ahead.ahead_s == pytest.approx(3 / 4 * forward)
    assert ahead.step_s == pytest.approx(max(generate * 1.5 + forward / 4 * 1.25,
                                             (update + 3 / 4 * forward) * 1.25 + fixed))
    assert both.forward_s == 0 and both.ahead_s == pytest.approx(forward)
    assert both.step_s == pytest.approx(max(generate * 1.5, (update + forward) * 1.25 + fixed))
    assert ahead.forward_tokens == inline.forward_tokens and ahead.signal == inline.signal
    # sequential (lag 0), nothing is on the trainer's side
    _, (seq,) = predict([Composition("ahead", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True)], grpo, POOL,
                        costs)
    assert seq.ahead_s == 0


def test_the_screen_in_the_generator_process_is_on_the_draws_side_hand_worked():
    """select.screen_process sampler: every screen pass of an overlapped step (a round's first step's own, the others'
    look-ahead) runs in the generator process beside its generate call, at the generator's pace, and the trainer's side
    is the update alone; the same pass, signal and tokens as on the trainer's side. Only where it screens and
    overlaps."""
    grpo = Composition("grpo", 4, 8, 8)
    split = ThreadSplit(generate=1.5, passes=1.25, threads=(1, 1))
    costs = UnitCosts(**{**COSTS.__dict__, "split": split})
    generate, forward = 4 * 8 * 10 * 2, 2 * 4 * 12 * 0.5  # 640 s of generation, a 48 s pass
    _, (trainer, sampler) = predict([
        Composition("trainer", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, overlap=True),
        Composition("sampler", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, overlap=True,
                    screen_in_sampler=True)], grpo, POOL, costs)
    update, fixed = sampler.update_s, sampler.fixed_s
    assert (sampler.forward_s, sampler.ahead_s) == (trainer.forward_s, trainer.ahead_s)
    assert sampler.step_s == pytest.approx(max((generate + forward) * 1.5, update * 1.25 + fixed))
    assert trainer.step_s == pytest.approx(max(generate * 1.5 + forward / 4 * 1.25,
                                               (update + 3 / 4 * forward) * 1.25 + fixed))
    slow = UnitCosts(**{**costs.__dict__, "update": CallCost(0.0, 10.0)})  # the update the longer side
    _, (trainer, sampler) = predict([
        Composition("trainer", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, overlap=True),
        Composition("sampler", 4, 8, 8, screen=2, round_steps=4, screen_ahead=True, overlap=True,
                    screen_in_sampler=True)], grpo, POOL, slow)
    assert sampler.step_s == pytest.approx(trainer.step_s - 3 / 4 * forward * 1.25), "the pass leaves the longer side"
    with pytest.raises(ValueError, match="only where it screens"):
        Composition("x", 4, 8, 8, screen=2, screen_in_sampler=True)


def test_a_round_started_ahead_costs_what_outlasts_the_generate_call_hand_worked():
    """select.round_ahead: the round's predictor fit, then (with the screen run ahead) the screen of its first step,
    beside the generate call of the round's last step; each pays only what outlasts the call, the fit first."""
    grpo = Composition("grpo", 4, 8, 8)
    forward = 2 * 4 * 12 * 0.5  # a step's 48 s screen, beside its 640 s generate call (4 x 8 x 10 x 2)

    def pair(fit_s: float, **kw):
        costs = UnitCosts(**{**COSTS.__dict__, "fixed": FixedCosts(0.0, 0.0, 0.0, fit_s)})
        _, got = predict([Composition(n, 4, 8, 8, screen=2, round_steps=4, predictor=True, screen_ahead=True,
                                      round_ahead=ahead, **kw) for n, ahead in (("inline", False), ("ahead", True))],
                         grpo, POOL, costs)
        return got

    inline, ahead = pair(100.0)  # a 100 s fit: it and the 48 s screen both fit in the 640 s call
    assert inline.fixed_s == pytest.approx(100 / 4) and inline.forward_s == pytest.approx(forward / 4)
    assert ahead.fixed_s == pytest.approx(0.0) and ahead.forward_s == pytest.approx(0.0)
    assert ahead.step_s == pytest.approx(inline.step_s - (100 + forward) / 4)
    inline, ahead = pair(620.0)  # a 620 s fit leaves 20 s of the call for the screen: 28 s of it show through
    assert ahead.fixed_s == pytest.approx(0.0) and ahead.forward_s == pytest.approx(28 / 4)
    _, ahead = pair(700.0)  # a fit longer than the call: 60 s of it and the whole screen show through
    assert ahead.fixed_s == pytest.approx(60 / 4) and ahead.forward_s == pytest.approx(forward / 4)


def test_a_training_clock_with_its_fixed_costs_hand_worked():
    costs = UnitCosts(generate=CallCost(0.5, 0.01), update=CallCost(0.2, 0.001), forward=CallCost(0.0, 0.0),
                      completion_tokens=10, prompt_tokens=5,
                      fixed=FixedCosts(optimizer_s=0.05, step_s=0.02, round_s=0.3, fit_s=0.7), score_s=0.001)
    budget = {"steps": 10, "round_steps": 5, "chunk": 16}  # 2 prompts of 8 a generate call
    grpo = Composition("grpo", 4, 8, 8, **budget)
    dots = Composition("dots", 4, 8, 8, reference=(2, 4), predictor=True, calibration=(4, 4), scored=100, **budget)
    base, (fit,) = predict([dots], grpo, POOL, costs)
    # two calls of 16 rollouts x 10 tokens; one update of 2 informative groups x 8 rows x 15 tokens
    generate, update = 2 * (0.5 + 0.01 * 160), 0.2 + 0.001 * 240
    assert (base.generate_s, base.update_s, base.forward_s) == pytest.approx((4.2, 0.44, 0.0))
    # the optimizer step and the bookkeeping a step, a checkpoint a round of 5; plain GRPO pays no predictor fit
    assert base.fixed_s == pytest.approx(0.05 + 0.02 + 0.3 / 5)
    assert base.step_s == pytest.approx(generate + update + base.fixed_s)
    assert base.upfront_s == 0.0 and base.train_s == pytest.approx(10 * base.step_s)
    # DOTS: the fit a round, and its fresh reference rollouts (2 prompts x 4: one call of 8) a round
    assert fit.fixed_s == pytest.approx(0.05 + 0.02 + (0.3 + 0.7) / 5)
    assert fit.generate_s == pytest.approx(generate + (0.5 + 0.01 * 80) / 5)
    assert fit.generated == pytest.approx(32 + 8 / 5)
    # before its first step: the calibration (4 prompts x 4: one call of 16) and 100 prompts scored
    assert fit.upfront_s == pytest.approx(0.5 + 0.01 * 160 + 100 * 0.001)
    assert fit.train_s == pytest.approx(fit.upfront_s + 10 * fit.step_s)
    assert fit.clock == pytest.approx(fit.train_s / base.train_s) and base.clock == 1.0


def test_an_overlapped_step_costs_the_slower_side_hand_worked():
    """Lag 1: the draw (the screen's pass, then the generate calls) beside the update and the fixed costs, the
    slower side; where they split a CPU's cores, each at its pace beside the other. Off, the plain sum."""
    assert overlapped_step(0.2, 0.1, 0.15, 0.01, None) == pytest.approx(0.3)  # 0.2 + 0.1 against 0.16
    split = ThreadSplit(generate=1.5, passes=2.0, threads=(1, 1))
    assert overlapped_step(0.2, 0.1, 0.15, 0.01, split) == pytest.approx(0.2 * 1.5 + 0.1 * 2)  # against 0.31
    assert overlapped_step(0.1, 0.0, 0.3, 0.01, split) == pytest.approx(0.3 * 2 + 0.01)  # the trainer slower
    costs = replace(COSTS, split=split, fixed=FixedCosts(optimizer_s=1.0, step_s=2.0))
    grpo = Composition("grpo", 4, 8, 8)
    base, (seq, over, screen) = predict([grpo, replace(grpo, name="over", overlap=True),
                                         Composition("s", 4, 8, 8, screen=2, overlap=True)], grpo, POOL, costs)
    assert seq == replace(base, name="grpo")  # without the overlap: the sum, as before
    assert seq.step_s == pytest.approx(640 + 240 + 3)
    # 640 s of generation at 1.5x against 2 x 8 rows x 15 tokens x 1 s of update at 2x and 3 s fixed
    assert over.step_s == pytest.approx(max(640 * 1.5, 240 * 2 + 3))
    assert (over.generate_s, over.update_s, over.fixed_s) == (seq.generate_s, seq.update_s, seq.fixed_s)
    assert screen.step_s == pytest.approx(overlapped_step(screen.generate_s, screen.forward_s, screen.update_s, 3.0,
                                                          split))
    with pytest.raises(ValueError, match="ThreadSplit.generate"):
        ThreadSplit(generate=0.0, passes=1.0, threads=(1, 1))
    with pytest.raises(ValueError, match="ThreadSplit.threads"):
        ThreadSplit(generate=1.0, passes=1.0, threads=(0, 1))
    assert UnitCosts.from_dict(asdict(costs)) == costs


part = st.floats(0.0, 10.0)
pace = st.floats(0.5, 3.0)


@settings(max_examples=200, deadline=None)
@given(parts=st.tuples(part, part, part, part), paces=st.tuples(pace, pace), which=st.integers(0, 3),
       more=st.floats(0.0, 5.0))
def test_an_overlapped_step_is_each_sides_at_its_pace_and_never_falls_as_work_is_added(parts, paces, which, more):
    """At least each side at its pace, at most their sum; adding to any part never shortens the step (the plan's
    pruning predicts with the untimed parts at 0 as a lower bound: rlcore/plan_choice.py ``out_of_reach``)."""
    split = ThreadSplit(generate=paces[0], passes=paces[1], threads=(1, 1))
    gen, fwd, upd, fix = parts
    step = overlapped_step(gen, fwd, upd, fix, split)
    draw, train = gen * paces[0] + fwd * paces[1], upd * paces[1] + fix
    assert max(draw, train) - 1e-9 <= step <= draw + train + 1e-9
    grown = list(parts)
    grown[which] += more
    assert overlapped_step(*grown, split) >= step - 1e-9


def test_a_draw_has_the_lengths_of_the_levels_it_favours():
    # the probe's rollouts: level 1 completions of 10 tokens after prompts of 5, level 2 of 30 after 5
    costs = UnitCosts(**{**COSTS.__dict__, "levels": ((1, 10, 5), (2, 30, 5))})
    base, (dots,) = predict([Composition("dots", 4, 8, 8, draw="dots", alpha=0.6)], Composition("grpo", 4, 8, 8),
                            POOL, costs)
    # uniform: completions of (10 + 30) / 2 tokens; the informative prompts (2/8 at level 1, 4/8 at level 2) update
    # rows of 15 and 35 tokens
    assert base.generated_tokens == pytest.approx(32 * 20) and base.updated_tokens == pytest.approx(2 * 8 * 25)
    # DOTS near 0.6 draws level 2 only (its pooled rate 13/18): completions of 30, the 4/8 prompt's rows of 35
    assert dots.generated_tokens == pytest.approx(32 * 30) and dots.updated_tokens == pytest.approx(2 * 8 * 35)
    assert dots.step_s == pytest.approx(32 * 30 * 2 + 2 * 8 * 35)


def pred(name, signal, step_s, base_step=10.0):
    return Prediction(name, effective_ratio=0.5, signal=signal, generated=0, generated_tokens=0, updated_tokens=0,
                      forward_tokens=0, step_s=step_s, clock=step_s / base_step)


def test_choose_cheapest_with_enough_signal_ties_to_more_signal():
    base = pred("grpo", 10, 10)
    cheap_weak = pred("weak", 7, 2)  # below 0.8 x 10: does not qualify
    a = pred("a", 8, 5)
    b = pred("b", 12, 5 * (1 + TIE / 2))  # within the tie band of a, more signal
    c = pred("c", 20, 9)
    best, why = choose(base, [cheap_weak, a, b, c], 0.8)
    assert best is b and why.startswith("b: predicted 0.51x") and "next a" in why
    assert choose(base, [cheap_weak, a], 0.8)[0] is a
    best, why = choose(base, [pred("slow", 20, 12), cheap_weak], 0.8)
    assert best is base and "no candidate" in why
    with pytest.raises(ValueError, match="min_signal"):
        choose(base, [a], 1.5)


def test_the_choice_ranks_the_work_and_quotes_the_clock_the_run_will_take():
    """With ``work`` (the same candidates one after the other), the cheapest work is chosen, whatever the overlap
    makes of it; the reason quotes the overlapped clock. Candidates out of order are refused."""
    base, a, b = pred("grpo", 10, 10), pred("a", 10, 5), pred("b", 10, 6)
    over_base, over_a, over_b = pred("grpo", 10, 8), pred("a", 10, 4.5), pred("b", 10, 3.0)
    assert choose(over_base, [over_a, over_b], 0.95)[0] is over_b  # by the overlapped step
    best, why = choose(over_base, [over_a, over_b], 0.95, work=(base, [a, b]))
    assert best is over_a and why.startswith(f"a: predicted {over_a.clock:.2f}x") and "next b at 0.30x" in why
    with pytest.raises(ValueError, match="same candidates, in the same order"):
        choose(over_base, [over_a, over_b], 0.95, work=(base, [b, a]))


def clocked(name, signal, step_s, upfront_s=0.0, steps=10):
    """A prediction with its training clock: ``steps`` steps of ``step_s`` and ``upfront_s`` before them."""
    train_s = upfront_s + steps * step_s
    return Prediction(name, effective_ratio=0.5, signal=signal, generated=0, generated_tokens=0, updated_tokens=0,
                      forward_tokens=0, step_s=step_s, upfront_s=upfront_s, train_s=train_s, clock=train_s / 10.0)


def test_what_the_run_spent_before_the_choice_is_shown_not_weighed():
    """Plain GRPO: 10 steps of 1 s (10 s). dots: 10 steps of 0.9 s after 0.5 s of its own calibration and scoring
    (9.5 s, 0.95x). The run spent 3 s before its first step, whatever it now trains: dots (9 + 3) / 10 = 1.2x plain
    GRPO's clock against (10 + 3) / 10 = 1.3x for plain GRPO after the same 3 s, so dots, and the reason shows both
    of its figures. Having spent 0.8 s: 0.98x, dots as well."""
    base, dots = clocked("grpo", 10, 1.0), clocked("dots", 10, 0.9, upfront_s=0.5)
    best, why = choose(base, [dots], 0.8, plan_s=3.0)
    assert best is dots and why.startswith("dots: predicted 0.95x plain GRPO's training clock, 1.20x with the plan's "
                                           "own 3 s with 1.00x its informative contrasts")
    assert run_clock(dots, base, 3.0).with_plan == pytest.approx(1.2)
    best, why = choose(base, [dots], 0.8, plan_s=0.8)
    assert best is dots and why.startswith("dots: predicted 0.95x plain GRPO's training clock, 0.98x with the plan's "
                                           "own 1 s with 1.00x its informative contrasts")
    assert run_clock(dots, base, 0.8).with_plan == pytest.approx(0.98)
    assert choose(base, [dots], 0.8)[0] is dots  # nothing spent: the cheaper step wins
    slow = clocked("slow", 10, 1.0)
    assert choose(base, [slow], 0.8, plan_s=3.0) == (base, "grpo: no candidate is predicted cheaper than plain GRPO "
                                                            "with at least 80% of its informative contrasts a step")


def test_only_a_choice_that_reads_the_scores_pays_the_pools_scoring():
    """A run scores its pool only for a choice that reads the scores (tasks/stages.py ``score_stage``). Plain GRPO:
    10 steps of 1 s. ``dots``: 10 steps of 0.8 s after 0.5 s of calibration and 0.4 s of scoring (8.9 s); ``screen``:
    10 steps of 0.85 s after the same calibration, no scoring (9.0 s). From here on dots costs 8 + 0.4 = 8.4 s and
    the screen 8.5 s: dots, whatever was spent. The clock's seconds before the first step count the choice's
    scoring: with 1.5 s spent, dots (8 + 1.5 + 0.4) / 10 = 0.99x, the screen (8.5 + 1.5) / 10 = 1.00x."""
    base = clocked("grpo", 10, 1.0)
    dots = replace(clocked("dots", 10, 0.8, upfront_s=0.9), scoring_s=0.4)
    screen = clocked("screen", 10, 0.85, upfront_s=0.5)
    assert run_clock(dots, base, 1.5).with_plan == pytest.approx(0.99)
    assert run_clock(dots, base, 1.5).upfront_s == pytest.approx(1.9)
    assert run_clock(screen, base, 1.5).with_plan == pytest.approx(1.0)
    assert run_clock(screen, base, 1.5).upfront_s == pytest.approx(1.5)
    assert choose(base, [dots, screen], 0.8, plan_s=1.5)[0] is dots
    assert choose(base, [dots, screen], 0.8, plan_s=5.0)[0] is dots
    assert choose(base, [screen], 0.8, plan_s=5.0)[0] is screen
    # the choice weighs the scoring too: dots's cheaper steps (8 s) and 1 s of scoring against the screen's 8.4 s
    dots, screen = replace(dots, scoring_s=1.0), replace(screen, step_s=0.84, train_s=8.9)
    assert choose(base, [dots, screen], 0.8)[0] is screen
    assert choose(base, [replace(dots, scoring_s=0.3), screen], 0.8)[0].name == "dots"  # 8.3 s against 8.4 s


def test_the_tie_break_goes_to_the_signal_whatever_was_spent():
    """a: 10 steps of 0.8 s, 8 informative contrasts; b: 0.82 s (within the tie band of a), 12: b, with 1 s
    or 1.9 s spent (with 1.9 s b's clock is 1.01x and a's 0.99x, but both are spent either way)."""
    base, a, b = clocked("grpo", 10, 1.0), clocked("a", 8, 0.8), clocked("b", 12, 0.82)
    assert choose(base, [a, b], 0.8, plan_s=1.9)[0] is b
    assert choose(base, [a, b], 0.8, plan_s=1.0)[0] is b
    with pytest.raises(ValueError, match="plan_s"):
        choose(base, [a], 0.8, plan_s=-1.0)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 30.0), st.floats(0.1, 2.0), st.floats(0.0, 5.0))
def test_what_was_spent_never_changes_the_choice(plan_s, step_s, upfront):
    """The sunk seconds are shown, never weighed: the choice with any ``plan_s`` is the choice with none, and a
    candidate whose step is cheaper than plain GRPO's (at its signal) is chosen."""
    base, cand = clocked("grpo", 10, 1.0), clocked("c", 10, step_s, upfront_s=upfront)
    best, why = choose(base, [cand], 0.8, plan_s=plan_s)
    assert best is choose(base, [cand], 0.8)[0]
    assert (best is cand) == (step_s < 1.0), why


def test_out_of_reach_hand_worked():
    """Plain GRPO: 10 steps of 1 s. A candidate short of the signal, one whose step is already 1 s, and one at 0.9 s
    whose (9 + 1.5) / 10 = 1.05x with the 1.5 s spent are out of reach, each for its reason; at 0.9 s with 0.5 s
    spent ((9 + 0.5) / 10 = 0.95x) it is in reach."""
    base = clocked("grpo", 10, 1.0)
    assert out_of_reach(clocked("weak", 7, 0.5), base, 0.8, 0.0) == (
        "0.70x grpo's informative contrasts a step, under 80%")
    assert out_of_reach(clocked("slow", 10, 1.0), base, 0.8, 0.0) == "its step at least 1 s against grpo's 1 s"
    assert out_of_reach(clocked("late", 10, 0.9), base, 0.8, 1.5) == (
        "at least 1.05x grpo's clock with the 2 s spent before its first step")
    assert out_of_reach(clocked("near", 10, 0.9), base, 0.8, 0.5) is None


@settings(max_examples=80, deadline=None)
@given(st.floats(0.1, 2.0), st.floats(0.0, 1.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.0, 20.0),
       st.floats(0.0, 20.0), st.integers(6, 14))
def test_a_candidate_out_of_reach_is_never_chosen_once_its_costs_are_known(step_s, extra_s, upfront, more_upfront,
                                                                             spent, more_spent, signal):
    """Pruning is safe: a candidate out of reach for its signal or its step, with the costs it alone pays at 0
    (``step_s``, ``upfront``, the run's ``spent`` so far), is not chosen with any of them larger (``extra_s`` more a
    step, ``more_upfront``, the probe's ``more_spent``). One out of reach only for the planning it would have to
    repay is not offered to the choice (tests/tasks/test_plan_probe.py)."""
    base = clocked("grpo", 10, 1.0)
    lower = clocked("c", signal, step_s, upfront_s=upfront)
    full = clocked("c", signal, step_s + extra_s, upfront_s=upfront + more_upfront)
    why = out_of_reach(lower, base, 0.8, spent)
    if why is not None and "spent before its first step" not in why:
        assert choose(base, [full], 0.8, plan_s=spent + more_spent)[0] is base


def test_dominated_hand_worked():
    """Plain GRPO: 10 steps of 1 s. ``screen``, measured in full: 10 steps of 0.8 s (8 s from here on). ``dots``'s
    lower bound (its scoring and predictor not yet timed): 10 steps of 0.85 s (8.5 s, 6 % above 8 s: out of the tie
    band, dominated); at 0.83 s (8.3 s, within 5 %) it could still win the tie on its signal, so it is not. A rival
    short of the signal, or whose step is not cheaper than plain GRPO's, dominates nothing."""
    base, screen = clocked("grpo", 10, 1.0), clocked("screen", 10, 0.8)
    assert dominated(clocked("dots", 12, 0.85), [screen], base, 0.8) == (
        "at least 8.5 s from here on against screen's 8 s, measured in full")
    assert dominated(clocked("dots", 12, 0.83), [screen], base, 0.8) is None
    assert dominated(clocked("dots", 12, 0.85), [clocked("screen", 7, 0.8)], base, 0.8) is None
    assert dominated(clocked("dots", 12, 0.85), [clocked("screen", 10, 1.0)], base, 0.8) is None
    assert dominated(clocked("dots", 12, 0.85), [], base, 0.8) is None
    # the cheapest rival decides; scoring counts in the cost from here on
    assert dominated(replace(clocked("dots", 12, 0.7), scoring_s=1.5), [clocked("a", 10, 0.9), screen], base,
                     0.8).endswith("against screen's 8 s, measured in full")


@settings(max_examples=80, deadline=None)
@given(st.floats(0.1, 1.2), st.floats(0.0, 1.0), st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.1, 1.2),
       st.integers(6, 14), st.integers(6, 14))
def test_a_dominated_candidate_is_never_chosen_once_its_costs_are_known(step_s, extra_s, scoring, more_scoring,
                                                                         rival_s, signal, rival_signal):
    """Pruning against a rival measured in full is exact: whatever the costs not yet timed add (``extra_s`` a step,
    ``more_scoring``), a candidate ``dominated`` with them at 0 is not chosen beside that rival."""
    base = clocked("grpo", 10, 1.0)
    rival = clocked("rival", rival_signal, rival_s)
    lower = replace(clocked("c", signal, step_s), scoring_s=scoring)
    full = replace(clocked("c", signal, step_s + extra_s), scoring_s=scoring + more_scoring)
    if dominated(lower, [rival], base, 0.8) is not None:
        assert choose(base, [full, rival], 0.8)[0] is not full


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=12), st.sampled_from([2, 4, 8, 16]),
       st.sampled_from(["uniform", "target", "observed"]), st.integers(1, 4))
def test_a_draw_ratio_lies_between_its_prompts_chances(successes, n, how, f):
    k = len(successes)
    pool = PoolStats(successes=tuple(successes), g=8, levels=tuple(i % 3 for i in range(k)),
                     screen=tuple((i % 5) / 4 for i in range(k)))
    c = Composition("c", 8, n, min(n, 8), draw="uniform" if how == "uniform" else "dots",
                    weighting="target" if how == "uniform" else how, screen=f)
    w = group_chance(c, pool)
    r = draw_ratio(c, pool)
    assert float(w.min()) - 1e-9 <= r <= float(w.max()) + 1e-9
    if f == 1:
        assert torch.equal(w, informative_chance(torch.tensor(successes), 8, n)), "no screen: the measured chance"


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="successes"):
        PoolStats(successes=(9,), g=8, levels=(1,))
    with pytest.raises(ValueError, match="one entry per reference prompt"):
        PoolStats(successes=(1, 2), g=8, levels=(1,))
    with pytest.raises(ValueError, match="completion_tokens"):
        UnitCosts(CallCost(0, 1), CallCost(0, 1), CallCost(0, 1), completion_tokens=float("nan"), prompt_tokens=1)
    with pytest.raises(ValueError, match="fit_s"):
        FixedCosts(fit_s=-0.1)
    with pytest.raises(ValueError, match="steps >= 1"):
        Composition("x", 4, 4, 4, steps=0)
    with pytest.raises(ValueError, match="m <= n"):
        Composition("x", 4, 4, 8)


def test_lag_is_one_step_off_where_sampler_and_trainer_run_on_different_devices():
    """No probe is needed (or read): the draw hides behind the update on another device."""
    slow = OverlapProbe(draw_s=1.0, update_s=1.0, at_once_s=5.0)
    for probe in (None, slow):
        c = choose_lag("the sampler is ServerPool, outside this process", probe, 0.05)
        assert (c.lag, c.basis, c.probe) == (1, "devices", None)
        assert "different devices (the sampler is ServerPool" in c.reason


@pytest.mark.parametrize("at_once, lag", [
    (2.6, 0),    # at once slower than one after the other (the toy on one GPU: 1.43x)
    (2.0, 0),    # no gain
    (1.92, 0),   # 4% faster: within the 5% margin
    (1.90, 1),   # exactly 5% faster: the margin is met
    (1.76, 1),   # 0.88x (the 1.5B shape on one GPU)
])
def test_lag_on_a_shared_device_follows_the_probe_and_its_margin(at_once, lag):
    probe = OverlapProbe(draw_s=0.5, update_s=1.5, at_once_s=at_once, repeats=3)
    c = choose_lag(None, probe, 0.05)
    assert (c.lag, c.basis, c.probe) == (lag, "probe", probe)
    assert probe.sequential_s == 2.0 and probe.ratio == pytest.approx(at_once / 2)
    assert c.reason.startswith(f"lag {lag}: a draw and an update at once took {at_once:.3g} s, "
                               f"{at_once / 2:.2f}x the 2 s of one after the other")
    assert ("at least 5% faster" in c.reason) == bool(lag) and ("not 5% faster" in c.reason) == (not lag)
    assert "median of 3" in c.reason
    assert choose_lag(None, probe, 0.0).lag == int(at_once <= 2.0)  # no margin: any gain, or none, overlaps


def test_lag_choice_refuses_what_it_cannot_decide_or_hold():
    with pytest.raises(ValueError, match="no probe to decide by"):
        choose_lag(None, None, 0.05)
    with pytest.raises(ValueError, match="min_gain"):
        choose_lag(None, OverlapProbe(1, 1, 1), 1.0)
    with pytest.raises(ValueError, match="at_once_s"):
        OverlapProbe(draw_s=1, update_s=1, at_once_s=0)
    with pytest.raises(ValueError, match="repeats"):
        OverlapProbe(draw_s=1, update_s=1, at_once_s=1, repeats=0)
    with pytest.raises(ValueError, match="lag must be 0 or 1"):
        LagChoice(2, "config", "x")
    with pytest.raises(ValueError, match="lag must be 0 or 1"):
        LagChoice(True, "config", "x")
    with pytest.raises(ValueError, match="basis"):
        LagChoice(1, "guess", "x")
    with pytest.raises(ValueError, match="probe's timing goes with basis probe"):
        LagChoice(1, "probe", "x")
    with pytest.raises(ValueError, match="probe's timing goes with basis probe"):
        LagChoice(1, "devices", "x", OverlapProbe(1, 1, 1))


def test_the_overlap_probes_predicted_cost():
    """draw 0.05 s, update 0.06 s (the smoke on one GPU), the process's start 5 s: the repeats stop at 5 (19 would
    reach 2 s), each 0.11 s alone and at least 0.06 s at once: 5 + 5 x 0.17 = 5.85 s. draw 1.5 s, update 0.5 s: one
    repeat reaches 2 s: 2 + 1.5 = 3.5 s."""
    assert probe_cost(0.05, 0.06, 5.0, 2.0, 5) == pytest.approx(5.85)
    assert probe_cost(1.5, 0.5, 0.0, 2.0, 5) == pytest.approx(3.5)
    assert probe_cost(0.5, 0.5, 1.0, 2.0, 5) == pytest.approx(1.0 + 2 * 1.5)
    with pytest.raises(ValueError, match="start_s"):
        probe_cost(1, 1, -1, 2, 5)


def test_the_probe_is_skipped_where_it_cannot_pay_for_itself():
    """Lag 1 saves at most min(draw, update) a step: 0.05 s x 10 steps = 0.5 s, less than the 5.85 s probe: lag 0
    without it, and the reason says why; over 1000 steps (50 s) the probe runs and its timing decides."""
    few = ProbeWorth(draw_s=0.05, update_s=0.06, steps=10, probe_s=5.85, start_s=5.0)
    assert few.saving_s == pytest.approx(0.5) and not few.pays
    c = choose_lag(None, None, 0.05, few)
    assert (c.lag, c.basis, c.probe, c.worth) == (0, "cost", None, few)
    assert c.reason == ("lag 0 without the overlap probe: the probe, predicted at 5.85 s (5 s of it starting the "
                        "generator process), against at most 0.5 s lag 1 could save (min(draw 0.05 s, update 0.06 s) "
                        "x 10 steps); the probe could not pay for itself")
    many = ProbeWorth(draw_s=0.05, update_s=0.06, steps=1000, probe_s=5.85, start_s=5.0)
    assert many.saving_s == pytest.approx(50.0) and many.pays
    probe = OverlapProbe(draw_s=0.05, update_s=0.06, at_once_s=0.07, repeats=5, start_s=4.0)
    c = choose_lag(None, probe, 0.05, many)
    assert (c.lag, c.basis, c.probe, c.worth) == (1, "probe", probe, many)
    assert c.reason.endswith("at least 5% faster; starting the generator took 4 s")
    assert choose_lag("CPU cores for each", None, 0.05, few).basis == "devices"  # no probe needed at all
    with pytest.raises(ValueError, match="not run"):
        choose_lag(None, probe, 0.05, few)
    with pytest.raises(ValueError, match="basis cost"):
        LagChoice(0, "cost", "x", worth=many)
    with pytest.raises(ValueError, match="basis cost"):
        LagChoice(0, "cost", "x")


def test_waves_and_the_skip_hand_worked():
    """Waves (first 2, groups of 4, 1.5 x 4 = 6 candidates, uniform draw: no estimate, so an agreeing pair would end
    mixed with chance 13/48 < 0.5 and is not completed): a pair of a 2-of-8 prompt is mixed with chance 12/28, of a
    4-of-8 one 16/28, of the others 0, so 6 x 1/4 = 1.5 pairs are mixed and completed, all informative. Rollouts
    6 x 2 + 1.5 x 2 = 15; generation 12 x 10 x 2 + 3 x 10 x 2 s; the update 1.5 x 4 rows x 15 tokens. The skip
    (explore 0.5, cap 0.9) leaves a prompt whose 8 reference rollouts agreed (z = 8 / n = 1 at n = 8) in with chance
    1/2: GRPO's ratio 2 / 4 becomes 2 / 3."""
    wave = Composition("w", 4, 4, 4, rules=(WaveRule(2, 1.5, 0.5, 2.0),))
    base, (w, whole) = predict([wave, Composition("whole", 4, 4, 4)], Composition("grpo", 4, 8, 8), POOL, COSTS)
    assert w.generated == pytest.approx(15) and w.informative == pytest.approx(1.5) and w.effective_ratio == 1.0
    assert w.signal == pytest.approx(1.5 * 3)  # completed to 4 rows: 3 contrasts a group
    assert w.step_s == pytest.approx(12 * 10 * 2 + 3 * 10 * 2 + 1.5 * 4 * 15)
    assert whole.generated == 16 and whole.informative == pytest.approx(4 * 123 / 280)
    assert whole.signal == pytest.approx(4 * 123 / 280 * 3)
    skip = Composition("skip", 4, 8, 8, rules=(SkipRule(0.5, 0.9),))
    assert draw_ratio(skip, POOL) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="waves"):
        predict([Composition("x", 4, 4, 4, rules=(WaveRule(4, 1.5, 0.5, 2.0),))], Composition("grpo", 4, 8, 8), POOL,
                COSTS)
    with pytest.raises(ValueError, match="at most one rule"):
        predict([Composition("x", 4, 4, 4, rules=(WaveRule(2, 1.5, 0.5, 2.0),) * 2)], Composition("grpo", 4, 8, 8),
                POOL, COSTS)


def test_carried_waves_make_one_call_a_step_hand_worked():
    """The waves of the hand-worked case above with every completion 10 tokens and a decode step 100 s: in two calls,
    12 rows (12 x 10 x 2 + 10 x 100 s) and 1.5 prompts of 2 (between the calls of 1 and 2 prompts: 1040 and 1080 s);
    carried, one call of the 15 rows (15 x 10 x 2 + 10 x 100 s): one call's decode steps less, the same rollouts,
    signal and update."""
    costs = UnitCosts(**{**COSTS.__dict__, "generate": CallCost(0.0, 2.0, step_s=100.0),
                         "completion_lengths": ((1, (10, 10)), (2, (10, 10)))})
    two, one = (Composition(name, 4, 4, 4, rules=(WaveRule(2, 1.5, 0.5, 2.0, carry=carry),))
                for name, carry in (("two", False), ("one", True)))
    _, (w2, w1) = predict([two, one], Composition("grpo", 4, 8, 8), POOL, costs)
    assert w2.generate_s == pytest.approx(12 * 10 * 2 + 1000 + (1040 + 1080) / 2)
    assert w1.generate_s == pytest.approx(15 * 10 * 2 + 1000)
    assert (w1.generated, w1.signal, w1.update_s) == pytest.approx((w2.generated, w2.signal, w2.update_s))
    assert draw_calls(one, POOL) == [(15, 1)] and draw_calls(two, POOL) == [(6, 2), (2, 2)]


def test_waves_on_a_pool_that_is_never_mixed():
    """Every reference prompt solved or unsolved: no first pair is mixed, nothing is completed or trained but the
    silent pairs; the prediction says so (ratio 0, no signal) instead of dividing by zero."""
    pool = PoolStats(successes=(0, 8, 8, 0), g=8, levels=(1, 1, 2, 2))
    _, (w,) = predict([Composition("w", 4, 4, 4, rules=(WaveRule(2, 1.5, 0.5, 2.0),))], Composition("grpo", 4, 8, 8),
                      pool, COSTS)
    assert (w.effective_ratio, w.signal, w.informative, w.generated) == (0.0, 0.0, 0.0, 12.0)
