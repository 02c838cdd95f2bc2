"""export_for_vllm / serve_dir (no server needed): the untied serving copy computes the same function."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tasks.generation.vllm_engine import VLLMEngine, VLLMError
from tasks.generation.vllm_export import export_for_vllm, serve_dir
from tasks.model.loading import build_tiny_model, build_tokenizer, load_policy, save_policy


def test_export_unties_the_head_and_keeps_the_function(tmp_path):
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=1, heads=2, seed=3, tokenizer=tok).eval()
    assert model.config.tie_word_embeddings
    out = export_for_vllm(model, tok, tmp_path / "serve")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    head = load_file(str(out / "model-00002-of-00002.safetensors"))
    assert list(head) == ["lm_head.weight"]
    assert torch.equal(head["lm_head.weight"], model.model.embed_tokens.weight.detach())
    served, _ = load_policy(out)
    assert served.lm_head.weight.data_ptr() != served.model.embed_tokens.weight.data_ptr()  # really untied
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    # a second export into the same folder replaces it
    assert export_for_vllm(model, tok, out) == out


def test_serve_dir_exports_only_tied_models(tmp_path):
    tok = build_tokenizer()
    tied = save_policy(build_tiny_model(hidden=64, layers=1, heads=2, seed=0, tokenizer=tok), tok, tmp_path / "tied")
    assert serve_dir(tied, tmp_path / "out") == tmp_path / "out"
    untied = tmp_path / "out"  # the export itself is untied: served as is
    assert serve_dir(untied, tmp_path / "out2") == untied


def test_unreachable_server_and_bad_folder(tmp_path):
    engine = VLLMEngine("http://127.0.0.1:9", build_tokenizer(), max_new_tokens=4, temperature=1.0, top_p=1.0,
                        top_k=0, stop_ids=(2,))
    try:
        engine.generate(["Q: 1+1\n"], n=2, seed=0)
    except VLLMError as err:
        assert "unreachable" in str(err) and "vllm-serve.sh" in str(err)
    else:
        raise AssertionError("expected VLLMError")
    try:
        engine.reload_weights(tmp_path)
    except ValueError as err:
        assert "no config.json" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_completions_become_a_right_padded_generation_without_a_server(monkeypatch):
    """generate lays the server's choices out prompt-major: ids and log-probs right-padded, the mask
    on the returned tokens (EOS included), a missing log-prob as 0; the server here is a scripted ``complete``."""
    tok = build_tokenizer()
    engine = VLLMEngine("http://127.0.0.1:9", tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                        stop_ids=(tok.eos_token_id,))
    eos = tok.eos_token_id
    script = {0: [[10, 11, eos], [12]], 1: [[13, 14], [eos]]}  # prompt b -> its two completions' token ids

    def complete(prompt_ids, n, seed, greedy):
        b = 0 if prompt_ids == engine.tok("a", add_special_tokens=False)["input_ids"] else 1
        return [{"index": j, "token_ids": t, "logprobs": {"token_logprobs": [None if x == eos else -0.5 for x in t]}}
                for j, t in enumerate(script[b])]

    monkeypatch.setattr(engine, "complete", complete)
    monkeypatch.setattr("tasks.generation.vllm_engine.add_special", lambda _tok: False)
    gen = engine.generate(["a", "b"], n=2, seed=0)
    logp = gen.logprobs
    pad = tok.pad_token_id
    assert gen.completion_ids.tolist() == [[10, 11, eos], [12, pad, pad], [13, 14, pad], [eos, pad, pad]]
    assert gen.completion_mask.sum(1).tolist() == [3, 1, 2, 1]
    assert logp.tolist() == [[-0.5, -0.5, 0.0], [-0.5, 0.0, 0.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]
