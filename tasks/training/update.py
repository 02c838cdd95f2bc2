"""The policy-gradient update on a batch of rollout groups (fresh and replayed).

One call is one training step: the clipped surrogate of ``rlcore.grpo_loss`` with Rollout Replay's
off-policy correction, AdamW, gradient clipping. With one minibatch and one epoch the step-start
log-probs ``old_logp`` are the detached log-probs of the same forward pass (pi_theta = pi_old at that
moment), so no extra no-grad pass is spent; with several minibatches a no-grad pass computes them first.
Fresh groups get ``behaviour_logp = old_logp`` (the policy that sampled them is pi_old), which is what
Rollout Replay stores.

The training loop (tasks/training/loop.py) meets every backend through one interface, :class:`Updater`
(``step``, ``set_lr``, ``state_dict``, ``load_state_dict``), built by ``tasks.training.backend.build_updater``:
:class:`LocalUpdater` (one process: AdamW + :func:`policy_update`) or
``tasks.training.sharded_update.Driver`` (DDP, FSDP2, DeepSpeed ZeRO-2/3 under torchrun), which builds on this
module; this module imports neither. The learning rate of every step comes from :func:`scheduled_lr` and reaches
the optimizer(s) through ``set_lr``.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch
from transformers import PreTrainedModel

from rlcore.advantages import solved_mask
from rlcore.angle import online_angle_signal
from rlcore.grpo_loss import clipped_policy_loss
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.config import Config, KlRows
from tasks.model.forward import token_logprobs
from tasks.model.lora import trainable_parameters
from tasks.training.distributed import DataShard, backward_step

log = logging.getLogger(__name__)


def flatten(groups: Sequence[RolloutGroup]):
    """Rows of all groups: prompts (N tensors), completions [N, L], mask [N, L], advantages [N]."""
    width = max(g.completion_ids.shape[1] for g in groups)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    prompts = [g.prompt_ids for g in groups for _ in range(g.size)]
    comp = torch.cat([pad(g.completion_ids, 0) for g in groups])
    mask = torch.cat([pad(g.completion_mask, False) for g in groups])
    adv = torch.cat([g.advantages for g in groups]).float()
    return prompts, comp, mask, adv, width


KL_ROWS: tuple[str, ...] = get_args(KlRows)


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence[RolloutGroup], *,
                  clip_eps: float, aggregation: str, grad_clip: float, temperature: float, pad_id: int,
                  minibatches: int, kl_coef: float, kl_rows: KlRows = "all", kl_sample: float = 1.0, seed: int = 0,
                  bucket_tokens: int = 0, skip_zero_advantage: bool = False,
                  ref_model: torch.nn.Module | None = None, device: torch.device | str = "cpu",
                  angle_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  shard: DataShard | None = None, behaviour_cap: float | None = None) -> dict[str, float]:
    """One optimizer step (or ``minibatches`` of them) on ``groups``; fills fresh groups' behaviour log-probs.

    The behaviour policy mu of a row is its group's ``behaviour_logp`` when it has one (replayed groups, and fresh
    groups corrected by their sampler's log-probs, ``train.behaviour``), else pi_old. The loss is then the decoupled
    objective (AReaL, arXiv 2505.24298 section 5; Rollout Replay's form, rlcore/grpo_loss.py): PPO-clip on
    pi_theta / pi_old, weighted by pi_old / mu per token.

    Args:
        bucket_tokens: padded-token budget of one forward pass (``train.bucket_tokens``): rows are grouped by
            length (``tasks.model.forward.length_buckets``); the loss and its one backward pass are unchanged.
        skip_zero_advantage: leave the rows of groups whose advantages are all 0 out of the forward and backward
            passes (``train.skip_zero_advantage``); each minibatch's loss is scaled by the share of its aggregation
            units (tokens, or sequences) that were computed, so loss and gradient are those of the whole minibatch.
            With ``kl_coef > 0`` the rows ``kl_rows`` names are computed too (``train.kl_rows``: ``all`` computes
            every row; ``informative_and_solved`` keeps the rows of groups that all earn reward 1 for their KL
            term); ignored under scale-out with ``angle_fn``. A ``kl_rows`` other than ``all`` acts through the
            skip, so without it (and with a KL term) it is an error;
            in one process ``angle_fn`` gets the skipped rows' hidden states from a forward pass without autograd.
            Token-level metrics then average over the computed rows; skipped fresh groups get no behaviour
            log-probs (Rollout Replay stores only informative groups).
        kl_sample, seed: ``train.kl_sample`` < 1 computes each group that only its KL term puts in the update
            (advantages all 0) with that chance (:func:`kl_draw` of ``seed``) and weights its KL term by
            ``1 / kl_sample``: the KL term and its gradient are unbiased estimates of those over every such
            group. Needs the skip, like ``kl_rows``.
        angle_fn: optional ``(mlp_inputs [N, T, H], attention_mask [N, T]) -> [N]`` per-sequence angle signal
            computed from the same forward pass (GAIN-RL's online signal); its mean is ``gain/angle_online``.
        behaviour_cap: truncated importance sampling (``train.behaviour_cap``): on fresh rows whose mu is their
            sampler's, the weight pi_old / mu is capped at this value (done by raising mu to pi_old / cap, which
            turns the decoupled loss into exactly the capped one). Replayed groups keep Rollout Replay's uncapped
            loss. None: no cap.
        shard: scale-out (``tasks/training/distributed.py``): every rank passes the same ``groups`` and computes its
            slice of each minibatch; the loss is renormalised so the averaged gradient is the single-process
            one, and metrics and behaviour log-probs are combined over ranks. ``model``/``optimizer`` are then
            the wrapped engine and its optimizer. None: one process.

    Returns:
        Metrics: ``train/loss``, ``train/grad_norm`` and the loss's own metrics (averaged over the applied
        minibatches), and ``train/skipped_updates``: minibatches whose loss or gradient was not finite, so
        their update was not applied (``backward_step``); ``train/update_rows`` and ``train/update_tokens``: the
        rows computed (all of them without the skip) and their real prompt + completion tokens. Where the computed
        rows carry sampler log-probs, the sampler/trainer mismatch over their tokens (:func:`mismatch_metrics`).
    """
    if kl_rows not in KL_ROWS:
        raise ValueError(f"kl_rows must be one of {', '.join(KL_ROWS)}, got {kl_rows!r}")
    skip = skip_zero_advantage and (angle_fn is None or shard is None)
    if kl_coef > 0 and kl_rows != "all" and not skip:
        raise ValueError(f"kl_rows={kl_rows!r} leaves rollouts out of the KL term by skipping them in the update: it "
                         "needs train.skip_zero_advantage (and, under scale-out, GAIN-RL off)")
    if not 0 < kl_sample <= 1:
        raise ValueError(f"kl_sample must be in (0, 1], got {kl_sample}")
    sampled = kl_sample < 1 and kl_coef > 0
    if sampled and not skip:
        raise ValueError(f"kl_sample={kl_sample} leaves silent groups out of the KL term by skipping them in the "
                         "update: it needs train.skip_zero_advantage (and, under scale-out, GAIN-RL off)")

    def kl_weight_of(i: int, g: RolloutGroup) -> float:  # the group's KL weight; 0: it adds nothing, so it is skipped
        if not bool((g.advantages == 0).all()):
            return 1.0  # a policy gradient
        if kl_coef == 0 or kl_rows == "informative":
            return 0.0
        if kl_rows == "informative_and_solved" and not bool(solved_mask(g.rewards.unsqueeze(0))):
            return 0.0
        if not sampled:
            return 1.0
        return 1.0 / kl_sample if kl_draw(seed, g, i) < kl_sample else 0.0

    prompts, comp, mask, adv, width = flatten(groups)
    n_rows = comp.shape[0]
    row_kl = torch.cat([torch.full((g.size,), kl_weight_of(i, g)) for i, g in enumerate(groups)])  # [N]
    silent = row_kl == 0.0  # [N]
    kl_weight = row_kl if sampled else None
    if behaviour_cap is not None and not behaviour_cap >= 1:
        raise ValueError(f"behaviour_cap must be >= 1 (or None), got {behaviour_cap}")

    def rows_of(attr: str, has: Callable[[RolloutGroup], bool]) -> torch.Tensor:  # [N, width]; 0 where not has
        return torch.cat([torch.nn.functional.pad(getattr(g, attr), (0, width - getattr(g, attr).shape[1]))
                          if has(g) else torch.zeros(g.size, width) for g in groups])

    own_rows = torch.cat([torch.full((g.size,), g.has_behaviour) for g in groups])  # [N] mu stored with the group
    capped_rows = torch.cat([torch.full((g.size,), g.has_behaviour and g.replayed_from is None) for g in groups])
    behaviour = rows_of("behaviour_logp", lambda g: g.has_behaviour)  # [N, width]
    def measured_group(g: RolloutGroup) -> bool:  # a fresh group with its sampler's log-probs: the mismatch metrics
        return g.replayed_from is None and g.sampler_logp.numel() > 0

    sampler_rows = torch.cat([torch.full((g.size,), measured_group(g)) for g in groups])  # [N]
    sampler = rows_of("sampler_logp", measured_group)  # [N, width]
    log_cap = math.log(behaviour_cap) if behaviour_cap is not None else None

    def logp_of(rows: torch.Tensor, model_: torch.nn.Module, mlp_inputs: list | None = None) -> torch.Tensor:
        return token_logprobs(model_, [prompts[i] for i in rows], comp[rows], mask[rows], pad_id, temperature, device,
                              max_tokens=bucket_tokens, mlp_inputs=mlp_inputs)

    whole = list(torch.arange(n_rows).chunk(minibatches))
    chunks, scales = whole, [1.0] * len(whole)  # scales: computed share of each minibatch's aggregation units
    if skip:
        chunks, scales = map(list, zip(*(rows_with_gradient(c, silent, mask, aggregation,
                                                            min_rows=shard.world if shard is not None else 1)
                                         for c in whole), strict=True))
    computed = torch.cat(chunks)
    # per minibatch, the skipped rows: GAIN-RL's angle still needs their hidden states
    angle_only = [w[~torch.isin(w, c)] for w, c in zip(whole, chunks, strict=True)]
    update_tokens = sum(prompts[i].numel() for i in computed.tolist()) + int(mask[computed].sum())
    if shard is not None:  # scale-out: this rank's slice of every minibatch
        chunks = [shard.rows(c) for c in chunks]
    all_rows = torch.cat(chunks)  # the rows this process computes (all of them in one process)
    old_full = None
    if minibatches > 1:
        old_full = torch.zeros(n_rows, width)
        with torch.no_grad():
            old_full[all_rows] = logp_of(all_rows, model).cpu()
    ref_full = None
    if kl_coef > 0 and ref_model is not None:
        ref_full = torch.zeros(n_rows, width)
        with torch.no_grad():
            ref_full[all_rows] = logp_of(all_rows, ref_model).cpu()

    model.train()
    stats: dict[str, float] = {}
    skipped = 0
    angle_sum, angle_n = 0.0, 0
    old_out = torch.zeros(n_rows, width)
    for mb, scale, skipped_rows in zip(chunks, scales, angle_only, strict=True):
        hidden: list | None = [] if angle_fn is not None else None  # the hidden-state hook only for GAIN-RL
        if hidden is not None and skipped_rows.numel():  # a pass without autograd: a third of what it saves
            with torch.no_grad():
                logp_of(skipped_rows, model, hidden)
        logp = logp_of(mb, model, hidden)  # [n, L] with grad
        for mlp_in, am in hidden or ():
            angle_sum, angle_n = angle_sum + float(angle_fn(mlp_in, am).sum()), angle_n + len(am)
        old = logp.detach() if old_full is None else old_full[mb].to(logp.device)
        old_out[mb] = old.cpu()
        own = own_rows[mb].to(logp.device).unsqueeze(1)  # [n, 1]
        beh = torch.where(own, behaviour[mb].to(logp.device), old)
        if log_cap is not None:  # pi_old / mu <= cap on the sampler-corrected fresh rows
            beh = torch.where(capped_rows[mb].to(logp.device).unsqueeze(1), torch.maximum(beh, old - log_cap), beh)
        w_agg, w_tok = shard.loss_weights(mask[mb], aggregation) if shard is not None else (1.0, 1.0)
        ref = None if ref_full is None else ref_full[mb].to(logp.device)
        poisoned = not all(bool(torch.isfinite(t[mask[mb].to(t.device)]).all()) for t in (old, beh, ref)
                           if t is not None)  # a non-finite pi_old / reference pass: skip the update (below)
        if poisoned:
            old, beh, ref = (None if t is None else torch.nan_to_num(t) for t in (old, beh, ref))
        if w_tok == 0.0:  # scale-out: no valid token in this rank's slice; still run the collective backward
            loss, m = logp.sum() * 0.0, {}
        else:
            loss, m = clipped_policy_loss(
                logp, old, adv[mb].to(logp.device), mask[mb].to(logp.device), clip_eps=clip_eps,
                aggregation=aggregation, behaviour_logp=beh if bool(own.any()) else None, ref_logp=ref,
                kl_coef=kl_coef, kl_weight=None if kl_weight is None else kl_weight[mb].to(logp.device))
            if scale != 1.0:  # rows left out by the skip count in the normaliser (their terms are 0)
                loss = loss * scale
                for key in ("train/pg_loss", "train/kl"):
                    if key in m:
                        m[key] = m[key] * scale
            m["train/loss"] = float(loss.detach())
        if poisoned:  # same metric keys on every rank; the NaN loss makes every rank skip (backward_step)
            loss = loss * float("nan")
        if shard is not None:  # rank average of world * w_agg * local loss = the global loss
            loss = loss * (shard.world * w_agg)
            m = shard.combine(m, w_agg, w_tok)
        gnorm = backward_step(model, optimizer, loss, grad_clip)
        if not math.isfinite(gnorm):  # not applied (backward_step): log why, keep NaN out of the averages
            skipped += 1
            log.warning("update skipped, not applied: loss %s, gradient norm %s (minibatch of %d rows)",
                        m.get("train/loss", float(loss.detach())), gnorm, len(mb))
            continue
        m["train/grad_norm"] = gnorm
        for k, v in m.items():
            stats[k] = stats.get(k, 0.0) + float(v)
    stats = {k: v / (minibatches - skipped) for k, v in stats.items()}
    stats["train/skipped_updates"] = float(skipped)
    stats["train/update_rows"] = float(computed.numel())
    stats["train/update_tokens"] = float(update_tokens)
    if shard is not None:  # every row was computed by exactly one rank
        old_out = shard.all_sum(old_out)
        angle_sum, angle_n = (float(v) for v in shard.all_sum(torch.tensor([angle_sum, float(angle_n)],
                                                                             dtype=torch.float64)))
    measured = computed[sampler_rows[computed]]  # computed fresh rows with the sampler's log-probs
    if measured.numel():
        stats |= mismatch_metrics(old_out[measured], sampler[measured], mask[measured], log_cap)
    row = 0
    for g in groups:
        if not g.has_behaviour:
            g.behaviour_logp = old_out[row:row + g.size, :g.completion_ids.shape[1]].clone()
        row += g.size
    if angle_n:
        stats["gain/angle_online"] = angle_sum / angle_n
    return stats


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


def kl_draw(seed: int, group: RolloutGroup, position: int) -> float:
    """``train.kl_sample``'s uniform draw in [0, 1) for the group at ``position`` in a step's batch: a function of
    the run's seed, the group's step, its position and its prompt, so every rank and a resumed run draw alike."""
    return derive_seed(seed, group.step, position, group.prompt_id, "kl-sample") / 2.0**63


def rows_with_gradient(rows: torch.Tensor, silent: torch.Tensor, mask: torch.Tensor, aggregation: str, *,
                       min_rows: int = 1) -> tuple[torch.Tensor, float]:
    """The rows of a minibatch the update must compute, and the share of the minibatch's loss units they hold.

    A rollout of a group whose advantages are all 0 adds 0 to the clipped surrogate (without a KL term), so
    leaving it out changes neither loss nor gradient as long as the loss is still divided by the whole
    minibatch's units: the caller multiplies the computed rows' aggregated loss by the returned share.

    Args:
        rows: [n] row indices of one minibatch.
        silent: [N] bool, True for rows of groups whose advantages are all 0.
        mask: [N, L] bool valid-token mask.
        aggregation: ``"token"`` (units are valid tokens) or ``"sequence"`` (sequences with a valid token).
        min_rows: compute at least this many rows (scale-out needs one per rank); when fewer carry a gradient,
            the minibatch is computed whole.

    Returns:
        ``(kept [k] row indices in their original order, share in (0, 1])``. A minibatch without any gradient
        keeps its first ``min_rows`` rows: the optimizer still takes its (zero-gradient) step, as without the skip.
    """
    def units(r: torch.Tensor) -> float:
        valid = mask[r]
        return float(valid.sum() if aggregation == "token" else (valid.sum(1) > 0).sum())

    kept = rows[~silent[rows]]
    if kept.numel() == 0:
        kept = rows[:min_rows]
    if kept.numel() < min_rows or units(rows) == 0 or units(kept) == 0:
        return rows, 1.0
    return kept, units(kept) / units(rows)


@dataclass(frozen=True)
class LossSettings:
    """The fixed settings of every :func:`policy_update` call of a run (``train.*``, ``rollout.temperature``).

    ``angle``: also compute GAIN-RL's online angle signal (``rlcore.angle.online_angle_signal``, metric
    ``gain/angle_online``) from the update's forward pass.
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
    bucket_tokens: int = 0
    skip_zero_advantage: bool = False
    angle: bool = False
    behaviour_cap: float | None = None

    @classmethod
    def from_config(cls, cfg: Config, pad_id: int) -> LossSettings:
        tc = cfg.train
        return cls(clip_eps=tc.clip_eps, aggregation=tc.aggregation, grad_clip=tc.grad_clip,
                   temperature=cfg.rollout.temperature, pad_id=pad_id, minibatches=tc.minibatches,
                   kl_coef=tc.kl_coef, kl_rows=tc.kl_rows, kl_sample=tc.kl_sample, seed=cfg.seed,
                   bucket_tokens=tc.bucket_tokens,
                   skip_zero_advantage=tc.skip_zero_advantage, angle=cfg.gain.enabled,
                   behaviour_cap=tc.behaviour_cap)

    def update_kwargs(self) -> dict:
        """Keyword arguments of :func:`policy_update` (``angle`` becomes ``angle_fn``)."""
        kw = asdict(self)
        kw["angle_fn"] = online_angle_signal if kw.pop("angle") else None
        return kw


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
    (through ``RolloutEngine.sync_weights``, tasks/model/rollout.py).
    """

    @abc.abstractmethod
    def step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One update on ``groups`` (fresh groups get their behaviour log-probs); returns :func:`policy_update`'s
        metrics."""

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
        model: the policy model (trained in place; under LoRA only its adapters, the parameters that need grad).
        settings: the loss settings of every step.
        lr, betas, eps, weight_decay: AdamW's.
        device: where the update's forward passes run.
        ref_model: the frozen KL reference (needed when ``settings.kl_coef > 0``).
    """

    def __init__(self, model: torch.nn.Module, settings: LossSettings, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, device: torch.device | str = "cpu",
                 ref_model: torch.nn.Module | None = None):
        if settings.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.model, self.settings, self.device, self.ref_model = model, settings, device, ref_model
        self.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)

    def step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        return policy_update(self.model, self.optimizer, groups, ref_model=self.ref_model, device=self.device,
                             **self.settings.update_kwargs())

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
