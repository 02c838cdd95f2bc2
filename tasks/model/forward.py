"""Model forward passes the algorithms need: token log-probs, pooled embeddings, last-layer MLP inputs.

Sequences are laid out as ``[left-padded prompt | right-padded completion]`` with explicit position ids
(the cumulative sum of the attention mask), the same positions ``generate`` uses with left padding, so
log-probs computed here match the sampling distribution token for token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from tasks.model.loading import add_special
from tasks.model.lora import BaseModelView


def last_mlp(model: torch.nn.Module) -> torch.nn.Module:
    """The MLP block of the model's last transformer layer (found by name, never a hard-coded index)."""
    best, best_i = None, -1
    for name, mod in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp$", name)
        if m and int(m.group(1)) > best_i:
            best, best_i = mod, int(m.group(1))
    if best is None:
        raise ValueError(f"{type(model).__name__}: no 'layers.<i>.mlp' module found for the angle hook")
    return best


@contextmanager
def capture_mlp_input(model: torch.nn.Module):
    """Capture the input of the last layer's MLP (the post-attention-norm activations) as ``box[0]``."""
    box: list[torch.Tensor] = []
    handle = last_mlp(model).register_forward_pre_hook(lambda _m, args: box.append(args[0].detach()))
    try:
        yield box
    finally:
        handle.remove()


def pack(prompts: Sequence[torch.Tensor], completions: torch.Tensor, completion_mask: torch.Tensor,
         pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay out N sequences as left-padded prompts followed by right-padded completions.

    Args:
        prompts: N prompt id tensors [P_i].
        completions: [N, L] completion ids.
        completion_mask: [N, L] bool.
        pad_id: padding token id.

    Returns:
        input_ids [N, P+L], attention_mask [N, P+L], position_ids [N, P+L], and P (the prompt width).
    """
    n = len(prompts)
    width = max(int(p.numel()) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    am = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        am[i, width - p.numel():] = 1
    input_ids = torch.cat([ids, completions.to(torch.long)], dim=1)
    attn = torch.cat([am, completion_mask.to(torch.long)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attn, pos, width


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one right-padded batch: ids [N, L] (``pad_id`` after each sequence) and the bool mask
    [N, L] of real tokens, L the longest length (0 when every sequence is empty)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = True
    return ids, mask


def length_buckets(prompt_lens: torch.Tensor, completion_lens: torch.Tensor, max_tokens: int,
                   min_rows: int = 1, parts: int = 1) -> list[torch.Tensor]:
    """Group N rows by length so that each forward pass pads little.

    Rows are ordered by completion length, then prompt length (longest first) and cut greedily: a bucket takes
    the next row while each of its ``parts`` contiguous slices (``torch.tensor_split``: scale-out gives slice r to
    rank r) stays within ``max_tokens`` padded tokens, ``ceil(rows / parts) * (longest prompt + longest
    completion)`` in :func:`pack`'s layout (one part: the bucket's own padded size). A bucket has at least
    ``min_rows`` rows (scale-out splits each over its ranks): it closes only once it has them, so a bucket whose
    ``min_rows`` rows need more than the budget exceeds it; a last bucket with fewer rows takes rows from the
    one before (the two keep their slices within the budget when each part of the last can hold one row), or
    joins it when the two have fewer than ``2 * min_rows``. ``max_tokens <= 0`` gives one bucket of every row in
    order. verl's dynamic batch size (``use_dynamic_bsz``) bounds micro-batches by tokens the same way; we sort
    instead of packing sequences into one row (no varlen attention on CPU).

    Args:
        prompt_lens: [N] real prompt lengths; completion_lens: [N] real completion lengths.
        max_tokens: the padded-token budget of one forward pass (of each part's).
        min_rows: the fewest rows of a bucket (when N has them).
        parts: the slices each bucket is split into (the ranks; 1: one process).

    Returns:
        Row-index tensors, together a permutation of ``range(N)``.
    """
    n = len(prompt_lens)
    if max_tokens <= 0 or n == 0:
        return [torch.arange(n)]
    order = sorted(range(n), key=lambda i: (-int(completion_lens[i]), -int(prompt_lens[i]), i))
    buckets, cur, p_max, l_max = [], [], 0, 0
    for i in order:
        p, c = max(p_max, int(prompt_lens[i])), max(l_max, int(completion_lens[i]))
        if len(cur) >= max(min_rows, 1) and -(-(len(cur) + 1) // parts) * (p + c) > max_tokens:
            buckets.append(cur)
            cur, p, c = [], int(prompt_lens[i]), int(completion_lens[i])
        cur.append(i)
        p_max, l_max = p, c
    if buckets and len(cur) < min_rows:
        merged = buckets.pop() + cur  # in length order: the last min_rows rows are the shortest
        buckets += [merged[:-min_rows], merged[-min_rows:]] if len(merged) >= 2 * min_rows else [merged]
    else:
        buckets.append(cur)
    return [torch.tensor(b) for b in buckets]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                          max_elements: int = 1 << 26) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``index`` only, in float32, without a float32 copy of all logits.

    Rows are taken in chunks of at most ``max_elements`` logits, each upcast, scaled and reduced before the
    next (the peak extra memory of a 150k-token vocabulary is one chunk, not [N, L, V] in float32); TRL's
    ``selective_log_softmax`` does the same row by row.

    Args:
        logits: [N, L, V] in any float dtype.
        index: [N, L] token ids.

    Returns:
        [N, L] float32 log-probs, differentiable.
    """
    n, length, vocab = logits.shape
    rows = max(1, max_elements // max(length * vocab, 1))
    out = []
    for s in range(0, n, rows):
        chunk = logits[s:s + rows].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, index[s:s + rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out) if len(out) > 1 else out[0]


#: Float32 logits of one chunk of the LM head in :func:`chunked_head` (2^26 elements: 256 MiB).
HEAD_CHUNK_ELEMENTS = 1 << 26
#: Config fields of models whose forward changes the LM head's output before returning it (Gemma 2's soft-capping,
#: Cohere's logit scale): :func:`chunked_head` cannot stand in for their head, so they take the full-logits path.
HEAD_POSTPROCESSING = ("final_logit_softcapping", "logit_scale")


def causal_lm(model) -> PreTrainedModel:
    """The transformers model inside ``model``: itself, or under a DDP wrapper, a DeepSpeed engine, PEFT's adapters
    or a :class:`~tasks.model.lora.BaseModelView` (the first :class:`PreTrainedModel` among its modules)."""
    root = model.model if isinstance(model, BaseModelView) else model
    for module in root.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel")


class _LogProbHead(torch.nn.Module):
    """Stands in for a causal LM's head during one forward pass: hidden states [b, K, H] in, the log-probs [b, K - 1]
    of ``targets`` [b, K - 1] at ``temperature`` out (the last kept position predicts nothing). See
    :func:`chunked_head`."""

    def __init__(self, head: torch.nn.Module, targets: torch.Tensor, temperature: float, vocab: int,
                 max_elements: int):
        super().__init__()
        self.head, self.targets, self.temperature = head, targets, temperature
        self.rows = max(1, max_elements // max(vocab, 1))  # tokens per chunk

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [c, H], [c] -> [c]
        logits = self.head(hidden).float()  # [c, V]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, k, h = hidden.shape
        flat = hidden[:, :-1].reshape(b * (k - 1), h)  # [T, H]
        targets = self.targets.reshape(-1)  # [T]
        chunks = [(s, min(s + self.rows, len(flat))) for s in range(0, len(flat), self.rows)]
        if len(chunks) == 1 or not torch.is_grad_enabled():
            out = [self._chunk(flat[s:e], targets[s:e]) for s, e in chunks]
        else:  # keep no chunk's logits for the backward pass: recompute them there, one chunk at a time
            out = [torch.utils.checkpoint.checkpoint(self._chunk, flat[s:e], targets[s:e], use_reentrant=False)
                   for s, e in chunks]
        return (torch.cat(out) if len(out) > 1 else out[0]).reshape(b, k - 1)


@contextmanager
def chunked_head(model, targets: torch.Tensor, temperature: float, max_elements: int | None = None):
    """Within the block, ``model``'s forward returns as ``.logits`` the log-probs [b, L] of ``targets`` [b, L] at
    ``temperature`` instead of logits [b, L + 1, V]: the LM head runs on chunks of at most ``max_elements // V``
    tokens (default :data:`HEAD_CHUNK_ELEMENTS`), each reduced to its target's log-prob (float32) before the next,
    and with autograd on each chunk's
    logits are recomputed in the backward pass (``torch.utils.checkpoint``), so neither the [T, V] logits nor their
    float32 log-softmax exist at once (TRL's ``ChunkedLogProbFunction`` and Liger's fused linear cross-entropy
    avoid them the same way). Call the model with ``logits_to_keep = L + 1``.

    The model's own head module runs each chunk (found by ``get_output_embeddings`` and swapped for the block), so
    what wraps it works unchanged: DDP and FSDP2 (the same parameters), DeepSpeed ZeRO-3 (its hooks gather the
    weight on each call, also in the recompute), LoRA on the head. Yields False, and changes nothing, for a model
    whose forward transforms the head's output (:data:`HEAD_POSTPROCESSING`); the caller then takes the logits.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    name = next((n for n, child in lm.named_children() if child is head), None)
    if head is None or name is None or any(getattr(lm.config, f, None) for f in HEAD_POSTPROCESSING):
        yield False
        return
    setattr(lm, name, _LogProbHead(head, targets, temperature, lm.config.vocab_size,
                                   max_elements or HEAD_CHUNK_ELEMENTS))
    try:
        yield True
    finally:
        setattr(lm, name, head)


def token_logprobs(model: torch.nn.Module, prompts: Sequence[torch.Tensor], completions: torch.Tensor,
                   completion_mask: torch.Tensor, pad_id: int, temperature: float = 1.0,
                   device: torch.device | str = "cpu", max_tokens: int = 0,
                   mlp_inputs: list | None = None) -> torch.Tensor:
    """Per-token log-probs of the completions under ``model`` at the sampling temperature.

    The rows go through the model in :func:`length_buckets` of at most ``max_tokens`` padded tokens (0: one
    pass), each laid out by :func:`pack` to its own widths; only the completion positions reach the LM head
    (``logits_to_keep``), which runs in chunks (:func:`chunked_head`), so a pass never holds the [T, V] logits.
    The result does not depend on the bucketing beyond float rounding. With autograd on, every bucket's graph
    lives until the caller's backward pass: the update gives one micro-batch at a time
    (tasks/update/policy_update.py).

    Args:
        mlp_inputs: when a list, each bucket appends ``(mlp_in [b, T, H] float32 detached,
            attention_mask [b, T] bool)``: the last layer's MLP inputs (GAIN-RL's angle signal), for free.

    Returns:
        [N, L] float32 log-probs (0 where the mask is False). Differentiable when grad is enabled.
    """
    length = completions.shape[1]
    if length == 0:  # nothing was generated: no log-probs to compute
        return torch.zeros(completions.shape, device=device)
    lens = completion_mask.sum(-1)
    buckets = length_buckets(torch.tensor([int(p.numel()) for p in prompts]), lens, max_tokens)
    parts = []
    for rows in buckets:
        width_l = max(int(lens[rows].max()), 1)  # at least one column (a row may have no real token)
        comp, cmask = completions[rows, :width_l], completion_mask[rows, :width_l]
        input_ids, attn, pos, width = pack([prompts[i] for i in rows], comp, cmask, pad_id)
        input_ids, attn, pos = input_ids.to(device), attn.to(device), pos.to(device)
        comp, cmask = comp.to(device), cmask.to(device)
        with capture_mlp_input(model) if mlp_inputs is not None else nullcontext([]) as box, \
                chunked_head(model, comp, temperature) as chunked:
            out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False,
                        logits_to_keep=width_l + 1).logits  # chunked: [b, L_b] log-probs; else [b, L_b + 1, V]
        if mlp_inputs is not None:
            mlp_inputs.append((box[0].float().cpu(), attn.bool().cpu()))
        lp = out if chunked else selective_log_softmax(out[:, :-1], comp, temperature)
        parts.append(torch.nn.functional.pad(lp * cmask, (0, length - width_l)))
    return torch.cat(parts)[torch.argsort(torch.cat(buckets)).to(parts[0].device)]  # back to row order


@torch.inference_mode()
def prompt_batches(model: torch.nn.Module, tokenizer, texts: Sequence[str], batch_size: int = 64,
                   device: torch.device | str = "cpu"):
    """One forward pass over prompts, batch by batch.

    Yields:
        (embeddings [b, H] float32: the last hidden state mean-pooled over real tokens,
         mlp_inputs [b, T, H] float32: the last layer's MLP inputs, mask [b, T] bool).
    """
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), return_tensors="pt", padding=True,
                        add_special_tokens=add_special(tokenizer))
        am = enc["attention_mask"].to(device)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        with capture_mlp_input(model) as box:
            out = model(input_ids=enc["input_ids"].to(device), attention_mask=am, position_ids=pos,
                        output_hidden_states=True, use_cache=False)
        h = out.hidden_states[-1].float()  # [b, T, H]
        m = am.unsqueeze(-1).float()
        yield ((h * m).sum(1) / m.sum(1).clamp(min=1)).cpu(), box[0].float().cpu(), am.bool().cpu()
