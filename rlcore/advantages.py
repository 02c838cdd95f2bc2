"""Group-relative advantages (GRPO family) and the effective-group mask.

Papers:
    * GRPO: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300 (advantage (r - mean) / std).
    * Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783 (no std division).
    * DOTS / Rollout Replay: Sun et al. 2025, arXiv 2506.05316. Theorem 1 (E||g||^2 = V G p(1-p)(1-1/G),
      maximal at p = 0.5) is stated for the mean-only advantage A_i = r_i - mean_j r_j.
    * PODS: Xu et al. 2025, arXiv 2504.13818: advantages are recomputed on the m kept rollouts.

Choices and deviations:
    * rlsift's default (``train.scale_std=false``) is the Dr.-GRPO mean-only form, ``A = r - mean_group(r)``,
      as the DOTS paper writes it and as its Theorem 1 assumes. One convention is used everywhere (fresh,
      replayed and down-sampled groups).
    * ``scale_by_std=True`` gives standard GRPO, ``(r - mean) / (std + eps)``. We use the *population* std
      (``unbiased=False``), which is 0 (not NaN) for a group of one and does not depend on G through a
      Bessel factor. The official DOTS code (verl) and PODS code use ``torch.std`` (unbiased, eps 1e-6
      and 1e-4 respectively); pass ``unbiased_std=True`` to get that form.
    * A group whose rewards are all equal gets advantage exactly 0 in either form (``effective_mask``
      tells which groups are not in that case), also when the value is not exactly representable: the
      float mean of eight 1.075s is not 1.075, and dividing that rounding error by its own tiny std would
      give every rollout +0.11, so equal groups are set to 0 explicitly.
    * Non-finite rewards (NaN, inf) are an error, with the group and rollout named: a verifier that returns
      NaN is broken, and a NaN advantage would reach the weights.
"""

from __future__ import annotations

import torch

__all__ = ["effective_mask", "group_advantages", "solved_anchor", "solved_mask"]


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor of shape [B, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [B, G] (2 dims), got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 1:
        raise ValueError(f"rewards must have at least one rollout per group, got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        b, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"rewards must be finite; {int(bad.sum())} are not, the first at group {b}, rollout {g} "
                         f"({float(rewards[b, g])})")
    return rewards


def group_advantages(
    rewards: torch.Tensor,
    *,
    scale_by_std: bool,
    eps: float = 1e-6,
    unbiased_std: bool = False,
) -> torch.Tensor:
    """Group-relative advantages, one group per row.

    Args:
        rewards: [B, G] rewards of the G rollouts of each of B prompts (integer rewards are cast to the
            default float dtype).
        scale_by_std: divide by the group std plus ``eps`` (standard GRPO); False is Dr. GRPO, rlsift's
            default (``train.scale_std``).
        eps: added to the std before dividing; must be > 0 when ``scale_by_std``.
        unbiased_std: use the unbiased (Bessel-corrected) std as the official DOTS/PODS code does; a group
            of one then has std NaN, so this needs G >= 2.

    Returns:
        [B, G] advantages, same dtype as ``rewards`` (float).

    Raises:
        ValueError: on a non-[B, G] input, a non-finite reward, eps <= 0 with scaling, or unbiased std with G < 2.
    """
    rewards = _check_rewards(rewards)
    equal = (rewards.amax(dim=1) == rewards.amin(dim=1)).unsqueeze(1)  # [B, 1]
    adv = torch.where(equal, 0.0, rewards - rewards.mean(dim=1, keepdim=True))
    if scale_by_std:
        if not eps > 0:
            raise ValueError(f"eps must be > 0 when scale_by_std=True, got {eps}")
        if unbiased_std and rewards.shape[1] < 2:
            raise ValueError("unbiased_std=True needs at least 2 rollouts per group (G >= 2)")
        std = rewards.std(dim=1, keepdim=True, unbiased=unbiased_std)
        adv = torch.where(equal, 0.0, adv / (std + eps))
    return adv


def effective_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Which groups are effective, i.e. have rewards that are not all equal (a non-zero gradient).

    Args:
        rewards: [B, G] rewards.

    Returns:
        [B] bool, True where the group's max reward differs from its min reward.

    Raises:
        ValueError: on a non-[B, G] input or a non-finite reward (an all-NaN group is neither effective nor not).
    """
    rewards = _check_rewards(rewards)
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def solved_mask(rewards: torch.Tensor, solved_reward: float = 1.0) -> torch.Tensor:
    """Which groups are solved: every rollout earns ``solved_reward``.

    Args:
        rewards: [B, G] rewards.

    Returns:
        [B] bool.
    """
    return (_check_rewards(rewards) == solved_reward).all(dim=1)


def solved_anchor(rewards: torch.Tensor, advantages: torch.Tensor, anchor: float, solved_reward: float = 1.0
                  ) -> torch.Tensor:
    """The solved-skill guard's advantages (rlsift's addition, ``guard.anchor``; docs/algorithms.md section 7).

    A group whose rollouts all earn ``solved_reward`` has advantage 0 in GRPO, so nothing holds the policy's
    solved behaviour in place while other prompts move it. Giving those rollouts advantage ``anchor`` instead
    makes the clipped surrogate a likelihood push on the policy's own correct answers (bounded per step by the
    ratio clip): a form of supervised replay of successes (RAFT, arXiv 2304.06767; self-imitation, arXiv
    1806.05635), applied only where GRPO has no signal.

    Args:
        rewards: [B, G] rewards.
        advantages: [B, G] the group advantages of ``rewards``.
        anchor: the advantage of a solved group's rollouts (0 leaves ``advantages`` unchanged).

    Returns:
        [B, G] advantages: ``anchor`` on solved groups, ``advantages`` elsewhere.
    """
    rewards = _check_rewards(rewards)
    if advantages.shape != rewards.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and rewards {tuple(rewards.shape)} differ in shape")
    if anchor == 0:
        return advantages
    solved = solved_mask(rewards, solved_reward).unsqueeze(1)  # [B, 1]
    return torch.where(solved, torch.full_like(advantages, anchor), advantages)
