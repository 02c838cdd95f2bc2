"""The in-process decode loop: a KV cache written in place, each prompt prefilled once, rows leaving by buckets, and
on CUDA the one-token forward replayed as a CUDA graph. How it runs on a device (graphs or eager steps, buckets,
checks, padding) is a :class:`tasks.generation.decode_options.DecodeOptions`.

What a step costs is what the GPU must do (the layout of nano-vllm, gpt-fast and SGLang; docs/performance.md):

- **One cache, written in place.** Keys and values of every layer live in buffers ``[R, H_kv, S, D]`` allocated
  once (and kept by :class:`Decoder` for the next call of the same shape), ``S = P + T - 1`` (rounded up to
  ``width_multiple``, on CUDA 128) for prompts padded to ``P`` columns (on CUDA a multiple of 64, so most calls
  share a shape) and ``T = max_new_tokens``. Step ``t`` writes its keys and values at column ``P + t - 1`` of
  every row (``index_copy_``; no ``torch.cat`` of the cache, as ``DynamicCache`` does each step). The attention
  mask is a 4-D additive buffer ``[R, 1, 1, S]`` whose column is opened in place (one column a step, no
  rebuild); token, position, column and step counter are buffers too.
- **Attention over the used width.** On CUDA step ``t`` reads the first ``P + t`` columns rounded up to 128
  (keys, values and mask sliced alike; aligned rows, so the memory-efficient kernel pads no mask), not all
  ``S``: at 128 + 256 tokens a third less cache read on average. On the CPU it reads exactly the ``P + t``
  written columns (a generate call 1.12x the tokens a second at `grpo_prescreen`'s call, 1.07x at plain GRPO's;
  the masked columns added exact zeros, and the golden rollouts' tokens are unchanged).
- **Each prompt prefilled once.** The B prompts go through the model once, into a small cache of their own;
  its keys and values are copied to the n rows of each prompt (GRPO's rollouts share the prompt).
- **Rows leave by buckets.** A finished row stays in the batch (its draws are discarded) until the live rows fit
  the next smaller bucket of ``1, 2, 4, ..., 2^k < R, R``; then live rows are gathered to the front of every
  buffer (``Decoder`` pads a bucket with finished rows). The host learns how many rows go on every
  ``check_every`` steps (one sync then), not every step.
- **A step is one CUDA graph.** The whole step (open the column, the one-token forward, the draw with
  :func:`tasks.generation.sampling.sample_next`, recording the token and its log-prob, the stop check, the step
  counter) is one function, :meth:`Decoder._step_body`; on CUDA each (bucket, width, sampling) runs eagerly once
  (the warm-up) and is captured at its second step (``torch.cuda.CUDAGraph``, one shared memory pool), then
  replayed. The draw's noise is keyed by (prompt seed, rollout, step, token) with the step read from a device
  counter, so the replay draws what an eager step draws, and a prompt's rollouts do not depend on its batch. A
  later call of the same shape (rows, padded prompt, new tokens) reuses the buffers and graphs, unless the
  model's parameters were replaced (their storage is checked). A failed capture: out of memory retries at a
  later call, anything else runs eagerly from then on (:mod:`tasks.generation.capture`).
  On the CPU the same step function runs eagerly, every finished row leaves at once (``exact_rows``) and the
  host checks every step, which is what the CPU's time is spent on; its one-token attention is two matrix
  products, not PyTorch's flash kernel (tasks/generation/step_attention.py; docs/performance.md: 1.06-1.16x the
  tokens a second on the tiny policy), and a Llama-family model's one-token forward runs without transformers'
  per-call machinery (tasks/generation/step_forward.py: the same logits, 1.08-1.13x).

KV cache bytes (what ``tasks/update/memory_check.py`` counts for generation):
``rows x (prompt + max_new_tokens) x layers x 2 x kv_heads x head_dim x dtype bytes`` bounds it up to the
padding of the prompt and of ``S`` (on CUDA at most 63 + 127 columns): exactly ``R x S x layers x 2 x H_kv x D x
bytes``, plus the prefill's ``B x P x layers x 2 x H_kv x D x bytes``
during the prefill (B = R / n prompts), the mask ``R x S x bytes`` and a float32 ``[R, T]`` of log-probs. The 1.5B
shape (28 layers, 2 KV heads of 128) in bf16 at 512 rows x (128 + 512): 9.4 GB.

Exactness: greedy decoding is ``generate``'s token for token and the drawn tokens' log-probs the trainer's
(tests/tasks/test_decode.py). Padding to a larger ``P`` or bucket only adds masked columns and discarded rows.
Deviation: positions are the attention mask's cumulative sum (as ``tasks.model.forward.pack``); transformers'
mask construction and cache classes are bypassed (the model gets a 4-D mask and the loop's own cache,
tasks/generation/slot_cache.py), so only decoder models whose attention calls
``past_key_values.update(keys, values, layer_idx, ...)`` are supported (Llama, Qwen2, Qwen3, Mistral and the like;
not sliding-window or linear-attention layers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from tasks.generation.capture import CapturePolicy, capture, capture_mode, world_size
from tasks.generation.decode_options import DecodeOptions, buckets
from tasks.generation.sampling import Sampling, row_keys, sample_next, step_keys
from tasks.generation.slot_cache import SlotCache
from tasks.generation.step_attention import one_token_attention
from tasks.generation.step_forward import StepForward, step_forward


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's lowest value elsewhere (what transformers' eager and sdpa masks
    hold; a fully masked row stays finite)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                      torch.finfo(dtype).min)


class Decoder:
    """Decoding with one model: buffers and CUDA graphs kept across calls that fit them (:func:`decode` for one
    call). Attributes ``capture_s`` (seconds spent capturing graphs, all calls), ``kv_bytes`` (the main cache's
    size) and ``graphs`` (captured so far) are read by the GPU check (infra/gpu_bench_generation.py).

    A decode step after the first is :meth:`_step_body`: open the step's column, the one-token forward over the
    cache's used width, then :meth:`_advance` (draw, record, stop check, advance the step counter). On CUDA each
    (bucket, width, sampling) is run eagerly the first time (the warm-up: lazy initialisation, the race's
    compile) and captured the second, then replayed: a step is one graph replay, the host's only work a check
    every ``check_every`` steps. Eagerly (the CPU, or a step not captured) the same function runs.
    """

    def __init__(self, model: torch.nn.Module, options: DecodeOptions | None = None):
        self.model, self.options = model, options
        self.cache: SlotCache | None = None
        self.capture_s = 0.0
        self.policy = CapturePolicy()
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._seen: set[tuple] = set()  # steps run eagerly once (warmed up), capture at the next
        self._pool = None
        self._stream = None
        self._params: tuple[int, ...] = ()
        self._lock = threading.Lock()  # one call at a time: the buffers are shared (a draw in a thread, say)
        self._forward: StepForward | None = None  # the call's one-token forward where not the model's own

    @property
    def kv_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Free the buffers and graphs (the next call allocates and captures again)."""
        self.cache, self._graphs, self._seen, self._pool = None, {}, set(), None

    # -- buffers ------------------------------------------------------------------------------------------
    def _fits(self, rows: int, prompt: int, new: int, pre: SlotCache, width_multiple: int | None) -> bool:
        """Whether the buffers have exactly this call's shape: a call's result must not depend on the calls before
        it (a resumed run samples what the uninterrupted one did), and a longer buffer would change the attention's
        reductions in the last bits."""
        c = self.cache
        return (c is not None and rows == c.keys[0].shape[0] and prompt == self._p and new == self._new
                and width_multiple == self._width_multiple
                and len(c.keys) == len(pre.keys)
                and all(a.shape[1:2] + a.shape[3:] == b.shape[1:2] + b.shape[3:] and a.dtype == b.dtype
                        and a.device == b.device
                        for a, b in zip(c.keys + c.values, pre.keys + pre.values, strict=True)))

    def _allocate(self, rows: int, p: int, new: int, pre: SlotCache, width_multiple: int | None) -> None:
        """Buffers for ``rows`` rows, prompts of ``p`` columns and ``new`` tokens: the cache's ``S = P + T - 1``
        columns rounded up to ``width_multiple``."""
        self.release()
        self.policy.new_shape()
        w = width_multiple or 1
        s = -(-(p + max(new - 1, 0)) // w) * w
        dtype, device = pre.keys[0].dtype, pre.keys[0].device
        keys = [k.new_zeros(rows, k.shape[1], s, k.shape[3]) for k in pre.keys]
        values = [v.new_zeros(rows, v.shape[1], s, v.shape[3]) for v in pre.values]
        self.cache = SlotCache(rows, s, keys, values)
        self.cache.slot = torch.zeros(1, dtype=torch.long, device=device)
        self._p, self._new, self._width_multiple = p, new, width_multiple
        self._mask = torch.zeros(rows, 1, 1, s, dtype=dtype, device=device)
        self._tok = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._t = torch.zeros((), dtype=torch.long, device=device)  # the step being drawn
        self._keys = torch.zeros(rows, dtype=torch.long, device=device)
        self._done = torch.ones(rows, dtype=torch.bool, device=device)
        self._row_of = torch.full((rows,), rows, dtype=torch.long, device=device)
        self._out = torch.zeros(rows + 1, new, dtype=torch.long, device=device)  # row `rows`: finished rows' scratch
        self._out_logp = torch.zeros(rows + 1, new, dtype=torch.float32, device=device)
        self._length = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self._stops = torch.full((8,), -1, dtype=torch.long, device=device)  # padded with -1, no token

    def _set_stops(self, stop_ids: Sequence[int]) -> None:
        """The stop ids into their buffer (padded with -1); a larger buffer, and no graphs, when they do not fit."""
        if len(stop_ids) > len(self._stops):
            self._stops = torch.full((1 << (len(stop_ids) - 1).bit_length(),), -1, dtype=torch.long,
                                     device=self._stops.device)
            self._graphs, self._seen = {}, set()
        self._stops.fill_(-1)
        if stop_ids:
            self._stops[:len(stop_ids)] = torch.tensor(list(stop_ids), dtype=torch.long)

    # -- a step -------------------------------------------------------------------------------------------
    def _advance(self, logits: torch.Tensor, m: int, sampling: Sampling | None) -> None:
        """Draw the next token of the first m rows from their [m, V] logits at the step ``_t``, record it (a
        finished row's in the scratch row), mark rows that drew a stop id, feed the tokens to the next forward and
        count the step. No host sync: it runs inside the step's graph."""
        keys = step_keys(self._keys[:m], self._t) if sampling is not None else None
        tok, logp = sample_next(logits, sampling, keys)
        scratch = self._out.shape[0] - 1
        target = torch.where(self._done[:m], scratch, self._row_of[:m])
        column = self._t.expand(m)
        self._out.index_put_((target, column), tok)
        self._out_logp.index_put_((target, column), logp)
        self._length.index_put_((target,), (self._t + 1).expand(m))
        self._done[:m] |= (tok[:, None] == self._stops).any(-1)
        self._tok[:m, 0] = tok
        self._t += 1

    def _open_column(self, m: int) -> None:
        """The next position of the first m rows, and the column ``P + t - 1`` their keys go to, opened in the
        mask (one column: the mask is never rebuilt)."""
        self._pos[:m] += 1
        torch.add(self._t, self._p - 1, out=self.cache.slot[0])
        self._mask[:m].index_fill_(3, self.cache.slot, 0)

    def _step_body(self, m: int, width: int, sampling: Sampling | None) -> None:
        """One decode step after the first, of the first m rows: the token drawn last goes in at column ``P + t -
        1``, attention reads the first ``width`` columns (at least ``P + t``), then :meth:`_advance`."""
        self._open_column(m)
        self.cache.rows, self.cache.width = m, width
        tok, mask, pos = self._tok[:m], self._mask[:m, :, :, :width], self._pos[:m]
        if self._forward is not None:
            logits = self._forward(tok, mask, pos, self.cache)
        else:
            logits = self.model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                                use_cache=True).logits[:, -1]
        self._advance(logits, m, sampling)

    def _step(self, m: int, width: int, sampling: Sampling | None, graphs: bool) -> None:
        """:meth:`_step_body`, replayed from its graph where there is one (capture at its second run)."""
        key = (m, width, sampling)
        if key in self._graphs:
            self._graphs[key].replay()
            return
        if not graphs or key not in self._seen or not self.policy.should_capture(key):
            self._seen.add(key)
            self._step_body(m, width, sampling)
            return
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        try:
            capture(graph, lambda: self._step_body(m, width, sampling), pool=self._pool, stream=self._stream,
                    mode=capture_mode(world_size()))
        except Exception as err:  # noqa: BLE001 - the policy decides; the step runs eagerly either way
            del graph
            self._pool = None  # a failed capture leaves its pool unusable: the next capture takes a new one
            if self.policy.failed(key, err) == "retry":
                torch.cuda.empty_cache()
            self._step_body(m, width, sampling)
            return
        self._graphs[key] = graph
        graph.replay()
        self.capture_s += time.perf_counter() - t0

    # -- a call -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int = 1, max_new_tokens: int,
                 sampling: Sampling | None, stop_ids: Sequence[int], pad_id: int,
                 seeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """n completions of each of the B prompts (see :func:`decode`)."""
        opts = self.options or DecodeOptions.for_device(input_ids.device)
        with self._lock, one_token_attention(self.model) if opts.step_attention else nullcontext():
            return self._call(opts, input_ids, attention_mask, n, max_new_tokens, sampling, stop_ids, pad_id, seeds)

    def _call(self, opts, input_ids, attention_mask, n, max_new_tokens, sampling, stop_ids, pad_id, seeds):
        device = input_ids.device
        graphs = opts.graphs and device.type == "cuda"
        b, p = input_ids.shape
        r, t_max = b * n, max_new_tokens
        if t_max == 0 or r == 0:
            return (torch.full((r, 0), pad_id, dtype=torch.long, device=device),
                    torch.zeros(r, 0, dtype=torch.float32, device=device))
        if sampling is not None and (seeds is None or seeds.shape != (b,)):
            raise ValueError(f"decode: sampling needs one noise seed per prompt ([{b}] int64), got "
                             f"{None if seeds is None else tuple(seeds.shape)}")
        params = tuple(q.data_ptr() for q in self.model.parameters())
        if params != self._params:  # replaced weights: graphs would read the old storage
            self._graphs, self._seen, self._params = {}, set(), params
        self.policy.new_call()
        self._forward = step_forward(self.model) if opts.step_forward and opts.step_attention else None
        am = attention_mask.bool()
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)

        logits, pre = self._prefill(input_ids, am, pos)
        p_alloc = -(-p // opts.prompt_multiple) * opts.prompt_multiple
        if not self._fits(r, p_alloc, t_max, pre, opts.width_multiple):
            self._allocate(r, p_alloc, t_max, pre, opts.width_multiple)
        cache, big_p, s = self.cache, self._p, self.cache.length
        lo = big_p - p  # prompts sit right-aligned in the buffers' prompt columns
        for dst, src in zip(cache.keys + cache.values, pre.keys + pre.values, strict=True):
            dst[:r, :, lo:big_p].unflatten(0, (b, n)).copy_(src[:, None])
        del pre
        sizes = list(range(1, cache.keys[0].shape[0] + 1)) if opts.exact_rows else buckets(cache.keys[0].shape[0])
        m = next(x for x in sizes if x >= r)
        self._set_stops(stop_ids)
        self._mask.fill_(torch.finfo(self._mask.dtype).min)
        self._mask[:r, 0, 0, lo:big_p] = _additive(am, self._mask.dtype).repeat_interleave(n, 0)
        self._mask[r:m, 0, 0, 0] = 0  # rows that only pad the bucket: one open column keeps them finite
        self._pos[:r] = pos[:, -1:].repeat_interleave(n, 0)
        self._row_of.fill_(r)
        self._row_of[:r] = torch.arange(r, device=device)
        self._done.fill_(True)
        self._done[:r] = False
        self._keys.zero_()
        if sampling is not None:
            self._keys[:r] = row_keys(seeds.to(device), n)
        self._out.fill_(pad_id)
        self._out_logp.zero_()
        self._length.zero_()
        self._t.zero_()

        logits = logits.repeat_interleave(n, 0)
        if m > r:
            logits = torch.cat([logits, logits[:1].expand(m - r, -1)])
        self._advance(logits, m, sampling)  # step 0, from the prefill's logits
        del logits
        for t in range(1, t_max):
            if t % opts.check_every == 0:  # the host's check: one sync
                live = int((~self._done[:m]).sum())
                if live == 0:
                    break
                smaller = next(x for x in sizes if x >= live)
                if smaller < m:
                    self._compact(m, smaller, big_p + t - 1)
                    m = smaller
            w = opts.width_multiple
            width = s if w is None else min(s, -(-(big_p + t) // w) * w)
            self._step(m, width, sampling, graphs)
        width = int(self._length[:r].max())
        ids, logp_out = self._out[:r, :width].clone(), self._out_logp[:r, :width].clone()
        if bool(logp_out.isnan().any()):
            raise FloatingPointError(f"decode: the model's logits were NaN for {int(logp_out.isnan().sum())} of the "
                                     f"drawn tokens ({r} rows); its weights are not finite")
        return ids, logp_out

    def _prefill(self, input_ids: torch.Tensor, am: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, SlotCache]:
        """Each of the B prompts [B, P] once through the model, into a cache of its own (``am``: [B, P] bool, the
        real tokens; ``pos``: [B, P] their positions). Returns the last position's logits [B, V] and that cache."""
        b, p = input_ids.shape
        pre = SlotCache(b, p)
        pre.slot = torch.arange(p, device=input_ids.device)
        causal = torch.ones(p, p, dtype=torch.bool, device=input_ids.device).tril()
        mask4 = _additive(causal[None, None] & am[:, None, None, :], self.model.get_input_embeddings().weight.dtype)
        logits = self.model(input_ids=input_ids, attention_mask=mask4, position_ids=pos, past_key_values=pre,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
        return logits, pre

    def _compact(self, m: int, smaller: int, written: int) -> None:
        """Gather the live rows (and finished ones to fill the bucket) to the front of every buffer: of the cache and
        the mask only the ``written`` columns (a later one stays closed in every row's mask until its step writes
        it), by ``index_select`` and a copy (an advanced-index assignment took 13 % of a CPU draw: docs/performance.md,
        "The decode loop")."""
        order = torch.argsort(self._done[:m].to(torch.int8), stable=True)[:smaller]  # live rows first, in row order
        for buf in self.cache.keys + self.cache.values:  # [rows, kv_heads, S, head_dim]
            buf[:smaller, :, :written].copy_(buf[:, :, :written].index_select(0, order))
        self._mask[:smaller, ..., :written].copy_(self._mask[..., :written].index_select(0, order))
        for buf in (self._tok, self._pos, self._row_of, self._done, self._keys):
            buf[:smaller].copy_(buf.index_select(0, order))


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
