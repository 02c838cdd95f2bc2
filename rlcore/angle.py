"""GAIN-RL angle concentration of hidden states, the signal that orders prompts.

Paper: Wang et al., "Angles Don't Lie: Unlocking Training-Efficient RL Through the Model's Own Signals"
(GAIN-RL), arXiv 2506.02281 (NeurIPS 2025); official code github.com/wangqinsi1/GAINRL
(``data_processor.py``; online signal in ``trl_gainrl/.../grpo_trainer.py`` and
``verl_gainrl/.../dp_actor.py``). Summary: docs/algorithms.md section 5.2.

For one prompt with m real tokens whose first n are a fixed prefix (system prompt, few-shot exemplar) and
whose question tokens are Q (``n <= r < m - suffix``), with x_r the last layer's MLP input at token r::

    C_intra = mean_{i, j in Q} cos(x_i, x_j)
    C_inter = mean_{i in Q, j < n} cos(x_i, x_j)          (0 when n = 0)
    score   = C_intra + inter_weight * C_inter            (prompts ordered by score, descending)

Choices and deviations (the official offline code, ``score = mean(C[110:-6][110:-6]) + 8 mean(C[110:-6][:110])``
on a tril-masked cosine matrix, has the quirks that docs/algorithms.md section 5.2 lists):

* Proper 2-D blocks (question x question, question x prefix), not chained row slices.
* Rows are L2-normalised over the **hidden** axis (the verl version normalises over tokens).
* No hard-coded offsets: ``prefix_len`` and ``suffix_len`` (chat-template tail tokens after the question)
  are given per prompt, measured from the tokenizer by the caller; padding may be on either side.
* Full blocks, no triangular mask, so the means do not count masked zeros. C_intra includes the diagonal
  (cos = 1) by default, as in the paper's formula (1/(m-n)^2) sum_{i>n} sum_{j>n}; with
  ``include_diagonal=False`` it is the mean over ordered pairs i != j (0 when there is one question token).
* ``inter_weight`` is 1 in rlsift (``gain.inter_weight``: the paper's and README's C_inter + C_intra); the
  official code uses 8.
* Vectorised without the [T, T] matrix: the sum of cosines over a block is a dot product of sums of unit
  vectors, sum_{i in A, j in B} <u_i, u_j> = <sum_A u, sum_B u>, so memory is O(B T H). Computed in
  float32 (float64 if the input is float64).
* Which layer to hook is the caller's choice; the paper means the last layer (the code hard-codes 23).

The online signal used by the GAIN-RL mu update (:func:`online_angle_signal`) is the mean of the strictly
lower-triangular cosines over the real tokens of a full prompt+completion sequence. The trl code averages
the non-zero entries of the tril-masked matrix (diagonal included, exact zeros dropped); we average every
off-diagonal pair of real tokens, padding excluded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class AngleScores(NamedTuple):
    """Per-prompt angle concentration: ``intra`` [B], ``inter`` [B], ``score`` [B] (all float)."""

    intra: torch.Tensor
    inter: torch.Tensor
    score: torch.Tensor


def _unit_rows(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, upcast and L2-normalise over the hidden axis; returns units [B, T, H] and mask [B, T]."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {tuple(hidden.shape)}")
    mask = torch.as_tensor(mask).bool()
    if mask.shape != hidden.shape[:2]:
        raise ValueError(f"mask must have shape {tuple(hidden.shape[:2])} ([B, T]), got {tuple(mask.shape)}")
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    h = hidden.detach().to(dtype)
    bad = (mask & ~torch.isfinite(h).all(dim=-1)).any(dim=1).nonzero().flatten()[:5].tolist()
    if bad:  # bf16 overflow upstream: a NaN score would surface only later, far from its cause
        raise ValueError(f"hidden states of rows {bad} are not finite on real tokens")
    zero = (mask & (h == 0).all(dim=-1)).any(dim=1).nonzero().flatten()[:5].tolist()
    if zero:  # a zero vector has no direction: its cosines, the diagonal's 1 included, are undefined
        raise ValueError(f"rows {zero} have an all-zero hidden state on a real token (no direction for a cosine)")
    h = torch.where(mask.unsqueeze(-1), h, torch.zeros((), dtype=dtype))  # padding's values never reach a sum
    units = F.normalize(h, dim=-1)  # [B, T, H]
    return units * mask.unsqueeze(-1).to(dtype), mask


def _per_prompt(value: torch.Tensor | int, bsz: int, name: str) -> torch.Tensor:
    """An int or a [B] tensor of token counts -> [B, 1] int64."""
    t = torch.as_tensor(value, dtype=torch.long)
    if t.ndim > 1 or (t.ndim == 1 and t.numel() != bsz):
        raise ValueError(f"{name} must be an int or have shape [{bsz}], got shape {tuple(t.shape)}")
    return t.expand(bsz).reshape(bsz, 1)


def _block_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_{i, j} <a_i, b_j> for rows already zeroed outside their block: [B, T, H] x 2 -> [B]."""
    return (a.sum(dim=1) * b.sum(dim=1)).sum(dim=-1)


def angle_concentration(
    hidden: torch.Tensor,
    mask: torch.Tensor,
    prefix_len: torch.Tensor | int = 0,
    suffix_len: torch.Tensor | int = 0,
    *,
    inter_weight: float,
    include_diagonal: bool = True,
) -> AngleScores:
    """C_intra, C_inter and their weighted sum per prompt.

    Args:
        hidden: [B, T, H] hidden states (the last layer's MLP input in GAIN-RL).
        mask: [B, T] bool, True on real tokens (left or right padding).
        prefix_len: [B] (or an int for all) number of leading real tokens that form the fixed prefix, >= 0.
        suffix_len: [B] (or an int) number of trailing real tokens excluded (chat-template tail), >= 0.
        inter_weight: weight of C_inter in the score (paper 1, official code 8) (``gain.inter_weight``).
        include_diagonal: count i = j pairs (cos = 1) in C_intra, as the paper's formula does.

    Returns:
        AngleScores with ``intra``, ``inter`` and ``score``, each [B].
    """
    units, mask = _unit_rows(hidden, mask)
    bsz = hidden.shape[0]
    n, s = _per_prompt(prefix_len, bsz, "prefix_len"), _per_prompt(suffix_len, bsz, "suffix_len")
    m = mask.sum(dim=1, keepdim=True)  # [B, 1] real tokens
    if (n < 0).any() or (s < 0).any():
        raise ValueError("prefix_len and suffix_len must be >= 0")
    short = (n + s >= m).flatten().nonzero().flatten().tolist()
    if short:
        raise ValueError(f"prompts {short} have no question token: prefix_len + suffix_len >= real tokens")
    pos = mask.long().cumsum(dim=1) - 1  # [B, T] rank of each real token among the real tokens
    is_prefix = mask & (pos < n)
    is_question = mask & (pos >= n) & (pos < m - s)
    q_units = units * is_question.unsqueeze(-1)
    p_units = units * is_prefix.unsqueeze(-1)
    nq = is_question.sum(dim=1).to(units.dtype)  # [B]
    npf = is_prefix.sum(dim=1).to(units.dtype)  # [B]
    intra_sum = _block_sum(q_units, q_units)  # [B]
    if include_diagonal:
        intra = intra_sum / nq**2
    else:
        diag = (q_units * q_units).sum(dim=(1, 2))  # sum of |u_i|^2: 1 per non-zero row
        pairs = nq * (nq - 1)
        intra = torch.where(pairs > 0, (intra_sum - diag) / pairs.clamp_min(1), torch.zeros_like(nq))
    inter = torch.where(npf > 0, _block_sum(q_units, p_units) / (nq * npf.clamp_min(1)), torch.zeros_like(nq))
    return AngleScores(intra=intra, inter=inter, score=intra + inter_weight * inter)


def angle_order(score: torch.Tensor) -> torch.Tensor:
    """GAIN-RL order: prompt indices by decreasing angle score (ties by lower index). [M] -> [M] int64."""
    score = torch.as_tensor(score)
    if score.ndim != 1 or not torch.isfinite(score).all():
        raise ValueError("score must be a 1-D tensor of finite values")
    return torch.sort(score, descending=True, stable=True).indices


def online_angle_signal(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean off-diagonal (i > j) cosine between the real tokens of each full sequence.

    Args:
        hidden: [N, T, H] hidden states of prompt+completion sequences.
        mask: [N, T] bool, True on real tokens.

    Returns:
        [N] mean cosine over the m(m-1)/2 pairs of real tokens (0 for a sequence with fewer than 2).
    """
    units, mask = _unit_rows(hidden, mask)
    m = mask.sum(dim=1).to(units.dtype)  # [N]
    total = _block_sum(units, units)  # all ordered pairs, diagonal included
    diag = (units * units).sum(dim=(1, 2))
    pairs = m * (m - 1)  # ordered off-diagonal pairs; the lower triangle has half of them and half the sum
    return torch.where(pairs > 0, (total - diag) / pairs.clamp_min(1), torch.zeros_like(m))
