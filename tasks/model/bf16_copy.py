"""A bfloat16 copy of a float32 model for passes without autograd, refreshed from the model before each pass.

On a device with bf16 matrix instructions a bf16 matrix product runs several times as fast as a float32 one: on
this project's 2-core AMD EPYC (AVX512-BF16), one thread, [1234, 128] x [128, 384] took 0.29 ms against 1.25 ms
(about 420 against 97 GFLOP/s), and the likelihood screen's pass over 48 default-pool candidates 0.059 s against
0.133 s (docs/performance.md, "The screen's pass in bf16"). A pass that ranks (the screen, tasks/selection/screen.py)
needs no float32 precision; a pass whose numbers a loss reads (the update's, the sampler's log-probs) keeps the
model's own dtype.

:class:`Bf16Copy` keeps one copy of the model whose parameters are bfloat16 and whose buffers (the rotary
frequencies) stay as they are, and copies the model's current parameters into it, rounded, at each
:meth:`Bf16Copy.of` call: one pass over the parameters (about 1 ms for the tiny policy's 0.9 M, tens of ms for a
135 M model on a CPU), so the copy never trails the weights it stands for. It costs 2 bytes a parameter for as long
as it is kept. Under LoRA the adapters are copied too (PEFT computes each adapter in its own dtype).
"""

from __future__ import annotations

import copy

import torch


def native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (AVX512-BF16 or AMX tiles). Elsewhere (AVX2 CPUs) bf16
    is converted to float32 around each product, slower than float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class Bf16Copy:
    """A bfloat16 copy of one model at a time (module docstring); :meth:`of` returns it up to date."""

    def __init__(self) -> None:
        self.source: torch.nn.Module | None = None
        self.copy: torch.nn.Module | None = None

    def of(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bf16 copy of ``model`` with its current weights, in eval mode and without gradients (built at the first
        call for ``model``, refreshed in place at the later ones)."""
        with torch.no_grad():
            if self.source is not model:
                self.copy = copy.deepcopy(model).eval().requires_grad_(False)
                for p in self.copy.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(torch.bfloat16)
                self.source = model
            else:
                for mine, theirs in zip(self.copy.parameters(), model.parameters(), strict=True):
                    mine.copy_(theirs)
        return self.copy
