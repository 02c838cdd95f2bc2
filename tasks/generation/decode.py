"""The in-process decode loop: a KV cache written in place, each prompt prefilled once, rows leaving by buckets, and
on CUDA the one-token forward replayed as a CUDA graph.

What a step costs is what the GPU must do (the layout of nano-vllm, gpt-fast and SGLang; docs/performance.md):

- **One cache, written in place.** Keys and values of every layer live in buffers ``[R, H_kv, S, D]`` allocated
  once (and kept by :class:`Decoder` for the next call of the same shape), ``S = P + T - 1`` for prompts padded to
  ``P`` columns (on CUDA a multiple of 64, so most calls share a shape) and ``T = max_new_tokens``. Step ``t``
  writes its keys and values at column ``P + t - 1`` of every row (``index_copy_``; no ``torch.cat`` of the
  cache, as ``DynamicCache`` does each step). The attention mask is a
  4-D additive buffer ``[R, 1, 1, S]`` whose column is opened in place; token, position and column are buffers
  too. Attention reads all ``S`` columns each step (the unwritten ones masked).
- **Each prompt prefilled once.** The B prompts go through the model once, into a small cache of their own;
  its keys and values are copied to the n rows of each prompt (GRPO's rollouts share the prompt).
- **Rows leave by buckets.** A finished row stays in the batch (its draws are discarded) until the live rows fit
  the next smaller bucket of ``1, 2, 4, ..., 2^k < R, R``; then live rows are gathered to the front of every
  buffer (``Decoder`` pads a bucket with finished rows). The host learns how many rows go on every
  ``check_every`` steps (one sync then), not every step.
- **CUDA graphs.** On CUDA the one-token forward of each bucket is captured once (``torch.cuda.CUDAGraph``, one
  shared memory pool, buckets captured as the call reaches them, largest first) and replayed; a later call that
  has the same shape (rows, padded prompt, new tokens) reuses the buffers and graphs, unless the model's
  parameters were replaced (their storage is checked).
  On the CPU the forward runs eagerly, every finished row leaves at once (``exact_rows``) and the host checks
  every step, which is what the CPU's time is spent on.
- Sampling outside the graph: :func:`tasks.generation.sampling.sample_next`, the exponential race with counter-based
  noise keyed by (prompt seed, rollout, step, token), so a prompt's rollouts do not depend on its batch.

KV cache bytes (what ``tasks/update/memory_check.py`` counts for generation):
``rows x (prompt + max_new_tokens) x layers x 2 x kv_heads x head_dim x dtype bytes`` bounds it: exactly
``R x (P + T - 1) x layers x 2 x H_kv x D x bytes``, plus the prefill's ``B x P x layers x 2 x H_kv x D x bytes``
during the prefill (B = R / n prompts), the mask ``R x S x bytes`` and a float32 ``[R, T]`` of log-probs. The 1.5B
shape (28 layers, 2 KV heads of 128) in bf16 at 512 rows x (128 + 512): 9.4 GB.

Exactness: greedy decoding is ``generate``'s token for token and the drawn tokens' log-probs the trainer's
(tests/tasks/test_decode.py). Padding to a larger ``P`` or bucket only adds masked columns and discarded rows.
Deviation: positions are the attention mask's cumulative sum (as ``tasks.model.forward.pack``); transformers'
mask construction and cache classes are bypassed (the model gets a 4-D mask and this module's cache), so only
decoder models whose attention calls ``past_key_values.update(keys, values, layer_idx, ...)`` are supported
(Llama, Qwen2, Qwen3, Mistral and the like; not sliding-window or linear-attention layers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tasks.generation.sampling import Sampling, row_keys, sample_next, step_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeOptions:
    """How the loop runs on a device.

    Attributes:
        graphs: capture the one-token forward per bucket as a CUDA graph (CUDA only).
        exact_rows: a finished row leaves the batch at the next check (every bucket size allowed); else only when
            the live rows fit a smaller bucket (powers of two below the rows, and the rows).
        check_every: decode steps between the host's checks of how many rows go on (one sync each).
        prompt_multiple: prompts are padded to a multiple of this many columns, so calls whose prompts differ a
            little in length share one shape, hence the buffers and graphs.
    """

    graphs: bool
    exact_rows: bool
    check_every: int
    prompt_multiple: int = 1

    def __post_init__(self):
        if self.check_every < 1 or self.prompt_multiple < 1:
            raise ValueError(f"DecodeOptions: check_every {self.check_every} and prompt_multiple "
                             f"{self.prompt_multiple} must be >= 1")

    @classmethod
    def for_device(cls, device: torch.device | str) -> DecodeOptions:
        """CUDA: graphs, buckets, a check every 8 steps, prompts padded to 64 columns; elsewhere eager, exact rows,
        a check every step (a CPU step costs what its rows cost; a check costs nothing there)."""
        if torch.device(device).type == "cuda":
            return cls(graphs=True, exact_rows=False, check_every=8, prompt_multiple=64)
        return cls(graphs=False, exact_rows=True, check_every=1)


def buckets(rows: int) -> list[int]:
    """The row counts a batch of ``rows`` is compacted to: powers of two below ``rows``, then ``rows``."""
    return [1 << i for i in range(max(rows - 1, 0).bit_length()) if 1 << i < rows] + [rows]


class SlotCache:
    """Keys and values of every layer in buffers written in place at the columns ``slot`` (a device tensor); the
    model sees the first ``rows`` rows. What transformers' attention layers call: ``update`` (and, in some
    versions, ``get_seq_length`` to make positions we pass anyway). Buffers are allocated at the first ``update``
    of each layer (``length`` columns) unless given."""

    is_compileable = True

    def __init__(self, rows: int, length: int, keys: list[torch.Tensor] | None = None,
                 values: list[torch.Tensor] | None = None):
        self.rows, self.length = rows, length
        self.keys: list[torch.Tensor] = keys if keys is not None else []
        self.values: list[torch.Tensor] = values if values is not None else []
        self.slot: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[rows, H_kv, q, D]`` keys and values at the columns ``slot`` (q of them) of layer
        ``layer_idx``; return that layer's ``[rows, H_kv, S, D]`` keys and values."""
        if layer_idx == len(self.keys):  # allocate lazily, as the prefill meets each layer
            shape = (self.rows, key_states.shape[1], self.length)
            self.keys.append(key_states.new_zeros(*shape, key_states.shape[-1]))
            self.values.append(value_states.new_zeros(*shape, value_states.shape[-1]))
        k, v = self.keys[layer_idx][:self.rows], self.values[layer_idx][:self.rows]
        k.index_copy_(2, self.slot, key_states)
        v.index_copy_(2, self.slot, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's lowest value elsewhere (what transformers' eager and sdpa masks
    hold; a fully masked row stays finite)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                      torch.finfo(dtype).min)


class Decoder:
    """Decoding with one model: buffers and CUDA graphs kept across calls that fit them (:func:`decode` for one
    call). Attributes ``capture_s`` (seconds spent capturing graphs, all calls) and ``kv_bytes`` (the main
    cache's size) are read by the GPU check (infra/gpu_bench_generation.py)."""

    def __init__(self, model: torch.nn.Module, options: DecodeOptions | None = None):
        self.model, self.options = model, options
        self.cache: SlotCache | None = None
        self.capture_s = 0.0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._params: tuple[int, ...] = ()
        self._eager = False  # set when a capture failed
        self._lock = threading.Lock()  # one call at a time: the buffers are shared (a draw in a thread, say)

    @property
    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    def release(self) -> None:
        """Free the buffers and graphs (the next call allocates and captures again)."""
        self.cache, self._graphs, self._pool = None, {}, None

    # -- buffers ------------------------------------------------------------------------------------------
    def _fits(self, rows: int, prompt: int, new: int, pre: SlotCache) -> bool:
        """Whether the buffers have exactly this call's shape: a call's result must not depend on the calls before
        it (a resumed run samples what the uninterrupted one did), and a longer buffer would change the attention's
        reductions in the last bits."""
        c = self.cache
        return (c is not None and rows == c.keys[0].shape[0] and prompt == self._p and new == self._t
                and len(c.keys) == len(pre.keys)
                and all(a.shape[1:2] + a.shape[3:] == b.shape[1:2] + b.shape[3:] and a.dtype == b.dtype
                        and a.device == b.device
                        for a, b in zip(c.keys + c.values, pre.keys + pre.values, strict=True)))

    def _allocate(self, rows: int, p: int, new: int, pre: SlotCache) -> None:
        self.release()
        s = p + max(new - 1, 0)
        dtype, device = pre.keys[0].dtype, pre.keys[0].device
        keys = [k.new_zeros(rows, k.shape[1], s, k.shape[3]) for k in pre.keys]
        values = [v.new_zeros(rows, v.shape[1], s, v.shape[3]) for v in pre.values]
        self.cache = SlotCache(rows, s, keys, values)
        self.cache.slot = torch.zeros(1, dtype=torch.long, device=device)
        self._p, self._t = p, new
        self._mask = torch.zeros(rows, 1, 1, s, dtype=dtype, device=device)
        self._tok = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._pos = torch.zeros(rows, 1, dtype=torch.long, device=device)

    # -- the one-token forward ----------------------------------------------------------------------------
    def _forward(self, m: int) -> torch.Tensor:
        self.cache.rows = m
        return self.model(input_ids=self._tok[:m], attention_mask=self._mask[:m], position_ids=self._pos[:m],
                          past_key_values=self.cache, use_cache=True).logits

    def _step(self, m: int, graphs: bool) -> torch.Tensor:
        """[m, V] logits of the next token of the first m rows."""
        if not graphs or self._eager:
            return self._forward(m)[:, -1]
        if m not in self._graphs:
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: writes this step's column with this step's values (replayed)
                self._forward(m)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._forward(m)
            except RuntimeError as err:  # a model whose forward cannot be captured: eager, as on the CPU
                log.warning("decode: the one-token forward could not be captured as a CUDA graph (%s); eager from "
                            "now on, slower", (str(err).splitlines() or ["?"])[0][:200])
                self._eager = True
                return self._forward(m)[:, -1]
            torch.cuda.synchronize()
            self._graphs[m] = (graph, out)
            self.capture_s += time.perf_counter() - t0
        graph, out = self._graphs[m]
        graph.replay()
        return out[:, -1]

    # -- a call -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int = 1, max_new_tokens: int,
                 sampling: Sampling | None, stop_ids: Sequence[int], pad_id: int,
                 seeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """n completions of each of the B prompts (see :func:`decode`)."""
        with self._lock:
            return self._call(input_ids, attention_mask, n, max_new_tokens, sampling, stop_ids, pad_id, seeds)

    def _call(self, input_ids, attention_mask, n, max_new_tokens, sampling, stop_ids, pad_id, seeds):
        device = input_ids.device
        opts = self.options or DecodeOptions.for_device(device)
        graphs = opts.graphs and device.type == "cuda"
        b, p = input_ids.shape
        r, t_max = b * n, max_new_tokens
        out = torch.full((r + 1, t_max), pad_id, dtype=torch.long, device=device)  # row r: finished rows' scratch
        out_logp = torch.zeros(r + 1, t_max, dtype=torch.float32, device=device)
        if t_max == 0 or r == 0:
            return out[:r, :0], out_logp[:r, :0]
        if sampling is not None and (seeds is None or seeds.shape != (b,)):
            raise ValueError(f"decode: sampling needs one noise seed per prompt ([{b}] int64), got "
                             f"{None if seeds is None else tuple(seeds.shape)}")
        params = tuple(q.data_ptr() for q in self.model.parameters())
        if params != self._params:  # replaced weights: graphs would read the old storage
            self._graphs, self._params = {}, params
        stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
        am = attention_mask.bool()
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)

        # prefill: each prompt once, into its own cache
        pre = SlotCache(b, p)
        pre.slot = torch.arange(p, device=device)
        causal = torch.ones(p, p, dtype=torch.bool, device=device).tril()
        mask4 = _additive(causal[None, None] & am[:, None, None, :], self.model.get_input_embeddings().weight.dtype)
        logits = self.model(input_ids=input_ids, attention_mask=mask4, position_ids=pos, past_key_values=pre,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        del mask4
        p_alloc = -(-p // opts.prompt_multiple) * opts.prompt_multiple
        if not self._fits(r, p_alloc, t_max, pre):
            self._allocate(r, p_alloc, t_max, pre)
        cache, big_p = self.cache, self._p
        lo = big_p - p  # prompts sit right-aligned in the buffers' prompt columns
        for dst, src in zip(cache.keys + cache.values, pre.keys + pre.values, strict=True):
            dst[:r, :, lo:big_p].unflatten(0, (b, n)).copy_(src[:, None])
        del pre
        sizes = list(range(1, cache.keys[0].shape[0] + 1)) if opts.exact_rows else buckets(cache.keys[0].shape[0])
        m = next(x for x in sizes if x >= r)
        self._mask.fill_(torch.finfo(self._mask.dtype).min)
        self._mask[:r, 0, 0, lo:big_p] = _additive(am, self._mask.dtype).repeat_interleave(n, 0)
        self._mask[r:m, 0, 0, 0] = 0  # rows that only pad the bucket: one open column keeps them finite
        self._pos[:r] = pos[:, -1:].repeat_interleave(n, 0)
        row_of = torch.full((m,), r, dtype=torch.long, device=device)
        row_of[:r] = torch.arange(r, device=device)
        done = torch.ones(m, dtype=torch.bool, device=device)
        done[:r] = False
        keys = torch.zeros(m, dtype=torch.long, device=device)
        if sampling is not None:
            keys[:r] = row_keys(seeds.to(device), n)
        length = torch.zeros(r + 1, dtype=torch.long, device=device)

        logits = logits.repeat_interleave(n, 0)
        if m > r:
            logits = torch.cat([logits, logits[:1].expand(m - r, -1)])
        live = r
        for t in range(t_max):
            if t > 0:
                self._tok[:m, 0] = tok
                self._pos[:m] += 1
                cache.slot.fill_(big_p + t - 1)
                self._mask[:m].index_fill_(3, cache.slot, 0)
                logits = self._step(m, graphs)
            tok, logp = sample_next(logits, sampling, step_keys(keys[:m], t) if sampling is not None else None)
            target = torch.where(done[:m], r, row_of[:m])
            out[target, t] = tok
            out_logp[target, t] = logp
            length[target] = t + 1
            done[:m] |= torch.isin(tok, stops)
            if t + 1 == t_max or (t + 1) % opts.check_every:
                continue
            live = int((~done[:m]).sum())  # the host's check: one sync
            if live == 0:
                break
            smaller = next(x for x in sizes if x >= live)
            if smaller < m:
                tok = self._compact(m, smaller, done, row_of, keys, tok)
                m = smaller
        width = int(length[:r].max())
        ids, logp_out = out[:r, :width], out_logp[:r, :width]
        if bool(logp_out.isnan().any()):
            raise FloatingPointError(f"decode: the model's logits were NaN for {int(logp_out.isnan().sum())} of the "
                                     f"drawn tokens ({r} rows); its weights are not finite")
        return ids, logp_out

    def _compact(self, m: int, smaller: int, done: torch.Tensor, row_of: torch.Tensor, keys: torch.Tensor,
                 tok: torch.Tensor) -> torch.Tensor:
        """Gather the live rows (and finished ones to fill the bucket) to the front of every buffer; the
        current tokens in the new order."""
        order = torch.argsort(done[:m].to(torch.int8), stable=True)[:smaller]  # live rows first, in row order
        for buf in self.cache.keys + self.cache.values + [self._mask, self._tok, self._pos, row_of, done, keys]:
            buf[:smaller] = buf[order]
        return tok[order]


def decode(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int = 1,
           max_new_tokens: int, sampling: Sampling | None, stop_ids: Sequence[int], pad_id: int,
           seeds: torch.Tensor | None = None,
           options: DecodeOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or, with ``sampling=None``, arg-max) n completions of each prompt (module docstring).

    Each step draws the next tokens with :func:`tasks.generation.sampling.sample_next`: the exponential race
    (Gumbel-max, an exact sampler of the softmax) on the logits divided by the temperature and cut by top-k and
    top-p, in float32 chunks of rows; row ``j`` of prompt ``b`` at step ``t`` races noise keyed by
    ``(seeds[b], j, t)``, so the same seed gives the same rollouts whichever rows, calls or devices of one kind
    the prompt shares. Only ``sampling`` applies: a model folder's own ``generation_config`` (a repetition
    penalty, say) does not, so the sampling distribution is exactly the one the update's log-probs describe.

    Args:
        input_ids: [B, P] left-padded prompts; attention_mask: [B, P].
        n: rollouts per prompt; the rows come out prompt-major (rows b*n .. b*n+n-1 are prompt b's).
        stop_ids: the tokens that end a row (``tasks.generation.rollout.end_of_turn_ids``); empty: none.
        seeds: [B] int64, each prompt's noise seed (``tasks.generation.rollout.prompt_seed``); required when
            sampling.
        options: default :meth:`DecodeOptions.for_device`.

    Returns:
        ``(ids, logp)``: [B*n, T] completion ids, T <= ``max_new_tokens`` the longest completion, ``pad_id`` after
        each row's first stop token; [B*n, T] float32 log-prob of each drawn token under the distribution it was
        drawn from (the warped one; arg-max decoding: the plain softmax), 0 after it.

    Raises:
        FloatingPointError: the model's logits were NaN for some drawn token (broken weights).
    """
    return Decoder(model, options)(input_ids, attention_mask, n=n, max_new_tokens=max_new_tokens, sampling=sampling,
                                   stop_ids=stop_ids, pad_id=pad_id, seeds=seeds)
