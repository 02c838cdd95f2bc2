"""Rollout engines: batched sampling of n completions per prompt.

``HFEngine`` decodes with the transformers model in this process (``tasks/generation/decode.py``: a KV cache
written in place, each prompt prefilled once, CUDA graphs; the exponential-race sampler of
``tasks/generation/sampling.py``, sampling settings from config). Prompt ``b`` of a call seeded ``seed`` (itself
derived from ``(seed, step, purpose)``) draws its noise from :func:`prompt_seed` ``(seed, first + b)``, so a resumed
run samples exactly what an uninterrupted one would, and a prompt's rollouts do not depend on how a call's prompts
are split between chunks, calls, ranks or servers. Every engine implements :class:`RolloutEngine` (``generate``,
``sync_weights`` and ``metrics``); the others are the vLLM server's (``tasks/generation/vllm_engine.py``) and a pool
of such servers (``tasks/generation/server_pool.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from rlcore.seeding import derive_seed
from tasks.config.rollout import RolloutConfig
from tasks.generation.decode import Decoder, decode
from tasks.generation.sampling import Sampling
from tasks.model.loading import add_special

if TYPE_CHECKING:  # annotations only: transformers loads with the first model, not at import
    from transformers import PreTrainedTokenizerBase

__all__ = ["Generation", "HFEngine", "RolloutEngine", "completion_mask", "decode", "end_of_turn_ids",
           "prompt_seed", "to_generation"]


@dataclass
class Generation:
    """n completions for each of B prompts, flattened prompt-major (rows b*n .. b*n+n-1 belong to prompt b).

    Attributes:
        prompt_ids: B tensors [P_b] (unpadded prompt ids).
        completion_ids: [B*n, L] right-padded completion ids.
        completion_mask: [B*n, L] bool, True up to and including the first end-of-turn token (any stop id).
        texts: B*n decoded completions.
        n: rollouts per prompt.
        logprobs: [B*n, L] float32, the sampler's log-prob of each generated token under the distribution it
            was drawn from (after temperature, top-k and top-p), 0 on padding: the behaviour policy mu of the
            loss (``train.behaviour``). Greedy decoding gives the log-probs at temperature 1.
        tokens: number of generated (real) completion tokens.
    """

    prompt_ids: list[torch.Tensor]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    n: int
    logprobs: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.completion_mask.sum())


def end_of_turn_ids(model, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every token id that ends a turn: the tokenizer's EOS, then each id of the model's generation config
    (``model.generation_config.eos_token_id``, an int or a list: Qwen2.5's ``[151645, 151643]``, Llama 3
    Instruct's three), without repeats. What decoding, completion masks (hence rewards, which read the text up to
    the mask's end) and the vLLM request (``stop_token_ids``) stop at.

    Raises:
        ValueError: neither names an end-of-turn token.
    """
    ids = [tokenizer.eos_token_id]
    eos = model.generation_config.eos_token_id
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    out = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    if not out:
        raise ValueError("no end-of-turn token: the tokenizer has no eos_token and the model's generation_config no "
                         "eos_token_id; set one of them")
    return out


def completion_mask(ids: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """[N, L] bool: True on tokens up to and including the first stop token (any of ``stop_ids``) of each row."""
    is_stop = torch.isin(ids, torch.tensor(list(stop_ids), dtype=ids.dtype, device=ids.device))
    before = is_stop.cumsum(-1) - is_stop.long()  # stop tokens strictly before position t
    return before == 0


def to_generation(tokenizer: PreTrainedTokenizerBase, prompt_ids: list[torch.Tensor], ids: torch.Tensor,
                  logp: torch.Tensor, n: int, stop_ids: Sequence[int]) -> Generation:
    """The :class:`Generation` of decoded rows: each row cut after its first stop token (any of ``stop_ids``):
    ids padded and log-probs 0 past it, and the text (what rewards read) decoded from the kept ids only.

    Args:
        ids, logp: [B*n, L] completion ids and their log-probs, prompt-major.
    """
    mask = completion_mask(ids, stop_ids) & (ids.shape[1] > 0)
    ids = torch.where(mask, ids, torch.full_like(ids, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return Generation(prompt_ids=prompt_ids, completion_ids=ids, completion_mask=mask, texts=texts, n=n,
                      logprobs=torch.where(mask, logp, 0.0))


def prompt_seed(seed: int, b: int) -> int:
    """The noise seed of prompt ``b`` (its index in the whole ``generate`` call) of a call seeded ``seed``: the
    same whichever chunk, call, rank or server samples it, so a call's results do not depend on how its prompts
    are spread (every engine seeds its prompts so)."""
    return derive_seed(seed, b) % 2**31


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training loop, the selector and the evaluation need from a rollout engine."""

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        """n completions for each of the B ``prompts`` (prompt-major rows), reproducible from ``seed``;
        ``greedy``: arg-max decoding (then n is usually 1); ``first``: the index of ``prompts[0]`` in the whole
        call this is a share of (prompt b is seeded :func:`prompt_seed` ``(seed, first + b)``)."""
        ...

    def sync_weights(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> float:
        """Make the next ``generate`` sample from ``model``'s current weights; returns the seconds it took.

        ``folder``: where an engine that runs outside this process may write the weights for it to load.
        """
        ...

    def metrics(self) -> dict[str, float]:
        """The engine's own gauges, logged with each step's metrics (a pool of servers: how many are live,
        tasks/generation/server_pool.py); an engine that subclasses this protocol and has none inherits ``{}``."""
        return {}


class HFEngine(RolloutEngine):
    """Sampling with transformers models in this process (the default engine; CPU or GPU) through :func:`decode`.
    It samples from the live training model itself, so :meth:`sync_weights` has nothing to do.

    ``stop_ids``: the tokens that end a turn (:func:`end_of_turn_ids`, computed once from ``model`` and ``tokenizer``
    when not given; a process that rebuilds the model from its config passes the parent's, :meth:`settings`).
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, chunk: int, device: torch.device | str = "cpu", stop_ids: Sequence[int] | None = None):
        self.model, self.tok = model, tokenizer
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else end_of_turn_ids(model, tokenizer)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.chunk, self.device = chunk, device
        #: the decode loop, its buffers and CUDA graphs kept for the next call that fits them
        self.decoder = Decoder(model)

    @classmethod
    def from_config(cls, model, tokenizer, rc: RolloutConfig, device: torch.device | str) -> HFEngine:
        """The engine the ``rollout`` section describes, sampling from ``model`` on ``device``."""
        return cls(model, tokenizer, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                   top_k=rc.top_k, chunk=rc.chunk, device=device)

    def sampling(self) -> Sampling:
        """The distribution these settings sample from (temperature, then top-k, then top-p, as ``generate``)."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @torch.inference_mode()
    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special(self.tok))
        ids_all, am_all = enc["input_ids"], enc["attention_mask"]  # [B, P] left-padded: tokenized once
        prompt_ids = [ids[am.bool()] for ids, am in zip(ids_all, am_all, strict=True)]
        seeds = torch.tensor([prompt_seed(seed, first + b) for b in range(len(prompts))], dtype=torch.long)
        per_call = max(1, self.chunk // n)
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []
        was_training = self.model.training
        self.model.eval()
        sampling = None if greedy else self.sampling()
        for start in range(0, len(prompts), per_call):
            am = am_all[start:start + per_call]
            cut = int((am.sum(0) == 0).sum())  # pad columns no prompt of this chunk needs
            ids, am = ids_all[start:start + per_call, cut:], am[:, cut:]
            outs.append(self.decoder(ids.to(self.device), am.to(self.device), n=n,
                                     max_new_tokens=self.max_new_tokens, sampling=sampling, stop_ids=self.stop_ids,
                                     pad_id=self.tok.pad_token_id, seeds=seeds[start:start + per_call]))
        self.model.train(was_training)
        width = max(o.shape[1] for o, _ in outs)
        ids = torch.cat([torch.nn.functional.pad(o.cpu(), (0, width - o.shape[1]), value=self.tok.pad_token_id)
                         for o, _ in outs])
        logp = torch.cat([torch.nn.functional.pad(lp.float().cpu(), (0, width - lp.shape[1])) for _, lp in outs])
        return to_generation(self.tok, prompt_ids, ids, logp, n, self.stop_ids)

    def settings(self) -> dict:
        """The keyword arguments that build this engine's sampling on another module
        (tasks/overlap/generator_process.py)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "chunk": self.chunk, "device": str(self.device), "stop_ids": self.stop_ids}

    def sync_weights(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> float:
        """A no-op: ``generate`` runs the very module the update trains (``model`` is that module)."""
        if model is not self.model:
            raise ValueError("HFEngine samples from the model it was built with; it cannot sync another one")
        return 0.0
