"""A tiny model that looks like a real one, built offline: Qwen2 architecture, a byte-level BPE tokenizer
trained here on GSM8K text, and a ChatML chat template whose end-of-turn token is the EOS (as Qwen2.5's).

It stands for ``model.path=<a Hugging Face model folder>`` in the end-to-end test of the real-model path;
it is random (it scores about 0), which is enough to run chat formatting, EOS handling, rewards, DOTS
scoring, evaluation and registration for real.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build(folder: Path, texts_file: Path, vocab_size: int = 400, hidden: int = 64, layers: int = 2,
          two_eos: bool = False) -> Path:
    """Train the tokenizer on the ``question`` and ``answer`` fields of a JSONL file, build a random Qwen2 of
    that vocabulary and save both (``save_pretrained``) to ``folder``.

    ``two_eos``: the generation config ends a turn on ``[<|im_end|>, <|endoftext|>]``, as Qwen2.5-Instruct's
    (``[151645, 151643]``); else on ``<|im_end|>`` alone."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    texts = []
    with open(texts_file) as f:
        for line in f:
            row = json.loads(line)
            texts += [row["question"], row["answer"]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=CHATML)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")] if two_eos else tok.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
