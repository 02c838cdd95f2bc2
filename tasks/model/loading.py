"""The policy: loading real causal LMs and building the tiny default (character tokenizer + Llama).

Real models and tokenizers are loaded from local paths through ``AutoModelForCausalLM`` /
``AutoTokenizer``; the tiny default of the embedded run (README.md, "Two commands")
is built here:

- ``build_tokenizer``: a character-level vocabulary built locally with the ``tokenizers`` library (a
  ``BPE`` model with no merges, so every character is one token, and a ``Fuse`` decoder). It holds the
  printable ASCII characters and the newline (every generated arithmetic problem uses only those), plus
  ``<pad> <s> </s> <unk>``; a post-processor prepends ``<s>``. ``padding_side="left"`` is passed to the
  constructor because setting the attribute later is not saved with the tokenizer.
- ``build_tiny_model``: a ``LlamaForCausalLM`` from a ``LlamaConfig`` with tied embeddings. A Llama
  config (not Qwen2) matters: ``AutoTokenizer`` on a saved Qwen2 folder swaps in Qwen2's pre-tokenizer
  and changes the ids, while a Llama folder keeps ours (tests/tasks/test_policy.py checks the round trip).
- ``format_prompt``: the tokenizer's chat template (with the system instruction) when it has one, else
  the plain format ``"Q: {question}\\n"`` that the warm start trains the tiny model on.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, processors

from tasks.model import lora

if TYPE_CHECKING:  # transformers loads with the first model or tokenizer, not at import (seconds at every start)
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
#: The characters of the tiny vocabulary, in id order after the four special tokens.
CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())
#: Plain prompt format for tokenizers without a chat template; the completion follows directly.
PLAIN_PROMPT = "Q: {question}\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer of the tiny default policy (ids: 0 pad, 1 bos, 2 eos, 3 unk, chars).

    Returns:
        A fast tokenizer whose ``encode`` prepends ``<s>``, pads on the left, and decodes (with
        ``skip_special_tokens=True``) back to exactly the input text for any printable-ASCII text.
    """
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=256,
    )


def build_tiny_model(
    *,
    hidden: int,
    layers: int,
    heads: int,
    seed: int,
    intermediate: int | None = None,
    max_positions: int = 256,
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama with tied embeddings (the default ``model.hidden`` 128 and
    ``model.layers`` 4 of ``tasks/config/model.py``: about 0.86M parameters).

    The sizes and the seed are required: their defaults live in the config (``model.*``, ``seed``).

    Args:
        hidden: hidden size H; ``hidden / heads`` (the head size) must be an even integer >= 32.
        layers: number of decoder layers.
        heads: attention heads (no grouped-query attention).
        intermediate: MLP width; default ``3 * hidden``.
        max_positions: context length in tokens.
        vocab_size: default ``len(tokenizer)``.
        seed: ``torch.manual_seed`` for the initialisation (the global RNG state is restored afterwards).
        tokenizer: gives the vocabulary size and the pad/bos/eos ids; default ``build_tokenizer()``.

    Raises:
        ValueError: a size that is not positive, or a head size below 32 / not a whole even number.
    """
    for name, v in (("hidden", hidden), ("layers", layers), ("heads", heads), ("max_positions", max_positions)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if hidden % heads or (hidden // heads) < 32 or (hidden // heads) % 2:
        raise ValueError(f"hidden/heads must be an even integer >= 32 (head size), got hidden={hidden} heads={heads}")
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    _set_generation_ids(model, tok)
    return model


def _set_generation_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    gc = model.generation_config
    if gc.pad_token_id is None:
        gc.pad_token_id = tokenizer.pad_token_id
    if gc.eos_token_id is None:
        gc.eos_token_id = tokenizer.eos_token_id
    if gc.bos_token_id is None and tokenizer.bos_token_id is not None:
        gc.bos_token_id = tokenizer.bos_token_id


def load_policy(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a causal LM and its tokenizer from a local folder (a real model or a saved tiny one).

    The tokenizer pads on the left (for batched generation); one without a pad token gets its EOS token as
    pad. Nothing is downloaded.

    Args:
        path: a folder written by ``save_pretrained`` (or ``save_policy``).
        dtype: e.g. ``torch.bfloat16`` or ``"bfloat16"``; default: the dtype the weights were saved in.
        device: where to put the model.

    Raises:
        ValueError: ``path`` is not an existing folder.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"policy path {str(path)!r} is not a folder with a saved model and tokenizer")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
    model.to(device)
    model.eval()
    _set_generation_ids(model, tokenizer)
    return model, tokenizer


def save_policy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Saves model (safetensors) and tokenizer to ``path`` (created if missing); returns the path.

    The weights are saved in the model's dtype: the compute dtype of ``model.precision`` (bf16 under
    ``bf16-mixed``, the float32 masters rounded; float32 under ``fp32``), the dtype users serve.

    A LoRA policy is saved as the plain model with its adapters merged (tasks/model/lora.py), so the folder loads
    with ``load_policy`` (and from MLflow's registry) as a full model.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if lora.is_lora(model):
        lora.base_model(model).save_pretrained(path, state_dict=lora.plain_state_dict(model))
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def format_prompt(tokenizer: PreTrainedTokenizerBase, question: str, system: str | None = None) -> str:
    """The prompt text for one question: the chat template when the tokenizer has one, else ``PLAIN_PROMPT``.

    Args:
        tokenizer: the policy's tokenizer.
        question: the record's question.
        system: a system instruction; used only with a chat template (the plain format has no room for it).

    Returns:
        Text to be tokenized as is; with a chat template it ends with the assistant turn's opening.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return PLAIN_PROMPT.format(question=question)


def add_special(tokenizer) -> bool:
    """Whether prompts get the tokenizer's special tokens (BOS): yes in the plain format, which the warm start
    trains as ``<s>`` + prompt; no when a chat template has already written them into the text."""
    return not getattr(tokenizer, "chat_template", None)
