"""The one-token forward of a CPU decode step for Llama-family decoders, without transformers' per-call machinery.

On the CPU a decode step of the tiny policy (4 layers of 128) costs about 2.1 ms at one row and 0.053 ms more a
row; 1.5 ms of the 2.1 is the model's forward, most of it the Python around its few dozen small ops: each module's
``__call__``, the model's decorators and output records, the causal mask's construction (the loop passes its own),
the attention function's lookup (docs/performance.md, "The decode loop"). :func:`step_forward` returns a function
that runs the same ops in the same order on the model's own parameters (what gpt-fast and nano-vllm do with their
own model code), so the logits are transformers' bit for bit (tests/tasks/test_step_forward.py): per layer the
input norm, the q, k and v projections, the rotary embedding, the cache's ``update``, the one-token attention
(tasks/generation/step_attention.py), the output projection and the residual, then the post-attention norm, the
gated MLP and the residual; the final norm and the head on the last position. A generate call is 1.11x faster at
`dots_screen`'s size (20 prompts x 4, one thread) and 1.09x at plain GRPO's (32 x 8, two threads), the same tokens
and log-probs.

Only where every part is the plain one, else None (the loop calls the model): a ``llama``, ``qwen2`` or ``mistral``
model (RMS norms, rotary positions, a gated MLP), its projections plain ``torch.nn.Linear`` (not under adapters), no
sliding window, no tensor-parallel split of the projections, on the CPU, and no forward hook on any of its modules
(a hook must see every step, as a test's or an inspection's does) but transformers' own output capturing, which a
model's first pass for hidden states installs and which records nothing outside the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tasks.generation.slot_cache import SlotCache
from tasks.generation.step_attention import step_attention
from tasks.model.wrappers import unwrap

#: ``config.model_type`` values whose decoder layers are the Llama layer (bias on the projections or not).
SUPPORTED = ("llama", "qwen2", "mistral")

#: What the model's layers must hold for the function to read them.
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")

StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SlotCache], torch.Tensor]

#: Where transformers' own output-capturing hooks live: a model's first pass that asks for hidden states or attentions
#: (the scoring's: the pool's embeddings and angles) installs one on every layer and attention module, and each
#: returns at once unless the model's own forward set a collector, which the step forward never does. They do not
#: turn it off.
_TRANSFORMERS_CAPTURE = "transformers.utils.output_capturing"


def step_forward(model: torch.nn.Module) -> StepForward | None:
    """The one-token forward of ``model`` (module docstring): ``(tokens [R, 1], mask [R, 1, 1, W] additive,
    positions [R, 1], cache) -> logits [R, V]`` of the last position, or None where ``model`` is not one it reads."""
    model = unwrap(model)
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    cfg = getattr(model, "config", None)
    if (cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "pretraining_tp", 1) != 1
            or type(head) is not torch.nn.Linear or inner is None
            or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm", "layers"))
            or next(model.parameters()).device.type != "cpu"
            or any(_foreign_hooks(m) for m in model.modules())):
        return None
    layers = list(inner.layers)
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (attn is None or mlp is None or not all(hasattr(attn, a) for a in _ATTENTION)
                or not all(hasattr(mlp, a) for a in _MLP)
                or getattr(attn, "sliding_window", None) is not None
                or any(type(getattr(m, p)) is not torch.nn.Linear for m, ps in ((attn, _ATTENTION[:4]), (mlp, _MLP[:3]))
                       for p in ps)
                or not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm"))):
            return None

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's and Mistral's are the same

    def forward(tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        x = inner.embed_tokens(tokens)  # [R, 1, E]
        cos, sin = inner.rotary_emb(x, positions)  # [R, 1, D] each
        r = x.shape[0]
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm.forward(x)
            q, k, v = (F.linear(h, p.weight, p.bias).view(r, 1, -1, attn.head_dim).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))  # [R, H or H_kv, 1, D]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            out, _ = step_attention(attn, q, k, v, mask, scaling=attn.scaling)
            x = x + F.linear(out.reshape(r, 1, -1).contiguous(), attn.o_proj.weight, attn.o_proj.bias)
            h = layer.post_attention_layernorm.forward(x)
            gate = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = x + F.linear(gate * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                             mlp.down_proj.bias)
        return F.linear(inner.norm.forward(x)[:, -1], head.weight, head.bias)

    return forward


def _foreign_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a forward (pre-)hook other than transformers' own output capturing (which is idle
    outside the model's forward: :data:`_TRANSFORMERS_CAPTURE`)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(getattr(h, "__module__", None) != _TRANSFORMERS_CAPTURE for h in hooks)
