"""The policy's sections: the model itself (``model.*``), the tiny default's supervised warm start
(``model.warmstart``) and LoRA adapters (``model.lora``); tasks/model/policy.py, warmstart.py, lora.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import _Frozen


class WarmStartConfig(_Frozen):
    """Supervised warm start of the tiny default policy (tasks/model/warmstart.py); unused with model.path."""

    steps: int = Field(1200, ge=0, description="AdamW steps on worked solutions (0: the untrained tiny model).")
    batch_size: int = Field(64, ge=1, description="Worked solutions per warm-start step.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (5 % linear warmup, then cosine decay to 0).")
    mix: str = Field("warmstart", description="Level mix of the worked solutions (tasks/data/arith.py MIXES).")
    flawed: float = Field(0.7, ge=0, le=1, description=(
        "Share of demonstrations (where it matters) that slip: left to right, ignoring precedence "
        "(tasks/data/arith.py flawed_solution); the habit RL then removes."))


class LoraConfig(_Frozen):
    """LoRA adapters through PEFT (tasks/model/lora.py; LoRA: arXiv 2106.09685): only the adapters train."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    rank: int = Field(16, ge=1, description="r: the rank of each adapter's update B A.")
    alpha: float = Field(32.0, gt=0, description="alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "Dropout on the adapters' input in training mode. Must be 0 while the rollouts' own log-probs are the "
        "loss's behaviour policy (train.behaviour), since the sampler runs without it."))
    target_modules: str | tuple[str, ...] = Field("all-linear", description=(
        "Layers that get adapters: module names (e.g. [q_proj, v_proj]) or 'all-linear' (every linear layer but "
        "the output head), as PEFT reads them."))


class ModelConfig(_Frozen):
    """The policy (tasks/model/policy.py): a local model folder, or the tiny Llama built and warm-started here."""

    path: str | None = Field(None, description="Local model folder; None builds and warm-starts the tiny default.")
    hidden: int = Field(128, ge=32, description="Tiny default only: hidden size of the Llama.")
    layers: int = Field(4, ge=1, description="Tiny default only: transformer layers.")
    heads: int = Field(4, ge=1, description="Tiny default only: attention heads (hidden/heads >= 32).")
    warmstart: WarmStartConfig = Field(WarmStartConfig(), description="Warm start of the tiny default.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (off: every weight trains).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Device of the policy: auto picks cuda when visible, else cpu (tasks/run.py resolve_device)."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weights dtype: auto is bfloat16 on a CUDA device that supports it, else float32."))
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    system_prompt: str = Field("Let's think step by step and output the final answer within \\boxed{}.", description=(
        "System message for tokenizers with a chat template (DOTS's template, arXiv 2506.05316); the tiny "
        "default has none and uses the plain 'Q: ...' prompt."))

    @model_validator(mode="after")
    def _head_size(self) -> ModelConfig:
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ValueError(
                f"hidden/heads must be an integer >= 32 (vLLM's CPU kernels); got {self.hidden}/{self.heads}")
        return self
