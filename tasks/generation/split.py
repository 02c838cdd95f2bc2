"""One ``generate`` call spread over several generators: contiguous shares of whole prompts, and the shares'
:class:`~tasks.generation.rollout.Generation` records put back together in the call's order.

Used where each rank of a sharded run decodes its share of a step's prompts (tasks/generation/rank_shared.py);
the cut is :func:`tasks.generation.server_pool.spread`'s (the vLLM server pool's), so a share holds whole groups
(a prompt's n rollouts never straddle two generators). With per-prompt seeds (prompt b of a call draws from
``prompt_seed(seed, b)`` whichever generator decodes it), the joined record does not depend on the number of shares.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tasks.generation.rollout import Generation
from tasks.generation.server_pool import spread


def share_bounds(b: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` contiguous shares of ``b`` prompts, sizes differing by at most one (the
    first ones longer); a share may be empty when ``b < parts``.

    Raises:
        ValueError: ``parts`` below 1 or ``b`` negative.
    """
    if parts < 1 or b < 0:
        raise ValueError(f"share_bounds: need parts >= 1 and b >= 0, got b={b}, parts={parts}")
    out, start = [], 0
    for share in spread(range(b), parts):
        out.append((start, start + len(share)))
        start += len(share)
    return out


def join(parts: Sequence[Generation], pad_id: int) -> Generation:
    """The shares' generations, in order, as one record: prompt-major rows concatenated, completions right-padded
    with ``pad_id`` (mask False, log-prob 0) to the longest share's width.

    Raises:
        ValueError: no parts, or parts with different n.
    """
    if not parts:
        raise ValueError("join: no generations to join")
    ns = {g.n for g in parts}
    if len(ns) != 1:
        raise ValueError(f"join: the shares have different rollouts a prompt: {sorted(ns)}")
    width = max(g.completion_ids.shape[1] for g in parts)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Generation(
        prompt_ids=[p for g in parts for p in g.prompt_ids],
        completion_ids=torch.cat([pad(g.completion_ids, pad_id) for g in parts]),
        completion_mask=torch.cat([pad(g.completion_mask, False) for g in parts]),
        texts=[t for g in parts for t in g.texts],
        n=ns.pop(),
        logprobs=torch.cat([pad(g.logprobs, 0.0) for g in parts]))
