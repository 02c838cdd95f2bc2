"""The LM head of a log-prob pass, in chunks: only the hidden states that predict a real completion token reach it,
and no pass holds the [T, V] logits (:func:`chunked_head`).

Shape letters (as in tasks/model/forward.py): N rows, P_i row i's prompt length, S a pass's sequence length, K the
positions kept for the head, T the real completion tokens of a pass, H the hidden size, V the vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint

from tasks.model.lora import BaseModelView

if TYPE_CHECKING:  # annotations only: transformers loads with the first model, not at import
    from transformers import PreTrainedModel

#: Float32 logits of one chunk of the LM head in :func:`chunked_head` (2^26 elements, 256 MiB: 441 tokens at a
#: 151,936 vocabulary). Smaller chunks lower the head's peak (one chunk's logits, their float32 copy, exponentials
#: and gradients, whose bytes tasks/update/memory_check.py counts) but run more, thinner [c, H] x [H, V] matmuls,
#: which use a GPU's tensor cores less well below a few hundred rows; larger ones hold more. A pass of more than
#: one chunk recomputes each chunk's logits in the backward pass (one more head forward, 2HV FLOPs a token).
HEAD_CHUNK_ELEMENTS = 1 << 26
#: Config fields of models whose forward changes the LM head's output before returning it (Gemma 2's soft-capping,
#: Cohere's logit scale): :func:`chunked_head` cannot stand in for their head, so they take the full-logits path.
HEAD_POSTPROCESSING = ("final_logit_softcapping", "logit_scale")


def causal_lm(model) -> PreTrainedModel:
    """The transformers model inside ``model``: itself, or under a DDP wrapper, a DeepSpeed engine, PEFT's adapters
    or a :class:`~tasks.model.lora.BaseModelView` (the first :class:`PreTrainedModel` among its modules)."""
    from transformers import PreTrainedModel  # here: loaded with the model, not at import

    root = model.model if isinstance(model, BaseModelView) else model
    for module in root.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel")


@dataclass(frozen=True)
class CompletionIndex:
    """Where a pass's T real completion tokens are (:meth:`of`).

    Attributes:
        rows: [T] row of each token; columns: [T] its index j in its completion.
        positions: [T] the sequence position whose hidden state predicts it, ``P_i - 1 + j``.
        targets: [T] the token ids.
        n: the pass's rows N; width: S, its sequence length.
        real: False when the pass has no real completion token: then the index holds one masked stand-in (row 0's
            first completion column), so the pass still runs the head and has a graph through every parameter
            (the update's backward, DDP's reducer); its log-prob is zeroed by the completion mask.
        pass_rows: [T] the pass's row that holds each predicting state, where it is not ``rows`` (a packed pass,
            tasks/model/shared_prefix.py: every state in row 0); None: ``rows``.
    """

    rows: torch.Tensor
    columns: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    n: int
    width: int
    real: bool = True
    pass_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, prompt_lens: torch.Tensor, width: int, completions: torch.Tensor,
           completion_mask: torch.Tensor) -> CompletionIndex:
        """The index of ``completion_mask``'s True entries [N, L] (row-major) in a contiguous layout of N rows
        ``[prompt | completion | pads]`` (:class:`tasks.model.forward.ContiguousRows`) whose prompts are
        ``prompt_lens`` [N] long and whose rows are ``width`` (S) tokens wide."""
        mask, real = completion_mask.cpu().bool(), bool(completion_mask.any())
        if not real:
            mask = torch.zeros_like(mask)
            mask[0, 0] = True
        rows, columns = mask.nonzero(as_tuple=True)
        return cls(rows=rows, columns=columns, positions=prompt_lens[rows] - 1 + columns,
                   targets=completions.cpu().to(torch.long)[rows, columns], n=prompt_lens.shape[0],
                   width=width, real=real)

    @property
    def keep(self) -> int:
        """The hidden states the head needs: the last ``S - min(positions)`` (the model's ``logits_to_keep``)."""
        return self.width - int(self.positions.min())

    def to(self, device: torch.device | str) -> CompletionIndex:
        return CompletionIndex(rows=self.rows.to(device), columns=self.columns.to(device),
                               positions=self.positions.to(device), targets=self.targets.to(device),
                               n=self.n, width=self.width, real=self.real,
                               pass_rows=None if self.pass_rows is None else self.pass_rows.to(device))

    def hidden(self, kept: torch.Tensor) -> torch.Tensor:
        """The tokens' predicting states [T, ...] of ``kept`` [B, K, ...], the last K positions of the pass."""
        rows = self.rows if self.pass_rows is None else self.pass_rows
        return kept[rows, self.positions - (self.width - kept.shape[1])]

    def scatter(self, values: torch.Tensor, length: int) -> torch.Tensor:
        """``values`` [T] back into a zero-padded [N, length] (N: the pass's rows), differentiable."""
        return values.new_zeros(self.n, length).index_put((self.rows, self.columns), values) * self.real


class _LogProbHead(torch.nn.Module):
    """Stands in for a causal LM's head during one forward pass: the kept hidden states [N, K, H] in, the log-probs
    [T] of ``index``'s targets at ``temperature`` out. See :func:`chunked_head`."""

    def __init__(self, head: torch.nn.Module, index: CompletionIndex, temperature: float, vocab: int,
                 max_elements: int):
        super().__init__()
        self.head, self.index, self.temperature = head, index, temperature
        self.rows = max(1, max_elements // max(vocab, 1))  # tokens per chunk

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [c, H], [c] -> [c]
        logits = self.head(hidden).float()  # [c, V]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = self.index.hidden(hidden)  # [T, H]: only the states that predict a real completion token
        targets = self.index.targets
        chunks = [(s, min(s + self.rows, len(flat))) for s in range(0, len(flat), self.rows)]
        if len(chunks) == 1 or not torch.is_grad_enabled():
            out = [self._chunk(flat[s:e], targets[s:e]) for s, e in chunks]
        else:  # keep no chunk's logits for the backward pass: recompute them there, one chunk at a time
            out = [torch.utils.checkpoint.checkpoint(self._chunk, flat[s:e], targets[s:e], use_reentrant=False)
                   for s, e in chunks]
        return torch.cat(out) if len(out) > 1 else out[0]


@contextmanager
def chunked_head(model, index: CompletionIndex, temperature: float, max_elements: int | None = None):
    """Within the block, ``model``'s forward returns as ``.logits`` the log-probs [T] of ``index``'s targets at
    ``temperature`` instead of logits [N, K, V]: the LM head takes only the T hidden states that predict a real
    completion token (row-specific positions, :class:`CompletionIndex`) and runs on chunks of at most
    ``max_elements // V`` of them (default :data:`HEAD_CHUNK_ELEMENTS`), each reduced to its target's log-prob
    (float32) before the next; with autograd on, each chunk's logits are recomputed in the backward pass
    (``torch.utils.checkpoint``), so neither the [T, V] logits nor their float32 log-softmax exist at once (TRL's
    ``ChunkedLogProbFunction`` and Liger's fused linear cross-entropy avoid them the same way). Call the model with
    ``logits_to_keep = index.keep``.

    The model's own head module runs each chunk (found by ``get_output_embeddings`` and swapped for the block), so
    what wraps it works unchanged: DDP and FSDP2 (the same parameters), DeepSpeed ZeRO-3 (its hooks gather the
    weight on each call, also in the recompute), LoRA on the head. Yields False, and changes nothing, for a model
    whose forward transforms the head's output (:data:`HEAD_POSTPROCESSING`); the caller then takes the logits.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    name = next((n for n, child in lm.named_children() if child is head), None)
    if head is None or name is None or any(getattr(lm.config, f, None) for f in HEAD_POSTPROCESSING):
        yield False
        return
    setattr(lm, name, _LogProbHead(head, index, temperature, lm.config.vocab_size,
                                   max_elements or HEAD_CHUNK_ELEMENTS))
    try:
        yield True
    finally:
        setattr(lm, name, head)
