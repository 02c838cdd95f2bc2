"""The whole model's weights and optimizer state under every backend (tasks/update/distributed.py): gathered to
rank 0 for a checkpoint or the sampler, restored and broadcast on a resume, and the KL reference's frozen copy.

Collective where the backend shards (FSDP2, DeepSpeed ZeRO-3): every rank calls, rank 0 gets the result.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tasks.model.wrappers import is_deepspeed, unwrap
from tasks.update.distributed import is_rank0


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer of an (unwrapped, full) module from rank ``src`` to all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src)


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def full_state_dict(model, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's state dict (a copy), on rank 0 (other ranks get ``{}``). Call on every rank.

    Collective for FSDP2 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: always on CPU,
    so no rank holds the whole model on its GPU) and ZeRO-3 (``deepspeed.zero.GatheredParameters``); local
    for the replicated backends. ``to_cpu=False`` keeps the copy on the training device where possible
    (a device-to-device copy per step instead of two host transfers).
    """
    rank0 = is_rank0()
    from torch.distributed.fsdp import FSDPModule

    def copy_(sd: dict) -> dict:
        return _cpu(sd) if to_cpu else {k: v.detach().clone() for k, v in sd.items()}

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _cpu(sd) if rank0 else {}  # a copy: on CPU the result can share storage with the live model
    if is_deepspeed(model) and model.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=None):
            return copy_(model.module.state_dict()) if rank0 else {}
    return copy_(unwrap(model).state_dict()) if rank0 else {}


def copy_full_weights(model, target: torch.nn.Module) -> None:
    """Copy the whole model's weights into ``target`` (rank 0's full-weight policy) in place, on rank 0. Call on
    every rank: the same collectives as :func:`full_state_dict`.

    No whole state dict is cloned on the training device: the replicated backends copy parameter by parameter
    (device to device), FSDP2 gathers to the CPU first (``full_state_dict``), ZeRO-3 copies inside its gather.
    Values are cast to ``target``'s dtype (a float32 master into bf16 weights).
    """
    from torch.distributed.fsdp import FSDPModule

    rank0 = is_rank0()

    def copy_into(state: dict) -> None:
        own = target.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"the trained model lacks {missing[:3]} of the policy's weights")
        with torch.no_grad():
            for name, value in state.items():
                if name in own:
                    own[name].copy_(value)

    if isinstance(model, FSDPModule):
        state = full_state_dict(model)
        if rank0:
            copy_into(state)
        return
    if is_deepspeed(model) and model.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters()), modifier_rank=None):
            if rank0:
                copy_into(model.module.state_dict())
        return
    if rank0:
        copy_into(unwrap(model).state_dict())


def optimizer_state(model, optimizer, master_weights: bool = False) -> object:
    """The optimizer state needed to resume, on rank 0 (None elsewhere). Call on every rank.

    ``single``/``ddp``: the (replicated) ``state_dict`` (with :class:`~tasks.update.precision.MasterWeights`, its
    float32 masters); FSDP2: ``{"optimizer": the full state from get_optimizer_state_dict(full_state_dict=True),
    "weights": the full float32 weights or None}`` (``master_weights``: the sharded parameters are the run's master
    weights, in another dtype than the policy's, so the checkpoint keeps them); DeepSpeed: every rank's ZeRO
    partition state (its fp32 partitions included), gathered in rank order (reloading needs the same world size,
    as DeepSpeed's own rigid checkpoints do).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        weights = full_state_dict(model) if master_weights else None
        sd = get_optimizer_state_dict(model, optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # a copy: on CPU it can alias the live AdamW moments
        return {"optimizer": _cpu(sd), "weights": weights or None} if is_rank0() else None
    if is_deepspeed(model):
        mine = _cpu(model.optimizer.state_dict())
        shards = [None] * dist.get_world_size() if is_rank0() else None
        dist.gather_object(mine, shards, dst=0)
        return {"deepspeed_shards": shards} if is_rank0() else None
    return _cpu(optimizer.state_dict()) if is_rank0() else None


def load_state(model, optimizer, model_state: dict | None, optim_state: object) -> None:
    """Load a full model state dict and :func:`optimizer_state`'s result (both given on rank 0). Every rank.

    FSDP2: the optimizer state's own float32 ``weights``, where it has them, take the place of ``model_state``."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if is_rank0() and "optimizer" in optim_state:  # else a state written before the weights were kept
            model_state = optim_state["weights"] or model_state
            optim_state = optim_state["optimizer"]
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        # the setters replace the given dicts' entries with DTensor shards: hand them copies
        set_model_state_dict(model, _cpu(model_state) if is_rank0() else {}, options=opts)
        set_optimizer_state_dict(model, optimizer, _cpu(optim_state) if is_rank0() else {}, options=opts)
        return
    inner = unwrap(model)
    if is_deepspeed(model):
        shards = optim_state["deepspeed_shards"] if is_rank0() else None
        box: list = [None]
        dist.scatter_object_list(box, shards, src=0)
        states = [None] * dist.get_world_size()
        states[dist.get_rank()] = box[0]
        if model.zero_optimization_stage() == 3:  # ZeRO-3 restores the weights from its fp32 partitions
            model.optimizer.load_state_dict(states, load_optimizer_states=True)
            return
        if is_rank0():
            inner.load_state_dict(model_state)
        broadcast_module(inner)
        model.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        return
    if is_rank0():
        inner.load_state_dict(model_state)
    broadcast_module(inner)
    box = [optim_state if is_rank0() else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    optimizer.load_state_dict(box[0])


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen full copy for the KL reference (taken before wrapping; every rank keeps its own)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
