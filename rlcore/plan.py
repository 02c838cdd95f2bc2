"""The plan: which composition pays on a pool, predicted from what a run measures before it trains.

Ours (docs/algorithms.md section 9). Whether a technique pays depends on three measurements a run takes anyway:

* the pool's waste: K reference prompts rolled out g times each (the calibrate stage) give each prompt's
  successes s of g, so the share of prompts solved, unsolved and mixed;
* whether prompts have worked solutions, and how well the policy's likelihood of them (the screen,
  tasks/selection/screen.py) ranks the reference prompts;
* what the work of a step costs: a timed probe of generation and of the update at the batch sizes the candidates
  use, of the screen's forward pass, and of what a step pays whatever its tokens (the optimizer step, the
  bookkeeping, a round's checkpoint, DOTS's predictor fit).

From them this module predicts, for each candidate composition (rlcore/plan_draw.py ``Composition``, read from a
config), the effective-group ratio (share of a step's groups with unequal rewards) and the training clock, and
rlcore/plan_choice.py :func:`choose` picks the cheapest composition that keeps plain GRPO's learning signal. The
plan's inputs (``PoolStats``, ``Composition``) and its model of the draw (the informative chance of a reference
prompt's group, and the draw's ratio under uniform, DOTS and the screen) are rlcore/plan_draw.py's.

**The batch.** Rollout Replay fills a share 1 - delta of the batch with stored informative groups. DAPO's dynamic
sampling (``rlcore.dynamic_sampling``) asks ceil(o * missing) prompts a round until the batch holds B informative
groups or ``max_rounds`` is reached: the informative groups a round finds are taken as binomial in the prompts it
asks with chance r (the draw's ratio), and the expectation over the missing count is exact
(rlcore/dynamic_sampling.py ``dynamic_rounds``).

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
(``calibrate.reference=fresh``: K x g). A composition that overlaps its draw with the previous step's update
(``Composition.overlap``, lag 1) pays the slower of the two sides instead of their sum (:func:`overlapped_step`),
each side at its pace beside the other where the two split a CPU's cores (``UnitCosts.split``). **The training
clock** is ``train.steps`` such steps plus what the
composition pays before its first step and plain GRPO does not: the calibrate stage's rollouts and the scoring of
the pool where it reads them (the benchmark's clock, docs/benchmarks.md). A candidate's ``clock`` is its training
clock over plain GRPO's.

**Choice.** The signal of a step is its informative contrasts (fresh plus replayed): each informative group's
trained rows less one, since its advantages are measured from the group's own mean (a group of m rows holds m - 1
independent ones). Groups alone would price a group of 4 and one of 8 the same, and a candidate with groups of 6
at 0.68-0.85x plain GRPO's informative groups ended where the groups of 4 at 0.89-1.1x did (docs/benchmarks.md,
"Every idea tried", the row of groups of 6). A candidate qualifies when its
signal is at least ``min_signal`` times plain GRPO's and its step is cheaper (its work: the planner ranks the
candidates predicted one after the other, and reports them as the run will take them, rlcore/plan_choice.py
``choose``'s ``work``); the cheapest step among those is
chosen (plain GRPO always qualifies), and among those within ``TIE`` of the cheapest, the one with the most signal.
Steps, and the pool's scoring of a candidate that reads the scores, are compared, not clocks: a run that plans has
calibrated whatever it then trains, and scores its pool only for a choice that reads the scores. What the run
spent before the choice is spent whatever it trains: the reason shows the clock with it (rlcore/plan_choice.py
:class:`RunClock` ``with_plan``), the choice does not weigh it.

Deviations and limits: the ratio is the one at the start of training (it moves as the policy learns, and with it
DAPO's rounds); an overlapped step's sides each run at one pace beside the other, timed at the probe's small sizes
(docs/algorithms.md 9.4); a shared device's lag is decided after the plan
(tasks/overlap/lag.py), so a candidate on one is predicted one after the other; replayed groups count as fresh
ones in the signal.

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from rlcore.dynamic_sampling import dynamic_rounds
from rlcore.plan_draw import (
    Composition,
    PoolStats,
    draw_ratio,
    draw_weights,
    group_chance,
    kept_mass,
    level_rates,
    screened_per_prompt,
)
from rlcore.step_costs import ThreadSplit, UnitCosts
from rlcore.step_rules import DrawOutcome, StepView

__all__ = ["Prediction", "call_rows", "draw_calls", "overlapped_step", "predict", "update_rows", "without_rule"]


@dataclass(frozen=True)
class Prediction:
    """One composition's predicted step and budget.

    ``effective_ratio`` (share of its groups with unequal rewards), ``signal`` (informative contrasts: each
    informative group's trained rows less one, what :func:`rlcore.plan_choice.choose` keeps), ``informative``
    groups, ``generated`` rollouts, ``generated_tokens``, ``updated_tokens``, ``forward_tokens`` and ``step_s``
    seconds, all a step;
    ``step_s`` is ``generate_s`` + ``update_s`` + ``forward_s`` + ``fixed_s`` (the optimizer step, the bookkeeping, and
    a round's checkpoint and predictor fit over its steps), or for an overlapped composition the slower side
    (:func:`overlapped_step`; the parts stay each as timed on all threads), where the screen's pass run ahead, after the
    update it runs beside, is ``ahead_s`` on the trainer's side (``forward_s`` the rest, in the draw); ``upfront_s``:
    what it pays before its first step and plain GRPO does not (calibration, scoring), ``scoring_s`` of it the pool's
    scoring (a run scores its pool only for a composition that reads the scores); ``train_s``: its training clock,
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
    ahead_s: float = 0.0
    fixed_s: float = 0.0
    upfront_s: float = 0.0
    scoring_s: float = 0.0
    informative: float = 0.0
    train_s: float = 0.0
    clock: float = field(default=float("nan"))


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
        return level_rates(pool)
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
    out = _outcome(c, pool, kept_mass(c, pool), c.prompts * c.fresh_frac)
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
    out = _outcome(c, pool, kept_mass(c, pool), fresh)
    if out is not None:
        return out.rows + c.m * replayed
    return c.m * (informative + replayed if c.skip_silent else groups + replayed)


def _mix(pool: PoolStats, mass: torch.Tensor) -> dict:
    """Each level's share of a draw with weights ``mass`` [K] on the reference set."""
    out: dict = {}
    for lv, q in zip(pool.levels, mass.tolist(), strict=True):
        out[lv] = out.get(lv, 0.0) + q
    return out


def _draw_s(c: Composition, costs: UnitCosts, prompts: int, n: int, tokens: float, levels: dict) -> float:
    """The generate calls of one draw of ``prompts`` prompts of n rollouts, completions ``tokens`` long on average,
    the levels mixed as ``levels``."""
    return sum(costs.generate.time(rows * tokens, costs.longest(levels, rows))
               for rows in call_rows(prompts, n, c.chunk))


@dataclass(frozen=True)
class _Draw:
    """A step's fresh draw: ``generate_s`` seconds of generate calls, ``rollouts`` and their ``tokens``, the
    ``informative`` and ``trained`` fresh groups, the ``rows`` of them the update computes, the ``screened`` prompts,
    and the ``replayed`` groups beside them in the batch."""

    generate_s: float
    rollouts: float
    tokens: float
    informative: float
    trained: float
    rows: float
    screened: float
    replayed: float


def _fresh_draw(c: Composition, pool: PoolStats, costs: UnitCosts, kept: torch.Tensor, r: float) -> _Draw:
    """The fresh draw of a step of ``c`` at the draw's ratio r: a rule's waves where one replaces it, else B groups
    of n (with DAPO's rounds where it samples dynamically)."""
    completion, _ = costs.lengths(pool.levels)
    fresh, replayed, asked, informative, groups = _batch(c, r)
    out = _outcome(c, pool, kept, fresh)
    if out is None:
        length, drawn = _mean(completion, kept), _mix(pool, kept)
        if c.dynamic is not None:
            generate_s = dynamic_rounds(round(fresh), r, *c.dynamic,
                                        lambda ask: _draw_s(c, costs, ask, c.n, length, drawn))[2]
        else:
            generate_s = _draw_s(c, costs, round(fresh), c.n, length, drawn)
        return _Draw(generate_s, asked * c.n, asked * c.n * length, informative, groups, informative * c.m, fresh,
                     replayed)
    generate_s = tokens = 0.0
    for prompts, each, where in out.calls:
        length, levels = _mean(completion, where), _mix(pool, where)
        low, frac = divmod(prompts, 1.0)  # an expected count: between the calls of its two neighbours
        generate_s += ((1 - frac) * _draw_s(c, costs, int(low), each, length, levels)
                       + (frac * _draw_s(c, costs, int(low) + 1, each, length, levels) if frac else 0.0))
        tokens += prompts * each * length
    return _Draw(generate_s, out.generated, tokens, out.informative, out.trained, out.rows, out.screened, replayed)


def _screen_parts(c: Composition, forward_s: float, fresh_s: float, fit_s: float) -> tuple[float, float, float]:
    """(forward_s, ahead_s, fit_s) a step: the screen's pass on the draw's side, the part of it run ahead after the
    update it runs beside (lag 1, on the trainer's side), and a round's predictor fit, where each runs beside the
    draw's generate calls (``fresh_s``) or not."""
    start_s, ahead_s = forward_s, 0.0  # a round's first step screens its own
    if c.round_ahead and not c.overlap:  # beside the generate call of the round's last step: what outlasts it
        fit_s, hidden = max(0.0, fit_s - fresh_s), max(0.0, fresh_s - fit_s)
        start_s = max(0.0, forward_s - hidden) if c.screen_ahead else forward_s
    if c.screen_ahead and c.overlap:  # every step's but a round's first (all with the round's start ahead)
        ahead = c.round_steps if c.round_ahead else c.round_steps - 1
        forward_s, ahead_s = forward_s * (c.round_steps - ahead) / c.round_steps, forward_s * ahead / c.round_steps
    elif c.screen_ahead:  # beside the draw's generate calls it costs what outlasts them
        forward_s = (start_s + (c.round_steps - 1) * max(0.0, forward_s - fresh_s)) / c.round_steps
    return forward_s, ahead_s, fit_s


def _step(c: Composition, pool: PoolStats, costs: UnitCosts) -> Prediction:
    kept = kept_mass(c, pool)
    w = group_chance(c, pool)
    r = float((kept * w).sum() / kept.sum())
    completion, prompt = costs.lengths(pool.levels)
    draw = _fresh_draw(c, pool, costs, kept, r)
    replayed = draw.replayed
    informative = draw.informative + replayed
    signal = draw.rows - draw.informative + replayed * (c.m - 1)  # the update's rows of them, less a group's mean
    k, g = c.reference  # a round's reference prompts, drawn from the whole pool
    reference_length = _mean(completion, pool.mass)
    generated = draw.rollouts + k * g / c.round_steps
    generate_s = draw.generate_s + _draw_s(c, costs, k, g, reference_length, _mix(pool, pool.mass)) / c.round_steps
    gen_tokens = draw.tokens + k * g * reference_length / c.round_steps
    if c.skip_silent:  # the rows of the groups with a gradient (replayed groups were informative too)
        upd_rows, upd_groups = draw.rows + replayed * c.m, draw.informative + replayed
        upd_completion, upd_prompt = _mean(completion, kept * w), _mean(prompt, kept * w)
    else:
        upd_rows, upd_groups = (draw.trained + replayed) * c.m, draw.trained + replayed
        upd_completion, upd_prompt = _mean(completion, kept), _mean(prompt, kept)
    # the update's passes: each row's completion, and its prompt (once a group with the shared prefix)
    upd_tokens = upd_rows * upd_completion + (upd_groups if c.shared_prefix else upd_rows) * upd_prompt
    candidate_tokens = _mean(prompt, draw_weights(c, pool)) + costs.solution_tokens  # a screened prompt's
    fwd_tokens = screened_per_prompt(c) * draw.screened * candidate_tokens if c.screen > 1 else 0.0
    fx = costs.fixed
    update_s = costs.update.time(upd_tokens)
    forward_s, ahead_s, fit_s = _screen_parts(c, costs.forward.time(fwd_tokens), draw.generate_s,
                                              fx.fit_s if c.predictor else 0.0)
    fixed_s = fx.optimizer_s + fx.step_s + (fx.round_s + fit_s) / c.round_steps
    if c.screen_in_sampler:  # every pass in the generator process, at its pace, beside its generate calls
        step_s = overlapped_step(generate_s + forward_s + ahead_s, 0.0, update_s, fixed_s, costs.split)
    elif c.overlap:
        step_s = overlapped_step(generate_s, forward_s, update_s + ahead_s, fixed_s, costs.split)
    else:
        step_s = generate_s + update_s + forward_s + fixed_s
    calibration_length = float(completion.mean())  # the calibrate stage's set, stratified by level
    scoring_s = c.scored * costs.score_s
    upfront_s = _draw_s(c, costs, *c.calibration, calibration_length, _mix(pool, torch.ones(len(pool.levels))))
    upfront_s += scoring_s
    trained = draw.trained + replayed  # 0 where no first wave is ever mixed: the step trains its silent first waves
    return Prediction(name=c.name, effective_ratio=informative / trained if trained > 0 else 0.0, signal=signal,
                      informative=informative, generated=generated,
                      generated_tokens=gen_tokens, updated_tokens=upd_tokens, forward_tokens=fwd_tokens,
                      step_s=step_s, generate_s=generate_s, update_s=update_s, forward_s=forward_s, ahead_s=ahead_s,
                      fixed_s=fixed_s,
                      upfront_s=upfront_s, scoring_s=scoring_s, train_s=upfront_s + c.steps * step_s)


def overlapped_step(generate_s: float, forward_s: float, update_s: float, fixed_s: float,
                    split: ThreadSplit | None) -> float:
    """A step's seconds where its draw runs beside the previous step's update (lag 1; parts as timed on all threads):
    the slower of the two sides. The draw side is the generate calls (in the generator process) after the screen's pass
    over the step's candidates where the step scores them itself (``forward_s``: on the trainer's threads, in the draw's
    thread: tasks/overlap/concurrent.py); the trainer's side is the update's passes (with the next step's screen pass
    where it runs ahead, after the update: ``update_s`` holds it) and what a step pays whatever its tokens. Where the
    screen's passes run in the generator process (``Composition.screen_in_sampler``), they are in ``generate_s``, at the
    generator's pace. Where the two split a CPU's cores (``split``), each side at its pace beside the other; without
    (the sampler on other hardware), as timed. Deviations: a side that outlasts the other runs its rest alone, faster
    than beside it, so where the sides differ much this is high by up to that pace's gain (measured on 2 cores, S53:
    generation 1.36-1.48x as slow beside the update as alone, the update 1.18-1.36x); and it is the slower side of a
    mean step, where a run waits at each step on whichever side is slower then, so it is low where the sides are close
    (`auto`'s seconds -15 % / -14 % on the default and `balanced` pools, S53, docs/benchmarks.md)."""
    g, p = (split.generate, split.passes) if split is not None else (1.0, 1.0)
    return max(generate_s * g + forward_s * p, update_s * p + fixed_s)


def predict(candidates: list[Composition], baseline: Composition, pool: PoolStats,
            costs: UnitCosts) -> tuple[Prediction, list[Prediction]]:
    """The baseline's prediction and each candidate's, with ``clock`` its training clock over the baseline's."""
    base = _step(baseline, pool, costs)
    scale = base.train_s if base.train_s > 0 else 1.0
    return (replace(base, clock=base.train_s / scale),
            [replace(p, clock=p.train_s / scale) for p in (_step(c, pool, costs) for c in candidates)])
