"""PODS: down-sample each prompt's n rollouts to the m that enter the policy update.

Paper: Xu, Savani, Fang, Kolter 2025, "Not All Rollouts are Useful: Down-Sampling Rollouts in LLM
Reinforcement Learning" (Policy Optimization with Down-Sampling), arXiv 2504.13818. Official code:
github.com/YixuanEvenXu/pods (``maxvargrpo_trainer.py``; ablations ``maxrewardgrpo_trainer.py``,
``randomgrpo_trainer.py``). Summary: docs/algorithms.md section 3.

Max-variance rule: pick the size-m subset S maximising the variance of {r_i : i in S}. Some optimal S is
always the m - k lowest plus the k highest rewards for some k in 0..m, so after one sort every candidate's
variance comes from prefix sums in O(1): O(n log n) per prompt, all prompts at once.

Choices and deviations:
    * Ordering and ties: rewards are sorted ascending with a stable sort, so equal rewards keep their
      original order; "lowest m - k" are the first m - k and "top k" the last k of that order. Among splits
      k with equal variance (within 1e-12 relative to the size of the prefix sums the score is computed from,
      however small the spread: an absolute floor would let a zero-variance split tie with the best when
      rewards differ by less than about 1e-6 / m) the largest k (the most high-reward rollouts) wins; so with
      m = 1, where every split has variance 0, the top reward is kept.
      The official code searches the splits in O(m^2) starting from the top-m; it states no tie rule.
    * Returned indices are sorted ascending (original rollout order), for every rule. With m == n every rule
      returns 0..n-1 in order and draws nothing from the generator, so the kept group is the input group.
    * Variance is the population variance (the argmax over fixed-size subsets is the same for either form);
      the ``pods/var_*`` metrics are population variances averaged over groups.
    * ``max_reward`` keeps the top m by reward (ties: lower original index first); ``random`` keeps a
      uniform m-subset. Both are the paper's ablations.
    * Advantages are not computed here: compute them on the kept m (PODS's convention) with
      ``rlcore.advantages.group_advantages``; success rates for DOTS labels and replay admission come from
      the full n (docs/algorithms.md section 6.3).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import numpy as np
import torch

from rlcore.advantages import effective_mask

__all__ = ["DownsampleRule", "downsample", "max_variance_subset"]

_TIE_RTOL = 1e-12


class DownsampleRule(StrEnum):
    """Names of the down-sampling rules."""

    MAX_VARIANCE = "max_variance"
    RANDOM = "random"
    MAX_REWARD = "max_reward"


def _max_variance_batch(rewards: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    """[B, n] float64 rewards -> [B, m] kept indices (unsorted) maximising the kept variance."""
    b, n = rewards.shape
    order = torch.sort(rewards, dim=1, stable=True).indices  # [B, n] ascending, ties by index
    s = torch.gather(rewards, 1, order)  # [B, n] sorted rewards
    s = s - s[:, :1]  # shift by the row minimum: variance is shift invariant, integer rewards stay exact
    zero = torch.zeros(b, 1, dtype=s.dtype)
    p1 = torch.cat([zero, s.cumsum(dim=1)], dim=1)  # [B, n + 1], p1[:, j] = sum of the j lowest
    p2 = torch.cat([zero, (s * s).cumsum(dim=1)], dim=1)  # [B, n + 1]
    k = torch.arange(m + 1)  # [m + 1] rollouts taken from the top
    low = (m - k).expand(b, -1)  # [B, m + 1]
    top_start = (n - k).expand(b, -1)  # [B, m + 1]
    s1 = p1.gather(1, low) + p1[:, n : n + 1] - p1.gather(1, top_start)  # [B, m + 1]
    s2 = p2.gather(1, low) + p2[:, n : n + 1] - p2.gather(1, top_start)  # [B, m + 1]
    score = m * s2 - s1 * s1  # [B, m + 1] = m^2 * population variance of the split
    best = score.amax(dim=1, keepdim=True)  # [B, 1]
    # relative to the size of the sums whose difference the score is (rounding is of that order): spreads of any
    # size, and splits whose variance is 0 (m = 1) tie exactly however the prefix sums round
    size = torch.maximum(best.abs(), (m * s2).abs().amax(dim=1, keepdim=True))  # [B, 1]
    near_best = score >= best - _TIE_RTOL * size  # [B, m + 1]
    k_best = (near_best * k).amax(dim=1)  # [B] largest k among the best splits
    pos = torch.arange(m).expand(b, -1)  # [B, m] positions j of the kept set in sorted order
    n_low = (m - k_best).unsqueeze(1)  # [B, 1]
    sorted_pos = torch.where(pos < n_low, pos, pos - n_low + (n - k_best).unsqueeze(1))  # [B, m]
    return torch.gather(order, 1, sorted_pos)


def _random_batch(rewards: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    b, n = rewards.shape
    keys = torch.rand(b, n, generator=generator, dtype=torch.float64)  # [B, n]
    return torch.argsort(keys, dim=1)[:, :m]


def _max_reward_batch(rewards: torch.Tensor, m: int, generator: torch.Generator | None) -> torch.Tensor:
    return torch.sort(rewards, dim=1, descending=True, stable=True).indices[:, :m]


_RULES: dict[DownsampleRule, Callable[[torch.Tensor, int, torch.Generator | None], torch.Tensor]] = {
    DownsampleRule.MAX_VARIANCE: _max_variance_batch,
    DownsampleRule.RANDOM: _random_batch,
    DownsampleRule.MAX_REWARD: _max_reward_batch,
}


def _rule(name: str | DownsampleRule) -> DownsampleRule:
    try:
        return DownsampleRule(name)
    except ValueError:
        valid = ", ".join(r.value for r in DownsampleRule)
        raise ValueError(f"unknown down-sampling rule {name!r}; valid names: {valid}") from None


def _as_rewards(rewards: torch.Tensor | np.ndarray, dims: int) -> torch.Tensor:
    if isinstance(rewards, np.ndarray):
        rewards = torch.from_numpy(np.asarray(rewards, dtype=np.float64))
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor or numpy array, got {type(rewards).__name__}")
    if rewards.dim() != dims:
        want = "[n]" if dims == 1 else "[B, n]"
        raise ValueError(f"rewards must have shape {want}, got shape {tuple(rewards.shape)}")
    rewards = rewards.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (found NaN or inf)")
    return rewards


def _check_m(m: int, n: int) -> None:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
        raise ValueError(f"m must be an int, got {type(m).__name__}")
    if not 1 <= m <= n:
        raise ValueError(f"m must satisfy 1 <= m <= n = {n}, got m = {m}")


def max_variance_subset(rewards: torch.Tensor | np.ndarray, m: int) -> torch.Tensor:
    """Indices of the m rollouts whose rewards have the largest variance (one prompt).

    Args:
        rewards: [n] rewards of one prompt's rollouts (binary or graded).
        m: how many to keep, 1 <= m <= n.

    Returns:
        [m] int64 indices into ``rewards``, ascending.
    """
    r = _as_rewards(rewards, dims=1)
    _check_m(m, r.shape[0])
    keep, _ = downsample(r.unsqueeze(0), m, rule=DownsampleRule.MAX_VARIANCE)
    return keep[0]


def downsample(
    rewards: torch.Tensor | np.ndarray,
    m: int,
    *,
    rule: str | DownsampleRule,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Choose m of the n rollouts of every prompt.

    Args:
        rewards: [B, n] rewards of n rollouts for each of B prompts.
        m: rollouts to keep per prompt, 1 <= m <= n.
        rule: ``"max_variance"`` (PODS), ``"random"`` or ``"max_reward"`` (the paper's ablations) (``pods.rule``).
        generator: CPU random generator for ``"random"`` (None: torch's global generator).

    Returns:
        (keep, metrics): keep is [B, m] int64 indices into dim 1 of ``rewards``, ascending in each row;
        metrics has ``pods/kept_frac`` (m / n), ``pods/var_before`` and ``pods/var_after`` (mean over
        groups of the population variance of all n / of the kept m rewards), ``pods/effective_before``
        and ``pods/effective_after`` (share of groups whose rewards are not all equal).

    Raises:
        ValueError: on a non-[B, n] or non-finite input, m outside 1..n, or an unknown rule.
    """
    r = _as_rewards(rewards, dims=2)
    b, n = r.shape
    _check_m(m, n)
    chosen = _rule(rule)
    if b == 0:
        keep = torch.zeros(0, m, dtype=torch.long)
    elif m == n:
        keep = torch.arange(n).expand(b, -1).clone()
    else:
        keep = torch.sort(_RULES[chosen](r, int(m), generator), dim=1).values
    kept = torch.gather(r, 1, keep)  # [B, m]
    metrics = {
        "pods/kept_frac": m / n,
        "pods/var_before": float(r.var(dim=1, unbiased=False).mean()) if b else 0.0,
        "pods/var_after": float(kept.var(dim=1, unbiased=False).mean()) if b else 0.0,
        "pods/effective_before": float(effective_mask(r).double().mean()) if b else 0.0,
        "pods/effective_after": float(effective_mask(kept).double().mean()) if b else 0.0,
    }
    return keep, metrics
