"""The attention of a one-token decode step on the CPU: two matrix products and a softmax, not PyTorch's flash kernel.

On the CPU ``scaled_dot_product_attention`` runs its flash kernel (``_scaled_dot_product_flash_attention_for_cpu``),
tiled for long queries. A decode step has one query a row, so the tiling is all overhead: on the tiny policy
(4 heads of 32) at 80 rows and about 55 cached columns it took 430 us a layer, 31 % of the step (torch profiler,
one thread). :func:`step_attention` computes the same attention directly (a generate call 1.06-1.16x the tokens a
second, docs/performance.md):

    scores [R, H_kv, G, S] = q [R, H_kv, G, D] @ k^T [R, H_kv, D, S] * scale + mask,
    out [R, H_kv, G, D] = softmax_float32(scores) @ v [R, H_kv, S, D]

with ``R`` rows, ``H = H_kv * G`` query heads grouped over ``H_kv`` key-value heads (no copy of the keys per group,
as ``repeat_kv`` makes), ``S`` cached columns and ``D`` the head size. Every other pass (the prefill, the update's
passes, the screen, anything on a GPU) goes to transformers' SDPA function unchanged.

The decode loop (tasks/generation/decode.py) switches the model to it for the length of a call with
:func:`one_token_attention` and back after, so the update's passes never see it. The difference from SDPA is float
rounding (tests/tasks/test_step_attention.py: the same tokens drawn, log-probs to 1e-5).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tasks.model.lora import base_model
from tasks.model.wrappers import unwrap

#: The name :func:`step_attention` is registered under in transformers' ``AttentionInterface``.
NAME = "rlsift_step"


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` [R, H, q, D] over ``key``, ``value`` [R, H_kv, S, D] with the additive
    ``attention_mask`` [R, 1, q, S] (or None): the products above where q = 1 on the CPU, else transformers' SDPA
    function. Returns ``([R, q, H, D], None)``, as transformers' attention functions do."""
    r, h, q, d = query.shape
    if q != 1 or query.device.type != "cpu" or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    hkv = key.shape[1]
    scale = d ** -0.5 if scaling is None else scaling
    qg = query.reshape(r, hkv, h // hkv, d)  # [R, H_kv, G, D]: the G query heads sharing a key-value head
    scores = torch.matmul(qg, key.transpose(2, 3)) * scale  # [R, H_kv, G, S]
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, :key.shape[2]]  # [R, 1, 1, S] over heads and groups
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [R, H_kv, G, D]
    return out.reshape(r, 1, h, d), None


@contextmanager
def one_token_attention(model: torch.nn.Module) -> Iterator[None]:
    """``model`` (a transformers model, under adapters or a backend's wrapper or not) attends with
    :func:`step_attention` inside the block where it attends with SDPA on the CPU (else unchanged); its own
    implementation comes back after, also on error."""
    from transformers import AttentionInterface, PreTrainedModel  # loaded with the model already

    inner = base_model(unwrap(model))
    if not (isinstance(inner, PreTrainedModel) and inner.config._attn_implementation == "sdpa"
            and inner.device.type == "cpu"):
        yield
        return
    AttentionInterface.register(NAME, step_attention)  # idempotent
    inner.set_attn_implementation(NAME)
    try:
        yield
    finally:
        inner.set_attn_implementation("sdpa")
