"""Run by ``tests/tasks/test_precision_dist.py`` under ``torchrun --nproc_per_node 2``: ``bf16-mixed`` on the sharded
backends.

For each backend named on the command line every rank builds the training replica as a run's ``Driver`` and
``serve`` build it (``tasks.update.sharded_update._Replica`` of a bf16 model under ``model.precision=bf16-mixed``),
takes ``STEPS`` updates on tests/tasks/test_precision.py's fixed batch and reads its float32 master weights before
and after (:func:`master_weights`: DDP's ``MasterWeights``, FSDP2's float32 shards gathered, DeepSpeed's fp32
partitions through ``safe_get_full_fp32_param``). Then, for the ``RESUME`` backends named, the training loop's
path: rank 0's ``Driver`` takes 2 steps, its ``state_dict`` is kept with the policy's bf16 weights, it takes 2
more; a second ``Driver`` on another start is restored from the kept state and takes the same 2: the policy's
weights must be equal. Rank 0 writes everything to ``OUT`` (a ``torch.save`` file).
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

from tasks.model.loading import build_tiny_model
from tasks.update.distributed import init_distributed, is_deepspeed, is_rank0
from tasks.update.distributed_state import full_state_dict
from tasks.update.precision import MasterWeights, resolve_precision
from tasks.update.sharded_update import Driver, _Replica, serve, stop_workers
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h
from tests.tasks.test_precision import STEPS, updater_config

#: Backends whose Driver is checkpointed and resumed under bf16-mixed.
RESUME = ("ddp", "fsdp2")


def master_weights(replica: _Replica) -> dict[str, torch.Tensor]:
    """The replica's float32 master weights by name, on rank 0 (collective for FSDP2 and DeepSpeed)."""
    model, opt = replica.model, replica.optimizer
    if is_deepspeed(model):
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.module.named_parameters()}
    if isinstance(opt, MasterWeights):  # DDP: the masters in the module's parameter order
        names = [n for n, _ in model.module.named_parameters()]
        return {n: m.detach().clone() for n, m in zip(names, opt.masters, strict=True)}
    return full_state_dict(model)  # FSDP2: the float32 shards are the masters


def replica_update(backend: str) -> dict:
    cfg = updater_config("bf16-mixed", backend)
    precision = resolve_precision("bf16-mixed", torch.device("cpu"))
    model = h.tiny_model()
    batch = h.make_batch(model)
    replica = _Replica(cfg, model.to(torch.bfloat16), precision)
    settings = LossSettings.from_config(cfg, h.PAD)
    start = master_weights(replica)
    stats = [replica.update(copy.deepcopy(batch), settings, cfg.train.lr) for _ in range(STEPS)]
    end = master_weights(replica)
    dtypes = sorted({str(p.dtype) for p in replica.model.parameters()})
    return {"start": start, "end": end, "micro_batches": stats[0].metrics["train/micro_batches"],
            "replica_dtypes": dtypes}


def driver_resume(backend: str) -> dict | None:
    """Rank 0: the policy's weights after 4 steps, uninterrupted and resumed from the state after 2."""
    if not is_rank0():
        serve()
        serve()
        return None
    cfg = updater_config("bf16-mixed", backend, lr=1e-3)
    batch = h.make_batch(h.tiny_model())
    settings = LossSettings.from_config(cfg, h.PAD)

    def policy(seed: int) -> torch.nn.Module:
        return build_tiny_model(hidden=64, layers=2, heads=2, seed=seed).to(torch.bfloat16)

    model = policy(0)
    driver = Driver(cfg, model, settings)
    for _ in range(2):
        driver.step(copy.deepcopy(batch))
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": driver.state_dict()})
    for _ in range(2):
        driver.step(copy.deepcopy(batch))
    stop_workers()
    again = policy(7)
    resumed = Driver(cfg, again, settings)
    again.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    for _ in range(2):
        resumed.step(copy.deepcopy(batch))
    stop_workers()
    return {"uninterrupted": {k: v.clone() for k, v in model.state_dict().items()},
            "resumed": {k: v.clone() for k, v in again.state_dict().items()},
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def main(out: str, backends: list[str]) -> None:
    torch.set_num_threads(1)
    init_distributed("cpu")
    results = {b: replica_update(b) for b in backends}
    for backend in (b for b in RESUME if b in backends):
        results[f"resume/{backend}"] = driver_resume(backend)
    if is_rank0():
        torch.save(results, out)
    dist.barrier()  # leave together (DeepSpeed's shared-memory comm threads: dist_update_helper.py)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
