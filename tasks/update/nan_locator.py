"""Where a non-finite value first appears in one micro-batch's forward and backward pass (:func:`locate`).

The update skips a minibatch whose loss or gradient is not finite (tasks/update/distributed.py ``optimizer_step``);
that keeps NaN out of the weights but says nothing of its cause. :func:`locate` re-runs the micro-batch with hooks
on every module and reports the first non-finite value as a :class:`NonFiniteSite`: the module, the phase (its
forward, its forward recomputed under activation checkpointing, its backward), the rows and positions, the dtype,
and the attention the model ran (``config._attn_implementation``, the SDPA backends enabled and the kernel PyTorch
picks for the first attention call, with the call's length and mask). It runs only when something was already not
finite, so a finite update pays nothing.

How the backward site is named: a hook on each module's output tensors and inputs sees their gradients in the
order the backward computes them. A module is *open* once the gradient of its output has arrived and until that of
its input has: its backward is running. The first non-finite gradient then lies inside the innermost open module
(the gradient of a ``q_proj`` output turned NaN by the attention kernel names the attention module, whose output
gradient was finite), or, when it is a parameter's gradient, in that parameter's module.

:class:`SkippedUpdate` is what the update hands on about each skipped minibatch (``policy_update``'s ``skips``):
the cause (loss, the loss's other inputs, gradient) and the site, for the log, the ledger and the run's stop
(tasks/update/skip_guard.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.overrides import TorchFunctionMode

#: How many non-finite (row, position) cells a site lists.
CELLS = 4
Phase = Literal["forward", "recompute", "backward", "loss"]
Cause = Literal["loss", "inputs", "gradient"]


@dataclass(frozen=True)
class AttentionInfo:
    """The attention a pass ran: ``implementation`` (the model config's ``_attn_implementation``), ``enabled``
    (the SDPA backends ``torch.backends.cuda`` allows, e.g. ``flash+mem_efficient+math+cudnn``), and of the first
    ``scaled_dot_product_attention`` call: ``kernel`` (the backend PyTorch picks for its arguments, e.g.
    ``CUDNN_ATTENTION``; empty when no SDPA call ran or the choice cannot be read), ``length`` (the query length, the
    padded one on the padded path), ``mask`` (``bool``, a float dtype, or ``none``) and ``causal``."""

    implementation: str
    enabled: str
    kernel: str = ""
    length: int = 0
    mask: str = ""
    causal: bool = False

    def describe(self) -> str:
        call = f", kernel {self.kernel} on length {self.length} ({self.length % 128} mod 128), mask {self.mask}" \
               f"{', causal' if self.causal else ''}" if self.kernel else ""
        return f"attention {self.implementation} (SDPA backends {self.enabled}{call})"


@dataclass(frozen=True)
class NonFiniteSite:
    """The first non-finite value of a micro-batch's pass (:func:`locate`).

    Attributes:
        module: the module's qualified name in the located model (``model.layers.3.self_attn``); the model's class
            name for its own top-level code; ``loss`` when every module's output and gradient was finite up to a
            non-finite loss (its other inputs: pi_old, the behaviour or reference log-probs).
        phase: ``forward``, ``recompute`` (a forward rerun in the backward pass by activation checkpointing),
            ``backward``, or ``loss``.
        tensor: which tensor held it (``output``, ``gradient of model.layers.3.self_attn.q_proj's output``, ...).
        kind: ``nan``, ``inf`` or ``nan+inf``.
        dtype, shape: the tensor's.
        count: its non-finite elements.
        cells: the first few non-finite (row, position) index pairs (the tensor's first two dimensions; a 1-D
            tensor's index alone), rows mapped to the batch's rows where the tensor has one row per row given.
        attention: the attention the pass ran.
    """

    module: str
    phase: Phase
    tensor: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    cells: tuple[tuple[int, ...], ...]
    attention: AttentionInfo

    def describe(self) -> str:
        """One line: ``backward of model.layers.3.self_attn: nan in the gradient of ..., bfloat16 [8, 1088, 1536],
        12 elements, at (row, position) (2, 1030), ...; attention sdpa (...)``."""
        if self.phase == "loss":
            return (f"the loss: {self.kind} though every module's output is finite (so its other inputs are not); "
                    f"{self.attention.describe()}")
        cells = ", ".join(str(c) if len(c) > 1 else str(c[0]) for c in self.cells)
        where = "(row, position)" if self.cells and len(self.cells[0]) > 1 else "index"
        return (f"{self.phase} of {self.module}: {self.kind} in the {self.tensor}, {self.dtype} "
                f"{list(self.shape)}, {self.count} element{'s' if self.count != 1 else ''}, at {where} {cells}; "
                f"{self.attention.describe()}")


@dataclass(frozen=True)
class SkippedUpdate:
    """One minibatch whose update was not applied (``policy_update``), and why.

    ``cause``: ``loss`` (a micro-batch's loss was not finite), ``inputs`` (its loss was finite but pi_old, the
    behaviour or the reference log-probs were not, which makes the loss NaN by design), ``gradient`` (every loss
    finite, the gradient not); ``detail``: the value or norm seen; ``site``: :func:`locate`'s finding (None when not
    located: under scale-out, or when the re-run was finite); ``note``: why not, or what the re-run found."""

    minibatch: int
    cause: Cause
    detail: str
    site: NonFiniteSite | None = None
    note: str = ""

    def what(self) -> str:
        """The cause alone: ``non-finite gradient (norm nan)``."""
        return {"loss": "non-finite loss", "inputs": "non-finite log-probs feeding the loss",
                "gradient": "non-finite gradient"}[self.cause] + f" ({self.detail})"

    def describe(self) -> str:
        """The cause and where: ``non-finite gradient (norm nan); micro-batch 2 of 5: backward of ...``."""
        if self.site is None:
            return f"{self.what()}; {self.note or 'site not located'}"
        return f"{self.what()}; {self.note + ': ' if self.note else ''}{self.site.describe()}"


def attention_info(model: torch.nn.Module) -> AttentionInfo:
    """The model's attention implementation and the SDPA backends enabled now (no SDPA call: no kernel)."""
    from transformers import PreTrainedModel  # here: loaded with the model, not at import

    lm = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)  # under any wrapper
    config = lm.config if lm is not None else None
    cuda = torch.backends.cuda
    flags = {"flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
             "math": cuda.math_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled()}
    return AttentionInfo(implementation=str(config._attn_implementation) if config is not None else "unknown",
                         enabled="+".join(k for k, on in flags.items() if on) or "none")


class _SdpaWatch(TorchFunctionMode):
    """Notes the first ``scaled_dot_product_attention`` call of a pass and the backend PyTorch picks for it
    (``torch._fused_sdp_choice``, the dispatcher's own choice function)."""

    def __init__(self):
        super().__init__()
        self.call: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and self.call is None:
            self.call = _sdpa_call(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               **_) -> dict:
    from torch.nn.attention import SDPBackend

    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
        kernel = SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError) as err:  # a torch without it, or other arguments
        kernel = f"unknown ({type(err).__name__})"
    mask = "none" if attn_mask is None else str(attn_mask.dtype).removeprefix("torch.")
    return {"kernel": kernel, "length": int(query.shape[-2]), "mask": mask, "causal": bool(is_causal)}


@torch.no_grad()
def _finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite; without autograd (``isfinite`` would otherwise save its input for
    a backward pass, and a checkpointed layer's recompute would not match its forward)."""
    return bool(torch.isfinite(t).all())


def _tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """The floating-point tensors in a module's inputs or outputs (tensors, tuples, lists, dicts, model outputs)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)


class _Probe:
    """The hooks of one :func:`locate` pass and what they saw."""

    def __init__(self, model: torch.nn.Module, rows: Sequence[int] | None):
        self.model, self.rows = model, list(rows) if rows is not None else None
        self.phase: Phase = "forward"
        self.found: tuple | None = None  # (module, phase, tensor description, tensor)
        self.open: list[str] = []  # modules whose backward runs (output gradient seen, input gradient not yet)
        self.group: list[tuple[str, str, torch.Tensor]] = []  # the hooks that saw the first non-finite gradient
        self.open_then: list[str] = []  # :attr:`open` when it arrived
        self.root = type(model).__name__
        self.handles: list = []

    def name(self, module_name: str) -> str:
        return module_name or self.root

    def note(self, module: str, phase: Phase, what: str, t: torch.Tensor) -> None:
        if self.found is None:
            self.found = (module, phase, what, t.detach().clone())

    # forward and recompute: the first module whose output is not finite
    def on_output(self, name: str, output) -> None:
        for t in _tensors(output):
            if self.found is None and not _finite(t):
                self.note(name, "recompute" if self.phase == "backward" else "forward", "output", t)
            if self.phase == "forward" and t.requires_grad:
                self.handles.append(t.register_hook(lambda g, n=name: self.on_grad(n, "output", g)))

    def on_input(self, name: str, args, kwargs) -> None:
        if self.phase == "forward":
            for t in _tensors((args, kwargs)):
                if t.requires_grad:
                    self.handles.append(t.register_hook(lambda g, n=name: self.on_grad(n, "input", g)))

    # backward: gradients in the order they are computed
    def on_grad(self, name: str, where: str, grad: torch.Tensor) -> None:
        if self.found is not None:
            if self.group and grad is self.group[0][2]:  # the same gradient, seen by another module's hook
                self.group.append((name, where, grad))
            return
        if not _finite(grad):
            self.group = [(name, where, grad)]
            self.open_then = list(self.open)
            self.note(name, "backward", "", grad)  # module and tensor named by resolve()
            return
        if where == "output":
            self.open.append(name)
        elif name in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(name)]

    def resolve(self) -> tuple[str, str]:
        """The module whose backward made the first non-finite gradient, and that gradient's description.

        Every hook on that tensor saw it (:attr:`group`). Where it is some modules' input and one of them encloses
        the others (a decoder layer and its first norm; an attention and its q, k and v projections), that one's
        backward made it: its gradient is the sum of what its consumers inside it gave. Otherwise the module that
        consumed the tensor did: the deepest module enclosing the first hook's module whose backward was running
        (:attr:`open_then`), or the loss outside the model when none was."""
        inputs = [n for n, where, _ in self.group if where == "input"]
        first = self.group[0][0]
        outer = [m for m in inputs if all(o == m or self.encloses(m, o) for o in inputs)]
        if outer:
            return outer[0], "gradient of its input" + (f" (the output of {first})" if self.group[0][1] == "output"
                                                        else "")
        running = [m for m in self.open_then if self.encloses(m, first)]
        return max(reversed(running), key=self.depth, default="loss"), f"gradient of {first}'s output"

    def depth(self, name: str) -> int:
        return 0 if name == self.root else name.count(".") + 1

    def encloses(self, outer: str, inner: str) -> bool:
        return outer != inner and (outer == self.root or inner.startswith(outer + "."))

    def on_param_grad(self, module: str, param: str, grad: torch.Tensor) -> None:
        if self.found is None and not _finite(grad):
            self.note(module, "backward", f"gradient of its parameter {param}", grad)

    @contextlib.contextmanager
    def hooked(self) -> Iterator[_Probe]:
        try:
            for module_name, module in self.model.named_modules():
                name = self.name(module_name)
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, a, kw, n=name: self.on_input(n, a, kw), with_kwargs=True))
                self.handles.append(module.register_forward_hook(lambda _m, _a, out, n=name: self.on_output(n, out)))
                for pname, p in module.named_parameters(recurse=False):
                    if p.requires_grad:
                        self.handles.append(p.register_hook(
                            lambda g, n=name, pn=pname: self.on_param_grad(n, pn, g)))
            yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()

    def site(self, attention: AttentionInfo) -> NonFiniteSite | None:
        if self.found is None:
            return None
        module, phase, what, t = self.found
        if phase == "backward" and self.group:
            module, what = self.resolve()
        bad = ~torch.isfinite(t)
        nan, inf = bool(torch.isnan(t).any()), bool(torch.isinf(t).any())
        idx = _first_cells(torch.nonzero(bad)[:, :2]) if t.dim() else []
        if self.rows is not None and t.dim() and t.shape[0] == len(self.rows):
            idx = [[self.rows[c[0]], *c[1:]] for c in idx]
        return NonFiniteSite(module=module, phase=phase, tensor=what, kind="nan+inf" if nan and inf else
                             ("nan" if nan else "inf"), dtype=str(t.dtype).removeprefix("torch."),
                             shape=tuple(t.shape), count=int(bad.sum()), cells=tuple(tuple(c) for c in idx),
                             attention=attention)


def _first_cells(idx: torch.Tensor) -> list[list[int]]:
    """The first :data:`CELLS` distinct rows of ``idx`` [n, k] (index tuples), in order."""
    out: list[list[int]] = []
    for cell in idx.tolist():
        if cell not in out:
            out.append(cell)
            if len(out) == CELLS:
                break
    return out


def locate(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
           rows: Sequence[int] | None = None) -> NonFiniteSite | None:
    """Re-run one micro-batch (``loss_fn``: its forward pass through ``model`` and its loss) with hooks on every
    module of ``model``, then its backward pass unless the forward already went non-finite; return where the first
    non-finite value appeared, or None when the re-run is finite throughout.

    One process only: the hooks see this process's modules, and the re-run runs no collective of its own (the
    caller keeps DDP, FSDP2 and DeepSpeed out; policy_update does). The model is left as found: no weight changes
    (no optimizer step), every hook removed, each parameter's ``.grad`` restored to what it was (the re-run's
    gradients dropped), and the random-number state restored.

    Args:
        rows: the batch's row indices of the micro-batch, in the order its tensors hold them (maps a tensor's
            first dimension to them when it has one entry per row).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    device = next(model.parameters()).device
    probe, watch = _Probe(model, rows), _SdpaWatch()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                probe.hooked():
            with watch:
                loss = loss_fn()
            if probe.found is None and not _finite(loss):
                probe.note("loss", "loss", "loss", loss)
            if probe.found is None and loss.requires_grad:
                probe.phase = "backward"
                loss.backward()
            del loss
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    info = attention_info(model)
    if watch.call is not None:
        info = AttentionInfo(implementation=info.implementation, enabled=info.enabled, **watch.call)
    return probe.site(info)


@contextlib.contextmanager
def inject_nan(model: torch.nn.Module, module: str, position: int, phase: Literal["forward", "backward"] = "forward",
               row: int = 0) -> Iterator[None]:
    """Within the block, a NaN at (``row``, ``position``) of ``module``'s output (forward) or of its output's
    gradient (backward), in every pass whose output reaches that position: a check of the diagnosis itself
    (:func:`locate`, the GPU check's bisection, infra/gpu-bench.py ``--inject-nan``), since a real non-finite value
    cannot be summoned on demand. ``module``: a qualified name in ``model.named_modules()``."""
    target = dict(model.named_modules()).get(module)
    if target is None:
        raise ValueError(f"inject_nan: {type(model).__name__} has no module {module!r}")

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[0] <= row or t.shape[1] <= position:
            return t
        t = t.clone()
        t[row, position] = float("nan")
        return t

    def hook(_m, _args, output):
        first = output[0] if isinstance(output, tuple) else output
        if phase == "forward":
            first = poison(first)
        elif first.requires_grad:
            first.register_hook(poison)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    handle = target.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
