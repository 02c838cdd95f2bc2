"""Sharded policy updates under ``torchrun``: rank 0 runs the pipeline, every rank runs each update.

Design (the simplest one that stays exactly equivalent to one process; see ``docs/scale-out.md``):

- Rank 0 runs the whole pipeline as usual (``flows/train_dist.py`` calls the same Prefect flow): selection,
  rewards, PODS, replay, ledger, MLflow, checkpoints, evaluation. Only rank 0 ever touches the ledger or the
  tracker.
- Ranks 1..W-1 run :func:`serve`: a loop that receives one command at a time from rank 0
  (``broadcast_object_list``) and takes part in it. The batch each rank trains on is rank 0's, bit for bit.
- Generation: from the first training step on (``overlap.lag`` 0, the in-process engine), every rank decodes a
  contiguous share of each ``generate`` call's prompts with its own weights and rank 0 gathers them
  (:meth:`Driver.share_generation`, the ``generate`` command, ``tasks/generation/rank_shared.py``); prompt b of a
  call is seeded by its index in the whole call, so the rollouts are the one-process run's. Before training
  (calibration, the plan's probes, the starting evaluation), with ``overlap.lag`` 1 (rank 0's generator process
  draws while every rank updates) and with vLLM servers, rank 0's engine generates alone.
- :class:`Driver` is rank 0's :class:`tasks.update.updater.Updater`. An update (:meth:`Driver.step`): rank 0
  broadcasts the step's ``RolloutGroup`` list, the run's ``LossSettings`` and the step's learning rate (set by
  :meth:`Driver.set_lr`, so a warm-up reaches every rank's optimizer: torch's ``param_groups``, or the
  DeepSpeed ZeRO optimizer's); every rank sets that lr and runs ``policy_update`` on its slice with the
  globally normalised loss (``tasks/update/distributed.py``); then the full weights are gathered to rank 0
  (collective under FSDP2 / ZeRO-3) and copied into ``policy.model``, so the next rollouts use them.
- Checkpoints (``tasks/training/checkpoint.py``): ``state_dict`` gathers the (possibly sharded) optimizer
  state to rank 0, ``load_state_dict`` pushes rank 0's restored weights and optimizer state to every rank.
  A resume needs the same backend and world size.

Costs: rank 0 holds its full generation copy next to its training replica (twice the weights; for DDP and
ZeRO-2 the replica is itself full), and each step moves the full weights once (gather + copy), as any rollout-weight
sync does. With every rank generating, ranks 1..W-1 under DDP and ZeRO-2 generate with their replica's own full module
(no copy while it is in the generation dtype), and under FSDP2 and ZeRO-3 keep a full copy in the generation dtype
(bf16 on a GPU: 2 bytes a parameter, ``tasks.generation.rank_shared.generation_copy_bytes``), gathered at every
``generate`` call (one more all-gather of the weights a call); each rank's KV cache holds its share's rows only; the
prompts go out and the completions come back as pickled objects (a few MB a step). The KL reference (``train.kl_coef >
0``) is a frozen full copy on every rank. Under ``bf16-mixed`` the weights every rank generates with stay bf16 and get
the new weights rounded from the float32 masters (FSDP2's gathered float32 shards, DDP's
:class:`~tasks.update.precision.MasterWeights`, DeepSpeed's own).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlcore.types import RolloutGroup
from tasks.generation.rank_shared import GenerationSetup, RankGenerator, RankSharedEngine
from tasks.generation.rollout import HFEngine
from tasks.model.attention import guard_attention
from tasks.update.distributed import DataShard, init_distributed, replica_dtype, wrap
from tasks.update.distributed_state import (
    broadcast_module,
    copy_full_weights,
    full_state_dict,
    load_state,
    optimizer_state,
    reference_copy,
)
from tasks.update.policy_update import gradient_checkpointing, policy_update
from tasks.update.precision import Precision, resolve_precision
from tasks.update.updater import LossSettings, Updater, UpdateResult, set_lr

INIT, UPDATE, OPT_STATE, LOAD, STOP = "init", "update", "optim_state", "load", "stop"
#: Every rank generating its share (tasks/generation/rank_shared.py): the engine's setup once, then each call.
GEN_INIT, GENERATE = "generation_init", "generate"


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
    """One rank's training copy: the wrapped model, its optimizer, the KL reference and the data shard.

    The replica is built in :func:`~tasks.update.distributed.replica_dtype` (float32 under FSDP2's mixed precision,
    else the compute dtype); the KL reference in the compute dtype."""

    def __init__(self, cfg, model: torch.nn.Module, precision: Precision):
        self.cfg, self.device, self.precision = cfg, _device(), precision
        guard_attention(self.device)  # this rank's process: cuDNN SDPA off on CUDA
        model = model.to(self.device, replica_dtype(cfg.scale.backend, precision))
        broadcast_module(model)  # every rank starts from rank 0's weights
        self.ref = reference_copy(model).to(precision.compute) if cfg.train.kl_coef > 0 else None
        gradient_checkpointing(model, cfg.train.gradient_checkpointing)
        tc = cfg.train
        factory = functools.partial(torch.optim.AdamW, lr=tc.lr, betas=tc.betas, eps=tc.adam_eps,
                                    weight_decay=tc.weight_decay)
        self.model, self.optimizer = wrap(model, factory, cfg, self.device, precision)
        self.shard = DataShard.current()
        #: FSDP2 under a mixed precision: the float32 shards are the master weights (the checkpoint keeps them)
        self.master_weights = cfg.scale.backend == "fsdp2" and precision.mixed

    def optimizer_state(self):
        return optimizer_state(self.model, self.optimizer, self.master_weights)

    def update(self, groups: Sequence[RolloutGroup], settings: LossSettings, lr: float) -> UpdateResult:
        set_lr(self.optimizer, lr)
        return policy_update(self.model, self.optimizer, groups, settings, ref_model=self.ref, device=self.device,
                             shard=self.shard)


class Driver(Updater):
    """Rank 0's :class:`~tasks.update.updater.Updater` for the sharded backends.

    Args:
        cfg: the run's config (broadcast to the other ranks, which build the model from its HF config).
        model: rank 0's full-weight policy (used for generation); updated in place after every step.
        settings: the loss settings of every step (sent with each update).

    Raises:
        ValueError: a DeepSpeed backend with ``settings.grad_clip`` other than ``train.grad_clip`` (DeepSpeed
            clips by its config).
    """

    def __init__(self, cfg, model: torch.nn.Module, settings: LossSettings):
        if settings.grad_clip != cfg.train.grad_clip and cfg.scale.backend.startswith("deepspeed"):
            raise ValueError(f"DeepSpeed clips by its config (train.grad_clip={cfg.train.grad_clip}), "
                             f"got grad_clip={settings.grad_clip}")
        if not dist.is_initialized():  # `rlsift run` with a sharded backend: a one-process group
            init_distributed(cfg.model.device)  # (e.g. DeepSpeed ZeRO-offload on one GPU)
        if dist.get_rank() != 0:
            raise RuntimeError("the Driver lives on rank 0; the other ranks run tasks.update.sharded_update.serve()")
        self.cfg, self.policy_model, self.settings = cfg, model, settings
        self.lr = cfg.train.lr
        self.precision = resolve_precision(cfg.model.precision, _device())
        _send(INIT, (cfg, model.config, self.precision))
        self.replica = _Replica(cfg, copy.deepcopy(model), self.precision)

    def step(self, groups: Sequence[RolloutGroup]) -> UpdateResult:
        """Every rank updates on its slice of ``groups`` with the current lr; rank 0's policy model gets the
        new full weights. Returns the update's result (the behaviour log-probs combined over ranks)."""
        _send(UPDATE, (groups, self.settings, self.lr))
        result = self.replica.update(groups, self.settings, self.lr)
        # collective for the sharded backends; FSDP2's float32 masters are rounded to the policy's dtype
        copy_full_weights(self.replica.model, self.policy_model)
        return result

    def set_lr(self, lr: float) -> None:
        """Takes effect at the next :meth:`step`, on every rank (the lr travels with the update command)."""
        self.lr = float(lr)

    def state_dict(self):
        _send(OPT_STATE)
        return self.replica.optimizer_state()

    def load_state_dict(self, state) -> None:
        """Call after ``policy.model`` holds the restored weights (``checkpoint.restore`` does so)."""
        _send(LOAD)
        load_state(self.replica.model, self.replica.optimizer, self.policy_model.state_dict(), state)

    def share_generation(self, engine: HFEngine) -> RankSharedEngine:
        """``engine`` (rank 0's, on ``policy.model``) as a :class:`~tasks.generation.rank_shared.RankSharedEngine`:
        from now on every rank decodes its share of each ``generate`` call with its own weights.

        Raises:
            ValueError: ``engine`` does not sample from this Driver's policy model.
        """
        if engine.model is not self.policy_model:
            raise ValueError("share_generation: the engine must sample from the Driver's policy model")
        _send(GEN_INIT, GenerationSetup(tokenizer=engine.tok, settings=engine.settings(),
                                        config=self.policy_model.config,
                                        dtype=next(self.policy_model.parameters()).dtype,
                                        backend=self.cfg.scale.backend))
        return RankSharedEngine(engine, self.replica.model, self.cfg.scale.backend,
                                functools.partial(_send, GENERATE))


def stop_workers() -> None:
    """Rank 0, at the end (also when no Driver was made, e.g. a run that failed before training)."""
    if dist.is_initialized() and dist.get_rank() == 0:
        _send(STOP)


def serve() -> None:
    """Ranks > 0: execute rank 0's commands until it sends ``stop``."""
    replica: _Replica | None = None
    generator: RankGenerator | None = None  # after GEN_INIT: this rank decodes its share of each call
    while True:
        cmd, payload = _recv()
        if cmd == STOP:
            return
        if cmd == INIT:
            from transformers import AutoModelForCausalLM

            cfg, config, precision = payload
            replica = _Replica(cfg, AutoModelForCausalLM.from_config(
                config, dtype=replica_dtype(cfg.scale.backend, precision)), precision)
            continue
        if replica is None:
            raise RuntimeError(f"rank {dist.get_rank()}: command {cmd!r} before {INIT!r}")
        if cmd == UPDATE:
            groups, settings, lr = payload
            replica.update(groups, settings, lr)
            full_state_dict(replica.model, to_cpu=False)
        elif cmd == OPT_STATE:
            replica.optimizer_state()
        elif cmd == LOAD:
            load_state(replica.model, replica.optimizer, None, None)
        elif cmd == GEN_INIT:
            generator = RankGenerator(replica.model, payload, replica.device)
        elif cmd == GENERATE:
            if generator is None:
                raise RuntimeError(f"rank {dist.get_rank()}: command {cmd!r} before {GEN_INIT!r}")
            generator.run(payload)
        else:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown command {cmd!r}")
