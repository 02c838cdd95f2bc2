"""A group's prompt computed once in a log-prob pass: the shared-prefix layout and its attention.

Prefix Grouper (arXiv 2506.05433, section 3): the n rollouts of a GRPO group share their prompt, so a pass over
the n rows ``[prompt | completion_i]`` computes the prompt n times. Laid out instead as one packed sequence
``[prompt | completion_1 | ... | completion_n]`` per group, with attention split in two, the prompt is computed once
and every completion token still attends to exactly what it attends to in its own row:

- the prompt's queries attend causally within the prompt;
- completion i's queries attend to the whole prompt and causally within completion i (not to the other
  completions).

Positions restart after the prompt for every completion (``P .. P + L_i - 1``), so each token's rotary position,
and with it every log-prob, is the one of its own row, up to float rounding (tests/tasks/test_shared_prefix.py
checks log-probs and gradients against the row layout). The linear layers, most of a pass, run over ``P + sum L_i``
tokens of a group instead of ``n P + sum L_i`` (measured in docs/performance.md, "One prompt a group").

Shape letters: T a pass's packed tokens (every group's prompt and completions, no pads), G its groups, R its rows,
P the longest prompt and L the longest completion of the pass, H query heads, H_kv key-value heads, D the head size.

The attention (:func:`grouped_attention`, registered in transformers' ``AttentionInterface`` as :data:`NAME`)
gathers the packed queries, keys and values into a [G, H, P, D] prompt block and an [R, H, L, D] completion block
and runs ``scaled_dot_product_attention`` twice with explicit boolean masks of [G, 1, P, P] and [R, 1, L, P + L]:
the scores of a row layout's pass, never [T, T]. No query row is fully masked (a pad query sees its prompt's first
token), so none has the -inf log-sum-exp behind cuDNN's NaN (tasks/model/attention.py). Deviations from the paper:
the paper's implementation concatenates the two attention outputs per sample; here a pass packs many groups into one
sequence of batch 1 and gathers, and the pass's layout travels as a keyword argument of the model's forward
(``prefix_layout``), which transformers hands to every layer's attention function, also in the recomputation of
activation checkpointing. A model attends with :func:`grouped_attention` inside :func:`prefix_attention` only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tasks.model.lora import base_model
from tasks.model.wrappers import unwrap

#: The name :func:`grouped_attention` is registered under in transformers' ``AttentionInterface``.
NAME = "rlsift_shared_prefix"


@dataclass(frozen=True)
class PrefixLayout:
    """Where a packed pass's prompts and completions are (:func:`pack_groups`), for :func:`grouped_attention`.

    Attributes:
        prompt_at: [G, P] packed position of each prompt column (0 past a prompt's end); prompt_real: [G, P] bool.
        completion_at: [R, L] packed position of each completion column (0 past its end); completion_real: [R, L].
        row_group: [R] the group of each row.
        prompt_mask: [G, 1, P, P] bool, True where a prompt query may attend (causal, real keys).
        completion_mask: [R, 1, L, P + L] bool: the row's prompt's real keys, then its own completion causally.
        order: [T] for each packed position, its index among the real prompt entries followed by the real
            completion entries (row-major), which is how the two blocks' outputs are put back in packed order.
    """

    prompt_at: torch.Tensor
    prompt_real: torch.Tensor
    completion_at: torch.Tensor
    completion_real: torch.Tensor
    row_group: torch.Tensor
    prompt_mask: torch.Tensor
    completion_mask: torch.Tensor
    order: torch.Tensor

    def to(self, device: torch.device | str) -> PrefixLayout:
        return PrefixLayout(**{f: getattr(self, f).to(device) for f in self.__dataclass_fields__})


@dataclass(frozen=True)
class PackedGroups:
    """A pass's rows packed by group (:func:`pack_groups`): ``input_ids`` and ``position_ids`` [1, T], the
    attention's ``layout``, and for each row's completion token j (row-major over the real ones) ``rows`` and
    ``columns`` (where it goes in [R, L]), ``positions`` (the packed position whose hidden state predicts it: the
    prompt's last token for j = 0, else the row's token j - 1) and ``targets`` (its id)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: PrefixLayout
    rows: torch.Tensor
    columns: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor


def rows_by_group(group_of_row: torch.Tensor) -> dict:
    """Each group label of ``group_of_row`` [R] with its rows, in order of the labels' first appearance."""
    members: dict = {}
    for i, lab in enumerate(group_of_row.tolist()):
        members.setdefault(lab, []).append(i)
    return members


def group_buckets(group_of_row: torch.Tensor, prompt_lens: torch.Tensor, completion_lens: torch.Tensor,
                  max_tokens: int) -> list[torch.Tensor]:
    """Cut N rows into passes of the shared-prefix layout (:func:`pack_groups`), a group's rows together.

    Rows of one group cost their packed tokens, the prompt once and every row's completion (``P_g + sum_i L_i``).
    Groups are taken in order of first appearance, and a pass takes the next group while its packed tokens stay
    within ``max_tokens``. A group over the budget by itself is cut into pieces that each fit (a piece has at least
    one row, and computes the prompt again), so a pass holds at most the budget unless one row alone exceeds it.
    ``max_tokens <= 0``: one pass.

    Returns:
        Row-index tensors, together a permutation of ``range(N)``.
    """
    pieces = []  # (rows, packed tokens): whole groups, or pieces of one over the budget
    for rows in rows_by_group(group_of_row).values():
        prompt = int(prompt_lens[rows[0]])
        piece, used = [], prompt
        for i in rows:
            cost = int(completion_lens[i])
            if piece and max_tokens > 0 and used + cost > max_tokens:
                pieces.append((piece, used))
                piece, used = [], prompt
            piece, used = piece + [i], used + cost
        pieces.append((piece, used))
    buckets, cur, used = [], [], 0
    for rows, cost in pieces:
        if cur and max_tokens > 0 and used + cost > max_tokens:
            buckets.append(cur)
            cur, used = [], 0
        cur, used = cur + rows, used + cost
    buckets.append(cur)
    return [torch.tensor(b, dtype=torch.long) for b in buckets]


def pack_groups(prompts: Sequence[torch.Tensor], completions: torch.Tensor, completion_lens: torch.Tensor,
                group_of_row: torch.Tensor) -> PackedGroups:
    """Pack R rows into one sequence, each group's prompt once, then its rows' real completion tokens in order.

    Args:
        prompts: R prompt id tensors; the rows of one group must hold the same prompt.
        completions: [R, L] ids, each row's ``completion_lens[i]`` real tokens first.
        completion_lens: [R] real completion tokens of each row.
        group_of_row: [R] a group label per row; a group's rows need not be adjacent.

    Raises:
        ValueError: two rows of one group with different prompts, or an empty prompt.
    """
    labels = group_of_row.tolist()
    members = rows_by_group(group_of_row)
    lens = [int(x) for x in completion_lens.tolist()]
    ids, pos, prompt_spans, row_spans = [], [], [], [(0, 0)] * len(labels)  # spans: (packed start, length)
    rows, columns, predict = [], [], []
    at = 0
    for g, mine in members.items():
        first = prompts[mine[0]].cpu().to(torch.long).flatten()
        if first.numel() == 0:
            raise ValueError(f"group {g}: an empty prompt (a completion's first token needs a prompt token)")
        for i in mine[1:]:
            if not torch.equal(prompts[i].cpu().to(torch.long).flatten(), first):
                raise ValueError(f"rows {mine[0]} and {i} are in group {g} but hold different prompts")
        p = first.numel()
        ids.append(first)
        pos.append(torch.arange(p))
        prompt_spans.append((at, p))
        last_prompt, at = at + p - 1, at + p
        for i in mine:
            n = lens[i]
            ids.append(completions[i, :n].cpu().to(torch.long))
            pos.append(torch.arange(p, p + n))
            row_spans[i] = (at, n)
            rows += [i] * n
            columns += range(n)
            predict += [last_prompt, *range(at, at + n - 1)] if n else []  # token j: after the prompt, or j - 1
            at += n
    index_of = {g: k for k, g in enumerate(members)}
    layout = _layout(prompt_spans, row_spans, torch.tensor([index_of[lab] for lab in labels]), at)
    rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long)
    return PackedGroups(input_ids=torch.cat(ids)[None], position_ids=torch.cat(pos)[None], layout=layout,
                        rows=rows_t, columns=cols_t, positions=torch.tensor(predict, dtype=torch.long),
                        targets=completions.cpu().to(torch.long)[rows_t, cols_t])


def _layout(prompt_spans: list[tuple[int, int]], row_spans: list[tuple[int, int]], row_group: torch.Tensor,
            total: int) -> PrefixLayout:
    """The :class:`PrefixLayout` of a packed pass of ``total`` tokens: each group's prompt and each row's completion
    as (packed start, length), and each row's group."""
    def blocks(spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:  # [B, W] positions, real
        starts, lengths = (torch.tensor(x, dtype=torch.long) for x in zip(*spans, strict=True))
        cols = torch.arange(max(int(lengths.max()), 0))
        real = cols < lengths[:, None]
        return torch.where(real, starts[:, None] + cols, 0), real

    prompt_at, prompt_real = blocks(prompt_spans)
    completion_at, completion_real = blocks(row_spans)
    r, width_l, width_p = len(row_spans), completion_at.shape[1], prompt_at.shape[1]
    causal_p = torch.ones(width_p, width_p, dtype=torch.bool).tril()
    causal_l = torch.ones(width_l, width_l, dtype=torch.bool).tril()
    seen = prompt_real[row_group][:, None, :].expand(r, width_l, width_p)  # [R, L, P]: the row's prompt
    own = causal_l[None] & completion_real[:, None, :]  # [R, L, L]: its own completion, causally
    order = torch.empty(total, dtype=torch.long)
    flat = torch.cat([prompt_at[prompt_real], completion_at[completion_real]])
    order[flat] = torch.arange(flat.numel())
    return PrefixLayout(prompt_at=prompt_at, prompt_real=prompt_real, completion_at=completion_at,
                        completion_real=completion_real, row_group=row_group,
                        prompt_mask=(causal_p[None] & prompt_real[:, None, :])[:, None],
                        completion_mask=torch.cat([seen, own], dim=2)[:, None], order=order)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, H_kv, T, D] -> [H, T, D], each key-value head repeated for its query heads (transformers' repeat_kv)."""
    kv = x.shape[1]
    return x[0] if kv == heads else x[0].repeat_interleave(heads // kv, dim=0)


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      prefix_layout: PrefixLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a packed pass (module docstring): ``query`` [1, H, T, D], ``key`` and ``value``
    [1, H_kv, T, D] with their rotary positions applied; ``attention_mask`` is not read (the layout is the mask).
    Returns ``([1, T, H, D], None)``, as transformers' attention functions do."""
    if prefix_layout is None:
        raise RuntimeError("shared-prefix attention without a prefix_layout: the model was called inside "
                           "prefix_attention() without the packed pass's layout (tasks/model/shared_prefix.py)")
    if query.shape[0] != 1 or dropout:
        raise ValueError(f"shared-prefix attention takes one packed sequence without dropout (batch "
                         f"{query.shape[0]}, dropout {dropout})")
    lay, heads = prefix_layout, query.shape[1]
    q, k, v = query[0], _heads(key, heads), _heads(value, heads)  # [H, T, D]

    def block(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [H, T, D] at [B, W] -> [B, H, W, D]
        return x[:, at].transpose(0, 1)

    kp, vp = block(k, lay.prompt_at), block(v, lay.prompt_at)
    prompt_out = torch.nn.functional.scaled_dot_product_attention(
        block(q, lay.prompt_at), kp, vp, attn_mask=lay.prompt_mask, scale=scaling)  # [G, H, P, D]
    ks = torch.cat([kp[lay.row_group], block(k, lay.completion_at)], dim=2)  # [R, H, P + L, D]
    vs = torch.cat([vp[lay.row_group], block(v, lay.completion_at)], dim=2)
    comp_out = torch.nn.functional.scaled_dot_product_attention(
        block(q, lay.completion_at), ks, vs, attn_mask=lay.completion_mask, scale=scaling)  # [R, H, L, D]
    real = torch.cat([prompt_out.transpose(1, 2)[lay.prompt_real],
                      comp_out.transpose(1, 2)[lay.completion_real]])  # [T, H, D], prompts then completions
    return real[lay.order].unsqueeze(0), None


def attends_with_sdpa(model: torch.nn.Module) -> bool:
    """Whether ``model`` (under adapters or a backend's wrapper or not) is a transformers model attending with SDPA
    (or already with :func:`grouped_attention`): what :func:`prefix_attention` can switch."""
    from transformers import PreTrainedModel  # loaded with the model already

    inner = base_model(unwrap(model))
    return isinstance(inner, PreTrainedModel) and inner.config._attn_implementation in ("sdpa", NAME)


@contextmanager
def prefix_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Inside the block ``model`` (a transformers model, under adapters or a backend's wrapper or not) attends with
    :func:`grouped_attention` where it attends with SDPA, and yields True; its own implementation comes back after,
    also on error. A model on another implementation (eager, flash-attention) is left as it is and the block
    yields False: the caller then uses the row layout. Nested blocks are one block."""
    from transformers import AttentionInterface  # loaded with the model already

    if not attends_with_sdpa(model):
        yield False
        return
    inner = base_model(unwrap(model))
    if inner.config._attn_implementation == NAME:
        yield True
        return
    AttentionInterface.register(NAME, grouped_attention)  # idempotent
    inner.set_attn_implementation(NAME)
    try:
        yield True
    finally:
        inner.set_attn_implementation("sdpa")
