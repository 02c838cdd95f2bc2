"""The policy-gradient update on a batch of rollout groups (fresh and replayed): :func:`policy_update`, and
:class:`LocalUpdater`, the one-process backend that runs it.

One call is one training step: the clipped surrogate of ``rlcore.grpo_loss`` with Rollout Replay's
off-policy correction, AdamW, gradient clipping. With one minibatch and one epoch the step-start
log-probs ``old_logp`` are the detached log-probs of the same forward pass (pi_theta = pi_old at that
moment), so no extra no-grad pass is spent; with several minibatches a no-grad pass computes them first.
Fresh groups without the sampler's log-probs as their mu get ``old_logp`` back as their behaviour log-probs
(the policy that sampled them is pi_old; :class:`~tasks.update.updater.UpdateResult`), which is what Rollout Replay
stores.

The pieces: which rows go in which minibatch and micro-batch (tasks/update/minibatch.py), one micro-batch's share of
the loss (tasks/update/loss.py), the minibatches not applied (tasks/update/skips.py), the optimizer step and the
collectives (tasks/update/distributed.py). The training loop meets every backend through
:class:`~tasks.update.updater.Updater`; ``tasks.update.sharded_update.Driver`` builds on this module, which imports
no other backend.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Sequence
from typing import get_args

import torch

from rlcore.angle import online_angle_signal
from rlcore.types import RolloutGroup
from tasks.config import KlRows, SharedPrefix
from tasks.model.forward import token_logprobs
from tasks.model.shared_prefix import attends_with_sdpa, prefix_attention
from tasks.update.distributed import (
    DataShard,
    all_finite,
    backward,
    gradient_sync,
    is_deepspeed,
    optimizer_step,
    zero_grad,
)
from tasks.update.loss import LossTerms, MetricSums, micro_batch_loss, mismatch_metrics
from tasks.update.minibatch import Minibatch, PassTokens, batch_rows, cut_minibatches
from tasks.update.nan_locator import SkippedUpdate
from tasks.update.precision import MasterWeights, Precision, build_optimizer
from tasks.update.skips import locate_skip, non_finite_loss
from tasks.update.updater import LossSettings, Updater, UpdateResult, set_lr

log = logging.getLogger(__name__)


KL_ROWS: tuple[str, ...] = get_args(KlRows)


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence[RolloutGroup],
                  settings: LossSettings, *, ref_model: torch.nn.Module | None = None,
                  device: torch.device | str = "cpu", shard: DataShard | None = None) -> UpdateResult:
    """One optimizer step (or ``minibatches`` of them) on ``groups`` with the run's ``settings``; returns the metrics
    and the behaviour log-probs of the groups that had none (:class:`~tasks.update.updater.UpdateResult`).

    The behaviour policy mu of a row is its group's ``behaviour_logp`` when it has one (replayed groups, and fresh
    groups corrected by their sampler's log-probs, ``train.behaviour``), else pi_old. The loss is then the decoupled
    objective (AReaL, arXiv 2505.24298 section 5; Rollout Replay's form, rlcore/grpo_loss.py): PPO-clip on
    pi_theta / pi_old, weighted by pi_old / mu per token.

    The parts, in order (:class:`BatchUpdate`): which rows (:func:`tasks.update.minibatch.batch_rows` and
    ``cut_minibatches``), the passes without autograd (:meth:`BatchUpdate.no_grad_logprobs`: pi_old when there are
    several minibatches, the KL reference), then per minibatch one forward and backward per micro-batch
    (:func:`~tasks.update.loss.micro_batch_loss`), gradients accumulating, and one optimizer step
    (:func:`tasks.update.distributed.optimizer_step`); the metrics (:class:`~tasks.update.loss.MetricSums`).

    Args:
        settings: the loss's settings (:class:`~tasks.update.updater.LossSettings`, whose fields say what each does).
        ref_model: the frozen KL reference (``settings.kl_coef > 0``).
        shard: scale-out (``tasks/update/distributed.py``): every rank passes the same ``groups`` and computes its
            slice of each micro-batch; the loss is renormalised so the averaged gradient is the single-process
            one, and metrics and behaviour log-probs are combined over ranks. ``model``/``optimizer`` are then
            the wrapped engine and its optimizer. None: one process.

    Each minibatch not applied comes back in the result's ``skipped`` (:class:`~tasks.update.nan_locator.
    SkippedUpdate`): its cause (loss, the loss's other inputs, gradient) and, in one process, the site
    :func:`~tasks.update.nan_locator.locate` finds by re-running the micro-batch (the one whose loss was not
    finite; for a gradient, each in turn until one shows it). Under scale-out nothing is re-run (the hooks see one
    rank's modules and a re-run would need every rank's collectives): the record says so.

    Returns:
        :class:`~tasks.update.updater.UpdateResult`: the behaviour log-probs of every group without its own (pi_old of
        the update's rows), and the metrics: ``train/loss``, ``train/grad_norm`` and the loss's own metrics (averaged
        over the applied minibatches), and ``train/skipped_updates``: minibatches whose loss or gradient was not
        finite, so their update was not applied (``optimizer_step``; under DeepSpeed see
        ``train/dropped_micro_batches``); ``train/update_rows`` and ``train/update_tokens``: the rows computed (all of
        them without the skip) and their real prompt + completion tokens (with the shared prefix, what the packed
        passes compute: a prompt a group, or a piece of one); ``train/micro_batches``: forward and
        backward passes per process. Where the computed rows carry sampler log-probs, the sampler/trainer mismatch
        over their tokens (:func:`~tasks.update.loss.mismatch_metrics`). The result's ``tokens``: the real and padded
        tokens of this process's passes with autograd (:class:`~tasks.update.minibatch.PassTokens`).
    """
    return BatchUpdate(model, optimizer, groups, settings, ref_model=ref_model, device=device, shard=shard).run()


def wants_shared_prefix(mode: SharedPrefix, device: torch.device | str, angle: bool) -> bool:
    """``train.shared_prefix`` ``mode`` on ``device``: true, or ``auto`` on the CPU, without GAIN-RL's hidden states
    (``angle``: the row layout gives them)."""
    return not angle and (mode is True or (mode == "auto" and torch.device(device).type == "cpu"))


def uses_shared_prefix(settings: LossSettings, model: torch.nn.Module, device: torch.device | str,
                       shard: DataShard | None) -> bool:
    """Whether the update computes each group's prompt once (tasks/model/shared_prefix.py): where
    :func:`wants_shared_prefix`, in one process, on a model that attends with SDPA."""
    return (wants_shared_prefix(settings.shared_prefix, device, settings.angle) and shard is None
            and attends_with_sdpa(model))


def skips_silent_rows(settings: LossSettings, shard: DataShard | None) -> bool:
    """Whether the update leaves the rows of groups with all-zero advantages out of its passes
    (``settings.skip_zero_advantage``, except under scale-out with GAIN-RL's angle); raises on settings that
    contradict each other or are out of range."""
    kl_coef, kl_rows, kl_sample, behaviour_cap = (settings.kl_coef, settings.kl_rows, settings.kl_sample,
                                                  settings.behaviour_cap)
    if kl_rows not in KL_ROWS:
        raise ValueError(f"kl_rows must be one of {', '.join(KL_ROWS)}, got {kl_rows!r}")
    skip = settings.skip_zero_advantage and (not settings.angle or shard is None)
    if kl_coef > 0 and kl_rows != "all" and not skip:
        raise ValueError(f"kl_rows={kl_rows!r} leaves rollouts out of the KL term by skipping them in the update: it "
                         "needs train.skip_zero_advantage (and, under scale-out, GAIN-RL off)")
    if not 0 < kl_sample <= 1:
        raise ValueError(f"kl_sample must be in (0, 1], got {kl_sample}")
    if kl_sample < 1 and kl_coef > 0 and not skip:
        raise ValueError(f"kl_sample={kl_sample} leaves silent groups out of the KL term by skipping them in the "
                         "update: it needs train.skip_zero_advantage (and, under scale-out, GAIN-RL off)")
    if behaviour_cap is not None and not behaviour_cap >= 1:
        raise ValueError(f"behaviour_cap must be >= 1 (or None), got {behaviour_cap}")
    return skip


class BatchUpdate:
    """One :func:`policy_update` call: its rows cut into minibatches and micro-batches, the passes without autograd
    (``old_full``: pi_old when there are several minibatches; ``ref_full``: the KL reference), and what the
    minibatches computed so far: the metric sums of the applied ones, pi_old of every computed row (``old_out``,
    [N, L]), the angle signal's sum, the minibatches skipped and DeepSpeed's dropped micro-batches. :meth:`run`
    steps every minibatch and returns the result."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence[RolloutGroup],
                 settings: LossSettings, *, ref_model: torch.nn.Module | None, device: torch.device | str,
                 shard: DataShard | None):
        skip = skips_silent_rows(settings, shard)
        kl_coef, kl_sample, behaviour_cap = settings.kl_coef, settings.kl_sample, settings.behaviour_cap
        self.model, self.optimizer, self.groups, self.settings = model, optimizer, groups, settings
        self.device, self.shard = device, shard
        self.shared = uses_shared_prefix(settings, model, device, shard)
        self.angle_fn = online_angle_signal if settings.angle else None
        self.rows = batch_rows(groups, kl_coef=kl_coef, kl_rows=settings.kl_rows, kl_sample=kl_sample,
                               seed=settings.seed)
        self.plan = cut_minibatches(self.rows, count=settings.minibatches, aggregation=settings.aggregation,
                                    skip=skip, micro_batch_tokens=settings.micro_batch_tokens, shard=shard,
                                    shared_prefix=self.shared)
        self.computed = torch.cat([mb.computed for mb in self.plan])
        self.terms = LossTerms(clip_eps=settings.clip_eps, aggregation=settings.aggregation, kl_coef=kl_coef,
                               log_cap=math.log(behaviour_cap) if behaviour_cap is not None else None,
                               kl_weighted=kl_sample < 1 and kl_coef > 0, world=shard.world if shard is not None else 1)
        self.old_full = self.no_grad_logprobs(model) if settings.minibatches > 1 else None
        self.ref_full = self.no_grad_logprobs(ref_model) if kl_coef > 0 and ref_model is not None else None
        self.sums = MetricSums()
        self.dropped = 0
        self.skips: list[SkippedUpdate] = []
        self.angle_sum, self.angle_n = 0.0, 0
        self.old_out = torch.zeros(self.rows.n, self.rows.width)

    def logprobs(self, part: torch.Tensor, model: torch.nn.Module, hidden: list | None = None,
                 budget: int = 0) -> torch.Tensor:
        """[n, L] the token log-probs of rows ``part`` under ``model`` (with autograd unless the caller turns it off);
        ``hidden`` collects the MLP inputs for the angle signal, ``budget`` caps the tokens of one pass."""
        rows = self.rows
        return token_logprobs(model, [rows.prompts[i] for i in part], rows.completions[part], rows.mask[part],
                              self.settings.pad_id, self.settings.temperature, self.device, max_tokens=budget,
                              mlp_inputs=hidden, groups=rows.group[part] if self.shared else None)

    def no_grad_logprobs(self, model: torch.nn.Module) -> torch.Tensor:
        """[N, L] ``model``'s log-probs of this process's rows (0 elsewhere), without autograd."""
        out = torch.zeros(self.rows.n, self.rows.width)
        with torch.no_grad():  # the update's micro-batches: as many passes on every rank (FSDP2 gathers in each)
            for part in (part for mb in self.plan for part in mb.micro):
                out[part] = self.logprobs(part, model).cpu()
        return out

    def run(self) -> UpdateResult:
        self.model.train()
        # the shared-prefix attention through every backward pass too (activation checkpointing attends again there)
        with prefix_attention(self.model) if self.shared else contextlib.nullcontext():
            for k, mb in enumerate(self.plan):
                self.minibatch(k, mb)
        return self.result()

    def minibatch(self, k: int, mb: Minibatch) -> None:
        """Minibatch ``k``: its micro-batches' forward and backward passes, then one optimizer step, applied only
        when its loss and gradient are finite (else it is recorded as skipped)."""
        model = self.model
        hidden: list | None = [] if self.angle_fn is not None else None  # the hidden-state hook only for GAIN-RL
        if hidden is not None and mb.angle_only.numel():  # a pass without autograd: a third of what it saves
            with torch.no_grad():
                self.logprobs(mb.angle_only, model, hidden, budget=self.settings.micro_batch_tokens)
        zero_grad(model, self.optimizer)
        step_sums, bad = self.micro_batches(k, mb, hidden)
        if hidden is not None:
            for mlp_in, am in hidden:
                self.angle_sum, self.angle_n = (self.angle_sum + float(self.angle_fn(mlp_in, am).sum()),
                                                self.angle_n + len(am))
        gnorm = optimizer_step(model, self.optimizer, self.settings.grad_clip, bad is None or is_deepspeed(model))
        if not math.isfinite(gnorm):  # not applied (optimizer_step): say why and where, keep NaN out of the averages
            self.skip(k, mb, bad, gnorm)
            return
        self.sums.add(step_sums.over_ranks(self.shard) | {"train/grad_norm": gnorm})  # the norm is global already

    def micro_batches(self, k: int, mb: Minibatch,
                      hidden: list | None) -> tuple[MetricSums, tuple[SkippedUpdate, torch.Tensor] | None]:
        """The forward and backward pass of each of minibatch ``k``'s micro-batches, gradients accumulating; returns
        their metric sums and ``bad``: (the skip, the micro-batch's rows) of a non-finite loss, else None. A
        non-finite loss ends the minibatch on every rank (the decision is global), except under DeepSpeed, which
        cannot drop what it accumulated: that micro-batch alone is dropped and counted."""
        model = self.model
        step_sums, bad = MetricSums(), None
        for i, part in enumerate(mb.micro):
            with gradient_sync(model, i == len(mb.micro) - 1):
                logp = self.logprobs(part, model, hidden)  # [n, L] with grad
                old = logp.detach() if self.old_full is None else self.old_full[part].to(logp.device)
                self.old_out[part] = old.cpu()
                piece, m = micro_batch_loss(self.terms, logp, old, self.rows, part, mb, self.ref_full)
                if not all_finite(piece):  # every rank decides alike (one all-reduce)
                    bad = (non_finite_loss(k, piece, m), part)
                    log.warning("update %s: micro-batch %d of %d (%d rows) gives a %s",
                                "micro-batch dropped" if is_deepspeed(model) else "skipped, not applied",
                                i + 1, len(mb.micro), len(part), bad[0].what())
                    del logp, piece  # their graph was never backpropagated: free it before the next forward
                    if is_deepspeed(model):  # it cannot drop what it accumulated: the others' gradient stays
                        self.dropped += 1
                        continue
                    break  # no rank goes on (the decision is global): the minibatch is not applied
                backward(model, piece)
                step_sums.add(m)
        return step_sums, bad

    def skip(self, k: int, mb: Minibatch, bad: tuple[SkippedUpdate, torch.Tensor] | None, gnorm: float) -> None:
        """Record minibatch ``k`` as not applied: its cause (``bad``'s loss, else the gradient norm ``gnorm``) and,
        in one process, the site found by re-running its micro-batches (:func:`~tasks.update.skips.locate_skip`)."""
        by_loss = bad is not None and not is_deepspeed(self.model)
        skip = locate_skip(self.model, self.shard, functools.partial(self.rerun_loss, mb),
                           bad[0] if by_loss else SkippedUpdate(k, "gradient", f"norm {gnorm}"),
                           [bad[1]] if by_loss else mb.micro)
        log.warning("update skipped, not applied (minibatch %d of %d, %d rows, %d micro-batches): %s", k + 1,
                    len(self.plan), len(mb.computed), len(mb.micro), skip.describe())
        self.skips.append(skip)

    def rerun_loss(self, mb: Minibatch, part: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``part``'s loss again, as :meth:`micro_batches` computed it (a forward pass with autograd)."""
        logp = self.logprobs(part, self.model)
        old = logp.detach() if self.old_full is None else self.old_full[part].to(logp.device)
        return micro_batch_loss(self.terms, logp, old, self.rows, part, mb, self.ref_full)[0]

    def result(self) -> UpdateResult:
        """The metrics (:func:`policy_update` says which), over ranks under scale-out, and the behaviour log-probs."""
        rows, computed, shard, skipped = self.rows, self.computed, self.shard, len(self.skips)
        stats = self.sums.mean(self.settings.minibatches - skipped)
        stats["train/skipped_updates"] = float(skipped)
        if self.dropped:
            stats["train/dropped_micro_batches"] = float(self.dropped)
        stats["train/update_rows"] = float(computed.numel())
        tokens = PassTokens.of(rows, self.plan, shared_prefix=self.shared)  # this process's passes
        # packed: what the passes computed (a prompt a group, or a piece of one); else every rank's rows
        stats["train/update_tokens"] = float(tokens.real if self.shared else rows.tokens(computed))
        stats["train/micro_batches"] = float(sum(len(mb.micro) for mb in self.plan))
        old_out, angle_sum, angle_n = self.old_out, self.angle_sum, self.angle_n
        if shard is not None:  # every row was computed by exactly one rank
            old_out = shard.all_sum(old_out)
            angle_sum, angle_n = (float(v) for v in shard.all_sum(torch.tensor([angle_sum, float(angle_n)],
                                                                                 dtype=torch.float64)))
        measured = computed[rows.measured[computed]]  # computed fresh rows with the sampler's log-probs
        if measured.numel():
            stats |= mismatch_metrics(old_out[measured], rows.sampler[measured], rows.mask[measured],
                                      self.terms.log_cap)
        if angle_n:
            stats["gain/angle_online"] = angle_sum / angle_n
        return UpdateResult(metrics=stats, behaviour=behaviour_of(self.groups, old_out), skipped=tuple(self.skips),
                            tokens=tokens)


def behaviour_of(groups: Sequence[RolloutGroup], old: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Each group's rows of ``old`` ([N, L] pi_old of every row, groups in order) cut to its completion width, for
    the groups without behaviour log-probs of their own (None for the others)."""
    out, row = [], 0
    for g in groups:
        out.append(None if g.has_behaviour else old[row:row + g.size, :g.completion_ids.shape[1]].clone())
        row += g.size
    return tuple(out)


class LocalUpdater(Updater):
    """``scale.backend=single``: AdamW on ``model`` in this process and :func:`policy_update`.

    Args:
        model: the policy model (trained in place).
        settings: the loss settings of every step.
        params: what AdamW steps (``Policy.trainable_parameters``: the adapters under LoRA); default every
            parameter of ``model``.
        lr, betas, eps, weight_decay: AdamW's.
        device: where the update's forward passes run.
        ref_model: the frozen KL reference (needed when ``settings.kl_coef > 0``).
        precision: the run's resolved ``model.precision``; a mixed one steps float32 master copies of the model's
            bf16 weights (:class:`~tasks.update.precision.MasterWeights`, in :attr:`optimizer`). None: AdamW on
            the weights in their own dtype.
    """

    def __init__(self, model: torch.nn.Module, settings: LossSettings, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, device: torch.device | str = "cpu",
                 ref_model: torch.nn.Module | None = None, params: list[torch.nn.Parameter] | None = None,
                 precision: Precision | None = None):
        if settings.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.model, self.settings, self.device, self.ref_model = model, settings, device, ref_model
        adamw = functools.partial(torch.optim.AdamW, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        params = list(model.parameters()) if params is None else params
        self.optimizer = build_optimizer(params, adamw, precision) if precision is not None else adamw(params)

    def step(self, groups: Sequence[RolloutGroup]) -> UpdateResult:
        return policy_update(self.model, self.optimizer, groups, self.settings, ref_model=self.ref_model,
                             device=self.device)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def master_weights(self) -> dict[str, torch.Tensor]:
        if not isinstance(self.optimizer, MasterWeights):
            return {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: m for p, m in self.optimizer.copies()}


def gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """``train.gradient_checkpointing``: recompute each decoder layer's activations in the backward pass
    (transformers' ``activation_checkpointing_enable``, non-reentrant; it acts in training mode only, so generation
    and the no-grad passes are unchanged): less memory for about a third more compute a step (docs/performance.md,
    "LoRA and activation checkpointing")."""
    if not enabled:
        return
    from transformers import PreTrainedModel  # here: loaded with the model, not at import

    if not (isinstance(model, PreTrainedModel) and model.supports_gradient_checkpointing):
        raise ValueError(f"train.gradient_checkpointing: {type(model).__name__} does not support it")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
