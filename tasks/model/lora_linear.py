"""PEFT's LoRA linear layer with a fused forward and backward pass: the adapter's update is added inside the
matmuls, and the frozen weight gets no gradient.

PEFT's ``lora.Linear.forward`` computes ``result = base(x); result = result + lora_B(lora_A(dropout(x))) *
scaling`` through autograd: per adapted layer and pass it writes the update [T, out], scales it, adds it to the
base's output (three more passes over [T, out] than the base layer), and in the backward pass autograd scales the
update's gradient and sums the two input gradients ([T, out] and [T, in] passes again). With adapters in another
dtype than the base (PEFT's float32 adapters over a bf16 model) it also casts x to float32 and the sum back,
and runs the adapters' matmuls in float32. Under activation checkpointing all of it runs twice. These passes
move memory at a rate no matmul waits for, and at a 1.5B shape they took more time than the frozen base's own
matmuls (docs/performance.md, "LoRA's speed").

Here, for the case a run trains (one active adapter, not merged, plain LoRA, adapters in the input's dtype, a
frozen base), one autograd function does, with x [T, in], W [out, in], A [r, in], B [out, r], s = alpha / r and
x' = dropout(x) (x itself without dropout):

- forward: y = x W^T + bias; a = x' A^T [T, r]; y += s a B^T, the last as the matmul's accumulation (``addmm_``,
  C = y read by the GEMM), so no [T, out] temporary exists;
- backward, from g = dL/dy [T, out]: gb = s g B [T, r]; dL/dx = g W, then += gb A (again an ``addmm_``), only when
  x needs a gradient; dL/dA = gb^T x'; dL/dB = s g^T a. The frozen W gets none, and nothing of size [T, out]
  or [T, in] is written besides dL/dx.

It saves x' and a (r columns) for the backward pass, against PEFT's x, x' and a. Everything else (a disabled or
merged adapter, several adapters, DoRA, mixed dtypes, a trained base weight) runs PEFT's own forward. The layer is
PEFT's in every other respect (merging, ``get_delta_weight``, state-dict keys), so ``disable_adapter``, merging and
checkpoints act on it as on PEFT's own layers.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + bias + s (x' A^T) B^T over [T, .] rows (module docstring); W and bias frozen."""

    @staticmethod
    def forward(ctx, x, x_in, weight, bias, lora_a, lora_b, scaling: float):
        y = torch.nn.functional.linear(x, weight, bias)  # [T, out]
        a = x_in.mm(lora_a.t())  # [T, r]
        y.addmm_(a, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x_in, weight, lora_a, lora_b, a)
        ctx.scaling = scaling
        ctx.same_input = x_in is x
        return y

    @staticmethod
    def backward(ctx, g):
        x_in, weight, lora_a, lora_b, a = ctx.saved_tensors
        s = ctx.scaling
        gb = g.mm(lora_b).mul_(s)  # [T, r]: s g B
        gx = gx_in = None
        if ctx.needs_input_grad[0]:
            gx = g.mm(weight)  # [T, in]
            if ctx.same_input:
                gx.addmm_(gb, lora_a)
            elif ctx.needs_input_grad[1]:
                gx_in = gb.mm(lora_a)
        elif ctx.needs_input_grad[1]:
            gx_in = gb.mm(lora_a)
        ga = gb.t().mm(x_in) if ctx.needs_input_grad[4] else None  # [r, in]
        gbw = g.t().mm(a).mul_(s) if ctx.needs_input_grad[5] else None  # [out, r]
        return gx, gx_in, None, None, ga, gbw, None


class LeanLoraLinear(Linear):
    """:class:`peft.tuners.lora.layer.Linear` whose plain forward and backward passes are fused (module
    docstring). Registered with PEFT for ``torch.nn.Linear`` targets by ``tasks.model.lora.apply_lora``."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """x: [..., in] -> [..., out]; PEFT's forward where the fused one does not apply (module docstring)."""
        adapters = self.active_adapters
        if args or kwargs or self.disable_adapters or self.merged or len(adapters) != 1:
            return super().forward(x, *args, **kwargs)
        name = adapters[0]
        if name not in self.lora_A or name in self.lora_variant:
            return super().forward(x, *args, **kwargs)
        base, lora_a, lora_b = self.get_base_layer(), self.lora_A[name], self.lora_B[name]
        if (lora_a.weight.dtype != x.dtype or base.weight.dtype != x.dtype or base.weight.requires_grad
                or lora_b.bias is not None or (base.bias is not None and base.bias.requires_grad)):
            return super().forward(x, *args, **kwargs)
        rows = x.reshape(-1, x.shape[-1])  # [T, in]
        dropout = self.lora_dropout[name]
        rows_in = rows if isinstance(dropout, torch.nn.Identity) else dropout(rows)
        y = _LoraLinear.apply(rows, rows_in, base.weight, base.bias, lora_a.weight, lora_b.weight,
                              float(self.scaling[name]))
        return y.view(*x.shape[:-1], y.shape[-1])
