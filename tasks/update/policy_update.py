"""The policy-gradient update on a batch of rollout groups (fresh and replayed).

One call is one training step: the clipped surrogate of ``rlcore.grpo_loss`` with Rollout Replay's
off-policy correction, AdamW, gradient clipping. With one minibatch and one epoch the step-start
log-probs ``old_logp`` are the detached log-probs of the same forward pass (pi_theta = pi_old at that
moment), so no extra no-grad pass is spent; with several minibatches a no-grad pass computes them first.
Fresh groups without the sampler's log-probs as their mu get ``old_logp`` back as their behaviour log-probs
(the policy that sampled them is pi_old; :class:`UpdateResult`), which is what Rollout Replay stores.

The training loop (tasks/training/loop.py) meets every backend through one interface, :class:`Updater`
(``step``, ``set_lr``, ``state_dict``, ``load_state_dict``), built by ``tasks.update.backend.build_updater``:
:class:`LocalUpdater` (one process: AdamW + :func:`policy_update`) or
``tasks.update.sharded_update.Driver`` (DDP, FSDP2, DeepSpeed ZeRO-2/3 under torchrun), which builds on this
module; this module imports neither. The learning rate of every step comes from :func:`scheduled_lr` and reaches
the optimizer(s) through ``set_lr``.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from transformers import PreTrainedModel

from rlcore.angle import online_angle_signal
from rlcore.grpo_loss import clipped_policy_loss
from rlcore.types import RolloutGroup
from tasks.config import Config, KlRows
from tasks.model.forward import token_logprobs
from tasks.update.distributed import (
    LOSS_LIKE,
    DataShard,
    all_finite,
    backward,
    gradient_sync,
    is_deepspeed,
    optimizer_step,
    zero_grad,
)
from tasks.update.minibatch import (  # noqa: F401  (flatten, kl_draw, rows_with_gradient: the update's API)
    BatchRows,
    Minibatch,
    batch_rows,
    cut_minibatches,
    flatten,
    kl_draw,
    loss_units,
    rows_with_gradient,
)
from tasks.update.nan_locator import SkippedUpdate, locate
from tasks.update.precision import Precision, build_optimizer

log = logging.getLogger(__name__)


KL_ROWS: tuple[str, ...] = get_args(KlRows)


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence[RolloutGroup],
                  settings: LossSettings, *, ref_model: torch.nn.Module | None = None,
                  device: torch.device | str = "cpu", shard: DataShard | None = None) -> UpdateResult:
    """One optimizer step (or ``minibatches`` of them) on ``groups`` with the run's ``settings``; returns the metrics
    and the behaviour log-probs of the groups that had none (:class:`UpdateResult`).

    The behaviour policy mu of a row is its group's ``behaviour_logp`` when it has one (replayed groups, and fresh
    groups corrected by their sampler's log-probs, ``train.behaviour``), else pi_old. The loss is then the decoupled
    objective (AReaL, arXiv 2505.24298 section 5; Rollout Replay's form, rlcore/grpo_loss.py): PPO-clip on
    pi_theta / pi_old, weighted by pi_old / mu per token.

    The parts, in order: which rows (:func:`tasks.update.minibatch.batch_rows` and ``cut_minibatches``), the passes
    without autograd (:func:`no_grad_logprobs`: pi_old when there are several minibatches, the KL reference), then
    per minibatch one forward and backward per micro-batch (:func:`micro_batch_loss`), gradients accumulating, and
    one optimizer step (:func:`tasks.update.distributed.optimizer_step`); the metrics (:class:`MetricSums`).

    Args:
        settings: the loss's settings (:class:`LossSettings`, whose fields say what each does).
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
        :class:`UpdateResult`: the behaviour log-probs of every group without its own (pi_old of the update's
        rows), and the metrics: ``train/loss``, ``train/grad_norm`` and the loss's own metrics (averaged over the
        applied minibatches), and ``train/skipped_updates``: minibatches whose loss or gradient was not finite, so
        their update was not applied (``optimizer_step``; under DeepSpeed see ``train/dropped_micro_batches``);
        ``train/update_rows`` and ``train/update_tokens``: the rows computed (all of them without the skip) and
        their real prompt + completion tokens; ``train/micro_batches``: forward and backward passes per process.
        Where the computed rows carry sampler log-probs, the sampler/trainer mismatch over their tokens
        (:func:`mismatch_metrics`).
    """
    clip_eps, aggregation, grad_clip = settings.clip_eps, settings.aggregation, settings.grad_clip
    temperature, pad_id, minibatches = settings.temperature, settings.pad_id, settings.minibatches
    kl_coef, kl_rows, kl_sample, seed = settings.kl_coef, settings.kl_rows, settings.kl_sample, settings.seed
    micro_batch_tokens, behaviour_cap = settings.micro_batch_tokens, settings.behaviour_cap
    angle_fn = online_angle_signal if settings.angle else None
    skip_zero_advantage = settings.skip_zero_advantage
    if kl_rows not in KL_ROWS:
        raise ValueError(f"kl_rows must be one of {', '.join(KL_ROWS)}, got {kl_rows!r}")
    skip = skip_zero_advantage and (angle_fn is None or shard is None)
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
    rows = batch_rows(groups, kl_coef=kl_coef, kl_rows=kl_rows, kl_sample=kl_sample, seed=seed)
    plan = cut_minibatches(rows, count=minibatches, aggregation=aggregation, skip=skip,
                           micro_batch_tokens=micro_batch_tokens, shard=shard)
    computed = torch.cat([mb.computed for mb in plan])
    loss = LossTerms(clip_eps=clip_eps, aggregation=aggregation, kl_coef=kl_coef,
                     log_cap=math.log(behaviour_cap) if behaviour_cap is not None else None,
                     kl_weighted=kl_sample < 1 and kl_coef > 0, world=shard.world if shard is not None else 1)

    def logp_of(rows_: torch.Tensor, model_, hidden: list | None = None, budget: int = 0) -> torch.Tensor:
        return token_logprobs(model_, [rows.prompts[i] for i in rows_], rows.completions[rows_], rows.mask[rows_],
                              pad_id, temperature, device, max_tokens=budget, mlp_inputs=hidden)

    def no_grad_logprobs(model_) -> torch.Tensor:  # [N, L] on this process's rows (0 elsewhere)
        out = torch.zeros(rows.n, rows.width)
        with torch.no_grad():  # the update's micro-batches: as many passes on every rank (FSDP2 gathers in each)
            for part in (part for mb in plan for part in mb.micro):
                out[part] = logp_of(part, model_).cpu()
        return out

    old_full = no_grad_logprobs(model) if minibatches > 1 else None
    ref_full = no_grad_logprobs(ref_model) if kl_coef > 0 and ref_model is not None else None

    model.train()
    sums = MetricSums()
    skipped = dropped = 0
    skips: list[SkippedUpdate] = []
    angle_sum, angle_n = 0.0, 0
    old_out = torch.zeros(rows.n, rows.width)
    for k, mb in enumerate(plan):
        hidden: list | None = [] if angle_fn is not None else None  # the hidden-state hook only for GAIN-RL
        if hidden is not None and mb.angle_only.numel():  # a pass without autograd: a third of what it saves
            with torch.no_grad():
                logp_of(mb.angle_only, model, hidden, budget=micro_batch_tokens)
        zero_grad(model, optimizer)
        step_sums, bad = MetricSums(), None  # bad: (SkippedUpdate, the micro-batch's rows) of a non-finite loss
        for i, part in enumerate(mb.micro):
            with gradient_sync(model, i == len(mb.micro) - 1):
                logp = logp_of(part, model, hidden)  # [n, L] with grad
                old = logp.detach() if old_full is None else old_full[part].to(logp.device)
                old_out[part] = old.cpu()
                piece, m = micro_batch_loss(loss, logp, old, rows, part, mb, ref_full)
                if not all_finite(piece):  # every rank decides alike (one all-reduce)
                    bad = (non_finite_loss(k, piece, m), part)
                    log.warning("update %s: micro-batch %d of %d (%d rows) gives a %s",
                                "micro-batch dropped" if is_deepspeed(model) else "skipped, not applied",
                                i + 1, len(mb.micro), len(part), bad[0].what())
                    del logp, piece  # their graph was never backpropagated: free it before the next forward
                    if is_deepspeed(model):  # it cannot drop what it accumulated: the others' gradient stays
                        dropped += 1
                        continue
                    break  # no rank goes on (the decision is global): the minibatch is not applied
                backward(model, piece)
                step_sums.add(m)
        if hidden is not None:
            for mlp_in, am in hidden:
                angle_sum, angle_n = angle_sum + float(angle_fn(mlp_in, am).sum()), angle_n + len(am)
        gnorm = optimizer_step(model, optimizer, grad_clip, bad is None or is_deepspeed(model))
        if not math.isfinite(gnorm):  # not applied (optimizer_step): say why and where, keep NaN out of the averages
            skipped += 1
            by_loss = bad is not None and not is_deepspeed(model)
            skip = locate_skip(model, shard, functools.partial(rerun_loss, model, loss, logp_of, old_full, rows, mb,
                                                               ref_full),
                               bad[0] if by_loss else SkippedUpdate(k, "gradient", f"norm {gnorm}"),
                               [bad[1]] if by_loss else mb.micro)
            log.warning("update skipped, not applied (minibatch %d of %d, %d rows, %d micro-batches): %s", k + 1,
                        len(plan), len(mb.computed), len(mb.micro), skip.describe())
            skips.append(skip)
            continue
        sums.add(step_sums.over_ranks(shard) | {"train/grad_norm": gnorm})  # the norm is global already
    stats = sums.mean(minibatches - skipped)
    stats["train/skipped_updates"] = float(skipped)
    if dropped:
        stats["train/dropped_micro_batches"] = float(dropped)
    stats["train/update_rows"] = float(computed.numel())
    stats["train/update_tokens"] = float(rows.tokens(computed))
    stats["train/micro_batches"] = float(sum(len(mb.micro) for mb in plan))
    if shard is not None:  # every row was computed by exactly one rank
        old_out = shard.all_sum(old_out)
        angle_sum, angle_n = (float(v) for v in shard.all_sum(torch.tensor([angle_sum, float(angle_n)],
                                                                             dtype=torch.float64)))
    measured = computed[rows.measured[computed]]  # computed fresh rows with the sampler's log-probs
    if measured.numel():
        stats |= mismatch_metrics(old_out[measured], rows.sampler[measured], rows.mask[measured], loss.log_cap)
    if angle_n:
        stats["gain/angle_online"] = angle_sum / angle_n
    return UpdateResult(metrics=stats, behaviour=behaviour_of(groups, old_out), skipped=tuple(skips))


@dataclass(frozen=True)
class UpdateResult:
    """What one update computed: its ``metrics`` (:func:`policy_update`'s) and, per group in the order given,
    ``behaviour``: [G, L] the update's pi_old log-probs for a group without behaviour log-probs of its own (a fresh
    group whose mu is pi_old: what Rollout Replay stores with it), None for a group that has them; ``skipped``.
    Under scale-out ``skipped`` names causes but no site, and DeepSpeed's dropped micro-batches are only counted
    (``train/dropped_micro_batches``)."""

    metrics: dict[str, float]
    behaviour: tuple[torch.Tensor | None, ...]
    #: the minibatches not applied, with their cause and, in one process, where the first non-finite value appeared
    skipped: tuple[SkippedUpdate, ...] = ()

    def with_behaviour(self, groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
        """``groups`` (those the update was given) with the behaviour log-probs it computed for them."""
        return [g if b is None else replace(g, behaviour_logp=b) for g, b in zip(groups, self.behaviour, strict=True)]


def behaviour_of(groups: Sequence[RolloutGroup], old: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Each group's rows of ``old`` ([N, L] pi_old of every row, groups in order) cut to its completion width, for
    the groups without behaviour log-probs of their own (None for the others)."""
    out, row = [], 0
    for g in groups:
        out.append(None if g.has_behaviour else old[row:row + g.size, :g.completion_ids.shape[1]].clone())
        row += g.size
    return tuple(out)


def non_finite_loss(minibatch: int, piece: torch.Tensor, m: dict[str, float]) -> SkippedUpdate:
    """What a micro-batch's non-finite loss ``piece`` says (``m``: its metrics, :func:`micro_batch_loss`): the loss
    itself is not finite; or the surrogate is (``train/loss`` in ``m``) and the loss was made NaN because pi_old, mu
    or the reference was not finite on a valid token; or the loss is finite here and not on another rank."""
    own = float(piece.detach())
    if math.isfinite(own):
        return SkippedUpdate(minibatch, "loss", "finite on this rank, not on another")
    if math.isfinite(m.get("train/loss", math.nan)):
        return SkippedUpdate(minibatch, "inputs", "pi_old, behaviour or reference log-probs not finite on a valid "
                                                  "token; the surrogate loss itself is finite")
    return SkippedUpdate(minibatch, "loss", f"loss {own}")


def rerun_loss(model: torch.nn.Module, terms: LossTerms, logp_of: Callable, old_full: torch.Tensor | None,
               rows: BatchRows, mb: Minibatch, ref_full: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Micro-batch ``part``'s loss again, as :func:`policy_update` computed it (a forward pass with autograd)."""
    logp = logp_of(part, model)
    old = logp.detach() if old_full is None else old_full[part].to(logp.device)
    return micro_batch_loss(terms, logp, old, rows, part, mb, ref_full)[0]


def locate_skip(model: torch.nn.Module, shard: DataShard | None, rerun: Callable[[torch.Tensor], torch.Tensor],
                skip: SkippedUpdate, parts: Sequence[torch.Tensor]) -> SkippedUpdate:
    """``skip`` with the site :func:`~tasks.update.nan_locator.locate` finds re-running ``parts`` (micro-batches'
    rows) one at a time until one shows it; in one process only (else ``skip`` says why not). Runs only for an
    update already skipped, so a finite update pays nothing."""
    if shard is not None or is_deepspeed(model):
        return replace(skip, note="not located under scale-out (the locator runs in one process: "
                                  "scale.backend=single)")
    for n, part in enumerate(parts):
        try:
            site = locate(model, functools.partial(rerun, part), rows=part.tolist())
        except RuntimeError as err:  # out of memory, a kernel's error: the diagnosis fails, the skip stands
            return replace(skip, note=f"the locator's re-run failed: {str(err).splitlines()[0][:200]}")
        if site is not None:
            return replace(skip, site=site, note=f"micro-batch {n + 1} of {len(parts)}" if len(parts) > 1 else "")
    return replace(skip, note=f"re-running its {len(parts)} micro-batch{'es' if len(parts) > 1 else ''} one at a "
                              "time gives finite values throughout (the value needs them accumulated, or does not "
                              "reproduce)")


@dataclass(frozen=True)
class LossTerms:
    """What :func:`micro_batch_loss` needs besides the rows: the loss's settings and the process count.

    ``log_cap``: log of ``train.behaviour_cap`` (None: no cap); ``kl_weighted``: the rows' KL weights apply
    (``train.kl_sample`` < 1); ``world``: ranks (1: one process).
    """

    clip_eps: float
    aggregation: str
    kl_coef: float
    log_cap: float | None
    kl_weighted: bool
    world: int


def micro_batch_loss(terms: LossTerms, logp: torch.Tensor, old: torch.Tensor, rows: BatchRows, part: torch.Tensor,
                     mb: Minibatch, ref_full: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's part of its minibatch's loss, and its metrics weighted for :class:`MetricSums`.

    The clipped surrogate (rlcore.grpo_loss) of the rows ``part`` is a mean over their loss units; times
    ``world * units(part) / units(minibatch)`` it is this micro-batch's share of the whole minibatch's loss (the
    units of rows the skip leaves out count in the minibatch's), and its rank average over ``world`` ranks (what
    DDP, FSDP2 and DeepSpeed's gradient averaging take) is the single-process share. Summed over micro-batches
    and ranks, loss and gradient are the whole minibatch's.

    Args:
        logp: [n, L] log-probs of ``part`` with grad; old: [n, L] pi_old's; ref_full: [N, L] the reference's.

    Returns:
        ``(loss, metrics)``: a loss that is NaN when pi_old, mu or the reference is not finite on a valid token
        (the update is then skipped); loss-like metrics weighted by the micro-batch's share of the minibatch's
        units, the token-level ones by its share of the computed tokens.
    """
    dev = logp.device
    mask = rows.mask[part].to(dev)
    units = loss_units(mask, terms.aggregation)
    if units == 0:  # no valid token here: still run the backward pass (and its collectives), adding nothing
        return logp.sum() * 0.0, {}
    own = rows.own_behaviour[part].to(dev).unsqueeze(1)  # [n, 1]
    beh = torch.where(own, rows.behaviour[part].to(dev), old)
    if terms.log_cap is not None:  # pi_old / mu <= cap on the sampler-corrected fresh rows
        beh = torch.where(rows.capped[part].to(dev).unsqueeze(1), torch.maximum(beh, old - terms.log_cap), beh)
    ref = None if ref_full is None else ref_full[part].to(dev)
    poisoned = not all(bool(torch.isfinite(t[mask]).all()) for t in (old, beh, ref) if t is not None)
    if poisoned:  # a non-finite pi_old / reference pass: the loss is NaN, so the update is skipped
        old, beh, ref = (None if t is None else torch.nan_to_num(t) for t in (old, beh, ref))
    loss, m = clipped_policy_loss(
        logp, old, rows.advantages[part].to(dev), mask, clip_eps=terms.clip_eps, aggregation=terms.aggregation,
        behaviour_logp=beh if bool(own.any()) else None, ref_logp=ref, kl_coef=terms.kl_coef,
        kl_weight=rows.kl_weight[part].to(dev) if terms.kl_weighted else None)
    share, tok_share = units / mb.units, float(mask.sum()) / mb.tokens
    m["train/loss"] = float(loss.detach())
    m = {k: v * (share if k in LOSS_LIKE else tok_share) for k, v in m.items()}
    loss = loss * (share * terms.world)
    return (loss * float("nan") if poisoned else loss), m


class MetricSums:
    """Weighted metric sums: each micro-batch adds its weighted metrics (:func:`micro_batch_loss`), so a
    minibatch's sum over micro-batches and ranks is its metric; minibatches are then averaged."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def over_ranks(self, shard: DataShard | None) -> dict[str, float]:
        """The sums over every rank (one gather under scale-out); collective."""
        return dict(self.sums) if shard is None else shard.sum_metrics(self.sums)

    def mean(self, count: int) -> dict[str, float]:
        return {k: v / count for k, v in self.sums.items()} if count else {}


def mismatch_metrics(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
                     log_cap: float | None) -> dict[str, float]:
    """How far the sampler's log-probs mu are from the trainer's pi_old on the same tokens.

    Args:
        old: [n, L] pi_old log-probs (the update's recompute); sampler: [n, L] mu; mask: [n, L] valid tokens.
        log_cap: log of ``train.behaviour_cap`` (None: no cap).

    Returns:
        ``offpolicy/kl``: k3 estimate of KL(mu || pi_old) over the tokens, ``(w - 1) - log w`` with
        w = pi_old / mu (the rollouts are draws from mu); ``offpolicy/ratio_mean`` and ``offpolicy/ratio_max``
        of w; ``offpolicy/logp_diff_max``: max |log pi_old - log mu|; ``offpolicy/truncated_frac``: share of
        the tokens whose w exceeds the cap. Empty when no token is valid.
    """
    if not bool(mask.any()):
        return {}
    d = (old - sampler)[mask].double()  # [T] log w
    w = d.exp()
    return {"offpolicy/kl": float((torch.expm1(d) - d).mean()), "offpolicy/ratio_mean": float(w.mean()),
            "offpolicy/ratio_max": float(w.max()), "offpolicy/logp_diff_max": float(d.abs().max()),
            "offpolicy/truncated_frac": float((d > log_cap).double().mean()) if log_cap is not None else 0.0}


@dataclass(frozen=True)
class LossSettings:
    """The fixed settings of every :func:`policy_update` call of a run (``train.*``, ``rollout.temperature``):
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
            (advantages all 0) with that chance (:func:`kl_draw` of ``seed``) and weights its KL term by
            ``1 / kl_sample``: the KL term and its gradient are unbiased estimates of those over every such
            group. Needs the skip, like ``kl_rows``.
        angle: GAIN-RL's online angle signal (``rlcore.angle.online_angle_signal``: ``(mlp_inputs [N, T, H],
            attention_mask [N, T]) -> [N]`` per sequence) from the same forward pass; its mean is
            ``gain/angle_online``.
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

    @classmethod
    def from_config(cls, cfg: Config, pad_id: int) -> LossSettings:
        tc = cfg.train
        return cls(clip_eps=tc.clip_eps, aggregation=tc.aggregation, grad_clip=tc.grad_clip,
                   temperature=cfg.rollout.temperature, pad_id=pad_id, minibatches=tc.minibatches,
                   kl_coef=tc.kl_coef, kl_rows=tc.kl_rows, kl_sample=tc.kl_sample, seed=cfg.seed,
                   micro_batch_tokens=tc.micro_batch_tokens,
                   skip_zero_advantage=tc.skip_zero_advantage, angle=cfg.gain.enabled,
                   behaviour_cap=tc.behaviour_cap)


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


class Updater(abc.ABC):
    """One policy-gradient step per call, whatever the backend; checkpointable (``tasks/training/checkpoint.py``).

    The updater trains the policy model it was built with in place, so the rollout engine sees the new weights
    (through ``RolloutEngine.sync_weights``, tasks/generation/rollout.py).
    """

    @abc.abstractmethod
    def step(self, groups: Sequence[RolloutGroup]) -> UpdateResult:
        """One update on ``groups``; returns :func:`policy_update`'s result (metrics, and the behaviour log-probs of
        the groups that had none)."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps, on every process that holds optimizer state."""

    @abc.abstractmethod
    def state_dict(self) -> object:
        """The optimizer state needed to resume (with the model's weights, which the checkpoint saves itself)."""

    @abc.abstractmethod
    def load_state_dict(self, state: object) -> None:
        """Restore :meth:`state_dict`'s result; call after the policy model holds the checkpoint's weights."""


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


def gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """``train.gradient_checkpointing``: recompute each decoder layer's activations in the backward pass
    (transformers' ``activation_checkpointing_enable``, non-reentrant; it acts in training mode only, so generation
    and the no-grad passes are unchanged). Measured on CPU (hidden 256, 8 layers, 32 rows of 544 tokens): peak
    RSS of a forward + backward 4.45 GB without, 2.69 GB with, at the same step time (docs/performance.md)."""
    if not enabled:
        return
    if not (isinstance(model, PreTrainedModel) and model.supports_gradient_checkpointing):
        raise ValueError(f"train.gradient_checkpointing: {type(model).__name__} does not support it")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
