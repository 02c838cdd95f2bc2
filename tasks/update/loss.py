"""One micro-batch's share of its minibatch's loss (:func:`micro_batch_loss`), the metrics summed over micro-batches
and ranks (:class:`MetricSums`), and how far the sampler's log-probs are from the trainer's (:func:`mismatch_metrics`).

The loss itself is ``rlcore.grpo_loss.clipped_policy_loss``; this module weights it so that, summed over a
minibatch's micro-batches and averaged over ranks, loss and gradient are the whole minibatch's
(tasks/update/policy_update.py runs the passes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.grpo_loss import clipped_policy_loss
from tasks.update.distributed import LOSS_LIKE, DataShard
from tasks.update.minibatch import BatchRows, Minibatch, loss_units


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
