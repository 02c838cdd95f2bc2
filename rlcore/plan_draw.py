"""The plan's draw: what share of a candidate composition's fresh groups carry a gradient, predicted from the
reference set a run measures before it trains.

Ours (docs/algorithms.md section 9). The plan's two inputs live here: :class:`PoolStats`, the reference set (K
reference prompts rolled out g times each by the calibrate stage, with their levels, the screen's likelihoods and
the share of the pool each stands for), and :class:`Composition`, a candidate read from a config. rlcore/plan.py
predicts each candidate's step and clock from the draw's ratio (:func:`draw_ratio`) and the q-mass it draws from.

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
top 1/f of the q-mass ranked by the screen (the limit of many candidates).

**The screen's kept groups.** The top 1/f is a few reference prompts (about 11 of 64 at f = 6), and their own g
rollouts made the estimate noise: 0.43-0.90 over three seeds' reference sets of one pool, where the draw measured
0.74. So under the screen each reference prompt's chance comes from all K of them (:func:`screen_calibration`): a
logistic line of the pass rate in the logit of the screen's likelihood, and a Beta spread of pass rates around it,
both fitted to the K prompts' successes; w_j is then the beta-binomial chance of a mixed group of n at that mean
and spread. Against the kept groups' informative share at the start policy (1,200 pool prompts, 16 rollouts each,
the screen's top B of fB drawn, 2,000 draws), over eight reference sets a pool: f = 6 on the default mix 0.700 ± 0.069
against 0.720 (the top prompts' own rollouts: 0.657 ± 0.141); f = 4 0.649 ± 0.071 against 0.662 (0.633 ± 0.110);
`balanced` f = 6 0.774 ± 0.033 against 0.785 (0.766 ± 0.068). A screen that says nothing about the pass rate
(a flat line) gives every prompt the pool's spread, not the chance at its mean.

A technique inside a step (``Composition.rules``, rlcore/step_rules.py) may reweigh the draw (the pre-rollout skip,
rlcore/silent_skip.py ``SkipRule``): q is then also the chance it leaves the prompt in; what replaces the draw, and
Rollout Replay and DAPO's dynamic sampling, are rlcore/plan.py's.

Limits: the ratio is the one at the start of training (it moves as the policy learns).

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from rlcore.pass_rate_posterior import CONCENTRATION_GRID, EPS, beta_binomial_log_pmf
from rlcore.pass_rate_posterior import informative_chance as posterior_chance
from rlcore.step_rules import StepRule

__all__ = ["Composition", "PoolStats", "draw_ratio", "draw_weights", "group_chance", "informative_chance", "kept_mass",
           "level_rates", "screen_calibration", "screened_per_prompt"]


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
    ahead of its draw, at every step but a round's first (``select.screen_ahead`` with the sampler apart from the
    trainer: lag 1, or a server): with ``overlap`` after the update it runs beside, on the trainer's side (its
    cores or device while the trainer waits for the draw: tasks/overlap/concurrent.py), else beside the generate
    call on a server, costing only what outlasts the call; ``round_ahead``: a round's start (the predictor's fit)
    runs ahead alike, beside the generate call of the round's last step where nothing overlaps (hidden but for what
    outlasts it), and with ``screen_ahead`` the screen of the round's first step after it (``select.round_ahead``,
    where a round start takes no reference rollouts, the sampler on other hardware: tasks/plan/planner.py
    ``hides``); ``shared_prefix``: the update computes each
    group's prompt once (``train.shared_prefix``), so its tokens are the rows' completions and one prompt a group;
    ``overlap``: step t+1 is drawn while update t runs (``overlap.lag`` 1, or ``auto`` with the sampler and the
    trainer apart: tasks/overlap/concurrent.py ``separate_devices``), so a step costs the slower of the two sides
    (rlcore/plan.py); ``screen_in_sampler``: with ``overlap``, the screen's passes run in the generator process,
    the look-ahead after its generate call (``select.screen_process``), on the draw's side."""

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
    shared_prefix: bool = False
    overlap: bool = False
    screen_in_sampler: bool = False

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
        if self.screen_in_sampler and not (self.overlap and self.screen > 1):
            raise ValueError(f"{self.name}: the screen runs in the generator process only where it screens (screen "
                             f"> 1) and overlaps (lag 1), got screen={self.screen}, overlap={self.overlap}")


def screened_per_prompt(c: Composition) -> int:
    """Candidates the screen's pass scores per prompt a step keeps: f, as the rules leave it (the prescreen's
    ``StepRule.screen_pass``)."""
    f = c.screen
    for rule in c.rules:
        f = rule.screen_pass(f)
    return f


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


def level_rates(pool: PoolStats) -> torch.Tensor:
    """[K] each reference prompt's level's pooled rate (s + 1) / (g + 2): how the plan models DOTS's prediction."""
    s = torch.tensor(pool.successes, dtype=torch.float64)
    pred = torch.empty(len(s), dtype=torch.float64)
    for lv in set(pool.levels):
        at = torch.tensor([x == lv for x in pool.levels])
        pred[at] = (s[at].sum() + 1) / (pool.g * int(at.sum()) + 2)
    return pred


def draw_weights(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] weights q of each reference prompt under the composition's draw: the pool share it stands for, times
    DOTS's weighting of its level's pooled rate, times the chance the skip leaves it in (module docstring)."""
    mass = pool.mass
    for rule in c.rules:
        mass = rule.weigh(torch.tensor(pool.successes), pool.g, c.n, mass)
    if c.draw == "uniform":
        return mass
    pred = level_rates(pool)
    if c.weighting == "target":
        dist = (pred - c.alpha).abs()
        return mass * torch.exp(-(dist - dist.min()) / c.tau)
    return mass * _binomial_informative(pred, c.n).clamp_min(1e-12)


def kept_mass(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] the q-mass of each reference prompt the composition's fresh groups come from: the draw's weights, and
    with the screen the top 1/f of them ranked by the screen (the boundary prompt in part)."""
    q = draw_weights(c, pool)
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


#: Newton steps, ridge and clamp of the screen's calibration (:func:`screen_calibration`).
CALIBRATION_STEPS, CALIBRATION_RIDGE, SCREEN_EPS = 25, 1e-3, 1e-6


def screen_calibration(pool: PoolStats) -> tuple[torch.Tensor, float]:
    """[K] the mean pass rate the screen's score predicts for each reference prompt, and the Beta concentration of
    pass rates around it (module docstring, "The screen's kept groups").

    ``mu_j = sigmoid(a + b x_j)`` with ``x_j = logit(screen_j)`` (clamped to [1e-6, 1 - 1e-6]): a and b maximise
    the binomial likelihood of the reference successes, each prompt weighted by the pool share it stands for
    (Newton's method, a small ridge so that a perfect ranking stays finite); the concentration, on
    ``rlcore.pass_rate_posterior``'s grid, maximises the beta-binomial likelihood of the same successes around mu.
    Fitted once a reference set (``PoolStats`` is frozen and hashable): the plan asks for it once per screened
    candidate and per question it answers about one (46 times in the default plan: 0.18 s of its 1.7 s)."""
    if pool.screen is None:
        raise ValueError("the screen's calibration needs the reference prompts' screen likelihoods")
    mu, concentration = _screen_fit(pool)
    return mu.clone(), concentration


@functools.lru_cache(maxsize=8)
def _screen_fit(pool: PoolStats) -> tuple[torch.Tensor, float]:
    """:func:`screen_calibration`'s fit, cached by reference set (callers get a copy of ``mu``)."""
    q = torch.tensor(pool.screen, dtype=torch.float64).clamp(SCREEN_EPS, 1 - SCREEN_EPS)
    x = torch.stack([torch.ones_like(q), torch.logit(q)], 1)  # [K, 2]
    s = torch.tensor(pool.successes, dtype=torch.float64)
    weight = pool.mass * len(s)  # [K], mean 1
    coef, ridge = torch.zeros(2, dtype=torch.float64), CALIBRATION_RIDGE * torch.eye(2, dtype=torch.float64)
    for _ in range(CALIBRATION_STEPS):
        mu = torch.sigmoid(x @ coef)
        grad = x.T @ (weight * (s - pool.g * mu)) - CALIBRATION_RIDGE * coef
        hess = x.T @ (x * (weight * pool.g * mu * (1 - mu)).unsqueeze(1)) + ridge
        coef = coef + torch.linalg.solve(hess, grad)
    mu = torch.sigmoid(x @ coef).clamp(EPS, 1 - EPS)
    loglik = [float((weight * beta_binomial_log_pmf(s, pool.g, c * mu, c * (1 - mu))).sum())
              for c in CONCENTRATION_GRID]
    return mu, CONCENTRATION_GRID[max(range(len(loglik)), key=lambda i: (loglik[i], -i))]


def group_chance(c: Composition, pool: PoolStats) -> torch.Tensor:
    """[K] the chance that the composition's group of n rollouts of each reference prompt is informative: under the
    screen (f > 1), the beta-binomial chance at the pass rate the screen's score predicts (:func:`screen_calibration`);
    otherwise the measured one (:func:`informative_chance`)."""
    if c.screen == 1:
        return informative_chance(torch.tensor(pool.successes), pool.g, c.n)
    if c.n < 2:
        return torch.zeros(len(pool.successes), dtype=torch.float64)
    mu, spread = screen_calibration(pool)
    zero = torch.zeros_like(mu)
    return posterior_chance(mu, zero, zero, c.n, concentration=spread)


def draw_ratio(c: Composition, pool: PoolStats) -> float:
    """The predicted share of the composition's fresh groups that are informative (module docstring)."""
    q = kept_mass(c, pool)
    return float((q * group_chance(c, pool)).sum() / q.sum())
