"""Drawing the next token of every row from its logits: the exponential race, in float32 row chunks.

A categorical draw from ``p = softmax(x)`` is ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` independent: the
exponential race, which is the Gumbel-max trick (``argmax_i x_i + G_i``, ``G_i = -log E_i``) with the
exponential taken of both sides (Gumbel 1954; Maddison et al., "A* Sampling", arXiv:1411.0030, section 2; Kool
et al., arXiv:1903.06059, section 2). It is exact: ``P(argmax = i) = p_i``. ``torch.multinomial`` with one
sample draws the same way internally (``q = exponential_(); argmax(probs / q)``, PyTorch issue 11931), and so does
vLLM's sampler; what this module drops is everything around it that cost a full ``[R, V]`` pass each: a float32
copy of all the logits, the temperature's copy, ``softmax``, ``multinomial``'s validity check (a host sync),
``log_softmax`` for the drawn token's log-prob, and the ``[B, V]`` matrix of every row, finished ones included.

Per chunk of rows (at most ``max_elements`` logits) one float32 buffer ``x`` and one of noise: the chunk is upcast
(the model's bf16 logits are exactly representable), divided by the temperature in place, warped by transformers'
top-k and top-p warpers when they are on, turned in place into unnormalised probabilities ``exp(x - max)`` (at most
1), summed, and raced against ``Exp(1)`` noise drawn in float32 from the caller's ``torch.Generator``. The drawn
token's log-prob is ``x_tok - max - log(sum)``: ``log_softmax`` of the warped logits at that token only, the
formula of the trainer's ``tasks.model.forward.selective_log_softmax``.

The noise is counter-based: the ``Exp(1)`` draw of token ``v`` in the row of rollout ``j`` of a prompt seeded ``s`` at
completion step ``t`` is a pure function of ``(s, j, t, v)`` (:func:`race_noise`), computed with int64 tensor ops,
so a prompt's rollouts do not depend on which rows, chunks, calls, ranks or buckets it shares (the counter-based
idea of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011, with SplitMix64's mixer: Steele,
Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014, whose output for state ``k + i
gamma`` is :func:`mix64`). A row's key ``mix64(mix64(s) + (j + 1) gamma)`` (:func:`row_keys`), a step's
``mix64(key + (t + 1) gamma')`` (:func:`step_keys`), and a token's 64 bits ``mix64(step key + (v + 1) gamma)``;
the top 53 bits give ``u = (m + 1/2) 2^-53`` and ``E = -log u`` in float64, stored as float32. No ``torch.Generator``
and no host sync; on CUDA the mixer runs as one fused kernel (``torch.compile``; eager where compiling fails).

Precision: the race runs in float32 with ``2^-54 <= E <= 37.4`` (53-bit uniforms, as the CPU's
``exponential_``), so a token more than 37 nats below the most likely one is never drawn; curand's 24-bit uniforms
(``torch.multinomial`` on CUDA) stop at 19.7. Noise and sums are never taken in the logits' own (bf16) dtype:
rounding the scaled logits or the race there would change the distribution by up to ``|x| 2^-9`` nats.

Deviation from ``generate``: the draws follow its distribution exactly but are not its draws token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

log = logging.getLogger(__name__)

#: Logits upcast at once (rows x vocabulary): two float32 buffers of this size, 128 MiB in all.
CHUNK_ELEMENTS = 1 << 24


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


#: SplitMix64's increment (the golden ratio's 64 bits) and the mixer's multipliers (Stafford's variant 13).
GAMMA, GAMMA_STEP = _signed(0x9E3779B97F4A7C15), _signed(0xD1B54A32D192ED03)
MIX1, MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (any shape), bit for bit the uint64 one: products wrap modulo 2^64
    and right shifts are made logical by masking off the copied sign bits."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * MIX1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def row_keys(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """[B*n] int64 noise keys of the n rollouts of each prompt, prompt-major, from the prompts' seeds [B] (int64,
    e.g. ``tasks.generation.vllm_engine.prompt_seed``)."""
    j = torch.arange(1, n + 1, dtype=torch.long, device=seeds.device)
    return mix64(mix64(seeds.long())[:, None] + j * GAMMA).reshape(-1)


def step_keys(keys: torch.Tensor, t: int) -> torch.Tensor:
    """[R] int64: the rows' keys at completion step ``t`` (0 for the first generated token)."""
    return mix64(keys + _signed((t + 1) * GAMMA_STEP % (1 << 64)))


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[r, vocab] float32 ``Exp(1)`` noise, entry ``(i, v)`` a function of ``keys[i]`` and ``v`` alone (module
    docstring)."""
    z = keys[:, None] + torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device).mul_(GAMMA)
    z ^= (z >> 30).bitwise_and_((1 << 34) - 1)  # mix64, in place: eagerly each op is a pass over [r, V]
    z *= MIX1
    z ^= (z >> 27).bitwise_and_((1 << 37) - 1)
    z *= MIX2
    z ^= (z >> 31).bitwise_and_((1 << 33) - 1)
    bits = z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    return bits.double().add_(0.5).mul_(2.0 ** -53).log_().neg_().float()


class _FusedNoise:
    """:func:`race_noise` fused into one kernel by ``torch.compile`` (eagerly each of its dozen int64 ops reads and
    writes the whole [r, V] block); the eager function from the first failure on (a missing compiler, say), with
    one warning. Compiled and eager noise may differ in the last bits of ``log``."""

    def __init__(self):
        self.fn = None

    def __call__(self, keys: torch.Tensor, vocab: int) -> torch.Tensor:
        if self.fn is None:
            self.fn = torch.compile(race_noise, dynamic=True, fullgraph=True)
        if self.fn is not race_noise:
            try:
                return self.fn(keys, vocab)
            except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact too
                log.warning("race noise: torch.compile failed (%s); eager noise from now on, slower",
                            (str(err).splitlines() or [type(err).__name__])[0][:200])
                self.fn = race_noise
        return race_noise(keys, vocab)


_FUSED = _FusedNoise()


def _noise_fn(device: torch.device):
    """The noise on ``device``: fused on CUDA, eager elsewhere (the CPU's vocabularies here are small)."""
    return _FUSED if device.type == "cuda" else race_noise


@dataclass(frozen=True)
class Sampling:
    """The sampling distribution: ``softmax`` of the logits divided by ``temperature``, cut to the ``top_k`` most
    likely tokens (0: off) and then to the smallest set holding ``top_p`` of the mass (1: off), transformers'
    warpers' definitions (ties at the k-th logit are kept)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature {self.temperature}: must be > 0 (arg-max decoding: no Sampling)")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k {self.top_k}: must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p {self.top_p}: must be in (0, 1] (1: off)")

    def warpers(self) -> LogitsProcessorList:
        """The warpers after the temperature, in ``generate``'s order; empty when neither cut is on."""
        out = LogitsProcessorList()
        if self.top_k > 0:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        return out


def sample_next(logits: torch.Tensor, sampling: Sampling | None, keys: torch.Tensor | None = None,
                max_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the distribution it was drawn from.

    Args:
        logits: [R, V] in any float dtype (left untouched).
        sampling: the distribution; None: arg-max (the first of tied maxima), log-probs at temperature 1.
        keys: [R] int64 noise keys of the rows at this step (:func:`step_keys`), on ``logits``' device; required
            when sampling.
        max_elements: logits upcast at once (default :data:`CHUNK_ELEMENTS`); rows go in chunks of
            ``max_elements // V`` (at least one).

    Returns:
        ``(tokens [R] int64, logp [R] float32)``; a row with a NaN logit gets a NaN log-prob.
    """
    r, v = logits.shape
    if r == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device), torch.zeros(0, device=logits.device)
    if sampling is not None and (keys is None or keys.shape != (r,)):
        raise ValueError(f"sample_next: sampling {r} rows needs [{r}] noise keys, got "
                         f"{None if keys is None else tuple(keys.shape)}")
    noise_fn = _noise_fn(logits.device) if sampling is not None else None
    temperature = 1.0 if sampling is None else sampling.temperature
    warpers = LogitsProcessorList() if sampling is None else sampling.warpers()
    step = max(1, (max_elements or CHUNK_ELEMENTS) // max(v, 1))
    toks, logps = [], []
    for s in range(0, r, step):
        raw = logits[s:s + step]
        x = raw.to(torch.float32, copy=True)  # [r, V], ours to overwrite
        if temperature != 1.0:
            x.div_(temperature)
        if warpers:
            x = warpers(None, x)  # -inf outside the kept set; these warpers read no history
        top = x.amax(-1, keepdim=True)  # [r, 1]
        if sampling is None:
            tok = x.argmax(-1)
        p = x.sub_(top).exp_()  # unnormalised probabilities, the largest exactly 1
        total = p.sum(-1)
        if sampling is not None:
            noise = noise_fn(keys[s:s + step], v)
            tok = torch.div(p, noise, out=noise).argmax(-1)
        picked = raw.gather(1, tok[:, None]).squeeze(1).float()  # the drawn logit, unchanged by top-k / top-p
        if temperature != 1.0:
            picked = picked / temperature
        toks.append(tok)
        logps.append(picked - top.squeeze(1) - total.log())
    if len(toks) == 1:
        return toks[0], logps[0]
    return torch.cat(toks), torch.cat(logps)
