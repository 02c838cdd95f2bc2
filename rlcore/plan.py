"""The plan: which composition pays on a pool, predicted from what a run measures before it trains.

Ours (docs/algorithms.md section 9). Whether a technique pays depends on three measurements a run takes anyway:

* the pool's waste: K reference prompts rolled out g times each (the calibrate stage) give each prompt's
  successes s of g, so the share of prompts solved, unsolved and mixed;
* whether prompts have worked solutions, and how well the policy's likelihood of them (the screen,
  tasks/training/screen.py) ranks the reference prompts;
* what the work of a step costs: a timed probe of generation and of the update at the batch sizes the candidates
  use, of the screen's forward pass, and of what a step pays whatever its tokens (the optimizer step, the
  bookkeeping, a round's checkpoint, DOTS's predictor fit).

From them this module predicts, for each candidate composition (:class:`Composition`, read from a config), the
effective-group ratio (share of a step's groups with unequal rewards) and the training clock, and :func:`choose`
picks the cheapest composition that keeps plain GRPO's learning signal.

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
expectation over the missing count is exact (:func:`dynamic_rounds`).

**A step's clock.** Each kind of work is a call whose seconds are a line in its tokens, a + b * tokens
(:class:`CallCost`), fitted to calls of the sizes the candidates make. A generate call's line is in its tokens
and its decode steps, d * steps + b * tokens: it decodes until its longest completion ends, and a step costs d
whatever its rows, so a token costs less in a bigger batch (most of a small call on a GPU; measured on 2 CPU
cores with the 0.87M-parameter policy, a 10-prompt call 120 us a token, a 56-prompt one 80 us) and less in a
call of short completions. The steps are the expected longest of the call's rollouts, from each level's
completion lengths in the probe mixed by the draw's level shares (:meth:`UnitCosts.longest`). A step makes generate-and-verify calls of at most ``chunk // n`` prompts of n rollouts (the
in-process engine's chunks), one update over the rows it computes (an informative group's m rows of prompt and
completion: silent groups are left out, ``train.skip_zero_advantage``) and, with the screen, one teacher-forced
pass over f candidates a slot. It also pays fixed seconds whatever its tokens (:class:`FixedCosts`): the
optimizer step and the step's bookkeeping (the draw, the ledger's rows, the metrics line); each round a
checkpoint and, for DOTS, the predictor's fit and its predictions over the pool and the fresh reference
rollouts (``calibrate.reference=fresh``: K x g). **The training clock** is ``train.steps`` such steps plus what
the composition pays before its first step and plain GRPO does not: the calibrate stage's rollouts and the
scoring of the pool where it reads them (the benchmark's clock, docs/benchmarks.md). A candidate's ``clock`` is
its training clock over plain GRPO's.

**Choice.** The signal of a step is its informative groups (fresh plus replayed). A candidate qualifies when its
signal is at least ``min_signal`` times plain GRPO's; the cheapest step among those is chosen (plain GRPO always
qualifies), and among those within ``TIE`` of the cheapest, the one with the most signal. Steps, not clocks, are
compared: a run that plans has calibrated and scores its pool whatever it then trains.

**Overlap.** Whether generation of step t+1 runs while update t does (``overlap.lag`` 1, AReaL's and verl's one
step off; tasks/training/overlap.py): :func:`choose_lag`. Where the sampler and the trainer run on different
devices (a vLLM server; CPU cores for each) the draw hides behind the update, or the update behind the draw, at
no cost to either: lag 1. Where they share one device they slow each other down by an amount no rule predicts (the
issue's toy on one GPU: 1.43x the sequential time; a 1.5B model: 0.88x), so a probe times one draw and one update
alone and at once (:class:`OverlapProbe`), and lag 1 is chosen only when at once takes at most ``1 - min_gain`` of
alone one after the other: a gain smaller than the probe's own noise, bought with rollouts one update old, does
not pay.

Deviations and limits: the ratio is the one at the start of training (it moves as the policy learns, and with it
DAPO's rounds); the clock is that of generation and update one after the other (lag 0); replayed groups count as
fresh ones in the signal.

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

#: Predicted step times within this share of the cheapest count as a tie, broken by the larger signal.
TIE = 0.05

__all__ = ["CallCost", "Composition", "FixedCosts", "LagChoice", "OverlapProbe", "PoolStats", "Prediction",
           "UnitCosts", "call_rows", "choose", "choose_lag", "draw_ratio", "dynamic_rounds", "informative_chance",
           "predict", "update_rows"]


def _check_seconds(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}.{name} must be finite and >= 0, got {v!r}")


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
class CallCost:
    """Seconds of one call of some work (a batch generated, an update, a screen pass) as a line in the tokens it
    processes and, for generation, its decode steps: ``fixed_s + step_s * steps + token_s * tokens``. A generate
    call decodes one step per token of its longest completion, and a step costs ``step_s`` whatever its rows (the
    model's weights are read, the loop's launches made) on top of ``token_s`` a row: so a call of many short
    completions costs less a token than one that waits for a long one, and a bigger batch less a token than a
    small one. ``tokens``, ``seconds`` and ``steps`` (() where steps are not counted): the timed calls it was
    fitted to (:meth:`fit`)."""

    fixed_s: float
    token_s: float
    tokens: tuple[float, ...] = ()
    seconds: tuple[float, ...] = ()
    step_s: float = 0.0
    steps: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens", "seconds", "steps"):
            object.__setattr__(self, name, tuple(float(t) for t in getattr(self, name)))
        _check_seconds("CallCost", fixed_s=self.fixed_s, token_s=self.token_s, step_s=self.step_s)
        if len(self.tokens) != len(self.seconds) or (self.steps and len(self.steps) != len(self.tokens)):
            raise ValueError(f"CallCost: {len(self.tokens)} token counts, {len(self.steps)} step counts for "
                             f"{len(self.seconds)} timings")
        _check_seconds("CallCost", **{f"tokens[{i}]": t for i, t in enumerate(self.tokens)},
                       **{f"seconds[{i}]": s for i, s in enumerate(self.seconds)},
                       **{f"steps[{i}]": s for i, s in enumerate(self.steps)})

    @classmethod
    def fit(cls, tokens: Sequence[float], seconds: Sequence[float],
            steps: Sequence[float] | None = None) -> CallCost:
        """The least-squares fit to timed calls (``tokens[i]``, ``seconds[i]``): with ``steps`` (generation: each
        call's decode steps), ``step_s * steps + token_s * tokens``; without, a line ``fixed_s + token_s * tokens``.
        Where the points give a negative part (a timing's noise) or cannot tell the parts apart (one size only),
        the line through 0: a token costs the same in any call."""
        t = torch.tensor([float(x) for x in tokens], dtype=torch.float64)
        s = torch.tensor([float(x) for x in seconds], dtype=torch.float64)
        if len(t) == 0 or len(t) != len(s) or float(t.max()) <= 0:
            raise ValueError(f"CallCost.fit needs timed calls with tokens, got tokens={tokens}, seconds={seconds}")
        through_0 = float((t * s).sum() / (t * t).sum())
        if steps is not None:
            d = torch.tensor([float(x) for x in steps], dtype=torch.float64)
            if len(d) != len(t):
                raise ValueError(f"CallCost.fit: {len(d)} step counts for {len(t)} timed calls")
            x = torch.stack([d, t], dim=1)
            gram = x.T @ x
            if len(t) > 1 and float(torch.linalg.det(gram)) > 1e-9 * float(gram.diagonal().prod()):
                step, slope = torch.linalg.solve(gram, x.T @ s).tolist()
                if step >= 0 and slope >= 0:
                    return cls(fixed_s=0.0, token_s=slope, step_s=step, tokens=tuple(t.tolist()),
                               seconds=tuple(s.tolist()), steps=tuple(d.tolist()))
            return cls(fixed_s=0.0, token_s=through_0, tokens=tuple(t.tolist()), seconds=tuple(s.tolist()),
                       steps=tuple(d.tolist()))
        fixed, slope = 0.0, through_0
        if len(set(t.tolist())) > 1:
            tm, sm = t.mean(), s.mean()
            b = float(((t - tm) * (s - sm)).sum() / ((t - tm) ** 2).sum())
            a = float(sm - b * tm)
            if a >= 0 and b >= 0:
                fixed, slope = a, b
        return cls(fixed_s=fixed, token_s=slope, tokens=tuple(t.tolist()), seconds=tuple(s.tolist()))

    def time(self, tokens: float, steps: float = 0.0) -> float:
        """Seconds of one call over ``tokens`` in ``steps`` decode steps (0 tokens: no call, 0 s)."""
        return self.fixed_s + self.step_s * steps + self.token_s * tokens if tokens > 0 else 0.0

    def per_token(self, tokens: float, steps: float = 0.0) -> float:
        """Seconds a token in a call of ``tokens`` in ``steps`` decode steps."""
        return self.time(tokens, steps) / tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class FixedCosts:
    """Seconds a step or a round pays whatever its tokens, timed by the probe.

    ``optimizer_s``: one optimizer step (gradient clipping and AdamW over the trainable parameters), a step;
    ``step_s``: a step's bookkeeping (the draw over the pool, the ledger's selection and group rows, the metrics
    line), a step; ``round_s``: a round's checkpoint (the weights and the optimizer's state); ``fit_s``: DOTS's
    predictor a round (its fit on the labels and its predictions over the pool), paid only by compositions that
    draw with it."""

    optimizer_s: float = 0.0
    step_s: float = 0.0
    round_s: float = 0.0
    fit_s: float = 0.0

    def __post_init__(self) -> None:
        _check_seconds("FixedCosts", optimizer_s=self.optimizer_s, step_s=self.step_s, round_s=self.round_s,
                       fit_s=self.fit_s)


@dataclass(frozen=True)
class UnitCosts:
    """What the work of a step costs, measured by a probe, and the mean token counts it saw.

    ``generate``: a call that generates and verifies rollouts, in their completion tokens; ``update``: the update's
    passes over the rows it computes, in their prompt and completion tokens (the optimizer step is in ``fixed``);
    ``forward``: the screen's teacher-forced pass, in prompt and solution tokens; ``completion_tokens``,
    ``prompt_tokens``, ``solution_tokens``: mean tokens of a completion, a prompt and a worked solution (0 where
    there is none); ``fixed``: what a step and a round pay whatever their tokens; ``score_s``: seconds to score
    (embed) one pool prompt before training; ``levels``: (level, completion tokens, prompt tokens), the mean lengths
    of a rollout of each level's prompts the probe drew (a draw that favours some levels has their lengths);
    ``completion_lengths``: (level, the completion tokens of each rollout of that level's prompts the probe drew),
    from which :meth:`longest` predicts a call's decode steps."""

    generate: CallCost
    update: CallCost
    forward: CallCost
    completion_tokens: float
    prompt_tokens: float
    solution_tokens: float = 0.0
    fixed: FixedCosts = field(default_factory=FixedCosts)
    score_s: float = 0.0
    levels: tuple[tuple, ...] = ()
    completion_lengths: tuple[tuple, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple((lv, float(c), float(p)) for lv, c, p in self.levels))
        object.__setattr__(self, "completion_lengths",
                           tuple((lv, tuple(int(x) for x in xs)) for lv, xs in self.completion_lengths))
        if any(not xs or min(xs) < 0 for _, xs in self.completion_lengths):
            raise ValueError("UnitCosts.completion_lengths: each level needs at least one length, none negative")
        _check_seconds("UnitCosts", completion_tokens=self.completion_tokens, prompt_tokens=self.prompt_tokens,
                       solution_tokens=self.solution_tokens, score_s=self.score_s,
                       **{f"levels[{i}]": x for i, (_, c, p) in enumerate(self.levels) for x in (c, p)})

    @classmethod
    def from_dict(cls, d: dict) -> UnitCosts:
        """The inverse of ``dataclasses.asdict``."""
        return cls(**{**d, **{k: CallCost(**d[k]) for k in ("generate", "update", "forward")},
                      "fixed": FixedCosts(**d.get("fixed", {})), "levels": tuple(map(tuple, d.get("levels", ()))),
                      "completion_lengths": tuple((lv, tuple(xs)) for lv, xs in d.get("completion_lengths", ()))})

    def lengths(self, levels: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """[K] float64 each: the mean completion and prompt tokens of a rollout of a prompt of each of ``levels``
        (the probe's for that level; its mean over every level where it drew none of that level)."""
        by = {lv: (c, p) for lv, c, p in self.levels}
        pairs = [by.get(lv, (self.completion_tokens, self.prompt_tokens)) for lv in levels]
        return (torch.tensor([c for c, _ in pairs], dtype=torch.float64),
                torch.tensor([p for _, p in pairs], dtype=torch.float64))

    def longest(self, mix: dict, rows: int) -> float:
        """The expected longest completion of ``rows`` rollouts drawn from the levels with shares ``mix`` (level ->
        share; a level the probe drew none of counts as every level the probe drew): a generate call's decode
        steps. With F the mix of the levels' empirical length distributions, E[max] = sum over x >= 0 of
        1 - F(x)^rows. 0 where the probe recorded no lengths."""
        if rows <= 0 or not self.completion_lengths:
            return 0.0
        by = {lv: torch.tensor(xs, dtype=torch.float64) for lv, xs in self.completion_lengths}
        every = torch.cat(list(by.values()))
        top = int(every.max())
        grid = torch.arange(top + 1, dtype=torch.float64)
        total = sum(mix.values())
        if total <= 0:
            mix, total = dict.fromkeys(by, 1.0), float(len(by))
        cdf = torch.zeros(top + 1, dtype=torch.float64)
        for lv, share in mix.items():
            xs = by.get(lv, every)
            cdf += share / total * (xs.unsqueeze(0) <= grid.unsqueeze(1)).to(torch.float64).mean(1)
        return float((1 - cdf.clamp(0, 1)[:top] ** rows).sum())


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
    where the composition reads the scores, 0 where it does not."""

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
    before its first step and plain GRPO does not (calibration, scoring); ``train_s``: its training clock,
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


def _draw_weights(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] weights q of each reference prompt under the composition's draw: the pool share it stands for, times
    DOTS's weighting of its level's pooled rate (module docstring)."""
    k = len(pool.successes)
    mass = pool.mass
    if c.draw == "uniform":
        return mass
    s = torch.tensor(pool.successes, dtype=torch.float64)
    pred = torch.empty(k, dtype=torch.float64)
    for lv in set(pool.levels):
        at = torch.tensor([x == lv for x in pool.levels])
        pred[at] = (s[at].sum() + 1) / (pool.g * int(at.sum()) + 2)
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


def _binomial_pmf(k: int, p: float) -> torch.Tensor:
    """[k + 1] float64: P(y successes of k, each with chance p)."""
    y = torch.arange(k + 1, dtype=torch.float64)
    if p <= 0 or p >= 1:
        return (y == (k if p >= 1 else 0)).to(torch.float64)
    log_c = torch.lgamma(torch.tensor(k + 1.0, dtype=torch.float64)) - torch.lgamma(y + 1) - torch.lgamma(k - y + 1)
    return torch.exp(log_c + y * math.log(p) + (k - y) * math.log1p(-p))


def dynamic_rounds(b: int, r: float, oversample: float, max_rounds: int,
                   round_s: Callable[[int], float] = lambda ask: 0.0) -> tuple[float, float, float]:
    """DAPO's filling of a batch of ``b`` informative groups (``rlcore.dynamic_sampling.BatchFiller``: each round
    asks ceil(oversample * missing) prompts, at most ``max_rounds`` rounds) when each prompt asked gives an
    informative group with chance ``r``, independently. Returns the expected prompts asked, informative groups
    kept and seconds (``round_s(ask)``: one round of ``ask`` prompts), exact over the binomial yields."""
    missing = torch.zeros(b + 1, dtype=torch.float64)  # P(missing = j)
    missing[b] = 1.0
    asked = seconds = 0.0
    for _ in range(max_rounds):
        nxt = torch.zeros_like(missing)
        nxt[0] = missing[0]
        for j in range(1, b + 1):
            p = float(missing[j])
            if p == 0.0:
                continue
            ask = math.ceil(oversample * j - 1e-9)
            asked += p * ask
            seconds += p * round_s(ask)
            left = (j - torch.arange(ask + 1)).clamp(min=0)  # missing after y informative groups
            nxt.index_add_(0, left, p * _binomial_pmf(ask, r))
        missing = nxt
    kept = b - float((torch.arange(b + 1, dtype=torch.float64) * missing).sum())
    return asked, kept, seconds


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
    _, replayed, _, informative, groups = _batch(c, draw_ratio(c, pool))
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
    if c.dynamic is not None:
        generate_s = dynamic_rounds(round(fresh), r, *c.dynamic, lambda ask: draw_s(ask, c.n, length, drawn))[2]
    else:
        generate_s = draw_s(round(fresh), c.n, length, drawn)
    signal = informative + replayed
    k, g = c.reference  # a round's reference prompts, drawn from the whole pool
    reference_length = _mean(completion, pool.mass)
    generated = asked * c.n + k * g / c.round_steps
    generate_s += draw_s(k, g, reference_length, mix(pool.mass)) / c.round_steps
    gen_tokens = asked * c.n * length + k * g * reference_length / c.round_steps
    upd_tokens = (signal * c.m * row if c.skip_silent
                  else (groups + replayed) * c.m * _mean(completion + prompt, kept))
    fwd_tokens = (c.screen * fresh * (_mean(prompt, _draw_weights(c, pool)) + costs.solution_tokens)
                  if c.screen > 1 else 0.0)
    fx = costs.fixed
    update_s, forward_s = costs.update.time(upd_tokens), costs.forward.time(fwd_tokens)
    fixed_s = fx.optimizer_s + fx.step_s + (fx.round_s + (fx.fit_s if c.predictor else 0.0)) / c.round_steps
    step_s = generate_s + update_s + forward_s + fixed_s
    calibration_length = float(completion.mean())  # the calibrate stage's set, stratified by level
    upfront_s = (draw_s(*c.calibration, calibration_length, mix(torch.ones(len(pool.levels))))
                 + c.scored * costs.score_s)
    return Prediction(name=c.name, effective_ratio=signal / (groups + replayed), signal=signal, generated=generated,
                      generated_tokens=gen_tokens, updated_tokens=upd_tokens, forward_tokens=fwd_tokens,
                      step_s=step_s, generate_s=generate_s, update_s=update_s, forward_s=forward_s, fixed_s=fixed_s,
                      upfront_s=upfront_s, train_s=upfront_s + c.steps * step_s)


def predict(candidates: list[Composition], baseline: Composition, pool: PoolStats,
            costs: UnitCosts) -> tuple[Prediction, list[Prediction]]:
    """The baseline's prediction and each candidate's, with ``clock`` its training clock over the baseline's."""
    base = _step(baseline, pool, costs)
    scale = base.train_s if base.train_s > 0 else 1.0
    return (replace(base, clock=base.train_s / scale),
            [replace(p, clock=p.train_s / scale) for p in (_step(c, pool, costs) for c in candidates)])


def choose(base: Prediction, predictions: list[Prediction], min_signal: float) -> tuple[Prediction, str]:
    """The prediction with the cheapest step whose signal is at least ``min_signal`` times the baseline's (the
    baseline when none is), and why in one line."""
    if not 0 <= min_signal <= 1:
        raise ValueError(f"min_signal must be in [0, 1], got {min_signal!r}")
    qualify = [p for p in predictions if p.signal >= min_signal * base.signal - 1e-9]
    cheapest = min((p.step_s for p in qualify), default=base.step_s)
    best = max((p for p in qualify if p.step_s <= (1 + TIE) * cheapest), key=lambda p: p.signal, default=base)
    if best.step_s >= base.step_s:
        best = base
        return best, (f"{best.name}: no candidate is predicted cheaper than plain GRPO with at least "
                      f"{min_signal:.0%} of its informative groups a step")
    slower = sorted((p for p in qualify if p is not best), key=lambda p: p.step_s)
    runner = f"; next {slower[0].name} at {slower[0].clock:.2f}x" if slower else ""
    return best, (f"{best.name}: predicted {best.clock:.2f}x plain GRPO's training clock with "
                  f"{best.signal / base.signal:.2f}x its informative groups a step (effective ratio "
                  f"{best.effective_ratio:.2f} against {base.effective_ratio:.2f}){runner}")


@dataclass(frozen=True)
class OverlapProbe:
    """One draw and one update of the same work, timed (seconds) on the device they share: ``draw_s`` and
    ``update_s`` each alone, one after the other (lag 0), and ``at_once_s`` from the start of both at once (the draw
    in the generator process, the update in the trainer, lag 1) until both are done; each the median of ``repeats``."""

    draw_s: float
    update_s: float
    at_once_s: float
    repeats: int = 1

    def __post_init__(self) -> None:
        for name in ("draw_s", "update_s", "at_once_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"OverlapProbe.{name} must be finite and > 0, got {v!r}")
        if self.repeats < 1:
            raise ValueError(f"OverlapProbe.repeats must be >= 1, got {self.repeats!r}")

    @property
    def sequential_s(self) -> float:
        return self.draw_s + self.update_s

    @property
    def ratio(self) -> float:
        """At once over one after the other: below 1, running them at once is faster."""
        return self.at_once_s / self.sequential_s


@dataclass(frozen=True)
class LagChoice:
    """The overlap's lag and why: ``basis`` ``config`` (``overlap.lag`` 0 or 1 set), ``devices`` (the sampler and
    the trainer run on different devices) or ``probe`` (they share one; ``probe`` holds the timing); ``reason``: one
    line for the run's summary, the plan and MLflow."""

    lag: int
    basis: Literal["config", "devices", "probe"]
    reason: str
    probe: OverlapProbe | None = None

    def __post_init__(self) -> None:
        if self.lag not in (0, 1) or isinstance(self.lag, bool):
            raise ValueError(f"LagChoice.lag must be 0 or 1, got {self.lag!r}")
        if self.basis not in ("config", "devices", "probe"):
            raise ValueError(f"LagChoice.basis must be config, devices or probe, got {self.basis!r}")
        if (self.basis == "probe") != (self.probe is not None):
            raise ValueError("LagChoice: a probe's timing goes with basis probe, and only with it")


def choose_lag(separate: str | None, probe: OverlapProbe | None, min_gain: float) -> LagChoice:
    """``overlap.lag=auto`` (module docstring, Overlap): 1 when ``separate`` says why the sampler and the trainer run
    on different devices; else, from ``probe``, 1 when at once takes at most ``1 - min_gain`` of one after the
    other, and 0 otherwise."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    if separate:
        return LagChoice(1, "devices", f"lag 1: the sampler and the trainer run on different devices ({separate})")
    if probe is None:
        raise ValueError("choose_lag: the sampler and the trainer share a device, and there is no probe to decide by")
    pays = probe.ratio <= 1 - min_gain
    timing = (f"a draw and an update at once took {probe.at_once_s:.3g} s, {probe.ratio:.2f}x the "
              f"{probe.sequential_s:.3g} s of one after the other (draw {probe.draw_s:.3g} s, update "
              f"{probe.update_s:.3g} s; median of {probe.repeats}) on the device they share")
    if pays:
        return LagChoice(1, "probe", f"lag 1: {timing}, at least {min_gain:.0%} faster", probe)
    return LagChoice(0, "probe", f"lag 0: {timing}, not {min_gain:.0%} faster", probe)
