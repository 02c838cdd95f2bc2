"""Every end-of-turn token: a Qwen2-type model whose generation config ends a turn on two ids (as Qwen2.5's
``[<|im_end|>, <|endoftext|>]``) stops decoding at either, its completion masks and texts (what rewards read) end
there, and a vLLM request carries both as ``stop_token_ids``."""

import json

import pytest
import torch

from tasks.data.rewards import numeric_reward
from tasks.generation.rollout import HFEngine, completion_mask, decode, end_of_turn_ids, to_generation
from tasks.generation.vllm_engine import VLLMEngine
from tasks.generation.vllm_export import export_for_vllm
from tasks.model.loading import format_prompt, load_policy
from tests import tiny_qwen
from tests.scripted_vllm import ScriptedVLLM

QUESTIONS = ["What is 3+4?", "What is 12*3?", "Add 7 and 9.", "What is 40-13?"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 (byte-level BPE, ChatML) whose generation config ends on two ids; both made likely, so rows end
    on either within a few tokens."""
    tmp = tmp_path_factory.mktemp("qwen2eos")
    texts = tmp / "texts.jsonl"
    texts.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"{a}+{b}={a + b} #### {a + b}"})
                             + "\n" for a in range(20) for b in range(0, 40, 7)))
    model, tok = load_policy(tiny_qwen.build(tmp / "model", texts, two_eos=True))
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    with torch.no_grad():
        model.lm_head.weight[[im_end, endoftext]] *= 8
    return model.eval(), tok, (im_end, endoftext)


def test_the_stop_ids_are_the_tokenizers_eos_and_every_generation_config_id(qwen):
    model, tok, (im_end, endoftext) = qwen
    assert tok.eos_token_id == im_end and model.generation_config.eos_token_id == [im_end, endoftext]
    assert end_of_turn_ids(model, tok) == (im_end, endoftext)
    assert HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=8).stop_ids == \
        (im_end, endoftext)
    model.generation_config.eos_token_id = endoftext  # an int, not the tokenizer's: both still stop
    try:
        assert end_of_turn_ids(model, tok) == (im_end, endoftext)
    finally:
        model.generation_config.eos_token_id = [im_end, endoftext]


def test_completion_mask_ends_at_the_first_of_any_stop_id():
    ids = torch.tensor([[5, 2, 7, 9], [5, 6, 3, 2], [5, 6, 7, 8], [3, 2, 3, 8]])
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(ids, (2, 3)), want)
    assert torch.equal(completion_mask(ids, (2,))[1], torch.tensor([True] * 4))  # 3 alone does not stop


def test_decoding_stops_at_either_id_and_the_text_ends_there(qwen):
    model, tok, stops = qwen
    engine = HFEngine(model, tok, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, chunk=64)
    gen = engine.generate([format_prompt(tok, q) for q in QUESTIONS], n=8, seed=0)
    lens = gen.completion_mask.sum(1)
    ended_on = {int(gen.completion_ids[i, lens[i] - 1]) for i in range(len(lens)) if lens[i] < 24}
    assert ended_on == set(stops)  # rows ended on each of the two ids
    for i, n_tok in enumerate(lens.tolist()):
        row = gen.completion_ids[i].tolist()
        assert not set(row[:n_tok - 1]) & set(stops)  # nothing decoded past the first stop
        assert all(x == tok.pad_token_id for x in row[n_tok:])
        assert gen.texts[i] == tok.decode(row[:n_tok], skip_special_tokens=True)
        assert float(gen.logprobs[i, n_tok:].abs().sum()) == 0


def test_greedy_equals_generate_with_both_ids(qwen):
    model, tok, stops = qwen
    enc = tok([format_prompt(tok, q) for q in QUESTIONS], return_tensors="pt", padding=True, add_special_tokens=False)
    ref = model.generate(**enc, max_new_tokens=16, do_sample=False)[:, enc["input_ids"].shape[1]:]  # its own config
    out, _ = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=16, sampling=None, stop_ids=stops,
                    pad_id=tok.pad_token_id)
    ref = torch.where(completion_mask(ref, stops), ref, torch.full_like(ref, tok.pad_token_id))
    assert torch.equal(out, ref[:, :out.shape[1]]) and bool((ref[:, out.shape[1]:] == tok.pad_token_id).all())


def test_the_reward_reads_only_the_text_up_to_the_stop(qwen):
    """A completion that states 7, ends its turn with the second id, and runs on with "0": the reward sees 7."""
    _, tok, (im_end, endoftext) = qwen
    said = tok("The answer is 7", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([said + [endoftext] + tok("0 and more", add_special_tokens=False)["input_ids"]])
    gen = to_generation(tok, [torch.tensor([1])], ids, torch.full(ids.shape, -0.5), 1, (im_end, endoftext))
    assert gen.texts == ["The answer is 7"] and numeric_reward(gen.texts[0], "7") == 1.0
    assert gen.tokens == len(said) + 1
    run_on = to_generation(tok, [torch.tensor([1])], ids, torch.zeros(ids.shape), 1, (im_end,))
    assert numeric_reward(run_on.texts[0], "7") == 0.0  # the run-on text would read 70


def test_a_vllm_request_carries_both_stop_ids(qwen, tmp_path):
    model, tok, stops = qwen
    server = ScriptedVLLM(export_for_vllm(model, tok, tmp_path / "serve"))
    try:
        engine = VLLMEngine(server.url, tok, max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=0,
                            stop_ids=end_of_turn_ids(model, tok))
        gen = engine.generate([format_prompt(tok, q) for q in QUESTIONS], n=8, seed=3)
    finally:
        server.close()
    assert [r["stop_token_ids"] for r in server.requests] == [list(stops)] * len(QUESTIONS)
    lens = gen.completion_mask.sum(1)
    last = {int(gen.completion_ids[i, lens[i] - 1]) for i in range(len(lens)) if lens[i] < 40}
    assert last == set(stops)  # the server stopped rows at each of them
    for i, n_tok in enumerate(lens.tolist()):
        assert not set(gen.completion_ids[i, :n_tok - 1].tolist()) & set(stops)
