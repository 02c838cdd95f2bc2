"""The in-process sampler: its draws follow the warped softmax, a seed reproduces them, its log-probs are the
trainer's, finished rows leave the batch, and greedy decoding is ``model.generate``'s."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper

from tasks.generation import sampling as sampling_module
from tasks.model.forward import token_logprobs
from tasks.model.policy import build_tiny_model, build_tokenizer
from tasks.generation.rollout import HFEngine, completion_mask, decode
from tasks.generation.sampling import Sampling, sample_next

PROMPTS = ["Q: 1+2=?\n", "Q: 12*34-5=?\n", "Q: 9=?\n", "Q: 40-3*7=?\n"]
SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    with torch.no_grad():  # make EOS likely, so rows end at different steps and leave the batch early
        model.lm_head.weight[tok.eos_token_id] *= 3
    return model.eval(), tok


def warped_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The oracle: transformers' temperature, top-k and top-p warpers (as ``generate`` applies them), softmax."""
    return torch.softmax(s.warpers()(None, TemperatureLogitsWarper(s.temperature)(None, logits.double())), -1)


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
@pytest.mark.parametrize("dtype, chunk", [(torch.float32, None), (torch.bfloat16, 999 * 12)])
def test_draws_follow_the_warped_softmax(temperature, top_k, top_p, dtype, chunk):
    """Chi-square of 40,000 draws from one row of 12 logits against the warped softmax (and, for power, against
    the softmax at a 15 % higher temperature); tokens the cut removes are never drawn; the log-probs are the
    warped distribution's. bf16 logits (the model's dtype on a GPU) in chunks of 999 rows."""
    s = Sampling(temperature, top_k, top_p)
    logits = (torch.linspace(-3.0, 2.5, 12) + torch.tensor([0.3, -0.2] * 6)).to(dtype)
    rows = logits.expand(40_000, 12)
    tok, logp = sample_next(rows, s, torch.Generator().manual_seed(0), max_elements=chunk)
    counts = torch.bincount(tok, minlength=12).double()
    want = warped_probs(logits.float()[None], s)[0]
    kept = want > 0
    assert bool((counts[~kept] == 0).all()) and (top_k == 0 and top_p == 1.0 or bool((~kept).any()))
    assert chisquare(counts[kept], want[kept] * len(rows)).pvalue > 1e-3
    hotter = warped_probs(logits.float()[None], Sampling(temperature * 1.15, top_k, top_p))[0]
    assert chisquare(counts[kept], hotter[kept] / hotter[kept].sum() * len(rows)).pvalue < 1e-6
    torch.testing.assert_close(logp, want.log()[tok].float(), atol=1e-5, rtol=0)


def test_the_first_token_of_decode_follows_the_models_softmax(policy):
    """End to end: 6,000 rows of one prompt, one decode step at temperature 0.8, against the model's own softmax."""
    model, tok = policy
    ids = torch.tensor([tok("Q: 12*34-5=?\n")["input_ids"]]).repeat(6000, 1)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids[:1]).logits[0, -1].double() / 0.8, -1)
    out, logp = decode(model, ids, torch.ones_like(ids), max_new_tokens=1, sampling=Sampling(0.8),
                       stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(out[:, 0], minlength=len(probs)).double()
    common = probs * len(ids) >= 5  # chi-square wants expected counts >= 5: pool the rest into one cell
    observed = torch.cat([counts[common], counts[~common].sum()[None]])[:None if (~common).any() else -1]
    expected = torch.cat([probs[common], probs[~common].sum()[None]])[:len(observed)] * len(ids)
    assert int(common.sum()) >= 10 and chisquare(observed, expected).pvalue > 1e-3
    torch.testing.assert_close(logp[:, 0], probs.log()[out[:, 0]].float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_a_seed_gives_the_same_draws_every_time_and_another_seed_others(policy, temperature, top_k, top_p):
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, chunk=512)
    ended_early = False
    for seed in range(3):
        torch.manual_seed(123)  # the global generator is not the draws' source
        a = engine.generate(PROMPTS, n=6, seed=seed)
        torch.manual_seed(456)
        b = engine.generate(PROMPTS, n=6, seed=seed)
        c = engine.generate(PROMPTS, n=6, seed=seed + 10)
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
        assert not torch.equal(a.completion_ids, c.completion_ids)
        lens = a.completion_mask.sum(1)
        ended_early |= bool(lens.min() < lens.max())
    assert ended_early  # rows did finish at different steps (and left the batch)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_the_trainers_with_a_larger_vocabulary_across_chunks(monkeypatch, temperature):
    """A 3,000-token vocabulary sampled in 5-row chunks: every drawn token's log-prob is the trainer's
    recomputation (``token_logprobs``, float32) within 1e-5."""
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, vocab_size=3000, seed=1).eval()
    monkeypatch.setattr(sampling_module, "CHUNK_ELEMENTS", 5 * 3000)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, am = enc["input_ids"].repeat_interleave(8, 0), enc["attention_mask"].repeat_interleave(8, 0)
    out, logp = decode(model, ids, am, max_new_tokens=10, sampling=Sampling(temperature), stop_ids=(tok.eos_token_id,),
                       pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(2))
    mask = completion_mask(out, (tok.eos_token_id,))
    prompts = [row[a.bool()] for row, a in zip(ids, am, strict=True)]
    with torch.no_grad():
        trainer = token_logprobs(model, prompts, out, mask, tok.pad_token_id, temperature)
    assert out.shape == (32, 10) and len(out.unique()) > 100  # tokens from all over the vocabulary
    assert float((trainer - logp)[mask].abs().max()) <= 1e-5
    assert bool((logp[~mask] == 0).all())


def test_greedy_matches_generate(policy):
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, chunk=512)
    gen = engine.generate(PROMPTS, n=1, seed=0, greedy=True)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[:, enc["input_ids"].shape[1]:]
    ref = torch.where(completion_mask(ref, (tok.eos_token_id,)), ref, torch.full_like(ref, tok.pad_token_id))
    assert torch.equal(gen.completion_ids, ref)


def test_finished_rows_leave_the_batch(policy):
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, chunk=512)
    rows: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        gen = engine.generate(PROMPTS, n=6, seed=0)
    finally:
        handle.remove()
    lens = gen.completion_mask.sum(1)
    # one prefill of all 24 rows, then one step per token with the rows still generating at that step
    assert rows[0] == 24 and len(rows) == int(lens.max())
    assert rows[1:] == [int((lens > t).sum()) for t in range(1, int(lens.max()))]


def test_nan_logits_are_an_error_not_tokens(policy):
    model, tok = policy
    ids = torch.tensor([tok("Q: 9=?\n")["input_ids"]] * 3)
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: out * float("nan"))
    try:
        with pytest.raises(FloatingPointError, match="NaN for 6 of the drawn tokens"):
            decode(model, ids, torch.ones_like(ids), max_new_tokens=2, sampling=Sampling(), stop_ids=(tok.eos_token_id,),
                   pad_id=tok.pad_token_id)
    finally:
        handle.remove()


def test_sampling_settings_are_checked():
    for bad, match in (({"temperature": 0.0}, "temperature 0.0"), ({"top_k": -1}, "top_k -1"),
                       ({"top_p": 0.0}, "top_p 0.0"), ({"top_p": 1.5}, "top_p 1.5")):
        with pytest.raises(ValueError, match=match):
            Sampling(**bad)


def test_decode_imports_without_prefect_mlflow_or_duckdb():
    """A GPU benchmark script may import the sampler with torch, transformers, peft, pydantic and numpy only."""
    code = ("import sys, tasks.generation.rollout\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'mlflow', 'duckdb'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]"
