"""LoRA adapters through PEFT (``model.lora``): only the adapters train; everything outside the trainer sees merged
weights.

LoRA (Hu et al., arXiv 2106.09685, section 4.1) freezes every weight W of a target linear layer and trains a
low-rank update, W' = W + (alpha / r) B A with A [r, in] and B [out, r], B starting at 0. PEFT
(``peft.get_peft_model``) wraps the policy, so the update, the rollout engine in this process and every forward
pass of the algorithms (log-probs, DOTS's embeddings, GAIN-RL's hook) run the adapted model unchanged.

What each part gets:

- **The optimizer**: the adapters only (:func:`trainable_parameters`); its state is a few per cent of a full
  update's (measured: docs/performance.md, "LoRA"). The adapters are held in the base's dtype (the compute dtype),
  so under ``model.precision=bf16-mixed`` their float32 masters and moments are ``MasterWeights``' as for full
  weights, and no adapted layer casts its activations (docs/performance.md, "LoRA's speed").
- **The passes**: PEFT's layer with a fused forward and backward (tasks/model/lora_linear.py): the adapter's
  update is added inside the matmuls and the frozen weights get no gradient.
- **The KL reference** (``train.kl_coef > 0``): the same model with the adapters disabled (:class:`BaseModelView`,
  PEFT's ``disable_adapter``), so no second copy of the weights exists.
- **Rollout engines outside the trainer** (the overlap's generator process, vLLM servers under
  ``rollout.vllm_weight_sync=merged``) and the saved or registered model: merged weights, W + (alpha / r) B A
  (:func:`plain_state_dict`), computed into new tensors per target layer. PEFT's in-place ``merge_adapter`` /
  ``unmerge_adapter`` is not used: W + d - d is not W in floating point, and the error would accumulate over a
  run's syncs. vLLM servers under ``adapter`` (the default with LoRA) get the adapter folder below.
- **Checkpoints**: the adapters (:func:`checkpoint_state`); the frozen base is the run's policy source, loaded
  again on resume.
- **The adapter folder** (:func:`save_adapter`): what PEFT's ``save_pretrained`` writes, ``adapter_config.json``
  (rank, alpha, dropout, target modules, ``base_model_name_or_path``: the base model's folder) and
  ``adapter_model.safetensors`` under PEFT's key names
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), in float32: under ``bf16-mixed`` the
  optimizer's float32 masters, not their bf16 rounding. It loads with ``PeftModel.from_pretrained(base, folder)``
  and serves as a vLLM LoRA (``--enable-lora``).

Deviations: LoRA dropout is refused above 0 while the rollouts' log-probs are the loss's behaviour policy (the
trainer's pi_old would see dropout the sampler does not); the sharded backends (``scale.backend`` other than
``single``) are not built for LoRA (the config says so).
"""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.config import LoraConfig

if TYPE_CHECKING:  # peft is imported where adapters are made: a run without LoRA (and every flow's start) is
    from peft import PeftModel  # spared its import, seconds on a loaded machine
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

BASE = ".base_layer"


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int) -> PeftModel:
    """Wrap ``model`` with fresh adapters (``cfg``: rank, alpha, dropout, target modules); its weights freeze.

    ``seed`` draws A's random start (B starts at 0), so a run's adapters, and the run, are reproducible; the global
    random state is left as it was.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from tasks.model.lora_linear import LeanLoraLinear

    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", task_type="CAUSAL_LM")
    peft_cfg._register_custom_module({torch.nn.Linear: LeanLoraLinear})  # PEFT's layer, a lean forward pass
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # adapters in the base's dtype (the compute dtype): their float32 masters are the optimizer's
            return get_peft_model(model, peft_cfg, autocast_adapter_dtype=False)
    except ValueError as err:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {err}") from None


def is_lora(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a model has adapters only once apply_lora (or a checkpoint's load) imported it
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under the adapters (``model`` itself when it has none)."""
    return model.get_base_model() if is_lora(model) else model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: the adapters under LoRA, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def _lora_layers(model: PeftModel) -> Iterator[tuple[str, LoraLayer]]:
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name.removeprefix(prefix), module


@torch.no_grad()
def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under the names of the plain transformers model: ``state_dict()`` without adapters; with
    them, W + (alpha / r) B A for each target layer (new tensors) and the other weights as they are (no copy)."""
    if not is_lora(model):
        return model.state_dict()
    merged = {}
    layers = dict(_lora_layers(model))
    for key, value in base_model(model).state_dict().items():
        if ".lora_" in key:
            continue
        if BASE in key:
            owner, _, leaf = key.partition(BASE + ".")
            layer = layers[owner]
            if leaf == "weight":
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
                value = value + delta.to(value.dtype)
            key = f"{owner}.{leaf}"
        merged[key] = value
    return merged


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen transformers model holding ``model``'s (merged) weights: what a separate sampler runs. Under LoRA
    only the merged target layers are new tensors; the frozen rest (embeddings, norms) is shared with ``model``."""
    base = base_model(model)
    if not is_lora(model):
        return copy.deepcopy(base).eval().requires_grad_(False)
    with torch.device("meta"):
        out = type(base)(base.config)
    out.load_state_dict(plain_state_dict(model), assign=True, strict=False)
    out.tie_weights()
    buffers = dict(base.named_buffers())  # those not in a state dict (rotary frequencies) come from the policy
    for name, buf in list(out.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            out.get_submodule(owner)._buffers[leaf] = buffers[name].clone()
    missing = [n for n, p in out.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"merged LoRA weights miss {missing[:3]}")
    out.generation_config = base.generation_config
    return out.eval().requires_grad_(False)


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the model: the adapters under LoRA (the base is the run's policy source), else
    every weight."""
    if not is_lora(model):
        return model.state_dict()
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def load_checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore :func:`checkpoint_state`'s result into ``model`` (a LoRA checkpoint into a LoRA model)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    why = "the checkpoint's weights do not fit this LoRA model (a checkpoint of a full-weight run, or other model.lora"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes: another rank
        raise ValueError(f"{why} settings): {str(err).splitlines()[1].strip()}") from None
    adapters = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or adapters or not state:
        raise ValueError(f"{why} settings): unexpected {result.unexpected_keys[:3]}, missing {adapters[:3]}")


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names


@torch.no_grad()
def adapter_state(model: PeftModel, masters: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` under PEFT's saved key names (``...q_proj.lora_A.weight``: the adapter's name
    dropped), float32 on the host. ``masters``: float32 values by ``model``'s parameter name (under ``bf16-mixed``
    the optimizer's masters, :meth:`tasks.update.updater.Updater.master_weights`), taken instead of the parameters'
    own (their rounding)."""
    from peft import get_peft_model_state_dict

    masters = masters or {}
    state = {k: masters.get(k, v) for k, v in model.state_dict().items() if ".lora_" in k}
    return {k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(model, state_dict=state).items()}


def save_adapter(model: torch.nn.Module, path: str | Path, base: str | Path,
                 masters: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write ``model``'s adapters to the folder ``path`` (replaced) as PEFT writes them: ``adapter_config.json``
    with ``base_model_name_or_path`` = ``base`` (the frozen base model's folder) and ``adapter_model.safetensors``
    (:func:`adapter_state` with ``masters``). Returns ``path``.

    Raises:
        ValueError: ``model`` has no adapters.
    """
    from safetensors.torch import save_file

    if not is_lora(model):
        raise ValueError("save_adapter: the model has no LoRA adapters (model.lora.enabled=false)")
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    cfg = copy.deepcopy(model.peft_config[model.active_adapter])
    cfg.base_model_name_or_path, cfg.inference_mode = str(base), True
    cfg.save_pretrained(str(path))
    save_file(adapter_state(model, masters), str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return path


class BaseModelView:
    """The KL reference of a LoRA policy: calls run the policy with its adapters disabled (PEFT's
    ``disable_adapter``), i.e. the frozen base model, without a second copy of its weights. Use it without grad."""

    def __init__(self, model: PeftModel):
        self.model = model

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)
