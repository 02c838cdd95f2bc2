"""The policy as every stage sees it: a model, its tokenizer and the rollout engine bound to it.

What the weights are to the rest of the run, with or without LoRA adapters (tasks/model/lora.py), is asked of the
:class:`Policy`: only it knows whether adapters are there. Loading and saving are tasks/model/loading.py; the
engines are tasks/generation/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import RolloutEngine
from tasks.model import lora
from tasks.model.loading import format_prompt, save_policy

if TYPE_CHECKING:  # annotations only: transformers loads with the first model, not at import
    from transformers import PreTrainedTokenizerBase


@dataclass
class Policy:
    """A model, its tokenizer and the rollout engine bound to it (``engine.sync_weights`` brings it up to date
    with ``model``)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    system_prompt: str | None = None
    #: the float32 masters of the adapters by parameter name, handed over when training ends under ``bf16-mixed``
    #: (``Updater.master_weights``): what :meth:`save_adapter` writes instead of their bf16 rounding
    adapter_masters: dict[str, torch.Tensor] = field(default_factory=dict)

    def prompt(self, question: str) -> str:
        """The text the policy is prompted with for ``question`` (its chat template and system prompt)."""
        return format_prompt(self.tokenizer, question, self.system_prompt)

    def prompts(self, records: list[PromptRecord]) -> list[str]:
        return [self.prompt(r.question) for r in records]

    @property
    def has_adapters(self) -> bool:
        """Whether the model trains LoRA adapters (``model.lora``) rather than every weight."""
        return lora.is_lora(self.model)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the adapters under LoRA, every weight otherwise."""
        return lora.trainable_parameters(self.model)

    def kl_reference(self):
        """The frozen KL reference as the model is now: under LoRA the same model with its adapters disabled (no
        copy), else a frozen copy."""
        if self.has_adapters:
            return lora.BaseModelView(self.model)
        return lora.plain_copy(self.model)

    def merged_copy(self) -> torch.nn.Module:
        """A frozen plain transformers model with the (merged) weights: what a separate sampler runs, in the compute
        dtype (under ``bf16-mixed`` the bf16 weights the updater rounds from its float32 masters after each step)."""
        return lora.plain_copy(self.model)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the weights: the adapters under LoRA, else every weight."""
        return lora.checkpoint_state(self.model)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`checkpoint_state`'s result."""
        lora.load_checkpoint_state(self.model, state)

    def save(self, path: str | Path) -> Path:
        """The plain model (merged under LoRA) and tokenizer in ``path`` (:func:`save_policy`)."""
        return save_policy(self.model, self.tokenizer, path)

    def save_adapter(self, path: str | Path, base: str | Path) -> Path:
        """The LoRA adapter folder PEFT loads and vLLM serves (``adapter_config.json`` naming ``base``, the frozen
        base model's folder, and ``adapter_model.safetensors`` in float32: :func:`tasks.model.lora.save_adapter`)
        in ``path``; only for a model with adapters."""
        return lora.save_adapter(self.model, path, base, self.adapter_masters)
