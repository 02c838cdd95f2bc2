"""The one batch record that moves between rollout, down-sampling, replay and the update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutGroup:
    """One prompt's rollouts as they enter the update (after PODS down-sampling, if on).

    Shapes (rlcore notation): G kept rollouts, L completion tokens (right-padded), P prompt tokens.

    Attributes:
        prompt_id: stable id of the prompt record.
        prompt_ids: [P] int64 prompt token ids, no padding.
        completion_ids: [G, L] int64 completion token ids, right-padded.
        completion_mask: [G, L] bool, True on real completion tokens (EOS included).
        rewards: [G] float32 rewards of the kept rollouts.
        advantages: [G] float32 group-relative advantages computed on the kept rollouts.
        behaviour_logp: [G, L] float32 per-token log-probs under mu, the behaviour policy of the loss: for a fresh
            group either the sampler's log-probs (``sampler_logp``, set when the group is made) or, left empty
            ([0]), the update's recomputed pi_old, which the update then stores here for replay.
        success_rate: mean reward over all n generated rollouts (before down-sampling).
        n_generated: n, the number of rollouts generated for this prompt.
        step: the training step whose policy generated these rollouts.
        replayed_from: for a replayed group, the step it was generated at; None when fresh.
        sampler_logp: [G, L] float32 log-probs the rollout engine drew the tokens with ([0] when unknown); the
            update compares them with its pi_old (the sampler/trainer mismatch metrics).
        policy_version: updates the sampling weights had received (the step's own index when sampled on-policy;
            one less with ``overlap.lag`` 1).
    """

    prompt_id: str
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    behaviour_logp: torch.Tensor
    success_rate: float
    n_generated: int
    step: int
    replayed_from: int | None = None
    extras: dict = field(default_factory=dict)
    sampler_logp: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    policy_version: int | None = None

    @property
    def has_behaviour(self) -> bool:
        """Whether ``behaviour_logp`` holds mu already (a replayed group, or a fresh one corrected by its sampler)."""
        return self.behaviour_logp.numel() > 0

    @property
    def size(self) -> int:
        return int(self.completion_ids.shape[0])

    def state(self) -> dict:
        """A plain dict of tensors and numbers (for ``torch.save``)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_state(cls, state: dict) -> RolloutGroup:
        return cls(**state)
