"""Model forward passes the algorithms need: token log-probs, pooled embeddings, last-layer MLP inputs.

Shape letters: N rows, P_i / L_i row i's prompt / completion length, S the longest ``P_i + L_i`` of a pass, T the
real completion tokens of a pass, H the hidden size, V the vocabulary.

Training and scoring passes lay each row out contiguously, ``[prompt | completion | pads]`` (:func:`contiguous_rows`):
no pad before or between real tokens, positions ``0 .. S - 1``, and **no attention mask**. Attention is causal, so a
real token never sees the trailing pads, and with ``attention_mask=None`` transformers' ``sdpa`` path calls
``scaled_dot_product_attention(..., attn_mask=None, is_causal=True)`` (``masking_utils._ignore_causal_mask_sdpa``,
``integrations/sdpa_attention.py``): flash attention on a GPU, no [N, 1, S, S] mask built, and no fully masked
query row. A left-padded row with an explicit mask has such rows (the pads see nothing), whose log-sum-exp is far
below -88.7: with a mask tensor that is what makes the cuDNN SDPA backward return NaN in the query gradient on
H100/H200 (pytorch/pytorch issue 196678, TRL issue 7181; docs/performance.md, "On a GPU").
tasks/model/attention.py turns cuDNN SDPA off as well, a guard for whatever pass still builds a mask. The
positions equal ``generate``'s with left padding (the mask's cumulative sum, :func:`pack`), so log-probs match the
sampling distribution token for token.

Only the hidden states that predict a real completion token (row-specific offsets ``P_i - 1 + j``) reach the LM
head, which runs in chunks (tasks/model/logprob_head.py, ``chunked_head``): no pass holds the [T, V] logits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from tasks.model.loading import add_special
from tasks.model.logprob_head import CompletionIndex, chunked_head
from tasks.model.shared_prefix import group_buckets, pack_groups, prefix_attention


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
    """Lay out N sequences as generation does: left-padded prompts followed by right-padded completions, with an
    explicit attention mask and positions its cumulative sum (``generate``'s and the decoder's layout). The
    training and scoring passes use :func:`contiguous_rows` instead (module docstring); this layout stays for
    comparisons with what generation computed.

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


@dataclass(frozen=True)
class ContiguousRows:
    """N rows laid out as ``[prompt | completion | pads]`` (:func:`contiguous_rows`).

    Attributes:
        input_ids: [N, S] token ids, S the longest ``P_i + L_i``; ``pad_id`` after each row's real tokens.
        prompt_lens: [N] P_i (each >= 1).
        lengths: [N] real tokens ``P_i + L_i``.
    """

    input_ids: torch.Tensor
    prompt_lens: torch.Tensor
    lengths: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        """[N, S] bool: True on real tokens (each row's first ``lengths[i]`` columns)."""
        return torch.arange(self.input_ids.shape[1]) < self.lengths.unsqueeze(1)

    @property
    def position_ids(self) -> torch.Tensor:
        """[N, S] ``0 .. S - 1`` on every row: a real token's position is its index in its sequence."""
        n, s = self.input_ids.shape
        return torch.arange(s).expand(n, s)


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """[N] real completion tokens of a [N, L] bool mask whose True entries lead each row (what
    :func:`~tasks.generation.rollout.completion_mask` gives).

    Raises:
        ValueError: a row has a False entry before a True one (a hole a contiguous row cannot hold).
    """
    mask = completion_mask.bool()
    lens = mask.sum(-1)
    holes = (mask != (torch.arange(mask.shape[1], device=mask.device) < lens.unsqueeze(1))).any(-1)
    if holes.any():
        raise ValueError(f"completion_mask rows {holes.nonzero().flatten()[:5].tolist()} have masked tokens before "
                         "real ones: each row's real tokens must lead it (right padding only)")
    return lens


def contiguous_rows(prompts: Sequence[torch.Tensor], completions: torch.Tensor, completion_mask: torch.Tensor,
                    pad_id: int) -> ContiguousRows:
    """Lay out N sequences contiguously, ``[prompt | completion | pads]``, right-padded to the longest.

    Args:
        prompts: N prompt id tensors [P_i], each of at least one token (the first completion token's context).
        completions: [N, L] completion ids, right-padded.
        completion_mask: [N, L] bool, True on each row's L_i leading real tokens.
        pad_id: padding token id.

    Raises:
        ValueError: an empty prompt, or a completion mask with a hole (:func:`completion_lengths`).
    """
    if len(prompts) != completions.shape[0]:
        raise ValueError(f"{len(prompts)} prompts for {completions.shape[0]} completion rows")
    empty = [i for i, p in enumerate(prompts) if p.numel() == 0]
    if empty:
        raise ValueError(f"prompts {empty[:5]} are empty: a completion's first token needs a prompt token before it")
    comp_lens = completion_lengths(completion_mask).cpu()
    completions = completions.cpu().to(torch.long)
    seqs = [torch.cat([p.cpu().to(torch.long).flatten(), completions[i, :int(comp_lens[i])]])
            for i, p in enumerate(prompts)]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    prompt_lens = torch.tensor([p.numel() for p in prompts])
    return ContiguousRows(input_ids=ids, prompt_lens=prompt_lens, lengths=prompt_lens + comp_lens)


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

    Rows are ordered by length ``P_i + L_i`` (longest first; ties by completion length, then index) and cut
    greedily: a bucket takes the next row while each of its ``parts`` contiguous slices (``torch.tensor_split``:
    scale-out gives slice r to rank r) stays within ``max_tokens`` padded tokens, ``ceil(rows / parts) *
    max_i (P_i + L_i)`` in :func:`contiguous_rows`' layout (one part: the bucket's own padded size). A bucket has
    at least ``min_rows`` rows (scale-out splits each over its ranks): it closes only once it has them, so a bucket
    whose ``min_rows`` rows need more than the budget exceeds it; a last bucket with fewer rows takes rows from the
    one before (the two keep their slices within the budget when each part of the last can hold one row), or joins
    it when the two have fewer than ``2 * min_rows``. ``max_tokens <= 0`` gives one bucket of every row in order.
    verl's dynamic batch size (``use_dynamic_bsz``) bounds micro-batches by tokens the same way; we sort instead of
    packing sequences into one row (no varlen attention on CPU).

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
    total = [int(prompt_lens[i]) + int(completion_lens[i]) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-total[i], -int(completion_lens[i]), i))
    buckets, cur, width = [], [], 0  # width: the open bucket's longest row (the first, in this order)
    for i in order:
        if len(cur) >= max(min_rows, 1) and -(-(len(cur) + 1) // parts) * width > max_tokens:
            buckets.append(cur)
            cur = []
        if not cur:
            width = total[i]
        cur.append(i)
    if buckets and len(cur) < min_rows:
        merged = buckets.pop() + cur  # in length order: the last min_rows rows are the shortest
        buckets += [merged[:-min_rows], merged[-min_rows:]] if len(merged) >= 2 * min_rows else [merged]
    else:
        buckets.append(cur)
    return [torch.tensor(b) for b in buckets]


def least_padding_buckets(prompt_lens: torch.Tensor, completion_lens: torch.Tensor,
                          max_tokens: int) -> list[torch.Tensor]:
    """:func:`length_buckets`' passes (as many, each within ``max_tokens`` padded tokens, rows in the same length
    order), cut where they pad least: the greedy cut fills the longest rows' pass to the budget, so its last rows pad
    to the longest; among the cuts into at most as many passes, this takes one with the fewest padded tokens, never
    more than the greedy's (a dynamic programme over the sorted rows, O(passes x N^2) on arrays). For a forward pass
    without gradients (the likelihood screen's, 48 candidates of the default pool on one CPU thread: 1.36x the real
    tokens at 2048 a pass, 1.10x here, the pass 0.82x the time); above :data:`LEAST_PADDING_ROWS` rows, the greedy
    cut. Returns row-index tensors, together a permutation of ``range(N)``."""
    greedy = length_buckets(prompt_lens, completion_lens, max_tokens)
    n = len(prompt_lens)
    if len(greedy) < 2 or n > LEAST_PADDING_ROWS:
        return greedy
    order = torch.cat(greedy)  # the rows longest first
    width = (prompt_lens + completion_lens)[order].double()  # [N] non-increasing
    first = torch.arange(n).unsqueeze(1)  # [N, 1] a pass's first row i
    end = torch.arange(1, n + 1).unsqueeze(0)  # [1, N] ... and its end j (rows i .. j - 1)
    cost = (end - first) * width.unsqueeze(1)  # [N, N] padded tokens of the pass
    cost[(end <= first) | ((cost > max_tokens) & (end - first > 1))] = float("inf")
    best = torch.full((n + 1,), float("inf"), dtype=torch.float64)  # fewest padded tokens of rows 0 .. j - 1
    best[0] = 0.0
    cuts, found = [], (float("inf"), 0)
    for passes in range(1, len(greedy) + 1):
        total = best[:-1].unsqueeze(1) + cost  # [N (i), N (j - 1)]
        at = total.argmin(0)  # [N] the best first row of the last pass ending at each j
        best = torch.cat([torch.tensor([float("inf")], dtype=torch.float64), total.gather(0, at.unsqueeze(0))[0]])
        cuts.append(at)
        if float(best[n]) < found[0]:
            found = (float(best[n]), passes)
    out, j = [], n
    for passes in range(found[1], 0, -1):
        i = int(cuts[passes - 1][j - 1])
        out.append(order[i:j])
        j = i
    return out[::-1]


#: Above this many rows :func:`least_padding_buckets` cuts greedily (its programme holds an [N, N] array).
LEAST_PADDING_ROWS = 1024


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


def token_logprobs(model: torch.nn.Module, prompts: Sequence[torch.Tensor], completions: torch.Tensor,
                   completion_mask: torch.Tensor, pad_id: int, temperature: float = 1.0,
                   device: torch.device | str = "cpu", max_tokens: int = 0,
                   mlp_inputs: list | None = None, groups: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probs of the completions under ``model`` at the sampling temperature.

    The rows go through the model in :func:`length_buckets` of at most ``max_tokens`` padded tokens (0: one
    pass), each laid out by :func:`contiguous_rows` to its own width, with no attention mask (causal attention
    without a mask tensor: module docstring); only the T states that predict a real completion token reach the LM
    head (:class:`~tasks.model.logprob_head.CompletionIndex`), which runs in chunks
    (:func:`~tasks.model.logprob_head.chunked_head`), so a pass never holds the [T, V] logits. The result does not
    depend on the bucketing beyond float rounding. With autograd on, every bucket's graph lives until the caller's
    backward pass: the update gives one micro-batch at a time (tasks/update/policy_update.py).

    Args:
        prompts: N prompt id tensors [P_i], none empty.
        completions: [N, L] ids; completion_mask: [N, L] bool, each row's real tokens first.
        mlp_inputs: when a list, each bucket appends ``(mlp_in [b, S, H] float32 detached, mask [b, S] bool)``:
            the last layer's MLP inputs and the real tokens (prompt and completion) of the bucket's rows, in
            bucket order (GAIN-RL's angle signal), for free.
        groups: [N] a group label per row (rows of one group hold the same prompt): each group's prompt is computed
            once (the shared-prefix layout of tasks/model/shared_prefix.py, in ``group_buckets`` of at most
            ``max_tokens`` packed tokens), where the model attends with SDPA and ``mlp_inputs`` is None; else, or
            None, the row layout. With autograd, the caller's backward pass must run inside
            :func:`~tasks.model.shared_prefix.prefix_attention` when the model checkpoints its activations (the
            recomputation attends again).

    Returns:
        [N, L] float32 log-probs (0 where the mask is False). Differentiable when grad is enabled.
    """
    length = completions.shape[1]
    if length == 0:  # nothing was generated: no log-probs to compute
        return torch.zeros(completions.shape, device=device)
    lens = completion_lengths(completion_mask.cpu())
    prompt_lens = torch.tensor([int(p.numel()) for p in prompts])
    if groups is not None and mlp_inputs is None:
        with prefix_attention(model) as shared:
            if shared:
                parts, buckets = [], group_buckets(groups, prompt_lens, lens, max_tokens)
                for rows in buckets:
                    parts.append(_packed_logprobs(model, [prompts[i] for i in rows], completions[rows], lens[rows],
                                                  groups[rows], temperature, device, length))
                return torch.cat(parts)[torch.argsort(torch.cat(buckets)).to(parts[0].device)]
    buckets = length_buckets(prompt_lens, lens, max_tokens)
    parts = []
    for rows in buckets:
        width_l = max(int(lens[rows].max()), 1)  # at least one column (a row may have no real token)
        comp, cmask = completions[rows, :width_l].cpu(), completion_mask[rows, :width_l].cpu()
        layout = contiguous_rows([prompts[i] for i in rows], comp, cmask, pad_id)
        index = CompletionIndex.of(layout.prompt_lens, layout.input_ids.shape[1], comp, cmask).to(device)
        with capture_mlp_input(model) if mlp_inputs is not None else nullcontext([]) as box, \
                chunked_head(model, index, temperature) as chunked:
            out = model(input_ids=layout.input_ids.to(device), position_ids=layout.position_ids.to(device),
                        use_cache=False, logits_to_keep=index.keep).logits  # chunked: [T]; else [b, K, V]
        if mlp_inputs is not None:
            mlp_inputs.append((box[0].float().cpu(), layout.mask))
        lp = out if chunked else selective_log_softmax(index.hidden(out).unsqueeze(0), index.targets.unsqueeze(0),
                                                       temperature)[0]
        lp = index.scatter(lp, width_l)  # [b, L_b]
        parts.append(torch.nn.functional.pad(lp * cmask.to(lp.device), (0, length - width_l)))
    return torch.cat(parts)[torch.argsort(torch.cat(buckets)).to(parts[0].device)]  # back to row order


def _packed_logprobs(model: torch.nn.Module, prompts: Sequence[torch.Tensor], completions: torch.Tensor,
                     lens: torch.Tensor, groups: torch.Tensor, temperature: float, device: torch.device | str,
                     length: int) -> torch.Tensor:
    """[b, length] log-probs of one pass of whole groups in the shared-prefix layout (:func:`token_logprobs`)."""
    packed = pack_groups(prompts, completions, lens, groups)
    width, real = packed.input_ids.shape[1], packed.rows.numel() > 0
    # no real completion token: one masked stand-in (row 0's first column, predicted by its prompt's last token) keeps
    # a graph through every parameter, as CompletionIndex.of does
    rows, columns, positions, targets = ((packed.rows, packed.columns, packed.positions, packed.targets) if real else
                                         (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                          packed.layout.prompt_real[0].sum().view(1) - 1,
                                          completions[:1, 0].cpu().to(torch.long)))
    index = CompletionIndex(rows=rows, columns=columns, positions=positions, targets=targets, n=len(prompts),
                            width=width, real=real, pass_rows=torch.zeros_like(rows)).to(device)
    with chunked_head(model, index, temperature) as chunked:
        out = model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                    use_cache=False, logits_to_keep=index.keep, prefix_layout=packed.layout.to(device)).logits
    lp = out if chunked else selective_log_softmax(index.hidden(out).unsqueeze(0), index.targets.unsqueeze(0),
                                                   temperature)[0]
    return index.scatter(lp, length)  # [b, L]: 0 past each row's end


@torch.inference_mode()
def prompt_batches(model: torch.nn.Module, tokenizer, texts: Sequence[str], batch_size: int = 64,
                   device: torch.device | str = "cpu"):
    """One forward pass over prompts, batch by batch: each batch right-padded, positions ``0 .. T - 1`` and no
    attention mask (causal attention without a mask tensor, as :func:`token_logprobs`; module docstring).

    Yields:
        (embeddings [b, H] float32: the last hidden state mean-pooled over real tokens,
         mlp_inputs [b, T, H] float32: the last layer's MLP inputs, mask [b, T] bool: each row's real tokens first).
    """
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), return_tensors="pt", padding=True, padding_side="right",
                        add_special_tokens=add_special(tokenizer))
        ids, am = enc["input_ids"], enc["attention_mask"].bool()
        completion_lengths(am)  # right padding: a row's real tokens lead it, or causal attention would see pads
        pos = torch.arange(ids.shape[1]).expand(ids.shape)
        with capture_mlp_input(model) as box:
            out = model(input_ids=ids.to(device), position_ids=pos.to(device), output_hidden_states=True,
                        use_cache=False, logits_to_keep=1)  # the logits are not used: the head runs on one position
        h = out.hidden_states[-1].float()  # [b, T, H]
        m = am.to(h.device).unsqueeze(-1).float()
        yield ((h * m).sum(1) / m.sum(1).clamp(min=1)).cpu(), box[0].float().cpu(), am
