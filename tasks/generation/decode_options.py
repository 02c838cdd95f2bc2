"""How the decode loop (tasks/generation/decode.py) runs on a device: :class:`DecodeOptions` (CUDA graphs or eager
steps, which row counts the live rows are compacted to, how often the host checks, the padding of prompts and of the
attention's width, the CPU's own one-token attention and forward) with its per-device defaults, and :func:`buckets`,
the row counts of the bucketed layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeOptions:
    """How the loop runs on a device.

    Attributes:
        graphs: capture the one-token forward per bucket as a CUDA graph (CUDA only).
        exact_rows: a finished row leaves the batch at the next check (every bucket size allowed); else only when
            the live rows fit a smaller bucket (powers of two below the rows, and the rows).
        check_every: decode steps between the host's checks of how many rows go on (one sync each).
        prompt_multiple: prompts are padded to a multiple of this many columns, so calls whose prompts differ a
            little in length share one shape, hence the buffers and graphs.
        width_multiple: attention at step t reads the cache's first ``P + t`` columns rounded up to a multiple of
            this (the cache's width too is a multiple of it): 1 reads only the written columns; on CUDA each width
            is a graph of its own, so a larger multiple means fewer graphs and aligned masks. None: every step reads
            the whole width (the masked columns add exact zeros; a shorter row changes only the order of the
            attention's reductions, in the last bits).
        step_attention: the one-token steps of a model that attends with SDPA on the CPU attend with two matrix
            products instead (tasks/generation/step_attention.py); the prefill is SDPA's either way.
        step_forward: with ``step_attention``, the one-token steps of a Llama-family model run its forward without
            transformers' per-call machinery (tasks/generation/step_forward.py: the same logits bit for bit).
    """

    graphs: bool
    exact_rows: bool
    check_every: int
    prompt_multiple: int = 1
    width_multiple: int | None = None
    step_attention: bool = False
    step_forward: bool = False

    def __post_init__(self):
        if min(self.check_every, self.prompt_multiple, self.width_multiple or 1) < 1:
            raise ValueError(f"DecodeOptions: check_every {self.check_every}, prompt_multiple {self.prompt_multiple} "
                             f"and width_multiple {self.width_multiple} must be >= 1")

    @classmethod
    def for_device(cls, device: torch.device | str) -> DecodeOptions:
        """CUDA: graphs, buckets, a check every 8 steps, prompts padded to 64 columns, attention widths in steps of
        128 columns; elsewhere eager, exact rows, a check every step, attention over the written columns only (a CPU
        step costs what its rows and columns cost; a check costs nothing there) and, on the CPU, the one-token
        steps' own attention and forward."""
        if torch.device(device).type == "cuda":
            return cls(graphs=True, exact_rows=False, check_every=8, prompt_multiple=64, width_multiple=128)
        cpu = torch.device(device).type == "cpu"
        return cls(graphs=False, exact_rows=True, check_every=1, width_multiple=1, step_attention=cpu,
                   step_forward=cpu)


def buckets(rows: int) -> list[int]:
    """The row counts a batch of ``rows`` is compacted to: powers of two below ``rows``, then ``rows``."""
    return [1 << i for i in range(max(rows - 1, 0).bit_length()) if 1 << i < rows] + [rows]
