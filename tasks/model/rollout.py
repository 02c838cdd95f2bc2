"""Rollout engines: batched sampling of n completions per prompt.

``HFEngine`` uses ``transformers`` generation (left padding, KV cache, sampling settings from config).
Each call is seeded from ``(seed, step, purpose)``, so a resumed run samples exactly what an
uninterrupted one would. Every engine implements :class:`RolloutEngine` (``generate`` and ``sync_weights``);
the other one is the vLLM server's (``tasks/model/vllm_engine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from rlcore.seeding import derive_seed


@dataclass
class Generation:
    """n completions for each of B prompts, flattened prompt-major (rows b*n .. b*n+n-1 belong to prompt b).

    Attributes:
        prompt_ids: B tensors [P_b] (unpadded prompt ids).
        completion_ids: [B*n, L] right-padded completion ids.
        completion_mask: [B*n, L] bool, True up to and including the first EOS.
        texts: B*n decoded completions.
        n: rollouts per prompt.
        tokens: number of generated (real) completion tokens.
    """

    prompt_ids: list[torch.Tensor]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    n: int

    @property
    def tokens(self) -> int:
        return int(self.completion_mask.sum())


def completion_mask(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[N, L] bool: True on tokens up to and including the first EOS of each row."""
    is_eos = ids == eos_id
    before = is_eos.cumsum(-1) - is_eos.long()  # EOS tokens strictly before position t
    return before == 0


def add_special(tokenizer) -> bool:
    """Whether prompts get the tokenizer's special tokens (BOS): yes in the plain format, which the warm start
    trains as ``<s>`` + prompt; no when a chat template has already written them into the text."""
    return not getattr(tokenizer, "chat_template", None)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training loop, the selector and the evaluation need from a rollout engine."""

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> Generation:
        """n completions for each of the B ``prompts`` (prompt-major rows), reproducible from ``seed``;
        ``greedy``: arg-max decoding (then n is usually 1)."""
        ...

    def sync_weights(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> float:
        """Make the next ``generate`` sample from ``model``'s current weights; returns the seconds it took.

        ``folder``: where an engine that runs outside this process may write the weights for it to load.
        """
        ...


class HFEngine(RolloutEngine):
    """Sampling with ``model.generate`` (the default engine; CPU or GPU). It samples from the live training
    model itself, so :meth:`sync_weights` has nothing to do."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, chunk: int, device: torch.device | str = "cpu"):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.chunk, self.device = chunk, device

    @torch.inference_mode()
    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> Generation:
        enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special(self.tok))
        ids_all, am_all = enc["input_ids"], enc["attention_mask"]  # [B, P] left-padded: tokenized once
        prompt_ids = [ids[am.bool()] for ids, am in zip(ids_all, am_all, strict=True)]
        per_call = max(1, self.chunk // n)
        outs: list[torch.Tensor] = []
        was_training = self.model.training
        self.model.eval()
        for c, start in enumerate(range(0, len(prompts), per_call)):
            am = am_all[start:start + per_call]
            cut = int((am.sum(0) == 0).sum())  # pad columns no prompt of this chunk needs
            ids, am = ids_all[start:start + per_call, cut:].to(self.device), am[:, cut:].to(self.device)
            torch.manual_seed(derive_seed(seed, c))
            kw = dict(do_sample=False) if greedy else dict(
                do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # 0: no top-k
            out = self.model.generate(input_ids=ids, attention_mask=am, max_new_tokens=self.max_new_tokens,
                                      num_return_sequences=n, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=self.tok.eos_token_id, use_cache=True, **kw)
            outs.append(out[:, ids.shape[1]:].cpu())
        self.model.train(was_training)
        width = max(o.shape[1] for o in outs)
        ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.tok.pad_token_id)
                         for o in outs])
        mask = completion_mask(ids, self.tok.eos_token_id) & (width > 0)
        ids = torch.where(mask, ids, torch.full_like(ids, self.tok.pad_token_id))
        texts = self.tok.batch_decode(ids, skip_special_tokens=True)
        return Generation(prompt_ids=prompt_ids, completion_ids=ids, completion_mask=mask, texts=texts, n=n)

    def sync_weights(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> float:
        """A no-op: ``generate`` runs the very module the update trains (``model`` is that module)."""
        if model is not self.model:
            raise ValueError("HFEngine samples from the model it was built with; it cannot sync another one")
        return 0.0
