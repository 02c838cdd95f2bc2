"""Training backends beyond one process: torch DDP, FSDP2, DeepSpeed ZeRO-2/3 (config ``scale.backend``).

Every backend here is the real library, launched with ``torchrun`` (``flows/train_dist.py``); nothing is
re-implemented. Communication is gloo on CPU and NCCL on CUDA (docs/scale-out.md).

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``; every rank holds the full model and optimizer.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the classes the model lists in
  ``_no_split_modules``) and then on the root, over ``init_device_mesh(device_type, (world,))``; params,
  grads and AdamW state are DTensor shards. The tied embedding / LM head sit in the root group.
- ``deepspeed_zero2`` / ``deepspeed_zero3``: ``deepspeed.initialize`` with ZeRO stage 2 or 3, a *torch*
  ``AdamW`` as client optimizer (no JIT-built ``fused_adam``/``cpu_adam``), gradient clipping by the DS
  config (``gradient_clipping``), ``offload_optimizer: {device: cpu}`` when ``scale.offload_optimizer``
  (with the torch optimizer kept, so ``zero_force_ds_cpu_optimizer`` is off: ``DeepSpeedCPUAdam`` would be
  faster on a GPU host but needs a ~45 s JIT build). bf16/fp16 follow the model's dtype; DeepSpeed then keeps
  fp32 master weights and moments itself (ZeRO's fp32 partitions).

Precision (``model.precision``, tasks/update/precision.py): under ``bf16-mixed`` DDP's replica holds bf16 weights
and steps float32 masters (:class:`~tasks.update.precision.MasterWeights`, as the single process does); FSDP2's
sharded parameters are float32 and ``fully_shard``'s ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=float32)`` gathers them as bf16 for the passes and reduce-scatters float32 gradients.

Data parallelism and the loss (``DataShard``, used by ``policy_update.py``): every rank sees the same batch of
groups and cuts the same micro-batches (tasks/update/minibatch.py); the rows of each micro-batch are split into
``world`` contiguous slices and rank r computes slice r. All three libraries *average* gradients over ranks, so
rank r must return ``world * (its share of the global loss)``. With token aggregation the global loss is
``sum over all tokens / N_tok`` (N_tok: valid tokens of the whole minibatch, known to every rank since every rank
has the batch), and rank r's local ``clipped_policy_loss`` on a slice is ``S_r / n_r``; multiplying it by
``world * n_r / N_tok`` gives ``world * S_r / N_tok``, whose rank average summed over micro-batches is exactly the
single-process loss (``sum S / N_tok``), hence the same gradient. Sequence aggregation is the same with "sequences
with at least one valid token" in place of tokens. Normalising each rank by its own count (a plain mean of
per-rank means) would weight tokens unevenly whenever slices differ in length; that is the bias avoided.
Metrics are weighted the same way and summed over ranks, so ``train/loss`` is the global loss.
A rank whose slice has no valid token contributes ``0 * sum(logp)`` so its backward (and the collectives
in it) still runs. Each micro-batch has at least one row per rank. Gradients are reduced once per minibatch
(:func:`gradient_sync`), at its last micro-batch.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tasks.model.wrappers import is_deepspeed
from tasks.update.precision import MasterWeights, Precision, build_optimizer, model_dtype

BACKENDS = ("single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")
#: Metrics that are aggregated like the loss (the rest are token-level means).
LOSS_LIKE = ("train/loss", "train/pg_loss", "train/kl")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment (RANK, WORLD_SIZE, ...).

    Without torchrun's variables a one-process group is created (127.0.0.1, a free port), so the sharded
    backends also run in a plain process (e.g. DeepSpeed ZeRO-offload on one GPU). gloo on CPU, NCCL on CUDA;
    on CUDA each rank uses ``cuda:LOCAL_RANK``. ``timeout_s`` (default ``$RLSIFT_DIST_TIMEOUT_S`` or 7200)
    must cover the longest stage rank 0 runs alone (evaluation, scoring) while the others wait.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("RLSIFT_DIST_TIMEOUT_S", 7200)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=dev if cuda else None)
    return DistInfo(rank, world, local, dev)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_rank0() -> bool:
    """True in a plain process and on rank 0 of a process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks to shard one by one: modules whose class is in HF's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found for FSDP2 (its _no_split_modules: "
                         f"{sorted(names) or 'none'})")
    return layers


def deepspeed_config(stage: int, *, grad_clip: float, dtype: torch.dtype, offload_optimizer: bool) -> dict:
    """The DeepSpeed config of one engine: ``step`` is the accumulation boundary (the update runs its own
    micro-batches and minibatches)."""
    zero: dict = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # the update's micro-batches accumulate; its step() is the boundary
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def replica_dtype(backend: str, precision: Precision) -> torch.dtype:
    """The dtype of a rank's training replica: the master dtype for FSDP2 under a mixed precision (its
    ``MixedPrecisionPolicy`` computes in bf16 from float32 shards), the compute dtype otherwise (DDP's
    :class:`~tasks.update.precision.MasterWeights` and DeepSpeed keep their own float32 masters)."""
    return precision.master if backend == "fsdp2" and precision.mixed else precision.compute


def wrap(model: torch.nn.Module, optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
         cfg, device: torch.device | None = None, precision: Precision | None = None):
    """Wrap ``model`` for ``cfg.scale.backend`` and build its optimizer. Call on every rank.

    Args:
        model: the full model, identical on every rank (e.g. after :func:`broadcast_module`), in
            :func:`replica_dtype`.
        optimizer_factory: ``params -> optimizer`` (e.g. a ``functools.partial`` of ``torch.optim.AdamW``).
        cfg: the :class:`tasks.config.Config` (``scale.backend``, ``scale.offload_optimizer``, ``train.grad_clip``).
        device: where the rank computes (default: cuda:LOCAL_RANK when the group is NCCL, else cpu).
        precision: the run's resolved ``model.precision``; None: the model's own dtype throughout.

    Returns:
        (engine-like model, optimizer-like): call :func:`backward_step` with both.
    """
    backend = cfg.scale.backend
    if backend not in BACKENDS:
        raise ValueError(f"scale.backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "single" and not dist.is_initialized():
        raise RuntimeError(f"scale.backend={backend} needs a process group: launch with torchrun "
                           "(torchrun --nproc_per_node N -m flows.train_dist ...) or call init_distributed()")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
    model = model.to(device)
    mixed = precision is not None and precision.mixed
    if mixed and model_dtype(model) != replica_dtype(backend, precision):
        raise ValueError(f"scale.backend={backend} under model.precision={precision.name} wraps a "
                         f"{replica_dtype(backend, precision)} replica, got {model_dtype(model)} weights")
    if backend in ("single", "ddp") and precision is not None:  # mixed: bf16 weights, float32 masters, moments
        optimizer_factory = functools.partial(build_optimizer, make_optimizer=optimizer_factory, precision=precision)
    if backend == "single":
        return model, optimizer_factory(model.parameters())
    if backend == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)
        if model_dtype(model) != torch.float32:  # bf16 buckets: summed over ranks in float32, as FSDP2 does
            ddp.register_comm_hook(None, float32_allreduce)
        return ddp, optimizer_factory(ddp.parameters())
    if backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.master) if mixed \
            else MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, optimizer_factory(model.parameters())
    import deepspeed

    stage = 2 if backend == "deepspeed_zero2" else 3
    dtype = next(model.parameters()).dtype
    config = deepspeed_config(stage, grad_clip=cfg.train.grad_clip, dtype=dtype,
                              offload_optimizer=cfg.scale.offload_optimizer)
    with contextlib.redirect_stdout(sys.stderr):  # it prints op-build notes; stdout may carry a --json result
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_factory(model.parameters()),
                                                       config=config)
    return engine, optimizer


def float32_allreduce(group: dist.ProcessGroup | None, bucket):  # DDP compares the bucket's annotation with
    # dist.GradBucket itself, which this module's postponed annotations (strings) would fail: none given
    """DDP communication hook: the bucket's (a ``dist.GradBucket``) mean over ranks computed in float32 (upcast,
    divided by the world size, all-reduced, cast back into the bucket); returns the future of the bucket. DDP's own
    hook sums a bf16 bucket in bf16, which rounds at every partial sum of the ring (world - 1 times); FSDP2's
    ``reduce_dtype=float32`` and DeepSpeed reduce in float32. ``group``: the process group (None: the default)."""
    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(narrow)


def all_finite(loss: torch.Tensor) -> bool:
    """Whether ``loss`` is finite on every rank (one all-reduce when a process group is up)."""
    ok = torch.isfinite(loss.detach()).all().to(torch.float32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() > 0)


def zero_grad(model, optimizer) -> None:
    """Before a minibatch's first micro-batch: no gradient left (DeepSpeed's engine clears its own in ``step``)."""
    if not is_deepspeed(model):
        optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def gradient_sync(model, last: bool):
    """A micro-batch's forward and backward: DDP reduces gradients over ranks only in the minibatch's ``last``
    (``no_sync`` before it); a local no-op in one process and under DeepSpeed, whose engine runs with
    ``managed_gradient_accumulation: false`` (:func:`deepspeed_config`), so its ``step`` is the accumulation
    boundary. FSDP2 reduce-scatters every micro-batch into its sharded gradients: deferring it
    (``set_requires_gradient_sync(False)``) keeps every rank's unsharded gradient between micro-batches, the whole
    model's (a 7B's 14 GiB in bf16, tasks/update/memory_check.py), to save one reduce-scatter a micro-batch (a 7B's
    28 GB in float32 over NVLink, about 0.15 s against the 1-2 s of a micro-batch's backward pass it overlaps)."""
    if not last and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def backward(model, loss: torch.Tensor) -> None:
    """Accumulate ``loss``'s gradient (DeepSpeed: ``engine.backward``)."""
    if is_deepspeed(model):
        model.backward(loss)
    else:
        loss.backward()


def optimizer_step(model, optimizer, grad_clip: float, finite: bool = True) -> float:
    """Clip the accumulated gradients to ``grad_clip`` and take one optimizer step; returns the pre-clip global
    gradient norm.

    DeepSpeed engines use ``engine.step`` (the clip is in their config); the others ``clip_grad_norm_`` (a DTensor
    norm for FSDP2, made whole with ``full_tensor``) and ``optimizer.step``.

    NaN never reaches the weights: when ``finite`` is False (a micro-batch's loss was not finite on some rank) or
    the global gradient norm is not finite, the update is not applied; the gradients are dropped and the returned
    norm is NaN (or inf), which is how the caller knows (``policy_update`` counts it in ``train/skipped_updates``
    and logs why). The norm is global, so every rank takes the same decision. Deviation: DeepSpeed's engine cannot
    drop the gradients it has accumulated, so there a non-finite micro-batch is left out of the backward pass
    (``policy_update``) and the step applies the others; a finite loss with a non-finite gradient is left to
    DeepSpeed's own overflow check (fp16's loss scaler skips such steps).
    """
    if is_deepspeed(model):
        model.step()
        return float(model.get_global_grad_norm() or 0.0)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        return float("nan")
    # bf16-mixed: clip (and check) the float32 master gradients, not the bf16 ones (tasks/update/precision.py)
    params = optimizer.master_gradients() if isinstance(optimizer, MasterWeights) else model.parameters()
    gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(gnorm, "full_tensor"):
        gnorm = gnorm.full_tensor()
    gnorm = float(gnorm)
    if math.isfinite(gnorm):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    return gnorm


def backward_step(model, optimizer, loss: torch.Tensor, grad_clip: float) -> float:
    """One loss, one step: :func:`zero_grad`, :func:`backward` and :func:`optimizer_step` (a loss that is not
    finite on any rank is not backpropagated, and the step is skipped)."""
    zero_grad(model, optimizer)
    if not all_finite(loss):
        return optimizer_step(model, optimizer, 0.0, finite=False) if not is_deepspeed(model) else float("nan")
    backward(model, loss)
    return optimizer_step(model, optimizer, grad_clip)


@dataclass(frozen=True)
class DataShard:
    """This rank's slice of every minibatch, and the sums that make the sharded loss the global one."""

    rank: int
    world: int

    @classmethod
    def current(cls) -> DataShard:
        return cls(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else cls(0, 1)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rank r's contiguous part of ``rows`` [n] (``torch.tensor_split`` into ``world`` parts)."""
        if rows.numel() < self.world:
            raise ValueError(f"a minibatch of {rows.numel()} rollouts cannot be split over {self.world} ranks: "
                             "use more prompts per step or fewer train.minibatches")
        return torch.tensor_split(rows, self.world)[self.rank]

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (a copy; CPU tensors go through the group's device)."""
        if self.world == 1:
            return t.clone()
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
        out = t.to(dev, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each key's sum over ranks (a rank may lack a key: it adds 0); collective."""
        if self.world == 1:
            return dict(metrics)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, metrics)
        out: dict[str, float] = {}
        for m in gathered:
            for k, v in m.items():
                out[k] = out.get(k, 0.0) + v
        return out
