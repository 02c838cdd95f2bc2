"""The user's module inside the wrappers a backend puts around it (DDP, a DeepSpeed engine; FSDP2 shards in place)."""

from __future__ import annotations

import torch


def is_deepspeed(model) -> bool:
    """Whether ``model`` is a DeepSpeed engine."""
    return type(model).__module__.startswith("deepspeed")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper or DeepSpeed engine (FSDP2 shards in place: itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) or is_deepspeed(model) \
        else model
