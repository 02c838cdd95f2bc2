"""Sharded policy updates under ``torchrun``: rank 0 runs the pipeline, every rank runs each update.

Design (the simplest one that stays exactly equivalent to one process; see ``docs/scale-out.md``):

- Rank 0 runs the whole pipeline as usual (``flows/train_dist.py`` calls the same Prefect flow): selection,
  generation (HF engine on its full-weight ``policy.model``, or the vLLM server), rewards, PODS, replay,
  ledger, MLflow, checkpoints, evaluation. Only rank 0 ever touches the ledger or the tracker.
- Ranks 1..W-1 run :func:`serve`: a loop that receives one command at a time from rank 0
  (``broadcast_object_list``) and takes part in it. Generation is not repeated on every rank (no seed-lock
  across processes, no W-fold reward work), and the batch each rank trains on is rank 0's, bit for bit.
- An update (:meth:`Driver.update`, with ``tasks.training.update.policy_update``'s signature): rank 0 broadcasts the
  step's ``RolloutGroup`` list and loss settings; every rank runs ``policy_update`` on its slice with the
  globally normalised loss (``tasks/training/distributed.py``); then the full weights are gathered to rank 0
  (collective under FSDP2 / ZeRO-3) and copied into ``policy.model``, so the next rollouts use them.
- Checkpoints: :class:`Driver` stands in for the optimizer in ``tasks/training/checkpoint.py``: ``state_dict``
  gathers the (possibly sharded) optimizer state to rank 0, ``load_state_dict`` pushes rank 0's restored
  weights and optimizer state to every rank. A resume needs the same backend and world size.

Costs: rank 0 holds its full generation copy next to its training replica (twice the weights; for DDP and
ZeRO-2 the replica is itself full), and each step moves the full weights once (gather + copy), as any
rollout-weight sync does. The KL reference (``train.kl_coef > 0``) is a frozen full copy on every rank.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

from rlcore.angle import online_angle_signal
from tasks.training.distributed import (
    DataShard,
    broadcast_module,
    full_state_dict,
    init_distributed,
    is_deepspeed,
    load_state,
    optimizer_state,
    reference_copy,
    wrap,
)
from tasks.training.update import policy_update

INIT, UPDATE, OPT_STATE, LOAD, STOP = "init", "update", "optim_state", "load", "stop"


def _send(cmd: str, payload=None) -> None:
    if dist.get_world_size() > 1:
        dist.broadcast_object_list([(cmd, payload)], src=0)


def _recv():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class _Replica:
    """One rank's training copy: the wrapped model, its optimizer, the KL reference and the data shard."""

    def __init__(self, cfg, model: torch.nn.Module):
        self.cfg, self.device = cfg, _device()
        model = model.to(self.device)
        broadcast_module(model)  # every rank starts from rank 0's weights
        self.ref = reference_copy(model) if cfg.train.kl_coef > 0 else None
        tc = cfg.train
        factory = functools.partial(torch.optim.AdamW, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
        self.model, self.optimizer = wrap(model, factory, cfg, self.device)
        self.shard = DataShard.current()

    def update(self, groups, settings: dict) -> dict[str, float]:
        settings = dict(settings)
        angle = settings.pop("angle")
        stats = policy_update(self.model, self.optimizer, groups, ref_model=self.ref, device=self.device,
                              angle_fn=online_angle_signal if angle else None, shard=self.shard, **settings)
        return stats


class Driver:
    """Rank 0's handle on the sharded update: optimizer-like for checkpoints, ``update`` for the train loop.

    Args:
        cfg: the run's config (broadcast to the other ranks, which build the model from its HF config).
        model: rank 0's full-weight policy (used for generation); updated in place after every step.
    """

    def __init__(self, cfg, model: torch.nn.Module):
        if not dist.is_initialized():  # `rlsift run` with a sharded backend: a one-process group
            init_distributed(cfg.model.device)  # (e.g. DeepSpeed ZeRO-offload on one GPU)
        if dist.get_rank() != 0:
            raise RuntimeError("the Driver lives on rank 0; the other ranks run tasks.training.sharded_update.serve()")
        self.cfg, self.policy_model = cfg, model
        dtype = next(model.parameters()).dtype
        _send(INIT, (cfg, model.config, dtype))
        self.replica = _Replica(cfg, copy.deepcopy(model))

    def update(self, model, optimizer, groups, *, grad_clip: float, ref_model=None, device=None, angle_fn=None,
               **settings) -> dict[str, float]:
        """``policy_update``'s signature; ``model``/``optimizer``/``ref_model``/``device`` are the ranks' own."""
        if grad_clip != self.cfg.train.grad_clip and is_deepspeed(self.replica.model):
            raise ValueError(f"DeepSpeed clips by its config (train.grad_clip={self.cfg.train.grad_clip}), "
                             f"got grad_clip={grad_clip}")
        settings = {**settings, "grad_clip": grad_clip, "angle": angle_fn is not None}
        _send(UPDATE, (groups, settings))
        stats = self.replica.update(groups, settings)
        state = full_state_dict(self.replica.model, to_cpu=False)  # collective for the sharded backends
        with torch.no_grad():
            self.policy_model.load_state_dict(state)
        return stats

    def state_dict(self):
        _send(OPT_STATE)
        return optimizer_state(self.replica.model, self.replica.optimizer)

    def load_state_dict(self, state) -> None:
        """Call after ``policy.model`` holds the restored weights (``checkpoint.restore`` does so)."""
        _send(LOAD)
        load_state(self.replica.model, self.replica.optimizer, self.policy_model.state_dict(), state)


def stop_workers() -> None:
    """Rank 0, at the end (also when no Driver was made, e.g. a run that failed before training)."""
    if dist.is_initialized() and dist.get_rank() == 0:
        _send(STOP)


def serve() -> None:
    """Ranks > 0: execute rank 0's commands until it sends ``stop``."""
    replica: _Replica | None = None
    while True:
        cmd, payload = _recv()
        if cmd == STOP:
            return
        if cmd == INIT:
            from transformers import AutoModelForCausalLM

            cfg, config, dtype = payload
            replica = _Replica(cfg, AutoModelForCausalLM.from_config(config, dtype=dtype))
            continue
        if replica is None:
            raise RuntimeError(f"rank {dist.get_rank()}: command {cmd!r} before {INIT!r}")
        if cmd == UPDATE:
            groups, settings = payload
            replica.update(groups, settings)
            full_state_dict(replica.model, to_cpu=False)
        elif cmd == OPT_STATE:
            optimizer_state(replica.model, replica.optimizer)
        elif cmd == LOAD:
            load_state(replica.model, replica.optimizer, None, None)
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown command {cmd!r}")
