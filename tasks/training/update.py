"""The policy-gradient update on a batch of rollout groups (fresh and replayed).

One call is one training step: the clipped surrogate of ``rlcore.grpo_loss`` with Rollout Replay's
off-policy correction, AdamW, gradient clipping. With one minibatch and one epoch the step-start
log-probs ``old_logp`` are the detached log-probs of the same forward pass (pi_theta = pi_old at that
moment), so no extra no-grad pass is spent; with several minibatches a no-grad pass computes them first.
Fresh groups get ``behaviour_logp = old_logp`` (the policy that sampled them is pi_old), which is what
Rollout Replay stores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlcore.grpo_loss import clipped_policy_loss
from rlcore.types import RolloutGroup
from tasks.model.forward import capture_mlp_input, token_logprobs
from tasks.training.distributed import DataShard, backward_step


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


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: Sequence[RolloutGroup], *,
                  clip_eps: float, aggregation: str, grad_clip: float, temperature: float, pad_id: int,
                  minibatches: int = 1, kl_coef: float = 0.0, ref_model: torch.nn.Module | None = None,
                  device: torch.device | str = "cpu",
                  angle_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                  shard: DataShard | None = None) -> dict[str, float]:
    """One optimizer step (or ``minibatches`` of them) on ``groups``; fills fresh groups' behaviour log-probs.

    Args:
        angle_fn: optional ``(mlp_inputs [N, T, H], attention_mask [N, T]) -> [N]`` per-sequence angle signal
            computed from the same forward pass (GAIN-RL's online signal); its mean is ``gain/angle_online``.
        shard: scale-out (``tasks/training/distributed.py``): every rank passes the same ``groups`` and computes its
            slice of each minibatch; the loss is renormalised so the averaged gradient is the single-process
            one, and metrics and behaviour log-probs are combined over ranks. ``model``/``optimizer`` are then
            the wrapped engine and its optimizer. None: one process.

    Returns:
        Metrics: ``train/loss``, ``train/grad_norm`` and the loss's own metrics (averaged over minibatches).
    """
    prompts, comp, mask, adv, width = flatten(groups)
    n_rows = comp.shape[0]
    fresh_rows = torch.cat([torch.full((g.size,), g.replayed_from is None) for g in groups])
    behaviour = torch.cat([torch.nn.functional.pad(g.behaviour_logp, (0, width - g.behaviour_logp.shape[1]))
                           if g.replayed_from is not None else torch.zeros(g.size, width) for g in groups])

    def logp_of(rows: torch.Tensor, model_: torch.nn.Module) -> torch.Tensor:
        return token_logprobs(model_, [prompts[i] for i in rows], comp[rows], mask[rows], pad_id, temperature, device)

    chunks = list(torch.arange(n_rows).chunk(minibatches))
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
    angle_sum, angle_n = 0.0, 0
    old_out = torch.zeros(n_rows, width)
    for mb in chunks:
        with capture_mlp_input(model) as box:
            logp = logp_of(mb, model)  # [n, L] with grad
        if angle_fn is not None:
            p_width = box[0].shape[1] - width
            am = torch.cat([torch.ones(len(mb), p_width, dtype=torch.bool), mask[mb]], dim=1)
            am[:, :p_width] = torch.stack([torch.arange(p_width) >= p_width - prompts[i].numel() for i in mb])
            sig = angle_fn(box[0].cpu(), am)
            angle_sum, angle_n = angle_sum + float(sig.sum()), angle_n + len(mb)
        old = logp.detach() if old_full is None else old_full[mb].to(logp.device)
        old_out[mb] = old.cpu()
        fresh = fresh_rows[mb].to(logp.device).unsqueeze(1)
        beh = torch.where(fresh, old, behaviour[mb].to(logp.device))
        w_agg, w_tok = shard.loss_weights(mask[mb], aggregation) if shard is not None else (1.0, 1.0)
        if w_tok == 0.0:  # scale-out: no valid token in this rank's slice; still run the collective backward
            loss, m = logp.sum() * 0.0, {}
        else:
            loss, m = clipped_policy_loss(
                logp, old, adv[mb].to(logp.device), mask[mb].to(logp.device), clip_eps=clip_eps,
                aggregation=aggregation, behaviour_logp=None if bool(fresh.all()) else beh,
                ref_logp=None if ref_full is None else ref_full[mb].to(logp.device), kl_coef=kl_coef)
            m["train/loss"] = float(loss.detach())
        if shard is not None:  # rank average of world * w_agg * local loss = the global loss
            loss = loss * (shard.world * w_agg)
            m = shard.combine(m, w_agg, w_tok)
        gnorm = backward_step(model, optimizer, loss, grad_clip)
        m["train/grad_norm"] = gnorm
        for k, v in m.items():
            stats[k] = stats.get(k, 0.0) + float(v) / minibatches
    if shard is not None:  # every row was computed by exactly one rank
        old_out = shard.all_sum(old_out)
        angle_sum, angle_n = (float(v) for v in shard.all_sum(torch.tensor([angle_sum, float(angle_n)],
                                                                             dtype=torch.float64)))
    row = 0
    for g in groups:
        if g.replayed_from is None:
            g.behaviour_logp = old_out[row:row + g.size, :g.completion_ids.shape[1]].clone()
        row += g.size
    if angle_n:
        stats["gain/angle_online"] = angle_sum / angle_n
    return stats
