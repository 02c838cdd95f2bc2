"""Per-prompt rollout budgets: a step's rollouts drawn in two waves, the second only where a gradient is likely.

Papers: Reinforce-Ada (Xiong et al. 2025, arXiv 2510.04996: keep sampling a prompt only until its group carries a
signal), AR3PO (Zhang et al. 2025, arXiv 2509.25808: adaptive rollout, stop sampling a prompt that is solved) and
Knapsack RL (Li et al. 2025, arXiv 2509.25849: the step's rollout budget allocated across prompts by the expected
value of a gradient). docs/algorithms.md section 7.9 has the rule in words and what it measured.

The rule (ours, from those three; shape letters C candidates, B the step's budget of groups, w first-wave rollouts,
n the full group):

1. **First wave.** Each of C candidate prompts gets w rollouts (one generate call for all of them).
2. **Chance of a gradient.** A candidate whose first wave is mixed already carries one (chance 1). One whose w
   rollouts agree (k = w right, or k = 0) would carry one once completed to n rollouts with chance

       c = 1 - E[p^(n - w)],      p ~ Beta(a + w, b)        (all right)
       c = 1 - E[(1 - p)^(n - w)], p ~ Beta(a, b + w)        (all wrong)
       a = s p_hat + 1/2,  b = s (1 - p_hat) + 1/2

   the prior being Jeffreys' plus s = ``prior_strength`` pseudo-rollouts at the prompt's estimated pass rate p_hat
   (the screen's likelihood, DOTS's prediction or the prompt's last measured rate; unknown: Jeffreys' alone).
   E[p^j] under Beta(a, b) is prod_{i < j} (a + i) / (a + b + i).
3. **Second wave (the knapsack).** Every candidate costs the same n - w rollouts to complete, so the value per
   rollout orders them by c: the (at most B) candidates of highest c with c >= ``min_chance`` get n - w more
   rollouts (one generate call for all of them; ties go to the earlier draw).
4. **What is trained.** The completed groups (n rollouts), and the mixed first waves the budget left out, as groups
   of w (free: their rollouts exist, and a right and a wrong answer carry a gradient, as AR3PO reuses responses).
   First waves that agreed and were not completed are not trained (as DAPO's dynamic sampling discards silent
   groups); their rollouts count in every cost, and they label the selection like any group.

:func:`wave_expectation` is the same rule in expectation over a prompt's pass rate, for the plan (rlcore/plan.py):
for a prompt of pass rate p, a candidate costs w + (n - w)(1 - p^w - (1 - p)^w + t1 p^w + t0 (1 - p)^w) rollouts
before the budget, with t1, t0 whether its prior completes an all-right, all-wrong first wave.

Deviations: Reinforce-Ada samples in many rounds until a signal is seen; we draw two waves (each wave is a generate
call, and a call's decode steps cost the same whatever its rows: docs/algorithms.md 9.1; carried, ``WaveRule.carry``,
a step's second wave is drawn in the next step's call, so a step makes one call of both kinds of rows and trains its
completed groups one step later). Knapsack RL solves the allocation with unequal costs and values from a value model;
ours has equal costs and values from a Beta posterior. AR3PO reuses correct responses from earlier steps; we reuse
only this step's first wave.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlcore.step_rules import DrawOutcome, StepView, Unchanged

__all__ = ["WaveExpectation", "WaveRule", "allocate", "completion_chance", "pass_rate_moment", "step_expectation",
           "wave_expectation"]


def _beta_moment(a: torch.Tensor, b: torch.Tensor, j: int) -> torch.Tensor:
    """[*] E[p^j] for p ~ Beta(a, b) (float64)."""
    if j == 0:
        return torch.ones_like(a)
    i = torch.arange(j, dtype=torch.float64)
    return ((a.unsqueeze(-1) + i) / (a + b).unsqueeze(-1).add(i)).prod(-1)


def completion_chance(successes: torch.Tensor, first: int, n: int, prior_mean: torch.Tensor,
                      prior_strength: float) -> torch.Tensor:
    """[C] chance that each candidate's group, completed from its first wave of ``first`` rollouts to ``n``, has
    unequal rewards (module docstring, step 2).

    Args:
        successes: [C] right answers in each candidate's first wave (0..first; rewards 0/1).
        first: w, rollouts in the first wave, 1 <= w < n.
        n: the full group.
        prior_mean: [C] each candidate's estimated pass rate p_hat in [0, 1], NaN where none is known.
        prior_strength: s >= 0, the pseudo-rollouts the estimate is worth.
    """
    if not 1 <= first < n:
        raise ValueError(f"need 1 <= first < n, got first={first}, n={n}")
    if not (math.isfinite(prior_strength) and prior_strength >= 0):
        raise ValueError(f"prior_strength must be finite and >= 0, got {prior_strength!r}")
    k = torch.as_tensor(successes, dtype=torch.float64)
    p_hat = torch.as_tensor(prior_mean, dtype=torch.float64)
    if k.shape != p_hat.shape or k.dim() != 1:
        raise ValueError(f"successes and prior_mean must be [C] of one length, got {tuple(k.shape)} and "
                         f"{tuple(p_hat.shape)}")
    if not ((k >= 0) & (k <= first) & (k == k.round())).all():
        raise ValueError(f"successes must be whole numbers in [0, {first}], got {k.tolist()}")
    known = ~torch.isnan(p_hat)
    if not ((p_hat[known] >= 0) & (p_hat[known] <= 1)).all():
        raise ValueError("prior_mean must be pass rates in [0, 1] or NaN")
    s = torch.where(known, torch.full_like(p_hat, float(prior_strength)), torch.zeros_like(p_hat))
    p0 = torch.nan_to_num(p_hat, nan=0.5)
    a, b = s * p0 + 0.5, s * (1 - p0) + 0.5
    rest = n - first
    all_right = 1 - _beta_moment(a + first, b, rest)
    all_wrong = 1 - _beta_moment(b + first, a, rest)  # E[(1 - p)^j] under Beta(a, b + w)
    c = torch.where(k == first, all_right, torch.where(k == 0, all_wrong, torch.ones_like(k)))
    return c.clamp(0, 1)


def allocate(chance: torch.Tensor, budget: int, min_chance: float) -> torch.Tensor:
    """[C] bool: the candidates whose groups are completed (module docstring, step 3): the at most ``budget`` of
    highest ``chance`` [C] with chance >= ``min_chance``, ties to the lower index (the earlier draw)."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if not 0 <= min_chance <= 1:
        raise ValueError(f"min_chance must be in [0, 1], got {min_chance!r}")
    c = torch.as_tensor(chance, dtype=torch.float64)
    order = torch.sort(c, descending=True, stable=True).indices[:budget]
    take = torch.zeros(len(c), dtype=torch.bool)
    take[order[c[order] >= min_chance]] = True
    return take


def pass_rate_moment(successes: torch.Tensor, g: int, j: int) -> torch.Tensor:
    """[K] unbiased estimates of E[p^j] for prompts with ``successes`` [K] of g rollouts: the chance that j of the g
    rollouts drawn without replacement are all right, C(s, j) / C(g, j), for j <= g; above g, the moment under the
    Jeffreys posterior Beta(s + 1/2, g - s + 1/2) (as rlcore.plan_draw.informative_chance)."""
    if g < 1 or j < 0:
        raise ValueError(f"need g >= 1 and j >= 0, got g={g}, j={j}")
    s = torch.as_tensor(successes, dtype=torch.float64)
    if j <= g:
        comb = torch.tensor([math.comb(c, j) for c in range(g + 1)], dtype=torch.float64)
        return comb[s.long()] / math.comb(g, j)
    return _beta_moment(s + 0.5, g - s + 0.5, j)


@dataclass(frozen=True)
class WaveExpectation:
    """One candidate's expected outcome under the wave rule before the budget, each [K] (float64): ``mixed``, the
    chance its first wave is mixed; ``agree_topped``, that it agrees and is completed; ``agree_informative``, that
    it agrees, is completed and ends mixed; ``rollouts``, its expected rollouts (first wave and completion)."""

    mixed: torch.Tensor
    agree_topped: torch.Tensor
    agree_informative: torch.Tensor
    rollouts: torch.Tensor


def wave_expectation(successes: torch.Tensor, g: int, first: int, n: int, top_right: torch.Tensor,
                     top_wrong: torch.Tensor) -> WaveExpectation:
    """Each reference prompt's (``successes`` [K] of g) expected outcome as a candidate (module docstring):
    ``top_right`` / ``top_wrong`` [K] bool, whether its prior completes a first wave that is all right / all
    wrong (:func:`completion_chance` >= the threshold)."""
    if not 1 <= first < n:
        raise ValueError(f"need 1 <= first < n, got first={first}, n={n}")
    s = torch.as_tensor(successes, dtype=torch.float64)
    right_w, wrong_w = pass_rate_moment(s, g, first), pass_rate_moment(g - s, g, first)
    right_n, wrong_n = pass_rate_moment(s, g, n), pass_rate_moment(g - s, g, n)
    t1, t0 = top_right.to(torch.float64), top_wrong.to(torch.float64)
    mixed = (1 - right_w - wrong_w).clamp(0, 1)
    topped = t1 * right_w + t0 * wrong_w
    informative = t1 * (right_w - right_n).clamp(0) + t0 * (wrong_w - wrong_n).clamp(0)
    return WaveExpectation(mixed=mixed, agree_topped=topped, agree_informative=informative,
                           rollouts=first + (n - first) * (mixed + topped))


def step_expectation(candidates: float, budget: float, mixed: float, agree_topped: float,
                     agree_informative: float) -> dict[str, float]:
    """A step's expected groups under the budget (module docstring, steps 3-4), from ``candidates`` C first waves
    and the per-candidate means of :class:`WaveExpectation`'s parts under the draw: ``topped`` groups completed
    (mixed first waves first, then agreeing ones, at most ``budget``), ``partial`` mixed first waves trained as
    groups of w, ``informative`` trained groups that are mixed, ``trained`` groups in all. Expectations are taken
    of the counts, not of the capped counts (the cap applied to their means)."""
    if candidates < 0 or budget < 0:
        raise ValueError(f"need candidates >= 0 and budget >= 0, got {candidates}, {budget}")
    m, a = candidates * mixed, candidates * agree_topped
    topped_mixed = min(m, budget)
    topped_agree = min(a, budget - topped_mixed)
    share = topped_agree / a if a > 0 else 0.0
    partial = m - topped_mixed
    informative = topped_mixed + share * candidates * agree_informative + partial
    return {"topped": topped_mixed + topped_agree, "topped_informative": topped_mixed + share * candidates *
            agree_informative, "partial": partial, "informative": informative,
            "trained": topped_mixed + topped_agree + partial}


@dataclass(frozen=True)
class WaveRule(Unchanged):
    """The waves as the plan predicts them (an rlcore.step_rules.StepRule; rlcore/plan.py): C = ceil(candidates x B)
    candidates from the draw, each reference prompt's expected outcome as one (:func:`wave_expectation`, its prior
    the run's estimate of it), the step's groups under the budget B (:func:`step_expectation`); a first generate
    call of C x w rollouts and a second of the completed groups' n - w each, or with ``carry`` one call of both (the
    last step's completions beside this step's first waves: in the steady state as many as this step's)."""

    first: int
    candidates: float
    min_chance: float
    prior_strength: float
    carry: bool = False
    name: str = "waves"

    def outcome(self, view: StepView) -> DrawOutcome:
        w, n, k = self.first, view.n, len(view.successes)
        if not 1 <= w < n:
            raise ValueError(f"waves: need 1 <= first < n, got first={w}, n={n}")
        top_right = completion_chance(torch.full((k,), float(w)), w, n, view.estimate,
                                      self.prior_strength) >= self.min_chance
        top_wrong = completion_chance(torch.zeros(k), w, n, view.estimate, self.prior_strength) >= self.min_chance
        e = wave_expectation(view.successes, view.g, w, n, top_right, top_wrong)
        q = view.kept / view.kept.sum()
        cands = math.ceil(self.candidates * round(view.fresh))
        out = step_expectation(cands, view.fresh, float((q * e.mixed).sum()), float((q * e.agree_topped).sum()),
                               float((q * e.agree_informative).sum()))
        firsts = (float(cands), w, view.kept)
        seconds = (out["topped"], n - w, view.kept * (e.mixed + e.agree_topped))
        if self.carry:  # one call of single rollouts, whose lengths follow where each kind of row goes
            where = sum(p * r * q / q.sum() for p, r, q in (firsts, seconds) if q.sum() > 0)
            calls = ((cands * w + out["topped"] * (n - w), 1, where),)
        else:
            calls = (firsts, seconds)
        return DrawOutcome(calls=calls,
                           generated=cands * w + out["topped"] * (n - w), informative=out["informative"],
                           trained=out["trained"],
                           rows=out["topped_informative"] * min(view.m, n) + out["partial"] * min(view.m, w),
                           screened=float(cands))
