"""DOTS prompt selection: sample prompts whose predicted adaptive difficulty is near a target.

Paper: Sun et al., "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through Difficulty-targeted
Online Data Selection and Rollout Replay", arXiv 2506.05316; official code
github.com/ASTRAL-Group/data-efficient-llm-rl (``ray_trainer.py``). Summary: docs/algorithms.md
sections 1.3 and 6.2 (stage 4).

    d_q = 1 - p_q                       # adaptive difficulty from the predicted success rate
    w_q = exp(-|d_q - alpha| / tau) * prior_q     (0 for prompts outside ``mask``)
    P(q) = w_q / sum w

Choices and deviations:

* The weights are computed in log space in float64 and the largest log-weight is subtracted before ``exp``,
  so tau = 1e-3 (official) never overflows, and with alpha = 0.5 no eligible prompt underflows to 0
  (exp(-500) is representable in float64; in float32 it is 0). The returned probabilities are float64.
* ``prior`` is an optional multiplicative prior (a GAIN-RL Gaussian window, an angle/length prior, a
  ScalingRL DES weight); ``mask`` marks the eligible prompts. Neither is in the paper (docs/algorithms.md
  section 6.3).
* Sampling without replacement: ``"weighted"`` is the official ``torch.multinomial(replacement=False)``;
  ``"greedy"`` (top-k of the probabilities, ties broken by lower index) and ``"gumbel"`` (Gumbel-top-k,
  the same distribution as ``"weighted"``) are the variants left commented out in the official code.
  All three refuse to draw a prompt with probability 0: asking for more prompts than have positive
  probability is an error rather than a silent fill.
* ``informative_weights`` (``select.weighting=informative``) is ours, not DOTS's: weights in proportion to the
  chance that a prompt's group has unequal rewards, the distribution of DAPO's dynamic-sampling batch.
* ``observed_informative_weights`` and ``posterior_informative_weights`` (``select.weighting=observed``,
  ``posterior``) are ours too: the same chance, measured on the groups drawn so far, or under a Beta posterior
  of each prompt's pass rate with the prediction as its prior mean (rlcore/pass_rate_posterior.py).
* ``screen`` (``select.screen``) is ours: of C drawn candidates whose pass rates are known (tasks/selection/screen.py
  estimates them from the policy's likelihood of each prompt's worked solution), keep the k whose groups of n are
  most likely to have unequal rewards. ``prescreen`` (``select.prescreen``, ours too) picks which drawn candidates
  the screen's pass scores, from the scores it gave them before: the screen's cost then falls below its f
  candidates a prompt while it still ranks most of them. The pre-rollout skip of GRESO (arXiv 2506.02177) skips
  prompts before rollouts on their last groups' silence; this skips them before the screen on its own last score.
* ``uniform`` is plain GRPO's selection (and the code's ``random_selection=True`` baseline).
* Indices come back in draw order (greedy: by decreasing probability); DOTS shuffles the selection before
  splitting it into the mu batches of a round, which is the caller's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.pass_rate_posterior import informative_chance
from rlcore.step_rules import Unchanged

SAMPLE_METHODS = ("weighted", "greedy", "gumbel")


def _log_prior_and_mask(m: int, prior: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    """[M] float64 log prior, -inf outside the mask or where the prior is 0."""
    logw = torch.zeros(m, dtype=torch.float64)
    if prior is not None:
        prior = torch.as_tensor(prior, dtype=torch.float64)
        if prior.shape != (m,):
            raise ValueError(f"prior must have shape [{m}], got {tuple(prior.shape)}")
        if not (torch.isfinite(prior) & (prior >= 0)).all():
            raise ValueError("prior must be finite and non-negative")
        logw = logw + torch.log(prior)
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != (m,) or mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor of shape [{m}], got {mask.dtype} {tuple(mask.shape)}")
        logw = logw.masked_fill(~mask, float("-inf"))
    return logw


def _normalise(logw: torch.Tensor) -> torch.Tensor:
    top = logw.max()
    if not torch.isfinite(top):
        raise ValueError("no eligible prompt: every prompt is masked out or has prior 0")
    w = torch.exp(logw - top)  # the largest weight is exactly 1
    return w / w.sum()


def _success_rates(x: torch.Tensor, name: str, *, nonempty: bool = True) -> torch.Tensor:
    """``x`` as a [N] float64 tensor of success rates, or a ValueError naming ``name`` and what is wrong."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.ndim != 1 or (nonempty and x.numel() == 0):
        raise ValueError(f"{name} must be a {'non-empty ' if nonempty else ''}1-D tensor, got shape {tuple(x.shape)}")
    if not ((x >= 0) & (x <= 1)).all():
        raise ValueError(f"{name} must be success rates in [0, 1] (NaN not allowed)")
    return x


def dots_weights(
    pred_success: torch.Tensor,
    *,
    alpha: float,
    tau: float,
    prior: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DOTS selection probabilities, P(q) proportional to exp(-|(1 - p_q) - alpha| / tau) * prior_q.

    Args:
        pred_success: [M] predicted success rates in [0, 1].
        alpha: target adaptive difficulty (failure rate), in [0, 1]; official 0.5 (``select.alpha``).
        tau: temperature > 0; official 1e-3, near-greedy (``select.tau``).
        prior: optional [M] non-negative multiplicative prior.
        mask: optional [M] bool, True for eligible prompts.

    Returns:
        [M] float64 probabilities summing to 1, exactly 0 for ineligible prompts.
    """
    p = _success_rates(pred_success, "pred_success")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha is a target difficulty and must lie in [0, 1], got {alpha}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    d = 1.0 - p  # adaptive difficulty
    logw = -(d - alpha).abs() / tau + _log_prior_and_mask(p.numel(), prior, mask)
    return _normalise(logw)


def informative_weights(
    pred_success: torch.Tensor,
    n: int,
    *,
    prior: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selection probabilities proportional to the chance that a prompt's group carries a gradient (ours).

    A group of n rollouts of a prompt with success rate p has unequal rewards with probability
    ``1 - p^n - (1 - p)^n`` (independent Bernoulli(p) rewards). DAPO's dynamic sampling (arXiv 2503.14476,
    section 3.2) draws prompts uniformly and keeps exactly the groups with unequal rewards, so the prompts of
    its kept batch are distributed in proportion to that probability. Sampling in proportion to it with DOTS's
    predicted p (``select.weighting=informative``) draws from that distribution without generating the groups
    dynamic sampling discards, to the extent the predictions are right. Unlike DOTS's target weights it keeps
    training nearly solved prompts (p = 0.9, n = 8: 0.57 against 0.99 at p = 0.5), which is what holds the easy
    levels up under plain GRPO and dynamic sampling (docs/benchmarks.md, "Every idea tried", row "Informative
    weighting").

    Args:
        pred_success: [M] predicted success rates in [0, 1].
        n: rollouts per prompt (``rollout.n``), >= 2.
        prior: optional [M] non-negative multiplicative prior.
        mask: optional [M] bool, True for eligible prompts.

    Returns:
        [M] float64 probabilities summing to 1, 0 for ineligible prompts and for predictions of exactly 0 or 1.
    """
    p = _success_rates(pred_success, "pred_success")
    return _normalise(torch.log(_binomial_informative(p, n)) + _log_prior_and_mask(p.numel(), prior, mask))


def observed_informative_weights(
    pred_success: torch.Tensor,
    n: int,
    seen_pred: torch.Tensor,
    seen_informative: torch.Tensor,
    *,
    bins: int,
    strength: float,
    prior: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selection probabilities proportional to the chance of a gradient measured on the groups seen so far (ours).

    Predicted p is cut into ``bins`` equal bins of [0, 1]. In each bin the chance that a group has unequal
    rewards is the share of informative groups among those whose prompt had a prediction in the bin when it was
    drawn, shrunk toward the binomial chance 1 - p^n - (1 - p)^n of the query's own prediction with ``strength``
    pseudo-groups:

        w_q = (k_b + strength * c(p_q)) / (N_b + strength)     b = bin of p_q, k_b of N_b seen groups informative

    Selection depends on a prompt only through its prediction, so within a bin the seen groups are an unbiased
    sample of what a draw at that prediction yields. The measured share corrects predictions that are right on
    average but too narrow per prompt, for which the binomial chance of the mean is too high (it is concave in
    p; docs/benchmarks.md, "Every idea tried", row "Observed weighting").

    Args:
        pred_success: [M] predicted success rates in [0, 1].
        n: rollouts per prompt (``rollout.n``), >= 2.
        seen_pred: [N] predictions of the prompts drawn so far, at the time they were drawn.
        seen_informative: [N] bool, whether each of those groups had unequal rewards.
        bins: number of bins of predicted p (>= 1).
        strength: pseudo-groups of the binomial prior per bin (> 0).
        prior, mask: as in :func:`informative_weights`.

    Returns:
        [M] float64 probabilities summing to 1.
    """
    if bins < 1 or not strength > 0:
        raise ValueError(f"bins must be >= 1 and strength > 0, got {bins} and {strength}")
    p = _success_rates(pred_success, "pred_success")
    binomial = _binomial_informative(p, n)
    seen_pred = _success_rates(seen_pred, "seen_pred", nonempty=False)
    seen_inf = torch.as_tensor(seen_informative, dtype=torch.float64)
    if seen_pred.shape != seen_inf.shape:
        raise ValueError(f"seen_pred and seen_informative must be 1-D of one length, got {tuple(seen_pred.shape)} "
                         f"and {tuple(seen_inf.shape)}")
    seen_bin = (seen_pred * bins).long().clamp(max=bins - 1)  # [N]
    count = torch.bincount(seen_bin, minlength=bins).double()  # [bins]
    hits = torch.bincount(seen_bin, weights=seen_inf, minlength=bins).double()
    b = (p * bins).long().clamp(max=bins - 1)  # [M]
    w = (hits[b] + strength * binomial) / (count[b] + strength)
    return _normalise(torch.log(w) + _log_prior_and_mask(p.numel(), prior, mask))


def posterior_informative_weights(
    pred_success: torch.Tensor,
    n: int,
    own_successes: torch.Tensor,
    own_trials: torch.Tensor,
    *,
    concentration: float,
    prior: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selection probabilities proportional to the chance of a gradient under each prompt's Beta posterior (ours).

    The prediction is the mean of a Beta prior of ``concentration`` pseudo-rollouts and the prompt's own earlier
    rollouts are its evidence (rlcore.pass_rate_posterior): prompts never measured weigh by the beta-binomial
    chance 1 - P(0) - P(n), which is below the binomial one when the predictions are vague; a prompt measured
    before weighs by what its own groups showed (``select.weighting=posterior``).

    Args:
        pred_success: [M] predicted success rates in [0, 1].
        n: rollouts per prompt (``rollout.n``), >= 2.
        own_successes, own_trials: [M] each prompt's earlier successes and rollouts (0 and 0 when never measured).
        concentration: the prior's pseudo-rollouts (> 0; rlcore.pass_rate_posterior.fit_concentration).
        prior, mask: as in :func:`informative_weights`.

    Returns:
        [M] float64 probabilities summing to 1.
    """
    chance = informative_chance(pred_success, own_successes, own_trials, n, concentration=concentration)  # checks
    return _normalise(torch.log(chance) + _log_prior_and_mask(chance.numel(), prior, mask))


def _binomial_informative(p: torch.Tensor, n: int) -> torch.Tensor:
    """[M] float64 chance 1 - p^n - (1 - p)^n that n Bernoulli(p) rewards are not all equal (p: checked rates)."""
    if n < 2:
        raise ValueError(f"n must be >= 2 (a group of one rollout never has unequal rewards), got {n}")
    return (1.0 - p ** n - (1.0 - p) ** n).clamp_min(0.0)


def screen(success: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The k candidates whose groups of n rollouts are most likely informative (``select.screen``; ours).

    Args:
        success: [C] estimated pass rates of the candidates, in [0, 1].
        n: rollouts a group (``rollout.n``), >= 2.
        k: candidates to keep, 0 <= k <= C.

    Returns:
        [k] int64 candidate indices by decreasing chance 1 - p^n - (1 - p)^n, ties broken by lower index (draw order).
    """
    p = _success_rates(success, "success", nonempty=False)
    if not 0 <= k <= len(p):
        raise ValueError(f"k must be in [0, {len(p)}] (the candidates), got {k}")
    return torch.sort(_binomial_informative(p, n), descending=True, stable=True).indices[:k]


def prescreen(last: torch.Tensor, age: torch.Tensor, n: int, k: int, half_life: float) -> torch.Tensor:
    """The k of C drawn candidates the screen's pass scores (``select.prescreen``; ours): those whose groups of n
    were most likely informative when the screen last scored them.

    A candidate's priority is the chance 1 - q^n - (1 - q)^n of its last screened pass rate q, pulled toward the
    mean chance m of the candidates in this draw that were scored before, halfway every ``half_life`` steps of age
    (the policy has moved since): ``m + (chance - m) * 2^(-age / half_life)``. A candidate never scored (q NaN) has
    priority m, so it is scored before one remembered as solved or unsolved and after one remembered as mixed.

    Args:
        last: [C] float64 each candidate's last screened pass rate in [0, 1], NaN where it was never screened.
        age: [C] steps since that score (ignored where ``last`` is NaN), >= 0.
        n: rollouts a group (``rollout.n``), >= 2.
        k: candidates to score, 0 <= k <= C.
        half_life: steps after which a remembered chance is halfway to m, > 0.

    Returns:
        [k] int64 candidate indices by decreasing priority, ties broken by lower index (draw order).
    """
    last = torch.as_tensor(last, dtype=torch.float64)
    age = torch.as_tensor(age, dtype=torch.float64)
    if last.dim() != 1 or age.shape != last.shape:
        raise ValueError(f"last and age must be [C] tensors of one shape, got {tuple(last.shape)} and "
                         f"{tuple(age.shape)}")
    known = ~torch.isnan(last)
    _success_rates(last[known], "last", nonempty=False)
    if bool((age[known] < 0).any()) or not half_life > 0:
        raise ValueError(f"need ages >= 0 and half_life > 0, got half_life={half_life}")
    if not 0 <= k <= len(last):
        raise ValueError(f"k must be in [0, {len(last)}] (the candidates), got {k}")
    chance = _binomial_informative(torch.where(known, last, 0.0), n)
    mean = chance[known].mean() if bool(known.any()) else torch.tensor(0.0, dtype=torch.float64)
    priority = torch.where(known, mean + (chance - mean) * torch.exp2(-age / half_life), mean)
    return torch.sort(priority, descending=True, stable=True).indices[:k]


@dataclass(frozen=True)
class Prescreen(Unchanged):
    """The prescreen as a technique (rlcore/step_rules.py): the training's :class:`~rlcore.step_rules.ScreenOrder`
    (of a step's drawn candidates, the ``scored`` x need that :func:`prescreen` ranks first, in draw order) and the
    plan's :class:`~rlcore.step_rules.StepRule` (the pass scores ``scored`` candidates a prompt, not f; the screen
    still chooses among f, so the draw's ratio is f's: the prompts its earlier scores rank low are those it would
    not keep). ``n``: rollouts a group; ``half_life``: ``select.prescreen_half_life``."""

    scored: int
    n: int
    half_life: float
    name: str = "prescreen"

    def __post_init__(self) -> None:
        if self.scored < 1 or self.n < 2 or not self.half_life > 0:
            raise ValueError(f"prescreen: need scored >= 1, n >= 2 and half_life > 0, got {self.scored}, {self.n}, "
                             f"{self.half_life}")

    def screen_pass(self, f: int) -> int:
        return min(self.scored, f)

    def pick(self, last: torch.Tensor, age: torch.Tensor, need: int) -> torch.Tensor:
        k = self.scored * need
        if len(last) <= k:
            return torch.arange(len(last))
        return prescreen(last, age, self.n, k, self.half_life).sort().values


def guard_picks(eligible: torch.Tensor, n: int, generator: torch.Generator) -> list[int]:
    """The solved-skill guard's draw (``guard.share``; ours, docs/algorithms.md section 7): up to n of the prompts
    ``eligible`` [M] bool marks (measured solved, not yet used this round), uniformly at random without
    replacement, in the order drawn."""
    pool = torch.as_tensor(eligible, dtype=torch.bool).nonzero().squeeze(1)
    if n <= 0 or not len(pool):
        return []
    return pool[torch.randperm(len(pool), generator=generator)[:n]].tolist()


def uniform_weights(num_prompts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[M] float64 uniform probabilities over the eligible prompts (plain GRPO)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return _normalise(_log_prior_and_mask(num_prompts, None, mask))


def sample_prompts(
    probs: torch.Tensor, k: int, generator: torch.Generator | None = None, *, method: str
) -> torch.Tensor:
    """Draw k distinct prompt indices from selection probabilities.

    Args:
        probs: [M] non-negative probabilities (need not be normalised).
        k: number of prompts, 0 <= k <= number of prompts with positive probability.
        generator: torch RNG for ``"weighted"`` and ``"gumbel"``.
        method: ``"weighted"`` (multinomial without replacement), ``"greedy"`` (top-k) or ``"gumbel"``
            (Gumbel-top-k) (``select.sampler``).

    Returns:
        [k] int64 distinct indices, in draw order.
    """
    if method not in SAMPLE_METHODS:
        raise ValueError(f"method must be one of {SAMPLE_METHODS}, got {method!r}")
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if probs.ndim != 1 or not (torch.isfinite(probs) & (probs >= 0)).all():
        raise ValueError("probs must be a 1-D tensor of finite non-negative values")
    positive = int((probs > 0).sum())
    if not 0 <= k <= positive:
        raise ValueError(f"k must be in [0, {positive}] (the prompts with positive probability), got {k}")
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    if method == "weighted":
        return torch.multinomial(probs, k, replacement=False, generator=generator)
    if method == "greedy":
        return torch.sort(probs, descending=True, stable=True).indices[:k]
    u = torch.rand(probs.shape, dtype=torch.float64, generator=generator).clamp_min(1e-300)
    keys = torch.log(probs) - torch.log(-torch.log(u))  # log p + Gumbel(0, 1); -inf where p = 0
    return torch.topk(keys, k).indices


def uniform(
    num_prompts: int, k: int, generator: torch.Generator | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain GRPO selection: k distinct eligible prompts drawn uniformly at random.

    Returns:
        [k] int64 indices into the pool of ``num_prompts`` prompts.
    """
    return sample_prompts(uniform_weights(num_prompts, mask), k, generator, method="weighted")
