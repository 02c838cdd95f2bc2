"""Which precision a run trains in (``model.precision``): the dtype the forward and backward passes compute in, and
the dtype the weights the optimizer steps are kept in.

Mixed precision as the field runs it (Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740, section 3;
bf16 needs no loss scaling, Kalamkar et al., arXiv 1905.12322): the passes run in bf16, the optimizer steps float32
master weights with float32 AdamW moments, and the bf16 weights are a copy of the master made after each step.
Without the master copy an AdamW step of about ``lr`` is rounded away on a bf16 weight whose spacing is larger than
twice the step (a weight of 0.02 has a spacing of 1.2e-4): at lr 1e-6 under a quarter of the update survives.

- ``auto``: ``bf16-mixed`` on a CUDA device with bf16, ``fp32`` elsewhere (a CPU computes bf16 matmuls slowly).
- ``bf16-mixed``: bf16 compute, float32 master weights and optimizer state (16 bytes a trained parameter with
  AdamW while the passes run: 2 bf16 weight, 2 bf16 gradient, 4 master, 8 moments; docs/performance.md).
- ``fp32``: everything in float32.
- ``bf16-true``: weights, gradients and AdamW state all in bf16 (8 bytes a parameter). Small updates are lost;
  only when asked for by name, with a warning.

Who keeps the masters (docs/performance.md, "Precision"): :class:`MasterWeights` for one process and DDP (built by
:func:`build_optimizer`); FSDP2's float32 shards under ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=float32)`` (tasks/update/distributed.py ``wrap``); DeepSpeed's own fp32 partitions (its ``bf16``
config). LoRA's adapters are held in the compute dtype like every other weight (tasks/model/lora.py), so their
masters are :class:`MasterWeights`' too.

AdamW's kernel (:func:`adamw_kernel`): torch's fused AdamW where torch has it (CUDA, and the CPU since torch 2.4:
one pass over each tensor, no temporaries), the multi-tensor ``foreach`` one elsewhere; both give the single-tensor
loop's result to float32 rounding (tests/tasks/test_precision.py). On this project's 2-core CPU the fused step of
13M float32 parameters took 99 ms against 356 ms for the loop and 514 ms for ``foreach`` (docs/performance.md,
"LoRA's speed").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tasks.config.model import PRECISIONS, PrecisionName  # noqa: F401  (the config's values; this module's API)

log = logging.getLogger(__name__)


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

    def bytes_per_trained_param_at_step(self, optimizer_moments: int = 2) -> int:
        """The same during the optimizer step, when no activation is held: under a mixed precision
        :meth:`MasterWeights.master_gradients` has replaced the bf16 gradients by float32 ones (18 bytes with AdamW
        under bf16-mixed, against 16 while the passes run). Not counted: the temporaries of torch's foreach AdamW
        (a float32 square root of the second moments, 4 bytes a parameter, in any precision)."""
        extra = _size(self.master) - _size(self.compute) if self.mixed else 0
        return self.bytes_per_trained_param(optimizer_moments) + extra


#: Device types with torch's fused AdamW kernel (torch 2.13) that this project runs on.
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def adamw_kernel(device: torch.device | str) -> dict[str, bool | None]:
    """``torch.optim.AdamW``'s kernel arguments on ``device``: fused where torch has the kernel
    (:data:`FUSED_ADAMW_DEVICES`), ``foreach`` (multi-tensor) elsewhere."""
    if torch.device(device).type in FUSED_ADAMW_DEVICES:
        return {"fused": True, "foreach": False}
    return {"fused": None, "foreach": True}


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_warned: set[str] = set()


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The precision ``model.precision`` names on ``device`` (``auto``: ``bf16-mixed`` on a CUDA device with bf16,
    else ``fp32``); ``bf16-true`` logs what it costs (once a process)."""
    if name not in PRECISIONS:
        raise ValueError(f"model.precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if name == "auto":
        name = "bf16-mixed" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, torch.float32)
    if name == "bf16-true":
        _warn_once()
        return Precision(name, torch.bfloat16, torch.bfloat16)
    return Precision(name, torch.bfloat16, torch.float32)


def _warn_once() -> None:
    if "bf16-true" not in _warned:
        _warned.add("bf16-true")
        log.warning("model.precision=bf16-true: weights and AdamW state in bf16; an update smaller than half a bf16 "
                    "weight's spacing is rounded away (at lr 1e-6 most of it). Use bf16-mixed to keep float32 "
                    "master weights (docs/performance.md)")


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating-point weight (under LoRA the base model's: its adapters may differ)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point weights")


class MasterWeights:
    """An optimizer over float32 master copies of lower-precision parameters (``bf16-mixed``'s optimizer).

    The model keeps its compute-dtype weights (what the forward and backward passes and the in-process sampler
    use); ``make_optimizer`` (e.g. a ``functools.partial`` of ``torch.optim.AdamW``) builds the real optimizer over
    a float32 master copy of each parameter, so its moments are float32 too. A parameter already in float32 is
    its own master: no copy.

    A step (:func:`tasks.update.distributed.optimizer_step`): :meth:`master_gradients` moves each accumulated
    gradient into its master's ``.grad`` as float32 (the compute-dtype gradient is freed as it goes), the caller
    clips and checks those, :meth:`step` steps the masters, copies them, rounded, into the model's weights and
    frees the float32 gradients (4 bytes a trained parameter that would otherwise stay through the next
    generation). A skipped step (:meth:`zero_grad` without :meth:`step`) leaves both untouched.

    Gradients accumulate over micro-batches in the parameters' own dtype (autograd's and DDP's buckets, unchanged)
    and are upcast once a step. Deviation from Megatron-LM and DeepSpeed's bf16 optimizer, which accumulate into a
    float32 buffer from a hook: that buffer costs 2 more bytes a parameter while the passes run (18 against 16),
    and each micro-batch's bf16 gradient is already rounded to bf16 by autograd, so a bf16 running sum adds an
    error of the size each term already carries (measured in docs/performance.md, "Precision": the update's
    norm and direction within 0.5 % of float32 accumulation at 8 micro-batches).
    """

    def __init__(self, params, make_optimizer, master: torch.dtype = torch.float32):
        self.params: list[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.masters: list[torch.Tensor] = [
            p if p.dtype == master else torch.nn.Parameter(p.detach().to(master), requires_grad=True)
            for p in self.params]
        self.copied = [i for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)) if m is not p]
        self.optimizer: torch.optim.Optimizer = make_optimizer(self.masters)

    @property
    def param_groups(self) -> list[dict]:
        """The real optimizer's groups (``lr`` is set here)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The real optimizer's per-master state (AdamW's moments, float32)."""
        return self.optimizer.state

    def copies(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its master) for each parameter held in another dtype than its master."""
        return [(self.params[i], self.masters[i]) for i in self.copied]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's and the masters' gradients."""
        for i in self.copied:
            self.params[i].grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def master_gradients(self) -> list[torch.Tensor]:
        """Move the model's accumulated gradients into the masters' ``.grad`` (float32); returns the masters (what
        to clip: the same norm as the model's gradients, computed in float32)."""
        for i in self.copied:
            p, m = self.params[i], self.masters[i]
            if p.grad is not None:
                m.grad = p.grad.to(m.dtype)
                p.grad = None
        return self.masters

    @torch.no_grad()
    def step(self) -> None:
        """Step the masters (call :meth:`master_gradients` first), round them into the model's weights and free
        the masters' gradients."""
        self.master_gradients()  # a no-op when the caller already moved them
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._copy_out()

    @torch.no_grad()
    def _copy_out(self) -> None:
        for i in self.copied:
            self.params[i].copy_(self.masters[i])

    def state_dict(self) -> dict:
        """The real optimizer's state (its live tensors, as torch's ``state_dict`` gives them) and the float32
        masters of the copied parameters (by position), copied to the host: a copy on the device would hold
        another 4 bytes a trained parameter there while a checkpoint is written."""
        return {"optimizer": self.optimizer.state_dict(),
                "master": {i: self.masters[i].detach().to("cpu", copy=True) for i in self.copied}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s result; the model's weights become the restored masters, rounded. A plain
        optimizer state (a checkpoint written before master weights existed) restarts the masters from the model's
        weights."""
        if "master" not in state:
            self.optimizer.load_state_dict(state)
            for i in self.copied:
                self.masters[i].copy_(self.params[i])
            return
        if sorted(state["master"]) != self.copied:
            raise ValueError(f"the checkpoint's master weights ({len(state['master'])} tensors) do not match this "
                             f"model's ({len(self.copied)} in {self.masters[0].dtype if self.masters else '-'}): "
                             "another model or model.precision")
        for i, t in state["master"].items():
            self.masters[i].copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self._copy_out()


#: What ``torch.optim.AdamW`` takes back from its ``defaults`` (the rest it sets itself).
ADAMW_ARGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable", "differentiable")


def build_optimizer(params: Iterable[torch.nn.Parameter],
                    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], precision: Precision):
    """The optimizer of a single-process or DDP update under ``precision``: :class:`MasterWeights` when it is mixed,
    else ``make_optimizer(params)`` (float32 everywhere, or bf16-true's bf16 weights and moments). An AdamW that
    ``make_optimizer`` builds runs :func:`adamw_kernel`'s kernel for the parameters' device, whatever it asked."""
    params = list(params)

    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = make_optimizer(tensors)
        if type(opt) is torch.optim.AdamW and tensors:  # no state yet: built again, its groups, with the kernel
            kernel = adamw_kernel(tensors[0].device)
            settings = {k: v for k, v in opt.defaults.items() if k in ADAMW_ARGS} | kernel
            opt = torch.optim.AdamW([g | kernel for g in opt.param_groups], **settings)
        return opt

    if precision.mixed:
        return MasterWeights(params, make, precision.master)
    return make(params)
