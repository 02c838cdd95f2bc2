"""Whether one update fits the device, checked before training from the model's shape (``train.micro_batch_tokens``).

The peak of a step on one device is the largest of three moments, each counted from what is alive then (bytes;
P the parameters, P_t the trained ones, c the compute dtype's bytes, m the master's; tasks/update/precision.py):

- **state**, alive throughout: the compute weights (P c), the master copy under mixed precision (P_t m), AdamW's
  two moments (2 P_t m), the KL reference's copy (``train.kl_coef > 0`` without LoRA: P c), the generator's copy
  (``overlap.lag`` 1 with the in-process engine: P c) and, under the sharded backends, rank 0's full policy
  (P c) beside its training replica. The backends divide what they shard by the world size W (below).
- **the backward pass of the largest micro-batch** of T padded tokens: the state, the gradients (P_t c) when the
  minibatch has several micro-batches (they accumulate), the activations kept for the backward pass, the LM head's
  buffers and one layer's backward buffers. A Qwen2/Llama decoder layer keeps, for each token (H hidden, Q = heads
  x head_dim, KV = key-value heads x head_dim, I the MLP's width): the two RMSNorms' float32 inputs (2 x 4H), their
  normalised values and outputs (2 x 2cH), q after the rotary embedding, the attention output and o_proj's input
  (3cQ), the keys and values (2cKV, or 2cQ once repeated for attention: transformers' ``repeat_kv`` runs whenever
  a padding mask is passed, i.e. on rows of varied length), the attention's log-sum-exp (4 a head), the padding
  mask turned into an additive bias (c x the row's length) and the MLP's gate, activation, up and product (4cI).
  With ``train.gradient_checkpointing`` only each layer's input (cH) stays, and the layer whose backward runs is
  recomputed with all of the above. A layer's backward adds its gradient buffers (c (3I + 4Q + 2H): the MLP's
  three intermediate gradients, the attention's q, k, v and output gradients, the residual's). The chunked head
  (tasks/model/logprob_head.py, ``chunked_head``) keeps its input (cH a token) and, in its backward pass, one chunk of
  :data:`HEAD_CHUNK_ELEMENTS` logits recomputed (c), upcast (4), exponentiated (4) and their gradients (4 + c);
  a micro-batch of one chunk or less keeps that chunk's float32 logits from the forward pass instead. Where the head's
  weight is trained (full weights), its gradient [V, H] (c) is summed over the chunks in autograd's input buffer
  before it reaches ``.grad``: the buffer and each chunk's own [V, H] weight-gradient temporary (one buffer for a
  single chunk), a gradient the passes hold whether or not the micro-batches accumulate. With tied embeddings
  (Qwen2.5 up to 3B) that buffer waits for the embedding's gradient until the end of the backward pass.
- **the end of the backward pass**: the state, every gradient (P_t c) and the embedding's backward buffer, a dense
  [V, H] gradient (c) made before it is summed into the tied weight's (or, across micro-batches, the embedding's own).
- **the optimizer step**: the state, the gradients (under mixed precision moved into the masters' float32
  ``.grad``, P_t m, by ``MasterWeights``, which frees them after the step), one parameter-sized buffer of torch's
  foreach AdamW (P_t m; none for the fused AdamW, which runs on CUDA and the CPU: precision.py ``adamw_kernel``)
  and the copy of the new weights into the policy (one parameter at a time: the largest, P_max c). AdamW's
  moments are allocated at the first step and counted in the state from the start.
- **generation on the same device**, where it shares the GPU: its KV cache (rows x (prompt + max_new_tokens) x
  layers x 2 x KV x c, rows = ``rollout.chunk``, prompts padded to the decoder's multiple of 64 columns on CUDA)
  and one decode step's float32 logits (rows x V x 4). On CUDA the decoder's graphs add their memory pool: each
  bucket's logits (1, 2, 4, ... rows up to ``rows``: under 2 rows x V x c) and one step's largest transient, the
  keys and values of a layer repeated to every query head for the masked attention (2 x rows x Q x context x c,
  transformers' ``repeat_kv``; none without grouped keys). The in-process engine keeps its cache and CUDA graphs
  between calls (tasks/generation/decode.py), so both are resident during the update (added to the backward's
  moment) whether or not ``overlap.lag`` 1 runs the two at once. The prompt length is the run's longest prompt
  where the caller knows it, else :data:`PROMPT_TOKENS`.

Per rank under the sharded backends: DDP keeps full replicas and a second copy of the gradients in its reduction
buckets. FSDP2 keeps the sharded parameters in the master dtype (P m / W), its moments and gradients sharded, and
gathers one decoder layer at a time plus the next (prefetch) and the root module (embeddings and head); it
reduce-scatters every micro-batch (tasks/update/distributed.py ``gradient_sync``), so no rank holds the unsharded
gradients between micro-batches (a 7B's 14 GiB in bf16). DeepSpeed keeps float32 master weights and moments
sharded (12 P_t / W), bf16 gradients partitioned (P_t c / W) and its float32 copy at the step (4 P_t / W); ZeRO-2
keeps the full bf16 weights and a reduction bucket of ``reduce_bucket_size`` elements; ZeRO-3 shards the weights,
gathers up to ``stage3_max_live_parameters`` at once (DeepSpeed's defaults, which the run's config keeps) plus the
prefetch bucket, and gathers every parameter at once when the new weights are copied to rank 0's policy.

Checked against one H100 (random Qwen2.5-1.5B, bf16 weights and AdamW state, one forward and backward; before the
chunked head, whose full [T, V] logits the test models as they were): 5-8 % above each of the four measured peaks
(tests/tasks/test_fit.py, docs/performance.md). :data:`MARGIN` covers the allocator's fragmentation.

The budget is what this process could use: on CUDA the device's free memory plus what PyTorch already holds
(``mem_get_info`` and ``memory_reserved``); on a CPU the available memory plus this process's resident set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

import psutil
import torch

from tasks.config import Config
from tasks.generation.decode_options import DecodeOptions
from tasks.model.logprob_head import HEAD_CHUNK_ELEMENTS
from tasks.update.precision import Precision, adamw_kernel

log = logging.getLogger(__name__)

GIB = 2.0 ** 30
#: Headroom over the count (the caching allocator's fragmentation, cuBLAS workspaces).
MARGIN = 1.05
#: The smallest micro-batch worth suggesting (one row of a short completion).
MIN_TOKENS = 256
#: DeepSpeed's defaults (elements): ZeRO-2's gradient reduction bucket, ZeRO-3's gathered parameters and prefetch.
DS_REDUCE_BUCKET = 500_000_000
DS_MAX_LIVE = 1_000_000_000
DS_PREFETCH = 50_000_000
BACKENDS = ("single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")


class DoesNotFit(ValueError):
    """The update would run out of memory on its device; the message says what to lower."""


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a causal LM: parameter counts and the decoder's widths."""

    params: int
    trainable: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    largest: int  # elements of the largest parameter (the embedding, mostly)
    root: int  # elements outside the decoder layers (embeddings, final norm, untied head)
    head_trained: bool = True  # the LM head's weight gets a gradient (full weights; not under LoRA)
    embedding_trained: bool = True  # the input embedding gets one (the same weight as the head's when tied)

    @classmethod
    def of(cls, model: torch.nn.Module, hf_config) -> ModelShape:
        """``model``'s counts (trainable: the parameters that need grad, the adapters under LoRA) and
        ``hf_config``'s widths (a transformers decoder config)."""
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        params = {id(p): p for p in model.parameters()}.values()  # tied weights once
        in_layers = {id(p) for name, p in model.named_parameters() if ".layers." in f".{name}"}
        named = dict(model.named_parameters(remove_duplicate=False))  # a tied head under its own name too
        return cls(params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
                   hidden=c.hidden_size, intermediate=c.intermediate_size, heads=c.num_attention_heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
                   layers=c.num_hidden_layers, vocab=c.vocab_size, largest=max(p.numel() for p in params),
                   root=sum(p.numel() for p in params if id(p) not in in_layers),
                   head_trained=any(p.requires_grad for n, p in named.items() if n.endswith("lm_head.weight")),
                   embedding_trained=any(p.requires_grad for n, p in named.items()
                                         if n.endswith("embed_tokens.weight")))

    def layer_kept(self, c: int, *, padded: bool, row_tokens: int) -> float:
        """Bytes a token one decoder layer keeps for its backward pass (module docstring)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        keys = q if padded and kv < q else kv
        mask = c * (-(-row_tokens // 16) * 16) if padded else 0  # the bias, padded to 16 columns
        return 2 * (4 * h + 2 * c * h) + c * (3 * q + 2 * keys) + 4 * self.heads + mask + 4 * c * self.intermediate

    def layer_backward(self, c: int) -> float:
        """Bytes a token of one layer's gradient buffers during its backward pass."""
        return c * (3 * self.intermediate + 4 * self.heads * self.head_dim + 2 * self.hidden)


@dataclass(frozen=True)
class UpdateMemory:
    """A step's estimated peak on one process, in bytes, by part (module docstring)."""

    weights: float
    master: float
    optimizer: float
    copies: float
    gradients: float
    held_gradients: float  # of them, alive during the backward pass (several micro-batches, or DDP's buckets)
    activations: float
    head: float
    head_gradient: float  # the head weight's gradient summed over chunks in autograd's buffer, and a chunk's own
    embedding_gradient: float  # the embedding's dense [V, H] backward buffer, at the end of the backward pass
    layer: float  # the layer whose backward runs: recomputed activations and gradient buffers
    gathered: float  # sharded backends: parameters gathered and communication buckets during the passes
    step: float  # the optimizer step's own buffers and the copy to the policy
    kv_cache: float
    kv_overlaps: bool
    tokens: int

    @property
    def state(self) -> float:
        return self.weights + self.master + self.optimizer + self.copies

    @property
    def backward_peak(self) -> float:
        kv = self.kv_cache if self.kv_overlaps else 0.0
        return (self.state + self.held_gradients + self.activations + self.head + self.head_gradient + self.layer
                + self.gathered + kv)

    @property
    def backward_end_peak(self) -> float:
        kv = self.kv_cache if self.kv_overlaps else 0.0
        return self.state + self.gradients + self.embedding_gradient + kv

    @property
    def step_peak(self) -> float:
        return self.state + self.gradients + self.step

    @property
    def generation_peak(self) -> float:
        return self.state + (0.0 if self.kv_overlaps else self.kv_cache)

    @property
    def peak(self) -> float:
        """The largest moment's count, before :data:`MARGIN`."""
        return max(self.backward_peak, self.backward_end_peak, self.step_peak, self.generation_peak)

    @property
    def total(self) -> float:
        return MARGIN * self.peak

    def describe(self) -> str:
        moment = max((self.backward_peak, "the backward pass"),
                     (self.backward_end_peak, "the end of the backward pass"),
                     (self.step_peak, "the optimizer step"), (self.generation_peak, "generation"))[1]
        parts = ", ".join(f"{f.name.replace('_', ' ')} {getattr(self, f.name) / GIB:.1f}" for f in fields(self)
                          if f.name not in ("tokens", "kv_overlaps") and getattr(self, f.name))
        return f"{self.total / GIB:.1f} GiB at {moment} ({parts}; micro-batches of {self.tokens:,} tokens; " \
               f"+{MARGIN - 1:.0%})"


@dataclass(frozen=True)
class GenerationMemory:
    """GenerationMemory on the update's device: ``rows`` sequences of up to ``context`` tokens at once; ``overlaps``:
    its KV cache is alive during the update (the in-process engine keeps it between calls), else only between
    updates; ``graphs``: the decoder replays CUDA graphs, whose memory pool stays with the cache."""

    rows: int
    context: int
    overlaps: bool
    graphs: bool = False

    def kv_bytes(self, shape: ModelShape, c: int) -> float:
        """The KV cache and one step's float32 logits (module docstring)."""
        return self.rows * (self.context * shape.layers * 2 * shape.kv_heads * shape.head_dim * c + 4 * shape.vocab)

    def graph_pool_bytes(self, shape: ModelShape, c: int) -> float:
        """The CUDA graphs' pool (module docstring); 0 without graphs."""
        if not self.graphs:
            return 0.0
        q = shape.heads * shape.head_dim
        repeated = 2 * self.rows * q * self.context * c if shape.kv_heads < shape.heads else 0.0
        return 2 * self.rows * shape.vocab * c + repeated


def estimate(shape: ModelShape, precision: Precision, *, tokens: int, checkpointing: bool, accumulating: bool = True,
             padded: bool = True, row_tokens: int = 0, backend: str = "single", world: int = 1,
             reference_copy: bool = False, generator_copy: bool = False, fused_adamw: bool = False,
             generation: GenerationMemory | None = None) -> UpdateMemory:
    """:class:`UpdateMemory` of one step with micro-batches of ``tokens`` padded tokens on each rank (module
    docstring).

    Args:
        precision: what the passes compute in and what the optimizer steps (tasks/update/precision.py).
        accumulating: a minibatch runs several micro-batches (their gradients accumulate during the backward pass).
        padded: rows of varied length (a padding mask: keys and values repeated for attention, the mask's bias).
        row_tokens: the longest row's padded tokens (the mask's bias; default ``tokens``).
        backend: ``scale.backend``; world: ranks.
        fused_adamw: the single process's or DDP's AdamW is torch's fused kernel (no parameter-sized buffer).
        generation: generation on the same device (None: elsewhere, or not counted).
    """
    if backend not in BACKENDS:
        raise ValueError(f"scale.backend {backend!r} is not one of {', '.join(BACKENDS)}")
    c, m = _bytes(precision.compute), _bytes(precision.master)
    mixed = precision.mixed
    p, pt, w = shape.params, shape.trainable, max(world, 1)
    sharded = backend != "single"
    layer_params = (p - shape.root) / max(shape.layers, 1)
    weights, master, optimizer, gradients = p * c, pt * m * mixed, 2 * pt * m, pt * c
    gathered = step = 0.0
    if backend == "fsdp2":  # float32 sharded parameters are the master; bf16 copies of what is gathered
        weights, master, optimizer, gradients = p * m / w, 0.0, 2 * pt * m / w, pt * m / w
        gathered = (2 * layer_params + shape.root) * c + layer_params * (c + 4)  # a layer's gradient, reduced
    elif backend.startswith("deepspeed"):
        master, optimizer, gradients = 4 * pt / w, 8 * pt / w, pt * c / w
        step = 4 * pt / w  # the float32 gradient partition
        if backend == "deepspeed_zero3":
            weights = p * c / w
            gathered = min(p, DS_MAX_LIVE + DS_PREFETCH) * c
            step += p * c  # every parameter gathered for the copy to rank 0's policy
        else:
            gathered = min(pt, DS_REDUCE_BUCKET) * c
    held = gradients if accumulating else 0.0
    if backend == "ddp":
        held += gradients  # the reduction buckets
    if backend == "fsdp2":
        step = pt * m / w  # foreach AdamW's buffer; the sharded gradients are the master's already
    elif not backend.startswith("deepspeed"):  # MasterWeights moves the gradients into float32 at the step
        step = pt * m * (not fused_adamw) + pt * (m - c) * mixed
    step += shape.largest * c  # the new weights, copied into the policy one parameter at a time
    # rank 0's full policy under the sharded backends; every other rank's generation copy (FSDP2, ZeRO-3:
    # tasks/generation/rank_shared.py generation_copy_bytes) and its share of the rows are no larger
    copies = p * c * (int(reference_copy) + int(generator_copy) + int(sharded))
    row = row_tokens or tokens
    per_layer = shape.layer_kept(c, padded=padded, row_tokens=row)
    h = shape.hidden
    final_norm = 4 * h + 2 * c * h  # the model's last RMSNorm (outside the layers); its output feeds the head
    rotary = 2 * c * shape.head_dim  # cos and sin, shared by the layers
    kept = shape.layers * (c * h if checkpointing else per_layer) + final_norm + rotary
    layer = tokens * (shape.layer_backward(c) + (per_layer if checkpointing else 0.0))
    chunk_rows = max(1, HEAD_CHUNK_ELEMENTS // shape.vocab)
    chunk = min(tokens, chunk_rows) * shape.vocab
    head = tokens * c * h + chunk * (3 * 4 + 2 * c) + (4 * chunk if tokens <= chunk_rows else 0.0)
    weight = shape.vocab * h * c  # one [V, H] gradient of the head's or the embedding's weight
    head_gradient = weight * (2 if tokens > chunk_rows else 1) if shape.head_trained else 0.0
    embedding_gradient = weight if shape.embedding_trained else 0.0
    kv = 0.0 if generation is None else generation.kv_bytes(shape, c) + generation.graph_pool_bytes(shape, c)
    return UpdateMemory(weights=weights, master=master, optimizer=optimizer, copies=copies, gradients=gradients,
                        held_gradients=held, activations=tokens * kept, head=head, head_gradient=head_gradient,
                        embedding_gradient=embedding_gradient, layer=layer, gathered=gathered,
                        step=step, kv_cache=kv, kv_overlaps=generation is not None and generation.overlaps,
                        tokens=tokens)


def available_bytes(device: torch.device | str) -> float:
    """What this process could hold on ``device`` (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device))
    return float(psutil.virtual_memory().available + psutil.Process(os.getpid()).memory_info().rss)


#: The prompt length assumed where the caller does not know the run's longest prompt (the config does not bound it).
PROMPT_TOKENS = 256


def micro_batch_tokens(cfg: Config, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """The padded tokens of the update's largest micro-batch: ``train.micro_batch_tokens``, or with 0 a whole
    minibatch of rows of ``prompt_tokens`` + ``rollout.max_new_tokens``."""
    tc = cfg.train
    if tc.micro_batch_tokens > 0:
        return tc.micro_batch_tokens
    rows = -(-tc.prompts_per_step * cfg.rollout.n // tc.minibatches)
    return rows * (prompt_tokens + cfg.rollout.max_new_tokens)


def check_update_fits(cfg: Config, model: torch.nn.Module, hf_config, device: torch.device | str, *,
                      precision: Precision, lora: bool, world: int = 1, budget: float | None = None,
                      prompt_tokens: int | None = None) -> UpdateMemory:
    """Estimate the step's peak on ``device`` and stop before training when it exceeds the budget.

    Args:
        precision: the run's (``model.precision``, tasks/update/precision.py).
        lora: the policy trains adapters (its KL reference is then no copy).
        world: ranks (the sharded backends; this process is rank 0).
        budget: bytes available (default :func:`available_bytes`).
        prompt_tokens: the run's longest prompt, in tokens (default :data:`PROMPT_TOKENS`).

    Returns:
        The estimate (logged in one line).

    Raises:
        DoesNotFit: with the estimate by part, the budget, and what to lower: the largest
            ``train.micro_batch_tokens`` that fits, checkpointing, LoRA, the rollout chunk.
    """
    shape = ModelShape.of(model, hf_config)
    prompt = prompt_tokens or PROMPT_TOKENS
    tokens = micro_batch_tokens(cfg, prompt)
    row = prompt + cfg.rollout.max_new_tokens
    same_device = cfg.rollout.engine == "hf"
    overlaps = same_device and cfg.overlap.lag != 0  # auto may choose 1: counted
    # the in-process decoder keeps its cache (and CUDA graphs) between calls: resident during the update
    decoding = DecodeOptions.for_device(device)
    padded_prompt = -(-prompt // decoding.prompt_multiple) * decoding.prompt_multiple
    generation = GenerationMemory(rows=cfg.rollout.chunk, context=padded_prompt + cfg.rollout.max_new_tokens,
                            overlaps=True, graphs=decoding.graphs) if same_device else None
    kw = dict(reference_copy=cfg.train.kl_coef > 0 and not lora, generator_copy=overlaps,
              backend=cfg.scale.backend, world=world, accumulating=cfg.train.micro_batch_tokens > 0,
              row_tokens=row, generation=generation, padded=False,  # the update's passes carry no mask
              fused_adamw=cfg.scale.backend in ("single", "ddp") and bool(adamw_kernel(device)["fused"]))
    est = estimate(shape, precision, tokens=tokens, checkpointing=cfg.train.gradient_checkpointing, **kw)
    budget = available_bytes(device) if budget is None else budget
    log.info("update memory on %s (%s): %s of %.1f GiB available", device, precision.name, est.describe(),
             budget / GIB)
    if est.total <= budget:
        return est
    what = [f"the step needs about {est.describe()} on {device}, but {budget / GIB:.1f} GiB is available"]
    fits = [t for t in (2 ** k for k in range(8, 20)) if t < tokens and estimate(
        shape, precision, tokens=t, checkpointing=cfg.train.gradient_checkpointing, **kw).total <= budget]
    if fits:
        what.append(f"lower train.micro_batch_tokens to {max(fits)} or less (the step's gradient is the same)")
    if not cfg.train.gradient_checkpointing:
        ckpt = estimate(shape, precision, tokens=tokens, checkpointing=True, **kw)
        what.append(f"set train.gradient_checkpointing=true ({ckpt.total / GIB:.1f} GiB at {tokens:,} tokens)")
    if not lora:
        what.append("train LoRA adapters (model.lora.enabled=true): gradients and AdamW state for the adapters only")
    if est.kv_cache and est.kv_cache * MARGIN > 0.1 * budget:
        what.append(f"lower rollout.chunk ({cfg.rollout.chunk} rows decode at once: a KV cache of "
                    f"{est.kv_cache / GIB:.1f} GiB)")
    if est.state * MARGIN > budget:
        what.append("the weights and optimizer state alone do not fit: shard them (scale.backend=fsdp2 or "
                    "deepspeed_zero3, docs/scale-out.md)")
    raise DoesNotFit("; ".join(what))
