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

Precision: the race runs in float32, so it is exact up to the resolution of the float32 noise, the same as
``torch.multinomial``'s. On CUDA ``2^-24 <= E <= 22`` (curand's uniforms), so a token more than 19.7 nats below the
most likely one is never drawn: at most ``V e^-19.7`` of the mass, 4e-4 for 152k tokens if every other token sat
just there, orders of magnitude less for a language model's tail. On the CPU the noise comes from double-precision
uniforms (``E`` up to 36.7). Noise and sums are never taken in the logits' own (bf16) dtype: rounding the scaled
logits or the race there would change the distribution by up to ``|x| 2^-9`` nats.

Deviation from ``generate``: the noise is drawn only for the rows still generating, from a generator the caller
seeds, so a seed reproduces its draws (on one device) but they are not ``generate``'s token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

#: Logits upcast at once (rows x vocabulary): two float32 buffers of this size, 128 MiB in all.
CHUNK_ELEMENTS = 1 << 24


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


def sample_next(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None = None,
                max_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the distribution it was drawn from.

    Args:
        logits: [R, V] in any float dtype (left untouched).
        sampling: the distribution; None: arg-max (the first of tied maxima), log-probs at temperature 1.
        generator: the noise's source, on ``logits``' device (None: torch's default generator).
        max_elements: logits upcast at once (default :data:`CHUNK_ELEMENTS`); rows go in chunks of
            ``max_elements // V`` (at least one).

    Returns:
        ``(tokens [R] int64, logp [R] float32)``; a row with a NaN logit gets a NaN log-prob.
    """
    r, v = logits.shape
    if r == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device), torch.zeros(0, device=logits.device)
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
            noise = torch.empty_like(p).exponential_(generator=generator)
            tok = torch.div(p, noise, out=noise).argmax(-1)
        picked = raw.gather(1, tok[:, None]).squeeze(1).float()  # the drawn logit, unchanged by top-k / top-p
        if temperature != 1.0:
            picked = picked / temperature
        toks.append(tok)
        logps.append(picked - top.squeeze(1) - total.log())
    if len(toks) == 1:
        return toks[0], logps[0]
    return torch.cat(toks), torch.cat(logps)
