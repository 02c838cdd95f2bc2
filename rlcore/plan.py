"""The plan: which composition pays on a pool, predicted from what a run measures before it trains.

Ours (docs/algorithms.md section 9). Whether a technique pays depends on three measurements a run takes anyway:

* the pool's waste: K reference prompts rolled out g times each (the calibrate stage) give each prompt's
  successes s of g, so the share of prompts solved, unsolved and mixed;
* whether prompts have worked solutions, and how well the policy's likelihood of them (the screen,
  tasks/training/screen.py) ranks the reference prompts;
* what a generated token costs against an updated one (a timed probe of generation and of one update's forward
  and backward passes).

From them this module predicts, for each candidate composition (:class:`Composition`, read from a config), the
effective-group ratio (share of a step's groups with unequal rewards) and the training clock of a step, and
:func:`choose` picks the cheapest composition that keeps plain GRPO's learning signal.

**Informative chance.** A group of n rollouts of a prompt whose g reference rollouts had s successes is
informative (unequal rewards) with chance

    w(n) = 1 - C(s, n) / C(g, n) - C(g - s, n) / C(g, n)               for n <= g (exact, hypergeometric)
    w(n) = 1 - E[p^n] - E[(1 - p)^n],  p ~ Beta(s + 1/2, g - s + 1/2)   for n > g (Jeffreys posterior)

the first an unbiased estimate of 1 - p^n - (1 - p)^n (DAPO, arXiv 2503.14476 section 3.2: such groups carry
the gradient); ``rlcore.adaptive_composition.subset_informative`` is the same count for one group.

**A draw's ratio.** A selection draws reference prompt j with weight q_j; the predicted ratio of its fresh
groups is r = sum_j q_j w_j / sum_j q_j. Uniform: q = 1. DOTS (arXiv 2506.05316): q is the configured weighting
of the predicted pass rate, with the predictor modelled by each level's pooled pass rate (s + 1) / (g + 2)
(on the bundled task the prompt embedding DOTS reads predicts no better than the level; docs/algorithms.md 7.8).
The screen (``select.screen`` = f) keeps, of f candidates a slot, those whose screened pass rate gives the
highest informative chance: its ratio is that of the top 1/f of the q-mass ranked by the screen (the limit of
many candidates). Rollout Replay fills a share 1 - delta of the batch with stored informative groups.
DAPO's dynamic sampling asks ceil(o * missing) prompts a round (``rlcore.dynamic_sampling``), predicted with
the expected yield r per prompt.

**A step's clock.** generated tokens x c_gen + updated tokens x c_upd + screened tokens x c_fwd, where a
rollout has the probe's mean completion length, an updated row is prompt plus completion, silent groups are
left out of the update (``train.skip_zero_advantage``), and DOTS's fresh reference rollouts
(``calibrate.reference=fresh``: K x g a round) count as generation. Fixed costs a step (the optimizer step,
selection) are left out: they are the same for every composition up to the predictor's fit.

**Choice.** The signal of a step is its informative groups (fresh plus replayed). A candidate qualifies when its
signal is at least ``min_signal`` times plain GRPO's; the cheapest qualifying one is chosen (plain GRPO always
qualifies), and among those within ``TIE`` of the cheapest, the one with the most signal.

**Overlap.** Whether generation of step t+1 runs while update t does (``overlap.lag`` 1, AReaL's and verl's one
step off; tasks/training/overlap.py): :func:`choose_lag`. Where the sampler and the trainer run on different
devices (a vLLM server; CPU cores for each) the draw hides behind the update, or the update behind the draw, at
no cost to either: lag 1. Where they share one device they slow each other down by an amount no rule predicts (the
issue's toy on one GPU: 1.43x the sequential time; a 1.5B model: 0.88x), so a probe times one draw and one update
alone and at once (:class:`OverlapProbe`), and lag 1 is chosen only when at once takes at most ``1 - min_gain`` of
alone one after the other: a gain smaller than the probe's own noise, bought with rollouts one update old, does
not pay.

Deviations and limits: the ratio is the one at the start of training (it moves as the policy learns); the
per-token costs are linear (true of a CPU; on a GPU decoding gets cheaper per token with the batch); replayed
groups count as fresh ones in the signal.

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

#: Predicted step times within this share of the cheapest count as a tie, broken by the larger signal.
TIE = 0.05

__all__ = ["Composition", "LagChoice", "OverlapProbe", "PoolStats", "Prediction", "UnitCosts", "choose",
           "choose_lag", "draw_ratio", "informative_chance", "predict"]


@dataclass(frozen=True)
class PoolStats:
    """The reference set: each of K prompts' ``successes`` of ``g`` rollouts, its ``levels`` (None where a prompt
    has none) and ``screen``, the policy's likelihood of its worked solution (None when prompts have none)."""

    successes: tuple[int, ...]
    g: int
    levels: tuple
    screen: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        k = len(self.successes)
        if k == 0:
            raise ValueError("PoolStats needs at least one reference prompt")
        if self.g < 1 or any(not 0 <= s <= self.g for s in self.successes):
            raise ValueError(f"successes must lie in [0, g={self.g}], got {self.successes}")
        if len(self.levels) != k or (self.screen is not None and len(self.screen) != k):
            raise ValueError(f"levels ({len(self.levels)}) and screen must have one entry per reference prompt ({k})")
        if self.screen is not None and any(not (0 <= q <= 1) for q in self.screen):
            raise ValueError("screen likelihoods must lie in [0, 1]")

    @property
    def shares(self) -> dict[str, float]:
        """Shares of reference prompts with every rollout right, none right, and mixed."""
        k = len(self.successes)
        solved = sum(s == self.g for s in self.successes) / k
        unsolved = sum(s == 0 for s in self.successes) / k
        return {"solved": solved, "unsolved": unsolved, "mixed": 1 - solved - unsolved}


@dataclass(frozen=True)
class UnitCosts:
    """Seconds per token of each kind of work, measured by a probe, and the mean token counts it saw.

    ``generate_s``: a generated (completion) token; ``update_s``: an updated token (the update's no-grad forward
    for pi_old plus its forward and backward); ``forward_s``: a teacher-forced token (the screen);
    ``completion_tokens``, ``prompt_tokens``, ``solution_tokens``: mean tokens of a completion, a prompt and a
    worked solution (0 where there is none)."""

    generate_s: float
    update_s: float
    forward_s: float
    completion_tokens: float
    prompt_tokens: float
    solution_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("generate_s", "update_s", "forward_s", "completion_tokens", "prompt_tokens", "solution_tokens"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"UnitCosts.{name} must be finite and >= 0, got {v!r}")


@dataclass(frozen=True)
class Composition:
    """What a candidate does a step, as the prediction needs it.

    ``prompts`` B a step; ``n`` rollouts generated and ``m`` kept a prompt (PODS: m < n); ``draw`` uniform or
    dots, with DOTS's ``weighting`` (target, informative, observed, posterior), ``alpha`` and ``tau``;
    ``screen`` f (1: off); ``fresh_frac`` delta (1 without replay); ``dynamic`` (oversample, max_rounds) or
    None; ``reference_rollouts``: DOTS's fresh reference rollouts a step (K g / round_steps, 0 otherwise);
    ``skip_silent``: silent groups left out of the update."""

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
    reference_rollouts: float = 0.0
    skip_silent: bool = True

    def __post_init__(self) -> None:
        if self.prompts < 1 or not 1 <= self.m <= self.n:
            raise ValueError(f"{self.name}: need prompts >= 1 and 1 <= m <= n, got {self.prompts}, {self.m}, {self.n}")
        if self.draw not in ("uniform", "dots"):
            raise ValueError(f"{self.name}: draw must be uniform or dots, got {self.draw!r}")
        if not 0 < self.fresh_frac <= 1 or self.screen < 1:
            raise ValueError(f"{self.name}: need 0 < fresh_frac <= 1 and screen >= 1")


@dataclass(frozen=True)
class Prediction:
    """One composition's predicted step: ``effective_ratio`` (share of its groups with unequal rewards),
    ``signal`` (informative groups), ``generated`` rollouts, ``generated_tokens``, ``updated_tokens``,
    ``forward_tokens``, ``step_s`` seconds, and ``clock`` (step_s over plain GRPO's; set by :func:`predict`)."""

    name: str
    effective_ratio: float
    signal: float
    generated: float
    generated_tokens: float
    updated_tokens: float
    forward_tokens: float
    step_s: float
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
    """[K] weights q of each reference prompt under the composition's draw (module docstring)."""
    k = len(pool.successes)
    if c.draw == "uniform":
        return torch.ones(k, dtype=torch.float64)
    s = torch.tensor(pool.successes, dtype=torch.float64)
    pred = torch.empty(k, dtype=torch.float64)
    for lv in set(pool.levels):
        at = torch.tensor([x == lv for x in pool.levels])
        pred[at] = (s[at].sum() + 1) / (pool.g * int(at.sum()) + 2)
    if c.weighting == "target":
        dist = (pred - c.alpha).abs()
        return torch.exp(-(dist - dist.min()) / c.tau)
    return _binomial_informative(pred, c.n).clamp_min(1e-12)


def draw_ratio(c: Composition, pool: PoolStats) -> float:
    """The predicted share of the composition's fresh groups that are informative (module docstring)."""
    w = informative_chance(torch.tensor(pool.successes), pool.g, c.n)
    q = _draw_weights(c, pool)
    if c.screen > 1:
        if pool.screen is None:
            raise ValueError(f"{c.name}: the screen needs worked solutions, and the pool has none")
        score = _binomial_informative(torch.tensor(pool.screen, dtype=torch.float64), c.n)
        order = torch.argsort(score, descending=True, stable=True)
        q_sorted = q[order]
        before = torch.cumsum(q_sorted, 0) - q_sorted  # q-mass ranked above each prompt
        budget = float(q.sum()) / c.screen
        keep = (budget - before).clamp(0).minimum(q_sorted)  # the top 1/f of the mass, the boundary prompt in part
        return float((keep * w[order]).sum() / keep.sum())
    return float((q * w).sum() / q.sum())


def _dynamic_prompts(b: int, r: float, oversample: float, max_rounds: int) -> tuple[float, float]:
    """(prompts generated, informative groups kept) of DAPO's filling at yield r a prompt (fluid model of
    ``rlcore.dynamic_sampling.BatchFiller``)."""
    need, asked = float(b), 0.0
    for _ in range(max_rounds):
        ask = math.ceil(oversample * need - 1e-9)
        asked += ask
        need -= r * ask
        if need <= 0:
            break
    return asked, min(float(b), r * asked)


def _step(c: Composition, pool: PoolStats, costs: UnitCosts) -> Prediction:
    r = draw_ratio(c, pool)
    fresh = c.prompts * c.fresh_frac
    replayed = c.prompts - fresh
    if c.dynamic is not None:
        asked, informative = _dynamic_prompts(round(fresh), r, *c.dynamic)
        groups = max(informative, 1.0)
    else:
        asked, informative, groups = fresh, r * fresh, fresh
    signal = informative + replayed
    trained = signal if c.skip_silent else groups + replayed
    generated = asked * c.n + c.reference_rollouts
    gen_tokens = generated * costs.completion_tokens
    upd_tokens = trained * c.m * (costs.prompt_tokens + costs.completion_tokens)
    fwd_tokens = c.screen * fresh * (costs.prompt_tokens + costs.solution_tokens) if c.screen > 1 else 0.0
    step_s = gen_tokens * costs.generate_s + upd_tokens * costs.update_s + fwd_tokens * costs.forward_s
    return Prediction(name=c.name, effective_ratio=signal / (groups + replayed), signal=signal, generated=generated,
                      generated_tokens=gen_tokens, updated_tokens=upd_tokens, forward_tokens=fwd_tokens,
                      step_s=step_s)


def predict(candidates: list[Composition], baseline: Composition, pool: PoolStats,
            costs: UnitCosts) -> tuple[Prediction, list[Prediction]]:
    """The baseline's prediction and each candidate's, with ``clock`` relative to the baseline's step."""
    base = _step(baseline, pool, costs)
    scale = base.step_s if base.step_s > 0 else 1.0
    rel = lambda p: Prediction(**{**p.__dict__, "clock": p.step_s / scale})  # noqa: E731
    return rel(base), [rel(_step(c, pool, costs)) for c in candidates]


def choose(base: Prediction, predictions: list[Prediction], min_signal: float) -> tuple[Prediction, str]:
    """The cheapest prediction whose signal is at least ``min_signal`` times the baseline's (the baseline when
    none is), and why in one line."""
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
