"""Drawing the next token of every row from its logits: the exponential race, in float32 row chunks.

A categorical draw from ``p = softmax(x)`` is ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` independent: the
exponential race, which is the Gumbel-max trick (``argmax_i x_i + G_i``, ``G_i = -log E_i``) with the
exponential taken of both sides (Gumbel 1954; Maddison et al., "A* Sampling", arXiv:1411.0030, section 2; Kool
et al., arXiv:1903.06059, section 2). It is exact: ``P(argmax = i) = p_i``. ``torch.multinomial`` with one
sample draws the same way internally (``q = exponential_(); argmax(probs / q)``, PyTorch issue 11931), and so does
vLLM's sampler; what this module drops is everything around it that cost a full ``[R, V]`` pass each: a float32
copy of all the logits, the temperature's copy, ``softmax``, ``multinomial``'s validity check (a host sync),
``log_softmax`` for the drawn token's log-prob, and the ``[B, V]`` matrix of every row, finished ones included.

Per chunk of rows (at most ``max_elements`` logits), :func:`race_draw`: the chunk is upcast to float32 (the
model's bf16 logits are exactly representable), divided by the temperature (before transformers' top-k and top-p
warpers when they are on), turned into unnormalised probabilities ``exp(x - max)`` (at most 1), summed, and raced
against float32 ``Exp(1)`` noise. Eagerly that is a few float32 buffers of the chunk's size; compiled (CUDA), a few
fused passes over the logits with the noise made in registers. The drawn token's log-prob is ``x_tok - max -
log(sum)``: ``log_softmax`` of the warped logits at that token only, the formula of the trainer's
``tasks.model.forward.selective_log_softmax``.

The noise is counter-based: the ``Exp(1)`` draw of token ``v`` in the row of rollout ``j`` of a prompt seeded ``s`` at
completion step ``t`` is a pure function of ``(s, j, t, v)`` (:func:`race_noise`), computed with int64 tensor ops,
so a prompt's rollouts do not depend on which rows, chunks, calls, ranks or buckets it shares (the counter-based
idea of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011, with SplitMix64's mixer: Steele,
Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014, whose output for state ``k + i
gamma`` is :func:`mix64`). A row's key ``mix64(mix64(s) + (j + 1) gamma)`` (:func:`row_keys`), a step's
``mix64(key + (t + 1) gamma')`` (:func:`step_keys`; ``t`` a Python int or a 0-d device tensor, the same bits), and
a token's 64 bits ``mix64(step key + (v + 1) gamma)``; the top 53 bits ``m`` give ``u = (m + 1/2) 2^-53`` and
``E = max(-log u, 2^-54)`` in float64, stored as float32 (:func:`exponential`; the floor only moves the all-ones
draw, whose ``u`` rounds to 1). No ``torch.Generator`` and no host sync.

The 64-bit constants (the increments, multipliers and the masks that make right shifts logical) reach the
functions as a 1-D int64 tensor (:func:`noise_constants`), never as Python literals: Triton types a literal by its
operand, and a literal beyond int32 next to an int32 index fails to compile (``Scalar ... is out of range for
type int32``). So on CUDA the race (:func:`race_draw`: the noise, the exponentials of the logits, their sum and the
arg-max) compiles with ``torch.compile`` into fused kernels; eager where Triton is missing or compiling fails.

Precision: the race runs in float32 with ``2^-54 <= E <= 37.4`` (53-bit uniforms, as the CPU's
``exponential_``), so a token more than 37 nats below the most likely one is never drawn; curand's 24-bit uniforms
(``torch.multinomial`` on CUDA) stop at 19.7. Noise and sums are never taken in the logits' own (bf16) dtype:
rounding the scaled logits or the race there would change the distribution by up to ``|x| 2^-9`` nats. As
``E > 0`` for every draw, a token the cut removed (``p = 0``) scores ``0 / E = 0`` and the row's most likely token
``1 / E > 0``: a removed token is never drawn.

Deviation from ``generate``: the draws follow its distribution exactly but are not its draws token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: transformers loads with the first model, not at import
    from transformers import LogitsProcessorList

log = logging.getLogger(__name__)

#: Logits upcast at once (rows x vocabulary): two float32 buffers of this size, 128 MiB in all.
CHUNK_ELEMENTS = 1 << 24


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


#: SplitMix64's increment (the golden ratio's 64 bits), the step keys' increment, the mixer's multipliers
#: (Stafford's variant 13), and the masks that make the right shifts by 30, 27, 31 and 11 logical (the low 34,
#: 37, 33 and 53 bits): the entries of :func:`noise_constants`, in this order.
CONSTANTS = {"gamma": 0x9E3779B97F4A7C15, "gamma_step": 0xD1B54A32D192ED03, "mix1": 0xBF58476D1CE4E5B9,
             "mix2": 0x94D049BB133111EB, "low34": (1 << 34) - 1, "low37": (1 << 37) - 1, "low33": (1 << 33) - 1,
             "low53": (1 << 53) - 1}
GAMMA, GAMMA_STEP, MIX1, MIX2, LOW34, LOW37, LOW33, LOW53 = range(len(CONSTANTS))
#: The smallest ``E``: ``-log(1 - 2^-54)``, what the all-ones draw would give with exact arithmetic.
E_MIN = 2.0 ** -54
_TABLES: dict[torch.device, torch.Tensor] = {}


def noise_constants(device: torch.device | str) -> torch.Tensor:
    """[8] int64: :data:`CONSTANTS` as the int64s with their bits, on ``device`` (one tensor a device, kept: a
    CUDA graph reads it at replay)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _TABLES:
        _TABLES[device] = torch.tensor([_signed(c) for c in CONSTANTS.values()], dtype=torch.long, device=device)
    return _TABLES[device]


def mix64(z: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (any shape), bit for bit the uint64 one: products wrap modulo 2^64
    and right shifts are made logical by masking off the copied sign bits. ``c``: :func:`noise_constants` of
    ``z``'s device (default: looked up)."""
    c = noise_constants(z.device) if c is None else c
    z = z ^ ((z >> 30) & c[LOW34])
    z = z * c[MIX1]
    z = z ^ ((z >> 27) & c[LOW37])
    z = z * c[MIX2]
    return z ^ ((z >> 31) & c[LOW33])


def row_keys(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """[B*n] int64 noise keys of the n rollouts of each prompt, prompt-major, from the prompts' seeds [B] (int64,
    e.g. ``tasks.generation.vllm_engine.prompt_seed``)."""
    c = noise_constants(seeds.device)
    j = torch.arange(1, n + 1, dtype=torch.long, device=seeds.device)
    return mix64(mix64(seeds.long(), c)[:, None] + j * c[GAMMA], c).reshape(-1)


def step_keys(keys: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
    """[R] int64: the rows' keys at completion step ``t`` (0 for the first generated token); ``t`` a Python int or
    a 0-d int64 tensor on ``keys``' device (a step counter a CUDA graph advances), the same bits either way."""
    c = noise_constants(keys.device)
    t = torch.as_tensor(t, dtype=torch.long, device=keys.device)
    return mix64(keys + (t + 1) * c[GAMMA_STEP], c)


def exponential(bits: torch.Tensor) -> torch.Tensor:
    """float32 ``Exp(1)`` draws from 53-bit integers ``m`` (int64 in ``[0, 2^53)``, any shape): ``-log u``, ``u =
    (m + 1/2) 2^-53`` in float64, at least :data:`E_MIN`. All zeros: 37.43; all ones: ``u`` rounds to 1, so
    :data:`E_MIN` (the race divides by it)."""
    return bits.double().add_(0.5).mul_(2.0 ** -53).log_().neg_().clamp_min_(E_MIN).float()


def race_noise(keys: torch.Tensor, vocab: int, c: torch.Tensor | None = None) -> torch.Tensor:
    """[r, vocab] float32 ``Exp(1)`` noise, entry ``(i, v)`` a function of ``keys[i]`` and ``v`` alone (module
    docstring). ``c``: :func:`noise_constants` of ``keys``' device (default: looked up); compiled, pass it."""
    c = noise_constants(keys.device) if c is None else c
    z = keys[:, None] + torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device).mul_(c[GAMMA])
    z ^= (z >> 30).bitwise_and_(c[LOW34])  # mix64, in place: eagerly each op is a pass over [r, V]
    z *= c[MIX1]
    z ^= (z >> 27).bitwise_and_(c[LOW37])
    z *= c[MIX2]
    z ^= (z >> 31).bitwise_and_(c[LOW33])
    return exponential(z.bitwise_right_shift_(11).bitwise_and_(c[LOW53]))


def race(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[r] int64 ``argmax_v p_v / E_v`` of [r, V] probabilities (unnormalised, the largest of a row positive) and
    ``Exp(1)`` noise (positive, finite): the exponential race. A token with ``p = 0`` (cut by top-k or top-p)
    scores 0 and never wins. Overwrites ``noise``."""
    return torch.div(p, noise, out=noise).argmax(-1)


def race_draw(x: torch.Tensor, keys: torch.Tensor, temperature: float,
              c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One race over a chunk of rows: ``(tok [r] int64, top [r, 1], total [r])``, the drawn tokens, the rows'
    largest scaled logit and ``sum exp(x / T - top)``, all float32.

    Args:
        x: [r, V] logits in any float dtype, already warped (``-inf`` outside the kept set) or not; ``temperature``
            divides them in float32 (1: none). Left untouched.
        keys: [r] int64 step keys (:func:`step_keys`).
        c: :func:`noise_constants` of their device.
    """
    x = x.float()
    if temperature != 1.0:
        x = x / temperature
    top = x.amax(-1, keepdim=True)  # [r, 1]
    p = (x - top).exp_()  # unnormalised probabilities, the largest exactly 1
    total = p.sum(-1)
    return race(p, race_noise(keys, x.shape[1], c)), top, total


class _FusedDraw:
    """:func:`race_draw` compiled by ``torch.compile`` (eagerly each of the noise's dozen int64 ops reads and
    writes the whole [r, V] block); no compile attempt without Triton; the eager function from the first failure on
    (a missing compiler, say), with one warning. Compiled and eager draws may differ in the last bits of ``exp``
    and the sum (the tokens drawn rarely), so a device kind draws one way: compiled on CUDA.

    Args:
        attempt: compile at the first call; default: where Triton is installed (inductor's CUDA backend).
    """

    def __init__(self, attempt: bool | None = None):
        self.attempt = attempt
        self.fn = None

    @property
    def compiled(self) -> bool:
        """Whether the calls so far ran the compiled function (False before the first)."""
        return self.fn is not None and self.fn is not race_draw

    def __call__(self, x: torch.Tensor, keys: torch.Tensor, temperature: float, c: torch.Tensor):
        """:func:`race_draw`'s arguments and result."""
        if self.fn is None:
            if self.attempt is None:
                from torch.utils._triton import has_triton

                self.attempt = has_triton()
            self.fn = torch.compile(race_draw, dynamic=True, fullgraph=True) if self.attempt else race_draw
        if self.fn is not race_draw:
            try:
                return self.fn(x, keys, temperature, c)
            except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact too
                log.warning("race draw: torch.compile failed (%s); eager draws from now on, slower",
                            (str(err).splitlines() or [type(err).__name__])[0][:200])
                self.fn = race_draw
        return race_draw(x, keys, temperature, c)


_FUSED = _FusedDraw()


def draw_fn(device: torch.device):
    """The race on ``device``: fused on CUDA, eager elsewhere (the CPU's vocabularies here are small, and a
    compile costs seconds there)."""
    return _FUSED if device.type == "cuda" else race_draw


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
        from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

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
    draw = draw_fn(logits.device) if sampling is not None else None
    c = noise_constants(logits.device) if sampling is not None else None
    temperature = 1.0 if sampling is None else sampling.temperature
    warpers = [] if sampling is None else list(sampling.warpers())
    step = max(1, (max_elements or CHUNK_ELEMENTS) // max(v, 1))
    toks, logps = [], []
    for s in range(0, r, step):
        raw = logits[s:s + step]
        if sampling is None:
            x = raw.float()
            top = x.amax(-1, keepdim=True)  # [r, 1]
            tok = x.argmax(-1)
            total = (x - top).exp_().sum(-1)
        elif warpers:
            x = raw.float() / temperature if temperature != 1.0 else raw.float()
            for warper in warpers:  # -inf outside the kept set; these warpers read no history
                x = warper(None, x)
            tok, top, total = draw(x, keys[s:s + step], 1.0, c)
        else:
            tok, top, total = draw(raw, keys[s:s + step], temperature, c)
        picked = raw.gather(1, tok[:, None]).squeeze(1).float()  # the drawn logit, unchanged by top-k / top-p
        if temperature != 1.0:
            picked = picked / temperature
        toks.append(tok)
        logps.append(picked - top.squeeze(1) - total.log())
    if len(toks) == 1:
        return toks[0], logps[0]
    return torch.cat(toks), torch.cat(logps)
