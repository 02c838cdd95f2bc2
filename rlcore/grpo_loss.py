"""Clipped GRPO surrogate with Rollout Replay's off-policy correction.

Papers:
    * PPO-clip: Schulman et al. 2017, arXiv 1707.06347.
    * GRPO: Shao et al. 2024, arXiv 2402.03300 (per-sequence mean of per-token terms, k3 KL to a reference).
    * Rollout Replay (RR): Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning
      Through Difficulty-targeted Online Data Selection and Rollout Replay", arXiv 2506.05316, Sec. on RR.
    * Generalized PPO with sample reuse: Queeney et al. 2021, arXiv 2111.00072 (the clip window form).

The loss (docs/algorithms.md sections 0.2 and 2.2; the official code's form,
``core_algos.compute_policy_loss_temp`` in github.com/ASTRAL-Group/data-efficient-llm-rl)::

    r       = exp(logp     - mu)        # pi_theta / mu,  mu = behaviour policy that generated the rollout
    r_old   = exp(old_logp - mu)        # pi_old   / mu,  pi_old = policy at the start of this step
    loss_t  = max(-A r, -A clip(r, r_old (1 - eps), r_old (1 + eps)))

For fresh rollouts mu = pi_old, so r_old = 1 exactly and this is ordinary PPO-clip, bit for bit.

Choices and deviations:
    * Clip window: the official code's window centred on r_old (generalized PPO). The paper's formula shows
      a plain [1 - eps, 1 + eps] window around pi_theta / mu; we do not offer it (it lets the trust region
      drift with the age of the rollout).
    * Aggregation (``train.aggregation``): ``"token"`` (rlsift's default; the official RR code and Dr. GRPO:
      masked mean over every token of the batch) or ``"sequence"`` (the GRPO/DOTS paper form: mean over
      sequences of each sequence's masked mean). Sequences with no valid token are left out of the sequence
      mean.
    * KL to a reference policy: GRPO's k3 estimator exp(ref - logp) - (ref - logp) - 1 per token, aggregated
      like the policy loss and added with ``kl_coef`` (``train.kl_coef``, 0 by default: off, as in DOTS,
      PODS and Dr. GRPO). Optional per-sequence weights ``kl_weight`` scale each sequence's KL tokens (ours:
      the update computes a random share of the silent groups for their KL term and weights them by the
      inverse of that share, ``train.kl_sample``); the normaliser is unchanged.
    * No dual-clip and no truncation of r_old itself (the paper does not use one; docs/algorithms.md section 2.3).
    * Metrics ``train/clip_frac``, ``train/ratio_mean``, ``train/behaviour_ratio_mean`` and
      ``train/approx_kl`` are token-level masked means whatever the aggregation; ``train/pg_loss`` and
      ``train/kl`` are aggregated like the loss. ``train/approx_kl`` is k3 of pi_theta against pi_old
      ((rho - 1) - log rho with rho = pi_theta / pi_old), as in CleanRL.
    * Padded positions must hold finite log-probs: they are excluded with ``torch.where`` so they do not
      change the loss, but a non-finite value there could still poison the gradient.
    * Non-finite input: advantages and the detached log-probs (old, behaviour, reference) come from data
      and earlier passes, so a NaN or inf among them (on a valid token) is a ``ValueError`` naming the
      tensor. A non-finite ``logp`` (the live policy's own output) is not checked here: it gives a
      non-finite loss, and the training loop skips that update (``tasks/update/distributed.py``,
      ``backward_step``). A mask with no valid token is an error, not 0/0.
"""

from __future__ import annotations

from enum import StrEnum

import torch

__all__ = ["Aggregation", "clipped_policy_loss", "masked_aggregate"]


class Aggregation(StrEnum):
    """How per-token losses are reduced to one number."""

    TOKEN = "token"
    SEQUENCE = "sequence"


def _aggregation(value: str | Aggregation) -> Aggregation:
    try:
        return Aggregation(value)
    except ValueError:
        valid = ", ".join(a.value for a in Aggregation)
        raise ValueError(f"unknown aggregation {value!r}; valid names: {valid}") from None


def masked_aggregate(
    values: torch.Tensor, mask: torch.Tensor, aggregation: str | Aggregation
) -> torch.Tensor:
    """Reduce per-token values to a scalar over the valid tokens.

    Args:
        values: [N, L] per-token values.
        mask: [N, L] bool, True on valid tokens.
        aggregation: ``"token"``: sum over valid tokens / number of valid tokens; ``"sequence"``: mean over
            sequences with at least one valid token of (sum over its valid tokens / its token count).

    Returns:
        A scalar tensor.

    Raises:
        ValueError: ``mask`` has no valid token (the mean over nothing is 0/0), or an unknown aggregation.
    """
    agg = _aggregation(aggregation)
    if not bool(mask.any()):
        raise ValueError("mask has no valid (True) token: the mean over no token is 0/0")
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if agg is Aggregation.TOKEN:
        return masked.sum() / mask.sum()
    counts = mask.sum(dim=1)
    has_tokens = counts > 0
    per_seq = masked.sum(dim=1)[has_tokens] / counts[has_tokens]
    return per_seq.mean()


def _bad_rows(t: torch.Tensor, first: int = 5) -> list[int]:
    """Indices of the first rows of [N, L] ``t`` that hold a non-finite value (for error messages)."""
    return (~torch.isfinite(t)).any(dim=1).nonzero().flatten()[:first].tolist()


def _check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    behaviour_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    clip_eps: float,
    kl_coef: float,
    kl_weight: torch.Tensor | None = None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [N, L], got {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("mask", mask), ("behaviour_logp", behaviour_logp), ("ref_logp", ref_logp)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape != (shape[0],):
        raise ValueError(f"advantages must have shape [N] = ({shape[0]},), got {tuple(advantages.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if not bool(mask.any()):
        raise ValueError("mask has no valid (True) token: the loss would be 0/0")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(f"advantages must be finite; rows {_bad_rows(advantages.unsqueeze(1))} are not")
    for name, t in (("old_logp", old_logp), ("behaviour_logp", behaviour_logp), ("ref_logp", ref_logp)):
        if t is not None and not bool(torch.isfinite(t[mask]).all()):
            raise ValueError(f"{name} must be finite on valid tokens; rows {_bad_rows(torch.where(mask, t, 0.0))} "
                             "are not")
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp (the reference policy's log-probs)")
    if kl_weight is not None:
        if kl_weight.shape != (shape[0],):
            raise ValueError(f"kl_weight must have shape [N] = ({shape[0]},), got {tuple(kl_weight.shape)}")
        bad = ~(torch.isfinite(kl_weight) & (kl_weight >= 0))
        if bool(bad.any()):
            raise ValueError(f"kl_weight must be finite and >= 0; rows {bad.nonzero().flatten()[:5].tolist()} are not")


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    aggregation: str | Aggregation,
    kl_coef: float,
    behaviour_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip / GRPO surrogate with the Rollout-Replay clip window centred on pi_old / mu.

    Args:
        logp: [N, L] per-token log-probs of the completions under the current policy pi_theta (with grad).
        old_logp: [N, L] log-probs under pi_old, the policy at the start of this optimizer step (detached here).
        advantages: [N] one advantage per sequence, broadcast over its tokens.
        mask: [N, L] bool, True on real completion tokens.
        clip_eps: epsilon of the clip window, in (0, 1) (``train.clip_eps``).
        aggregation: ``"token"`` (masked mean over all tokens of the batch) or ``"sequence"`` (mean over
            sequences of each sequence's masked mean) (``train.aggregation``).
        behaviour_logp: [N, L] log-probs under mu, the policy that generated the rollouts (detached here).
            None means mu = pi_old (fresh rollouts), which is ordinary PPO-clip.
        ref_logp: [N, L] log-probs under a reference policy, for the k3 KL term and the ``train/kl`` metric.
        kl_coef: weight of the KL term in the loss; > 0 needs ``ref_logp`` (``train.kl_coef``).
        kl_weight: [N] finite, non-negative weight of each sequence's KL tokens (``train.kl_sample``); None: 1.

    Returns:
        (loss, metrics): a scalar loss tensor to minimise, and a dict of float metrics ``train/clip_frac``,
        ``train/ratio_mean``, ``train/behaviour_ratio_mean``, ``train/approx_kl``, ``train/pg_loss`` and,
        when ``ref_logp`` is given, ``train/kl``.

    Raises:
        ValueError: on mismatched shapes, a non-bool or empty mask, non-finite advantages or detached
            log-probs, clip_eps outside (0, 1), a negative kl_coef, kl_coef > 0 without ref_logp, a
            kl_weight that is not [N], finite and >= 0, or an unknown aggregation.
    """
    _check_inputs(logp, old_logp, advantages, mask, behaviour_logp, ref_logp, clip_eps, kl_coef, kl_weight)
    agg = _aggregation(aggregation)
    old_logp = old_logp.detach()
    mu = old_logp if behaviour_logp is None else behaviour_logp.detach()

    ratio = torch.exp(logp - mu)  # [N, L] pi_theta / mu
    ratio_old = torch.exp(old_logp - mu)  # [N, L] pi_old / mu; exactly 1 when mu = pi_old
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)  # [N, 1]
    clipped = torch.clamp(ratio, min=ratio_old * (1.0 - clip_eps), max=ratio_old * (1.0 + clip_eps))
    loss_unclipped = -adv * ratio  # [N, L]
    loss_clipped = -adv * clipped  # [N, L]
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)  # [N, L]
    pg_loss = masked_aggregate(loss_tok, mask, agg)
    loss = pg_loss

    kl_value = None
    if ref_logp is not None:
        delta = ref_logp.detach() - logp  # [N, L]
        kl_tok = torch.exp(delta) - delta - 1.0  # k3 estimator of KL(pi_theta || pi_ref)
        if kl_weight is not None:
            kl_tok = kl_tok * kl_weight.to(kl_tok.dtype).unsqueeze(1)  # [N, L]
        kl_value = masked_aggregate(kl_tok, mask, agg)
        if kl_coef > 0:
            loss = pg_loss + kl_coef * kl_value

    with torch.no_grad():
        n_tok = mask.sum()
        log_rho = logp.detach() - old_logp  # log pi_theta / pi_old
        approx_kl = torch.where(mask, torch.expm1(log_rho) - log_rho, 0.0).sum() / n_tok
        metrics = {
            "train/clip_frac": float((mask & (loss_clipped > loss_unclipped)).sum() / n_tok),
            "train/ratio_mean": float(torch.where(mask, ratio.detach(), 0.0).sum() / n_tok),
            "train/behaviour_ratio_mean": float(torch.where(mask, ratio_old, 0.0).sum() / n_tok),
            "train/approx_kl": float(approx_kl),
            "train/pg_loss": float(pg_loss.detach()),
        }
        if kl_value is not None:
            metrics["train/kl"] = float(kl_value.detach())
    return loss, metrics
