"""The plan: which composition pays on a pool, predicted from what a run measures before it trains.

Ours (docs/algorithms.md section 9). Whether a technique pays depends on three measurements a run takes anyway:

* the pool's waste: K reference prompts rolled out g times each (the calibrate stage) give each prompt's
  successes s of g, so the share of prompts solved, unsolved and mixed;
* whether prompts have worked solutions, and how well the policy's likelihood of them (the screen,
  tasks/selection/screen.py) ranks the reference prompts;
* what the work of a step costs: a timed probe of generation and of the update at the batch sizes the candidates
  use, of the screen's forward pass, and of what a step pays whatever its tokens (the optimizer step, the
  bookkeeping, a round's checkpoint, DOTS's predictor fit).

From them this module predicts, for each candidate composition (:class:`Composition`, read from a config), the
effective-group ratio (share of a step's groups with unequal rewards) and the training clock, and
rlcore/plan_choice.py :func:`choose` picks the cheapest composition that keeps plain GRPO's learning signal.

**Informative chance.** A group of n rollouts of a prompt whose g reference rollouts had s successes is
informative (unequal rewards) with chance

    w(n) = 1 - C(s, n) / C(g, n) - C(g - s, n) / C(g, n)               for n <= g (exact, hypergeometric)
    w(n) = 1 - E[p^n] - E[(1 - p)^n],  p ~ Beta(s + 1/2, g - s + 1/2)   for n > g (Jeffreys posterior)

the first an unbiased estimate of 1 - p^n - (1 - p)^n (DAPO, arXiv 2503.14476 section 3.2: such groups carry
the gradient); ``rlcore.adaptive_composition.subset_informative`` is the same count for one group.

**A draw's ratio.** A selection draws reference prompt j with weight q_j; the predicted ratio of its fresh
groups is r = sum_j q_j w_j / sum_j q_j. Each reference prompt stands for its share of the pool
(``PoolStats.weights``: the calibrate stage draws the same number of prompts from every level, so a level that
is a tenth of the pool and a quarter of the reference set weighs 0.4 a prompt). Uniform: q is that weight. DOTS
(arXiv 2506.05316): that weight times the configured weighting of the predicted pass rate, with the predictor
modelled by each level's pooled pass rate (s + 1) / (g + 2) (on the bundled task the prompt embedding DOTS reads
predicts no better than the level; docs/algorithms.md 7.8). The screen (``select.screen`` = f) keeps, of f
candidates a slot, those whose screened pass rate gives the highest informative chance: its ratio is that of the
top 1/f of the q-mass ranked by the screen (the limit of many candidates). Rollout Replay fills a share
1 - delta of the batch with stored informative groups. DAPO's dynamic sampling (``rlcore.dynamic_sampling``)
asks ceil(o * missing) prompts a round until the batch holds B informative groups or ``max_rounds`` is reached:
the informative groups a round finds are taken as binomial in the prompts it asks with chance r, and the
expectation over the missing count is exact (rlcore/dynamic_sampling.py ``dynamic_rounds``).

**Techniques inside a step** (``Composition.rules``, rlcore/step_rules.py: the seam). Each rule may reweigh the draw
(the pre-rollout skip, rlcore/silent_skip.py ``SkipRule``) and may replace the draw of B groups of n with its own
(per-prompt rollout budgets, rlcore/rollout_budget.py ``WaveRule``: first waves of C candidates, then the
completions), given each reference prompt's s of g, the run's estimate of its pass rate before any rollout (the
screen's likelihood, DOTS's level rate, or none) and the draw's weights; its generate calls, rollouts, informative
and trained groups and update rows then stand in the step's clock for the default draw's. A call of an expected
number of prompts costs between the calls of its two whole neighbours, in proportion.

**A step's clock.** Each kind of work is a call whose seconds are a line in its tokens, a + b * tokens
(:class:`CallCost`), fitted to calls of the sizes the candidates make. A generate call's line is in its tokens and
its decode steps, d * steps + b * tokens: it decodes until its longest completion ends, and a step costs d whatever
its rows, so a token costs less in a bigger batch (most of a small call on a GPU, and much of one on a CPU:
docs/benchmarks.md) and less in a call of short completions. The steps are the expected longest of the call's
rollouts, from each level's completion lengths in the probe mixed by the draw's level shares
(:meth:`UnitCosts.longest`). A step makes generate-and-verify calls of at most ``chunk // n`` prompts of n rollouts
(the in-process engine's chunks), one update over the rows it computes (an informative group's m rows of prompt and
completion: silent groups are left out, ``train.skip_zero_advantage``) and, with the screen, one teacher-forced pass
over f candidates a slot (run ahead, beside the generate calls, it costs only what outlasts them, but at a round's
first step). It also pays fixed seconds whatever its tokens (:class:`FixedCosts`): the optimizer step
and the step's bookkeeping (the draw, the ledger's rows, the metrics line); each round a checkpoint and, for DOTS,
the predictor's fit and its predictions over the pool and the fresh reference rollouts
(``calibrate.reference=fresh``: K x g). **The training clock** is ``train.steps`` such steps plus what the
composition pays before its first step and plain GRPO does not: the calibrate stage's rollouts and the scoring of
the pool where it reads them (the benchmark's clock, docs/benchmarks.md). A candidate's ``clock`` is its training
clock over plain GRPO's.

**Choice.** The signal of a step is its informative groups (fresh plus replayed). A candidate qualifies when its
signal is at least ``min_signal`` times plain GRPO's and its step is cheaper; the cheapest step among those is
chosen (plain GRPO always qualifies), and among those within ``TIE`` of the cheapest, the one with the most signal.
Steps, and the pool's scoring of a candidate that reads the scores, are compared, not clocks: a run that plans has
calibrated whatever it then trains, and scores its pool only for a choice that reads the scores. But a
candidate is chosen only where it earns back what the run spent before its first step: its steps plus that time
(rlcore/plan_choice.py :class:`RunClock` ``with_plan``) at most plain GRPO's clock, else plain GRPO, and the reason
says so.

Deviations and limits: the ratio is the one at the start of training (it moves as the policy learns, and with it
DAPO's rounds); the clock is that of generation and update one after the other (lag 0); replayed groups count as
fresh ones in the signal.

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from rlcore.dynamic_sampling import dynamic_rounds
from rlcore.step_costs import UnitCosts
from rlcore.step_rules import DrawOutcome, StepRule, StepView

__all__ = ["Composition", "PoolStats", "Prediction", "call_rows", "draw_calls", "draw_ratio",
           "informative_chance", "predict", "update_rows", "without_rule"]


@dataclass(frozen=True)
class PoolStats:
    """The reference set: each of K prompts' ``successes`` of ``g`` rollouts, its ``levels`` (None where a prompt
    has none), ``screen``, the policy's likelihood of its worked solution (None when prompts have none), and
    ``weights``, the share of the pool each reference prompt stands for (None: equal shares, a plain random
    sample; the calibrate stage's reference set is stratified by level, so a level's prompts stand for its share of
    the pool over its count in the set)."""

    successes: tuple[int, ...]
    g: int
    levels: tuple
    screen: tuple[float, ...] | None = None
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        k = len(self.successes)
        if k == 0:
            raise ValueError("PoolStats needs at least one reference prompt")
        if self.g < 1 or any(not 0 <= s <= self.g for s in self.successes):
            raise ValueError(f"successes must lie in [0, g={self.g}], got {self.successes}")
        if len(self.levels) != k or any(len(x) != k for x in (self.screen, self.weights) if x is not None):
            raise ValueError(f"levels ({len(self.levels)}), screen and weights must have one entry per reference "
                             f"prompt ({k})")
        if self.screen is not None and any(not (0 <= q <= 1) for q in self.screen):
            raise ValueError("screen likelihoods must lie in [0, 1]")
        if self.weights is not None and (any(not (math.isfinite(w) and w >= 0) for w in self.weights)
                                         or sum(self.weights) <= 0):
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {self.weights}")

    @property
    def mass(self) -> torch.Tensor:
        """[K] float64: the share of the pool each reference prompt stands for (sums to 1)."""
        k = len(self.successes)
        w = torch.ones(k, dtype=torch.float64) if self.weights is None else torch.tensor(self.weights,
                                                                                          dtype=torch.float64)
        return w / w.sum()

    @property
    def shares(self) -> dict[str, float]:
        """Shares of the pool with every reference rollout right, none right, and mixed."""
        mass, s = self.mass, torch.tensor(self.successes)
        solved = float(mass[s == self.g].sum())
        unsolved = float(mass[s == 0].sum())
        return {"solved": solved, "unsolved": unsolved, "mixed": max(0.0, 1 - solved - unsolved)}


@dataclass(frozen=True)
class Composition:
    """What a candidate does a step, as the prediction needs it.

    ``prompts`` B a step; ``n`` rollouts generated and ``m`` kept a prompt (PODS: m < n); ``draw`` uniform or
    dots, with DOTS's ``weighting`` (target, informative, observed, posterior), ``alpha`` and ``tau``;
    ``screen`` f (1: off); ``fresh_frac`` delta (1 without replay); ``dynamic`` (oversample, max_rounds) or
    None; ``skip_silent``: silent groups left out of the update; ``steps`` and ``round_steps``: the budget and
    a round; ``chunk``: the rollouts a generate call holds (max(1, chunk // n) prompts of n; 0: a draw in one
    call); ``reference``: DOTS's fresh reference rollouts a round, (K prompts, g each), (0, 0) without;
    ``predictor``: DOTS's predictor is fitted each round; ``calibration``: the calibrate stage's (K, g) where the
    composition reads its pass rates, (0, 0) where it does not; ``scored``: pool prompts the score stage embeds
    where the composition reads the scores, 0 where it does not; ``rules``: the techniques acting inside its step
    (rlcore/step_rules.py; at most one replaces the draw); ``screen_ahead``: the screen's pass for the next step runs
    beside the generate call, at every step but a round's first (``select.screen_ahead`` with the sampler apart from
    the trainer); ``round_ahead``: a round's start (the predictor's fit) runs beside the generate call of the round's
    last step, and with ``screen_ahead`` the screen of the round's first step after it (``select.round_ahead`` with
    the sampler apart, where a round start takes no reference rollouts)."""

    name: str
    prompts: int
    n: int
    m: int
    draw: str = "uniform"
    weighting: str = "target"
    alpha: float = 0.5
    tau: float = 1e-3
    screen: int = 1
    fresh_frac: float = 1.0
    dynamic: tuple[float, int] | None = None
    skip_silent: bool = True
    steps: int = 1
    round_steps: int = 1
    chunk: int = 0
    reference: tuple[int, int] = (0, 0)
    predictor: bool = False
    calibration: tuple[int, int] = (0, 0)
    scored: int = 0
    rules: tuple[StepRule, ...] = ()
    screen_ahead: bool = False
    round_ahead: bool = False

    def __post_init__(self) -> None:
        if self.prompts < 1 or not 1 <= self.m <= self.n:
            raise ValueError(f"{self.name}: need prompts >= 1 and 1 <= m <= n, got {self.prompts}, {self.m}, {self.n}")
        if self.draw not in ("uniform", "dots"):
            raise ValueError(f"{self.name}: draw must be uniform or dots, got {self.draw!r}")
        if not 0 < self.fresh_frac <= 1 or self.screen < 1:
            raise ValueError(f"{self.name}: need 0 < fresh_frac <= 1 and screen >= 1")
        if self.steps < 1 or self.round_steps < 1 or self.chunk < 0 or self.scored < 0:
            raise ValueError(f"{self.name}: need steps >= 1, round_steps >= 1, chunk >= 0 and scored >= 0")
        if any(x < 0 for x in (*self.reference, *self.calibration)):
            raise ValueError(f"{self.name}: reference and calibration are (K, g) >= 0")


@dataclass(frozen=True)
class Prediction:
    """One composition's predicted step and budget.

    ``effective_ratio`` (share of its groups with unequal rewards), ``signal`` (informative groups),
    ``generated`` rollouts, ``generated_tokens``, ``updated_tokens``, ``forward_tokens`` and ``step_s`` seconds,
    all a step; ``step_s`` is ``generate_s`` + ``update_s`` + ``forward_s`` + ``fixed_s`` (the optimizer step,
    the bookkeeping, and a round's checkpoint and predictor fit over its steps); ``upfront_s``: what it pays
    before its first step and plain GRPO does not (calibration, scoring), ``scoring_s`` of it the pool's scoring (a
    run scores its pool only for a composition that reads the scores); ``train_s``: its training clock,
    ``upfront_s`` plus ``train.steps`` steps; ``clock``: ``train_s`` over plain GRPO's (set by :func:`predict`)."""

    name: str
    effective_ratio: float
    signal: float
    generated: float
    generated_tokens: float
    updated_tokens: float
    forward_tokens: float
    step_s: float
    generate_s: float = 0.0
    update_s: float = 0.0
    forward_s: float = 0.0
    fixed_s: float = 0.0
    upfront_s: float = 0.0
    scoring_s: float = 0.0
    train_s: float = 0.0
    clock: float = field(default=float("nan"))


def informative_chance(successes: torch.Tensor, g: int, n: int) -> torch.Tensor:
    """[K] chance that a group of n rollouts is informative, for prompts with ``successes`` [K] of g (module
    docstring: exact for n <= g, Jeffreys-posterior expectation above)."""
    if n < 1 or g < 1:
        raise ValueError(f"need n >= 1 and g >= 1, got n={n}, g={g}")
    s = successes.to(torch.float64)
    if n == 1:
        return torch.zeros_like(s)
    if n <= g:
        comb = torch.tensor([math.comb(c, n) for c in range(g + 1)], dtype=torch.float64)
        k = successes.long()
        return (1 - (comb[k] + comb[g - k]) / math.comb(g, n)).clamp(0, 1)
    a, b = s + 0.5, g - s + 0.5
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)  # E[p^n] = prod_i (a + i) / (a + b + i)
    moment_p = ((a.unsqueeze(1) + i) / (a + b).unsqueeze(1).add(i)).prod(1)
    moment_q = ((b.unsqueeze(1) + i) / (a + b).unsqueeze(1).add(i)).prod(1)
    return (1 - moment_p - moment_q).clamp(0, 1)


def _binomial_informative(p: torch.Tensor, n: int) -> torch.Tensor:
    return 1 - p.pow(n) - (1 - p).pow(n)


def _level_rates(pool: PoolStats) -> torch.Tensor:
    """[K] each reference prompt's level's pooled rate (s + 1) / (g + 2): how the plan models DOTS's prediction."""
    s = torch.tensor(pool.successes, dtype=torch.float64)
    pred = torch.empty(len(s), dtype=torch.float64)
    for lv in set(pool.levels):
        at = torch.tensor([x == lv for x in pool.levels])
        pred[at] = (s[at].sum() + 1) / (pool.g * int(at.sum()) + 2)
    return pred


def _draw_weights(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] weights q of each reference prompt under the composition's draw: the pool share it stands for, times
    DOTS's weighting of its level's pooled rate, times the chance the skip leaves it in (module docstring)."""
    mass = pool.mass
    for rule in c.rules:
        mass = rule.weigh(torch.tensor(pool.successes), pool.g, c.n, mass)
    if c.draw == "uniform":
        return mass
    pred = _level_rates(pool)
    if c.weighting == "target":
        dist = (pred - c.alpha).abs()
        return mass * torch.exp(-(dist - dist.min()) / c.tau)
    return mass * _binomial_informative(pred, c.n).clamp_min(1e-12)


def _kept(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] the q-mass of each reference prompt the composition's fresh groups come from: the draw's weights, and
    with the screen the top 1/f of them ranked by the screen (the boundary prompt in part)."""
    q = _draw_weights(c, pool)
    if c.screen == 1:
        return q
    if pool.screen is None:
        raise ValueError(f"{c.name}: the screen needs worked solutions, and the pool has none")
    score = _binomial_informative(torch.tensor(pool.screen, dtype=torch.float64), c.n)
    order = torch.argsort(score, descending=True, stable=True)
    q_sorted = q[order]
    before = torch.cumsum(q_sorted, 0) - q_sorted  # q-mass ranked above each prompt
    kept = torch.zeros_like(q)
    kept[order] = (float(q.sum()) / c.screen - before).clamp(0).minimum(q_sorted)
    return kept


def draw_ratio(c: Composition, pool: PoolStats) -> float:
    """The predicted share of the composition's fresh groups that are informative (module docstring)."""
    w = informative_chance(torch.tensor(pool.successes), pool.g, c.n)
    q = _kept(c, pool)
    return float((q * w).sum() / q.sum())


def _mean(x: torch.Tensor, weights: torch.Tensor) -> float:
    total = float(weights.sum())
    return float((x * weights).sum() / total) if total > 0 else float(x.mean())


def call_rows(prompts: int, n: int, chunk: int) -> list[int]:
    """The rollouts of each generate call a draw of ``prompts`` prompts of n rollouts makes: at most
    max(1, chunk // n) prompts a call (the in-process engine's chunks; ``chunk`` 0: one call)."""
    if prompts <= 0:
        return []
    per = max(1, chunk // n) if chunk else prompts
    full, rest = divmod(prompts, per)
    return [per * n] * full + ([rest * n] if rest else [])


def _estimate(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] the pass rate a run of ``c`` estimates for each reference prompt before rolling it out: the screen's
    likelihood where it screens, else DOTS's prediction (its level's rate), else none (NaN)."""
    if c.screen > 1 and pool.screen is not None:
        return torch.tensor(pool.screen, dtype=torch.float64)
    if c.draw == "dots":
        return _level_rates(pool)
    return torch.full((len(pool.successes),), float("nan"), dtype=torch.float64)


def _outcome(c: Composition, pool: PoolStats, kept: torch.Tensor, fresh: float) -> DrawOutcome | None:
    """The draw of the one rule of ``c`` that replaces B groups of n (rlcore/step_rules.py), or None."""
    view = StepView(n=c.n, m=c.m, g=pool.g, successes=torch.tensor(pool.successes, dtype=torch.float64),
                    estimate=_estimate(c, pool), kept=kept, fresh=fresh)
    outs = [o for o in (rule.outcome(view) for rule in c.rules) if o is not None]
    if len(outs) > 1 or (outs and c.dynamic is not None):
        raise ValueError(f"{c.name}: at most one rule may replace the draw, and not with dynamic sampling")
    return outs[0] if outs else None


def draw_calls(c: Composition, pool: PoolStats) -> list[tuple[int, int]]:
    """The generate calls of a step's fresh draw once replay runs: (prompts, rollouts a prompt), before cutting at
    the chunk."""
    first = math.ceil(c.dynamic[0] * c.prompts) if c.dynamic else max(1, round(c.prompts * c.fresh_frac))
    out = _outcome(c, pool, _kept(c, pool), c.prompts * c.fresh_frac)
    return [(max(1, round(p)), each) for p, each, _ in out.calls] if out is not None else [(first, c.n)]


def without_rule(c: Composition, name: str) -> Composition:
    """``c`` without its rule ``name`` (what that technique is measured against)."""
    return replace(c, name=f"{c.name} without {name}", rules=tuple(r for r in c.rules if r.name != name))


def _batch(c: Composition, r: float) -> tuple[float, float, float, float, float]:
    """A step's (fresh, replayed, asked, informative, groups) at the draw's ratio r: fresh and replayed groups in
    the batch (round 0 has an empty buffer, so its steps are all fresh, rlcore.replay_buffer.mix_counts), prompts
    asked, informative fresh groups, and fresh groups in the batch."""
    first = min(c.round_steps, c.steps) / c.steps if c.fresh_frac < 1 else 0.0
    fresh = c.prompts * (first + (1 - first) * c.fresh_frac)
    if c.dynamic is None:
        return fresh, c.prompts - fresh, fresh, r * fresh, fresh
    asked, informative, _ = dynamic_rounds(round(fresh), r, *c.dynamic)
    return fresh, c.prompts - fresh, asked, informative, max(informative, 1.0)


def update_rows(c: Composition, pool: PoolStats) -> float:
    """Rows a step of the composition updates: its informative groups' m rows (every group's without the skip)."""
    fresh, replayed, _, informative, groups = _batch(c, draw_ratio(c, pool))
    out = _outcome(c, pool, _kept(c, pool), fresh)
    if out is not None:
        return out.rows + c.m * replayed
    return c.m * (informative + replayed if c.skip_silent else groups + replayed)


def _step(c: Composition, pool: PoolStats, costs: UnitCosts) -> Prediction:
    kept = _kept(c, pool)
    w = informative_chance(torch.tensor(pool.successes), pool.g, c.n)
    r = float((kept * w).sum() / kept.sum())
    completion, prompt = costs.lengths(pool.levels)
    length = _mean(completion, kept)  # a fresh rollout's completion, under the draw
    row = _mean(completion + prompt, kept * w)  # an informative group's row (replayed ones were informative too)

    def mix(mass: torch.Tensor) -> dict:  # each level's share of a draw with these weights on the reference set
        out: dict = {}
        for lv, q in zip(pool.levels, mass.tolist(), strict=True):
            out[lv] = out.get(lv, 0.0) + q
        return out

    def draw_s(prompts: int, n: int, tokens: float, levels: dict) -> float:  # the generate calls of one draw
        return sum(costs.generate.time(rows * tokens, costs.longest(levels, rows))
                   for rows in call_rows(prompts, n, c.chunk))

    fresh, replayed, asked, informative, groups = _batch(c, r)
    drawn = mix(kept)
    out = _outcome(c, pool, kept, fresh)
    if out is not None:
        generate_s = fresh_tokens = 0.0
        for prompts, each, where in out.calls:
            tokens = _mean(completion, where)
            low, frac = divmod(prompts, 1.0)  # an expected count: between the calls of its two neighbours
            generate_s += ((1 - frac) * draw_s(int(low), each, tokens, mix(where))
                           + (frac * draw_s(int(low) + 1, each, tokens, mix(where)) if frac else 0.0))
            fresh_tokens += prompts * each * tokens
        asked_rollouts, informative, groups = out.generated, out.informative, out.trained
        upd_fresh_rows, screened = out.rows, out.screened
    else:
        if c.dynamic is not None:
            generate_s = dynamic_rounds(round(fresh), r, *c.dynamic, lambda ask: draw_s(ask, c.n, length, drawn))[2]
        else:
            generate_s = draw_s(round(fresh), c.n, length, drawn)
        asked_rollouts, fresh_tokens = asked * c.n, asked * c.n * length
        upd_fresh_rows = informative * c.m
        screened = fresh
    signal = informative + replayed
    fresh_s = generate_s  # the draw's own generate calls, before a round's reference rollouts
    k, g = c.reference  # a round's reference prompts, drawn from the whole pool
    reference_length = _mean(completion, pool.mass)
    generated = asked_rollouts + k * g / c.round_steps
    generate_s += draw_s(k, g, reference_length, mix(pool.mass)) / c.round_steps
    gen_tokens = fresh_tokens + k * g * reference_length / c.round_steps
    upd_tokens = ((upd_fresh_rows + replayed * c.m) * row if c.skip_silent
                  else (groups + replayed) * c.m * _mean(completion + prompt, kept))
    fwd_tokens = (c.screen * screened * (_mean(prompt, _draw_weights(c, pool)) + costs.solution_tokens)
                  if c.screen > 1 else 0.0)
    fx = costs.fixed
    update_s, forward_s = costs.update.time(upd_tokens), costs.forward.time(fwd_tokens)
    fit_s, start_s = (fx.fit_s if c.predictor else 0.0), forward_s  # a round's fit and its first step's screen
    if c.round_ahead:  # beside the generate call of the round's last step: what outlasts it, the fit first
        fit_s, hidden = max(0.0, fit_s - fresh_s), max(0.0, fresh_s - fit_s)
        start_s = max(0.0, forward_s - hidden) if c.screen_ahead else forward_s
    if c.screen_ahead:  # beside the draw's generate calls it costs what outlasts them
        forward_s = (start_s + (c.round_steps - 1) * max(0.0, forward_s - fresh_s)) / c.round_steps
    fixed_s = fx.optimizer_s + fx.step_s + (fx.round_s + fit_s) / c.round_steps
    step_s = generate_s + update_s + forward_s + fixed_s
    calibration_length = float(completion.mean())  # the calibrate stage's set, stratified by level
    scoring_s = c.scored * costs.score_s
    upfront_s = draw_s(*c.calibration, calibration_length, mix(torch.ones(len(pool.levels)))) + scoring_s
    trained = groups + replayed  # 0 where no first wave is ever mixed: the step trains its silent first waves
    return Prediction(name=c.name, effective_ratio=signal / trained if trained > 0 else 0.0, signal=signal,
                      generated=generated,
                      generated_tokens=gen_tokens, updated_tokens=upd_tokens, forward_tokens=fwd_tokens,
                      step_s=step_s, generate_s=generate_s, update_s=update_s, forward_s=forward_s, fixed_s=fixed_s,
                      upfront_s=upfront_s, scoring_s=scoring_s, train_s=upfront_s + c.steps * step_s)


def predict(candidates: list[Composition], baseline: Composition, pool: PoolStats,
            costs: UnitCosts) -> tuple[Prediction, list[Prediction]]:
    """The baseline's prediction and each candidate's, with ``clock`` its training clock over the baseline's."""
    base = _step(baseline, pool, costs)
    scale = base.train_s if base.train_s > 0 else 1.0
    return (replace(base, clock=base.train_s / scale),
            [replace(p, clock=p.train_s / scale) for p in (_step(c, pool, costs) for c in candidates)])
