"""The interface every update backend meets the training loop through (:class:`Updater`), what one step takes
(:class:`LossSettings`) and gives (:class:`UpdateResult`), and the learning rate of each step (:func:`scheduled_lr`).

The backends: ``tasks.update.policy_update.LocalUpdater`` (one process) and ``tasks.update.sharded_update.Driver``
(torchrun ranks); ``tasks.update.backend.build_updater`` picks the run's. This module imports neither, so the
training loop and the checkpoint depend on the interface alone.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from rlcore.types import RolloutGroup
from tasks.config import Config, KlRows, SharedPrefix
from tasks.update.minibatch import PassTokens
from tasks.update.nan_locator import SkippedUpdate


@dataclass(frozen=True)
class LossSettings:
    """The fixed settings of every ``policy_update`` call of a run (``train.*``, ``rollout.temperature``):
    ``clip_eps``, ``aggregation``, ``grad_clip``, ``temperature``, ``kl_coef``, ``kl_rows`` and ``minibatches`` as the
    config's fields say, ``pad_id`` the tokenizer's, and

    Attributes:
        micro_batch_tokens: padded-token budget of one forward and backward pass (``train.micro_batch_tokens``;
            0: each minibatch in one pass). Rows are grouped by length into micro-batches; each micro-batch's loss is
            its share of the whole minibatch's, so loss and gradient do not depend on it beyond float rounding, and
            the update's peak memory is one micro-batch's.
        skip_zero_advantage: leave the rows of groups whose advantages are all 0 out of the forward and backward
            passes (``train.skip_zero_advantage``); each minibatch's loss keeps every row's aggregation units
            (tokens, or sequences) in its normaliser, so loss and gradient are those of the whole minibatch.
            With ``kl_coef > 0`` the rows ``kl_rows`` names are computed too (``train.kl_rows``: ``all`` computes
            every row; ``informative_and_solved`` keeps the rows of groups that all earn reward 1 for their KL
            term); ignored under scale-out with ``angle``. A ``kl_rows`` other than ``all`` acts through the
            skip, so without it (and with a KL term) it is an error;
            in one process ``angle`` gets the skipped rows' hidden states from a forward pass without autograd.
            Token-level metrics then average over the computed rows; skipped fresh groups' behaviour log-probs are
            zeros (Rollout Replay stores only informative groups).
        kl_sample, seed: ``train.kl_sample`` < 1 computes each group that only its KL term puts in the update
            (advantages all 0) with that chance (``tasks.update.minibatch.kl_draw`` of ``seed``) and weights its KL
            term by ``1 / kl_sample``: the KL term and its gradient are unbiased estimates of those over every such
            group. Needs the skip, like ``kl_rows``.
        angle: GAIN-RL's online angle signal (``rlcore.angle.online_angle_signal``: ``(mlp_inputs [N, T, H],
            attention_mask [N, T]) -> [N]`` per sequence) from the same forward pass; its mean is
            ``gain/angle_online``.
        shared_prefix: ``train.shared_prefix``: each group's prompt computed once in the update's passes
            (tasks/model/shared_prefix.py) where :func:`uses_shared_prefix` says so.
        behaviour_cap: truncated importance sampling (``train.behaviour_cap``): on fresh rows whose mu is their
            sampler's, the weight pi_old / mu is capped at this value (done by raising mu to pi_old / cap, which
            turns the decoupled loss into exactly the capped one). Replayed groups keep Rollout Replay's uncapped
            loss. None: no cap.
    """

    clip_eps: float
    aggregation: Literal["token", "sequence"]
    grad_clip: float
    temperature: float
    pad_id: int
    minibatches: int = 1
    kl_coef: float = 0.0
    kl_rows: KlRows = "all"
    kl_sample: float = 1.0
    seed: int = 0
    micro_batch_tokens: int = 0
    skip_zero_advantage: bool = False
    angle: bool = False
    behaviour_cap: float | None = None
    shared_prefix: SharedPrefix = False

    @classmethod
    def from_config(cls, cfg: Config, pad_id: int) -> LossSettings:
        tc = cfg.train
        return cls(clip_eps=tc.clip_eps, aggregation=tc.aggregation, grad_clip=tc.grad_clip,
                   temperature=cfg.rollout.temperature, pad_id=pad_id, minibatches=tc.minibatches,
                   kl_coef=tc.kl_coef, kl_rows=tc.kl_rows, kl_sample=tc.kl_sample, seed=cfg.seed,
                   micro_batch_tokens=tc.micro_batch_tokens,
                   skip_zero_advantage=tc.skip_zero_advantage, angle=cfg.gain.enabled,
                   behaviour_cap=tc.behaviour_cap, shared_prefix=tc.shared_prefix)


@dataclass(frozen=True)
class UpdateResult:
    """What one update computed: its ``metrics`` (``tasks.update.policy_update.policy_update``'s) and, per group in
    the order given, ``behaviour``: [G, L] the update's pi_old log-probs for a group without behaviour log-probs of its
    own (a fresh group whose mu is pi_old: what Rollout Replay stores with it), None for a group that has them;
    ``skipped``. Under scale-out ``skipped`` names causes but no site, and DeepSpeed's dropped micro-batches are only
    counted (``train/dropped_micro_batches``)."""

    metrics: dict[str, float]
    behaviour: tuple[torch.Tensor | None, ...]
    #: the minibatches not applied, with their cause and, in one process, where the first non-finite value appeared
    skipped: tuple[SkippedUpdate, ...] = ()
    #: the tokens this process's passes with autograd computed, real and padded (None: not counted, e.g. DeepSpeed)
    tokens: PassTokens | None = None

    def with_behaviour(self, groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
        """``groups`` (those the update was given) with the behaviour log-probs it computed for them."""
        return [g if b is None else replace(g, behaviour_logp=b) for g, b in zip(groups, self.behaviour, strict=True)]


class Updater(abc.ABC):
    """One policy-gradient step per call, whatever the backend; checkpointable (``tasks/training/checkpoint.py``).

    The updater trains the policy model it was built with in place, so the rollout engine sees the new weights
    (through ``RolloutEngine.sync_weights``, tasks/generation/rollout.py).
    """

    @abc.abstractmethod
    def step(self, groups: Sequence[RolloutGroup]) -> UpdateResult:
        """One update on ``groups``; returns ``policy_update``'s result (metrics, and the behaviour log-probs of the
        groups that had none)."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps, on every process that holds optimizer state."""

    @abc.abstractmethod
    def state_dict(self) -> object:
        """The optimizer state needed to resume (with the model's weights, which the checkpoint saves itself)."""

    @abc.abstractmethod
    def load_state_dict(self, state: object) -> None:
        """Restore :meth:`state_dict`'s result; call after the policy model holds the checkpoint's weights."""

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The values the optimizer steps where they differ from the model's weights, by the model's parameter
        name: under ``bf16-mixed`` the float32 masters of the bf16 weights (what the adapter folder saves,
        tasks/model/lora.py ``save_adapter``). Empty where the weights are their own masters, and for backends
        that keep no single full copy (this default)."""
        return {}


def scheduled_lr(cfg: Config, step: int) -> float:
    """The learning rate of (0-based) ``step``, a function of the step alone (resume-safe).

    ``train.lr`` ramped linearly over the first ``train.warmup_steps`` steps (step s gets ``lr * (s + 1) /
    warmup``, so the last warmup step runs at ``lr``), then ``train.lr_schedule``: constant, or a linear or
    cosine decay from that peak step to ``lr * train.min_lr_ratio`` at the last step, ``train.steps - 1``.
    transformers' ``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup`` decay to 0 one
    step after the last; this schedule reaches its floor on the last step taken.
    """
    tc = cfg.train
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    peak = max(tc.warmup_steps - 1, 0)
    span = tc.steps - 1 - peak
    if tc.lr_schedule == "constant" or span <= 0:
        return tc.lr
    done = min(1.0, (step - peak) / span)  # 0 on the peak step, 1 on the last step
    shape = 1.0 - done if tc.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return tc.lr * (tc.min_lr_ratio + (1.0 - tc.min_lr_ratio) * shape)


def set_lr(optimizer, lr: float) -> None:
    """Set every param group's lr: a torch optimizer, or DeepSpeed's ZeRO optimizer (whose ``param_groups`` are
    its wrapped torch optimizer's, read by ``engine.step``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
