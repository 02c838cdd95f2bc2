"""Throughput and model FLOPs utilisation (MFU) of the training step's two compute phases.

FLOPs are counted the usual way (Kaplan et al. 2020, arXiv 2001.08361, section 2.1; PaLM, arXiv 2204.02311,
appendix B): a token through a forward pass costs ``2 N`` FLOPs, a forward and backward ``6 N``, with N the
model's parameters (a tied embedding counted once: it is the LM head's matrix), plus the attention scores,
``2 * 2 * layers * context * hidden`` per token forward (tripled for forward and backward), with ``context``
the mean sequence length. Padding is not counted: MFU measures useful work.

The peak is the machine's, in the run's dtype:

- a GPU whose name is in :data:`DATASHEET_TFLOPS` uses the vendor's dense tensor-core figure (no sparsity);
- anything else (every CPU) uses a measured peak: the best of a few large matrix products in the run's dtype
  with the run's threads (:func:`measured_peak_flops`), an achievable ceiling rather than a datasheet one, so
  a CPU's MFU reads higher than it would against the vendor's figure.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

#: Dense (no sparsity) datasheet TFLOP/s by device and dtype (NVIDIA H100 SXM, H200 SXM, A100 SXM, L40S data
#: sheets); float32 on tensor cores means TF32.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "nvidia-h100": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "nvidia-h200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "nvidia-a100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "nvidia-l40s": {"bfloat16": 362.1, "float16": 362.1, "float32": 183.0},
}


@dataclass(frozen=True)
class Peak:
    """A machine's peak FLOP/s in one dtype and where the figure comes from (``datasheet`` or ``measured``)."""

    flops: float
    source: str


@functools.cache
def measured_peak_flops(device: str, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """The best FLOP/s of ``repeats`` [size, size] x [size, size] products on ``device`` (cached per process)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first product warms up
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def peak(device_type: str, device: torch.device | str, dtype: torch.dtype) -> Peak:
    """The peak FLOP/s of ``device_type`` (``tasks.records.cost.detect_device``'s name) in ``dtype``."""
    sheet = DATASHEET_TFLOPS.get(device_type, {}).get(str(dtype).removeprefix("torch."))
    if sheet is not None:
        return Peak(sheet * 1e12, "datasheet")
    return Peak(measured_peak_flops(str(torch.device(device).type), dtype), "measured")


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP count needs from a model: parameters N, layers, hidden size."""

    params: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlopModel:
        cfg = model.config
        return cls(params=sum(p.numel() for p in model.parameters()), layers=cfg.num_hidden_layers,
                   hidden=cfg.hidden_size)

    def forward_flops(self, tokens: float, context: float) -> float:
        """FLOPs of a forward pass over ``tokens`` real tokens whose sequences average ``context`` tokens."""
        return tokens * (2 * self.params + 4 * self.layers * context * self.hidden)

    def train_flops(self, tokens: float, context: float) -> float:
        """Forward and backward: three forward passes' worth."""
        return 3 * self.forward_flops(tokens, context)


def rates(shape: FlopModel, machine: Peak, *, tokens: float, sequences: int, seconds: float,
          backward: bool) -> tuple[float, float]:
    """(tokens per second, MFU) of a phase that ran ``sequences`` sequences of ``tokens`` real tokens in all
    through forward passes (and backward passes when ``backward``) in ``seconds``."""
    seconds = max(seconds, 1e-9)
    context = tokens / max(sequences, 1)
    flops = shape.train_flops(tokens, context) if backward else shape.forward_flops(tokens, context)
    return tokens / seconds, flops / seconds / machine.flops
