"""Tests of the tiny policy: character tokenizer, Llama construction, save/load round trip, prompt format."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from tasks.config import Config
from tasks.data import arith
from tasks.model import loading as policy


@pytest.fixture(scope="module")
def tok():
    return policy.build_tokenizer()


def test_special_ids_and_padding_side(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    assert len(tok) == 4 + len(policy.CHARS) == 100  # 95 printable ASCII characters + newline + 4 specials


def test_character_level_by_hand(tok):
    ids = tok("Q: 1+1=?\n")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + 9  # <s> then one token per character
    assert tok.convert_ids_to_tokens(ids[1:4]) == ["Q", ":", " "]
    assert tok("é")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]


def test_round_trip_on_generated_problems(tok):
    recs = arith.generate(0, 1000, "train", "uniform") + arith.generate(0, 200, "test", "uniform")
    for r in recs:
        text = policy.format_prompt(tok, r.question) + r.solution
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text) + 1 and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert len(ids) + 1 <= 128  # with EOS, every problem fits a 128-token context


def test_left_padding_batch(tok):
    enc = tok(["Q: 1+1=?\n", "Q: 12+7*3=?\n"], padding=True, return_tensors="pt")
    # lengths 1+9 and 1+12 -> the first row gets 3 pads on the left
    assert enc["input_ids"][0, :3].tolist() == [0, 0, 0] and enc["input_ids"][0, 3].item() == tok.bos_token_id
    assert enc["attention_mask"][0].tolist() == [0, 0, 0] + [1] * 10


def test_tiny_model_size_by_hand(tok):
    m = Config().model  # the embedded default's size
    model = policy.build_tiny_model(hidden=m.hidden, layers=m.layers, heads=m.heads, seed=0, tokenizer=tok)
    # embeddings 100*128 = 12,800 (tied with the head); per layer q,k,v,o 4*128*128 = 65,536,
    # MLP 3*128*384 = 147,456, two RMSNorms 256 -> 213,248; 4 layers 852,992; final norm 128.
    assert sum(p.numel() for p in model.parameters()) == 12_800 + 4 * 213_248 + 128 == 865_920
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert model.generation_config.pad_token_id == 0 and model.generation_config.eos_token_id == 2


def test_tiny_model_is_seeded_and_leaves_global_rng_alone(tok):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = policy.build_tiny_model(hidden=64, layers=1, heads=2, seed=5, tokenizer=tok)
    after = torch.rand(1)
    b = policy.build_tiny_model(hidden=64, layers=1, heads=2, seed=5, tokenizer=tok)
    c = policy.build_tiny_model(hidden=64, layers=1, heads=2, seed=6, tokenizer=tok)
    assert torch.equal(before, after)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.parametrize(("hidden", "heads"), [(64, 4), (100, 3), (66, 2), (0, 1)])
def test_bad_sizes_are_errors(tok, hidden, heads):
    with pytest.raises(ValueError, match="hidden"):
        policy.build_tiny_model(hidden=hidden, layers=1, heads=heads, seed=0, tokenizer=tok)


def test_save_load_round_trip(tok, tmp_path):
    model = policy.build_tiny_model(hidden=64, layers=2, heads=2, seed=1, tokenizer=tok).eval()
    policy.save_policy(model, tok, tmp_path / "p")
    assert json.loads((tmp_path / "p" / "config.json").read_text())["model_type"] == "llama"
    loaded, tok2 = policy.load_policy(tmp_path / "p")
    text = "Q: 12+(40-7)*3=?\n40-7=33\n33*3=99\n12+99=111\n#### 111"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok2(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    assert tok2.padding_side == "left" and tok2.pad_token_id == 0
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # AutoTokenizer on a Llama folder keeps our pre-tokenization (a Qwen2 folder would not: tasks/model/loading.py)
    auto = AutoTokenizer.from_pretrained(tmp_path / "p")
    assert auto(text)["input_ids"] == ids[0].tolist()
    assert auto.decode(ids[0], skip_special_tokens=True) == text


def test_load_policy_dtype_and_missing_path(tok, tmp_path):
    policy.save_policy(policy.build_tiny_model(hidden=64, layers=1, heads=2, seed=0, tokenizer=tok), tok, tmp_path)
    model, _ = policy.load_policy(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    with pytest.raises(ValueError, match="is not a folder"):
        policy.load_policy(tmp_path / "missing")


def test_format_prompt_plain_and_chat_template(tok):
    assert policy.format_prompt(tok, "12+7*3=?") == "Q: 12+7*3=?\n"
    assert policy.format_prompt(tok, "12+7*3=?", system="ignored without a template") == "Q: 12+7*3=?\n"
    chat = policy.build_tokenizer()
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert policy.format_prompt(chat, "1+1=?", system="Be brief.") == "<system>Be brief.\n<user>1+1=?\n<assistant>"
    assert policy.format_prompt(chat, "1+1=?") == "<user>1+1=?\n<assistant>"
