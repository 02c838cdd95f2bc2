"""Model and LoRA adapter folders written for a vLLM server to serve, reload or load at runtime.

The server is reached through :class:`tasks.generation.vllm_engine.VLLMEngine`, whose ``sync_weights`` calls these;
``python -m tasks.generation.vllm_export serve-dir`` (:func:`main`) is what ``infra/vllm-serve.sh`` runs.

- Merged weights (``weight_sync="merged"``): :func:`export_for_vllm` writes the folder that
  :meth:`tasks.generation.vllm_engine.VLLMEngine.reload_weights` reloads in place, or that ``vllm serve`` starts on.
- LoRA adapters (``weight_sync="adapter"``): :func:`export_adapter` writes the adapter folder (PEFT's files) that
  :meth:`tasks.generation.vllm_engine.VLLMEngine.load_adapter` loads under a new name each sync;
  :func:`prune_adapters` removes the ones the servers have unloaded.
- Tied embeddings: vLLM 0.32's in-place reload rebuilds ``embed_tokens`` but puts the *old* tensor back into
  a tied ``lm_head`` ("ParallelLMHead: Failed to load weights" in the server log), so the served model
  would mix old and new weights (measured: log-prob errors up to 4 nats). :func:`export_for_vllm` therefore
  writes serving copies with the head untied (``tie_word_embeddings: false`` plus an explicit
  ``lm_head.weight`` equal to the embedding): the same function, and reloads become exact (measured 1e-6).
  ``infra/vllm-serve.sh`` starts the server from such a copy (``python -m tasks.generation.vllm_export serve-dir``,
  :func:`serve_dir`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["export_adapter", "export_for_vllm", "prune_adapters", "serve_dir"]


#: counts this process's adapter exports (their names on the servers: :func:`export_adapter`)
_ADAPTER_EXPORTS = itertools.count(1)


def export_adapter(model: torch.nn.Module, folder: str | Path) -> Path:
    """Write ``model``'s LoRA adapter (tasks/model/lora.py ``save_adapter``: PEFT's files, the adapters in the
    dtype the trainer computes with, widened to float32) to a new subfolder of ``folder`` named as the servers
    will know it (``policy-lora-<pid>-<k>``, k counting this process's exports); returns it.

    Raises:
        ValueError: ``model`` has no LoRA adapters (``rollout.vllm_weight_sync=adapter`` needs ``model.lora``).
    """
    from tasks.model.lora import base_model, is_lora, save_adapter

    if not is_lora(model):
        raise ValueError("rollout.vllm_weight_sync=adapter: the policy has no LoRA adapters (model.lora.enabled="
                         "false); set rollout.vllm_weight_sync=merged")
    name = f"policy-lora-{os.getpid()}-{next(_ADAPTER_EXPORTS)}"  # unique in this process and across processes
    return save_adapter(model, Path(folder) / name, base_model(model).name_or_path)


def prune_adapters(folder: str | Path, keep: Path) -> None:
    """Remove what ``folder`` holds besides the adapter folder ``keep`` (the adapters the servers have unloaded, a
    merged export of an earlier sync mode)."""
    for entry in Path(folder).iterdir():
        if entry.name == keep.name:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _tied(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def export_for_vllm(model, tokenizer, path: str | Path) -> Path:
    """Save ``model`` for the vLLM server: ``save_pretrained`` plus, for a tied LM head, an untied copy.

    The untied copy sets ``tie_word_embeddings: false`` in ``config.json`` and adds a safetensors shard
    holding the head's weight (= the embedding), listed in ``model.safetensors.index.json`` (a single-file
    save becomes two shards), so both transformers and vLLM load it. A LoRA policy is exported with its adapters
    merged (``weight_sync="merged"``; ``adapter`` sends the adapter alone, :func:`export_adapter`).
    Returns the folder (for :meth:`tasks.generation.vllm_engine.VLLMEngine.reload_weights` or ``vllm serve``).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tasks.model.loading import save_policy
    from tasks.model.lora import base_model

    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    save_policy(model, tokenizer, path)  # under LoRA: the merged weights
    model = base_model(model)
    if not _tied(model.config):
        return path
    head = model.get_output_embeddings().weight
    name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is head and "embed" not in n)
    index = path / "model.safetensors.index.json"
    if index.exists():  # already sharded: one more shard, listed in the index
        head_file = "lm_head.safetensors"
        data = json.loads(index.read_text())
    else:  # one file: make it shard 1 of 2 (transformers reads model.safetensors alone when it exists)
        head_file = "model-00002-of-00002.safetensors"
        (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
        with safe_open(str(path / "model-00001-of-00002.safetensors"), "pt") as f:
            data = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")}
    save_file({name: head.detach().to("cpu").contiguous().clone()}, str(path / head_file), metadata={"format": "pt"})
    data["weight_map"][name] = head_file
    data.setdefault("metadata", {})["total_size"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    index.write_text(json.dumps(data, indent=2))
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if "text_config" in cfg and "tie_word_embeddings" in cfg["text_config"]:
        cfg["text_config"]["tie_word_embeddings"] = False
    cfg["tie_word_embeddings"] = False
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


def serve_dir(model_dir: str | Path, out: str | Path) -> Path:
    """The folder to start ``vllm serve`` on: ``model_dir`` itself, or an untied export when its head is tied."""
    from transformers import AutoConfig

    if not _tied(AutoConfig.from_pretrained(model_dir, local_files_only=True)):
        return Path(model_dir)
    from tasks.model.loading import load_policy

    model, tok = load_policy(model_dir)
    return export_for_vllm(model, tok, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.generation.vllm_export", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve-dir", help="print the folder to serve (an untied export when the head is tied)")
    s.add_argument("model_dir")
    s.add_argument("out", help="where an untied export goes")
    args = p.parse_args(argv)
    print(serve_dir(args.model_dir, args.out))  # noqa: T201 - the shell script reads this line
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
