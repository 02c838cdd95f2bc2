"""Which precision a run trains in (``model.precision``): the dtype the forward and backward passes compute in, and
the dtype the weights the optimizer steps are kept in.

Mixed precision as the field runs it (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740, section 3;
bf16 needs no loss scaling, Kalamkar et al., arXiv 1905.12322): the passes run in bf16, the optimizer steps float32
master weights with float32 AdamW moments, and the bf16 weights are a copy of the master made after each step.
Without the master copy an AdamW step of about ``lr`` is rounded away on a bf16 weight whose spacing is larger than
twice the step (a weight of 0.02 has a spacing of 1.2e-4): at lr 1e-6 under a quarter of the update survives.

- ``auto``: ``bf16-mixed`` on a CUDA device with bf16, ``fp32`` elsewhere (a CPU computes bf16 matmuls slowly).
- ``bf16-mixed``: bf16 compute, float32 master weights and optimizer state (16 bytes a trained parameter with
  AdamW: 2 bf16 weight, 2 bf16 gradient, 4 master, 8 moments; docs/performance.md).
- ``fp32``: everything in float32.
- ``bf16-true``: weights, gradients and AdamW state all in bf16 (8 bytes a parameter). Small updates are lost;
  only when asked for by name, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, get_args

import torch

log = logging.getLogger(__name__)

PrecisionName = Literal["auto", "bf16-mixed", "fp32", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


@dataclass(frozen=True)
class Precision:
    """A resolved ``model.precision``.

    Attributes:
        name: ``bf16-mixed``, ``fp32`` or ``bf16-true`` (never ``auto``).
        compute: the dtype of the model's weights in the forward and backward passes (and of what generates).
        master: the dtype of the weights and AdamW moments the optimizer steps.
    """

    name: str
    compute: torch.dtype
    master: torch.dtype

    @property
    def mixed(self) -> bool:
        """The optimizer steps a master copy in another dtype than the compute weights."""
        return self.compute != self.master

    def bytes_per_trained_param(self, optimizer_moments: int = 2) -> int:
        """Bytes of a trained parameter's weight, gradient, master copy and optimizer moments (AdamW: 2)."""
        c, m = _size(self.compute), _size(self.master)
        return c + c + (m if self.mixed else 0) + optimizer_moments * m


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The precision ``model.precision`` names on ``device`` (``auto``: ``bf16-mixed`` on a CUDA device with bf16,
    else ``fp32``); ``bf16-true`` logs what it costs."""
    if name not in PRECISIONS:
        raise ValueError(f"model.precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if name == "auto":
        name = "bf16-mixed" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, torch.float32)
    if name == "bf16-true":
        log.warning("model.precision=bf16-true: weights and AdamW state in bf16; an update smaller than half a bf16 "
                    "weight's spacing is rounded away (at lr 1e-6 most of it). Use bf16-mixed to keep float32 "
                    "master weights (docs/performance.md)")
        return Precision(name, torch.bfloat16, torch.bfloat16)
    return Precision(name, torch.bfloat16, torch.float32)
