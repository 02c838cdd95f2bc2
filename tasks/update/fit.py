"""Whether one update fits the device, checked before training from the model's shape (``train.micro_batch_tokens``).

The update's peak on one process is its state plus one micro-batch (tasks/update/minibatch.py):

- **state**: the weights (P x b bytes, b the weights' dtype), the gradients and AdamW's two moments of the trainable
  parameters (3 x P_train x b: torch's AdamW keeps its state in the parameters' dtype), the KL reference's copy
  when ``train.kl_coef > 0`` without LoRA (P x b; LoRA's reference is the same weights), and under ``overlap.lag``
  1 with the in-process engine on the same device, the generator's copy (P x b). The sharded backends divide what
  they shard by the world size (FSDP2 and ZeRO-3: weights, gradients and moments; ZeRO-2: gradients and moments).
- **activations of a micro-batch of T padded tokens**: a decoder layer keeps about ``6H + 4 kv + 4I`` values a
  token for its backward pass (the norms' and projections' inputs, q, k, v after the rotary embedding, the
  attention output and its log-sum-exp, the MLP's gate, up, activation and product; H hidden, I the MLP's width,
  kv the key-value width), plus the two norms' float32 copies (``2H x 4`` bytes). Without checkpointing every
  layer keeps them; with ``train.gradient_checkpointing`` only each layer's input (H) stays, and one layer's are
  recomputed at a time. The LM head adds one chunk of float32 logits (tasks/model/forward.py, ``chunked_head``),
  three times over (the chunk, its softmax and its gradient), and the head's input (H a token).

For Qwen2.5-1.5B in bf16 this gives 2.9 MB a token without checkpointing; one H100 measured 3.4 MB a token of
the update before the chunked head, whose bf16 [T, V] logits held 0.3 MB of it (docs/performance.md). With the
chunked head on a GPU the figure is arithmetic until measured. A margin of 15 % covers the allocator's
fragmentation and the transient buffers of the backward pass.

The budget is what this process could use: on CUDA the device's free memory plus what PyTorch already holds
(``mem_get_info`` and ``memory_reserved``); on a CPU the available memory plus this process's resident set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil
import torch

from tasks.config import Config
from tasks.model.forward import HEAD_CHUNK_ELEMENTS

log = logging.getLogger(__name__)

GIB = 2.0 ** 30
#: Headroom over the arithmetic (allocator fragmentation, the backward pass's transient buffers).
MARGIN = 1.15
#: The smallest micro-batch worth suggesting (one row of a short completion).
MIN_TOKENS = 256


class DoesNotFit(ValueError):
    """The update would run out of memory on its device; the message says what to lower."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a causal LM: parameter counts and the decoder's widths."""

    params: int
    trainable: int
    dtype_bytes: int
    hidden: int
    intermediate: int
    kv_width: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module, hf_config) -> ModelShape:
        """``model``'s counts (trainable: the parameters that need grad, the adapters under LoRA) and
        ``hf_config``'s widths (a transformers decoder config)."""
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        first = next(model.parameters())
        return cls(params=sum(p.numel() for p in model.parameters()),
                   trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   dtype_bytes=first.element_size(), hidden=c.hidden_size, intermediate=c.intermediate_size,
                   kv_width=kv_heads * head_dim, layers=c.num_hidden_layers, vocab=c.vocab_size)

    def layer_bytes_per_token(self) -> float:
        """What one decoder layer keeps of a token for its backward pass."""
        b, h = self.dtype_bytes, self.hidden
        return b * (6 * h + 4 * self.kv_width + 4 * self.intermediate) + 4 * 2 * h


@dataclass(frozen=True)
class UpdateMemory:
    """The update's estimated peak on one process, in bytes, by part."""

    weights: float
    gradients: float
    optimizer: float
    copies: float
    activations: float
    head: float
    tokens: int

    @property
    def state(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.copies

    @property
    def total(self) -> float:
        return MARGIN * (self.state + self.activations + self.head)

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, gradients {self.gradients / GIB:.1f}, "
                f"AdamW {self.optimizer / GIB:.1f}, copies {self.copies / GIB:.1f}, activations of "
                f"{self.tokens:,} tokens {self.activations / GIB:.1f}, LM head {self.head / GIB:.1f}, "
                f"+{MARGIN - 1:.0%})")


def estimate(shape: ModelShape, *, tokens: int, checkpointing: bool, reference_copy: bool, generator_copy: bool,
             backend: str = "single", world: int = 1) -> UpdateMemory:
    """:class:`UpdateMemory` of one update with micro-batches of ``tokens`` padded tokens (module docstring)."""
    b = shape.dtype_bytes
    shard_weights = world if backend in ("fsdp2", "deepspeed_zero3") else 1
    shard_states = world if backend in ("fsdp2", "deepspeed_zero2", "deepspeed_zero3") else 1
    per_layer = shape.layer_bytes_per_token()
    if checkpointing:
        per_token = shape.layers * b * shape.hidden + per_layer
    else:
        per_token = shape.layers * per_layer
    chunk = HEAD_CHUNK_ELEMENTS if tokens * shape.vocab > HEAD_CHUNK_ELEMENTS else tokens * shape.vocab
    return UpdateMemory(weights=shape.params * b / shard_weights, gradients=shape.trainable * b / shard_states,
                        optimizer=2 * shape.trainable * b / shard_states,
                        copies=shape.params * b * (int(reference_copy) + int(generator_copy)),
                        activations=tokens * (per_token + b * shape.hidden), head=3 * 4 * chunk, tokens=tokens)


def available_bytes(device: torch.device | str) -> float:
    """What this process could hold on ``device`` (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device))
    return float(psutil.virtual_memory().available + psutil.Process(os.getpid()).memory_info().rss)


#: The prompt length assumed for a whole-minibatch pass (``train.micro_batch_tokens`` 0), whose size the config
#: does not bound.
PROMPT_TOKENS = 256


def micro_batch_tokens(cfg: Config) -> int:
    """The padded tokens of the update's largest micro-batch: ``train.micro_batch_tokens``, or with 0 a whole
    minibatch of rows of :data:`PROMPT_TOKENS` + ``rollout.max_new_tokens``."""
    tc = cfg.train
    if tc.micro_batch_tokens > 0:
        return tc.micro_batch_tokens
    rows = -(-tc.prompts_per_step * cfg.rollout.n // tc.minibatches)
    return rows * (PROMPT_TOKENS + cfg.rollout.max_new_tokens)


def check_update_fits(cfg: Config, model: torch.nn.Module, hf_config, device: torch.device | str, *,
                      lora: bool, world: int = 1, budget: float | None = None) -> UpdateMemory:
    """Estimate the update's peak on ``device`` and stop before training when it exceeds the budget.

    Args:
        lora: the policy trains adapters (its KL reference is then no copy).
        budget: bytes available (default :func:`available_bytes`).

    Returns:
        The estimate (logged in one line).

    Raises:
        DoesNotFit: with the estimate by part, the budget, and what to lower: the largest
            ``train.micro_batch_tokens`` that fits, checkpointing, LoRA.
    """
    shape = ModelShape.of(model, hf_config)
    tokens = micro_batch_tokens(cfg)
    same_device = cfg.overlap.lag != 0 and cfg.rollout.engine == "hf"  # auto may choose 1: counted
    kw = dict(reference_copy=cfg.train.kl_coef > 0 and not lora, generator_copy=same_device,
              backend=cfg.scale.backend, world=world)
    est = estimate(shape, tokens=tokens, checkpointing=cfg.train.gradient_checkpointing, **kw)
    budget = available_bytes(device) if budget is None else budget
    log.info("update memory on %s: %s of %.1f GiB available", device, est.describe(), budget / GIB)
    if est.total <= budget:
        return est
    what = [f"the update needs about {est.describe()} on {device}, but {budget / GIB:.1f} GiB is available"]
    fits = [t for t in (2 ** k for k in range(8, 20)) if t < tokens and estimate(
        shape, tokens=t, checkpointing=cfg.train.gradient_checkpointing, **kw).total <= budget]
    if fits:
        what.append(f"lower train.micro_batch_tokens to {max(fits)} or less (the step's gradient is the same)")
    if not cfg.train.gradient_checkpointing:
        ckpt = estimate(shape, tokens=tokens, checkpointing=True, **kw)
        what.append(f"set train.gradient_checkpointing=true ({ckpt.total / GIB:.1f} GiB at {tokens:,} tokens)")
    if not lora:
        what.append("train LoRA adapters (model.lora.enabled=true): gradients and AdamW state for the adapters only")
    if est.state * MARGIN > budget:
        what.append("the weights and optimizer state alone do not fit: shard them (scale.backend=fsdp2 or "
                    "deepspeed_zero3, docs/scale-out.md)")
    raise DoesNotFit("; ".join(what))
