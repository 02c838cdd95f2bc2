"""The in-process sampler: its draws follow the warped softmax, a seed reproduces them whatever the split of the
prompts, its log-probs are the trainer's, finished rows leave the batch, and greedy decoding is ``model.generate``'s
(a tiny Llama with grouped keys and values, and a tiny Qwen2 with two EOS ids)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare, kstest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, TemperatureLogitsWarper

from tasks.generation import sampling as sampling_module
from tasks.generation.decode import Decoder
from tasks.generation.decode_options import DecodeOptions, buckets
from tasks.generation.rollout import HFEngine, completion_mask, decode, prompt_seed
from tasks.generation.sampling import Sampling, mix64, race_noise, row_keys, sample_next, step_keys
from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model, build_tokenizer

PROMPTS = ["Q: 1+2=?\n", "Q: 12*34-5=?\n", "Q: 9=?\n", "Q: 40-3*7=?\n"]
SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)]
ROOT = Path(__file__).resolve().parents[2]
#: the CPU's default (every finished row leaves at once, a check every step, attention over the written columns) and
#: the GPU's layout run eagerly
#: (buckets of powers of two, a check every 3 steps, prompts padded to 16 columns, attention over the used width
#: in steps of 16 columns)
OPTIONS = [DecodeOptions.for_device("cpu"), DecodeOptions(graphs=False, exact_rows=False, check_every=3,
                                                          prompt_multiple=16, width_multiple=16)]
MASK64 = (1 << 64) - 1


def keys_for(rows: int, seed: int = 0) -> torch.Tensor:
    """Step-0 noise keys of ``rows`` rollouts of one prompt."""
    return step_keys(row_keys(torch.tensor([seed]), rows), 0)


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
    tok, logp = sample_next(rows, s, keys_for(len(rows)), max_elements=chunk)
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
    ids = torch.tensor([tok("Q: 12*34-5=?\n")["input_ids"]])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[0, -1].double() / 0.8, -1)
    out, logp = decode(model, ids, torch.ones_like(ids), n=6000, max_new_tokens=1, sampling=Sampling(0.8),
                       stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, seeds=torch.tensor([1]))
    counts = torch.bincount(out[:, 0], minlength=len(probs)).double()
    common = probs * len(out) >= 5  # chi-square wants expected counts >= 5: pool the rest into one cell
    observed = torch.cat([counts[common], counts[~common].sum()[None]])[:None if (~common).any() else -1]
    expected = torch.cat([probs[common], probs[~common].sum()[None]])[:len(observed)] * len(out)
    assert int(common.sum()) >= 10 and chisquare(observed, expected).pvalue > 1e-3
    torch.testing.assert_close(logp[:, 0], probs.log()[out[:, 0]].float(), atol=1e-5, rtol=0)
    assert out.shape == (6000, 1)


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


@pytest.mark.parametrize("options", OPTIONS, ids=["cpu", "buckets"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_the_trainers_with_a_larger_vocabulary_across_chunks(monkeypatch, temperature, options):
    """A 3,000-token vocabulary sampled in 5-row chunks: every drawn token's log-prob is the trainer's
    recomputation (``token_logprobs``, float32) within 1e-5."""
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, vocab_size=3000, seed=1).eval()
    monkeypatch.setattr(sampling_module, "CHUNK_ELEMENTS", 5 * 3000)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out, logp = decode(model, enc["input_ids"], enc["attention_mask"], n=8, max_new_tokens=10,
                       sampling=Sampling(temperature), stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id,
                       seeds=torch.arange(4), options=options)
    mask = completion_mask(out, (tok.eos_token_id,))
    prompts = [row[a.bool()] for row, a in zip(enc["input_ids"], enc["attention_mask"], strict=True) for _ in range(8)]
    with torch.no_grad():
        trainer = token_logprobs(model, prompts, out, mask, tok.pad_token_id, temperature)
    assert out.shape == (32, 10) and len(out.unique()) > 100  # tokens from all over the vocabulary
    assert float((trainer - logp)[mask].abs().max()) <= 1e-5
    assert bool((logp[~mask] == 0).all())


def lively_llama(tok) -> LlamaForCausalLM:
    """A tiny Llama with grouped keys and values (2 heads, 1 KV head) and large weights, so greedy decoding varies
    from row to row and step to step."""
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval()


def lively_qwen2(tok) -> Qwen2ForCausalLM:
    """A tiny Qwen2 whose generation config ends a turn on two ids (as Qwen2.5's), neither the tokenizer's EOS."""
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("6"), tok.convert_tokens_to_ids(")")]
    model.generation_config.pad_token_id = 0
    return model


GREEDY_PROMPTS = [*PROMPTS, "Q: 77=?\n", "Q: 5*5*5*5=?\n", "Q: (3+4)*2-11+6=?\n", "Q: 0=?\n"]


@pytest.mark.parametrize("options", OPTIONS, ids=["cpu", "buckets"])
@pytest.mark.parametrize("build", [lively_llama, lively_qwen2])
def test_greedy_matches_generate_token_for_token(build, options):
    """Left-padded prompts of different lengths, rows ending at different steps (on either of two stop ids)."""
    tok = build_tokenizer()
    model = build(tok)
    if build is lively_llama:  # two frequent tokens of its greedy text stop it
        model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("L"), tok.convert_tokens_to_ids("i")]
    stops = tuple(model.generation_config.eos_token_id)
    enc = tok(GREEDY_PROMPTS, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=24, do_sample=False)[:, enc["input_ids"].shape[1]:]
    ref = torch.where(completion_mask(ref, stops), ref, torch.full_like(ref, tok.pad_token_id))
    lens = completion_mask(ref, stops).sum(1)
    assert len(set(lens.tolist())) >= 4 and int(lens.max()) == 24
    assert len(set(enc["attention_mask"].sum(1).tolist())) > 3  # prompts of different lengths
    out, _ = decode(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=24, sampling=None, stop_ids=stops,
                    pad_id=tok.pad_token_id, options=options)
    assert torch.equal(out, ref)
    engine = HFEngine(model, tok, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, chunk=3)  # 3 chunks
    assert engine.stop_ids == (tok.eos_token_id, *stops)
    gen = engine.generate(GREEDY_PROMPTS, n=1, seed=0, greedy=True)
    assert torch.equal(gen.completion_ids, torch.where(completion_mask(ref, engine.stop_ids), ref, tok.pad_token_id))


@pytest.mark.parametrize("options", OPTIONS, ids=["cpu", "buckets"])
def test_finished_rows_leave_the_batch(policy, options):
    """One prefill of the 4 prompts (not of their 24 rows), then one step per token with the rows still generating
    (the CPU's default) or the smallest bucket that holds them at the last check (every 3 steps). The EOS logit is
    raised by 3 so rows end all through the call."""
    model, tok = policy
    rows: list[int] = []
    handles = [model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True),
               model.lm_head.register_forward_hook(lambda _m, _i, out: out.index_add(
                   -1, torch.tensor([tok.eos_token_id]), torch.full((*out.shape[:-1], 1), 3.0)))]
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    try:
        out, _ = decode(model, enc["input_ids"], enc["attention_mask"], n=6, max_new_tokens=16, sampling=Sampling(),
                        stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, seeds=torch.arange(4),
                        options=options)
    finally:
        for handle in handles:
            handle.remove()
    lens = completion_mask(out, (tok.eos_token_id,)).sum(1)
    live = [int((lens > t).sum()) for t in range(1, int(lens.max()))]  # rows that feed a token at step t
    assert rows[0] == 4 and len(lens.unique()) > 3
    if options.exact_rows:
        assert rows[1:] == live
    else:
        sizes, at_check = buckets(24), 24
        for t, m in enumerate(rows[1:], start=1):
            if t % 3 == 0:  # the host checked after step t - 1's draws: rows whose completion goes on past it
                at_check = int((lens > t).sum())
            assert m == next(x for x in sizes if x >= at_check), (t, m, at_check)
        assert set(rows[1:]) >= {24, 16, 8}  # it did compact, bucket by bucket


def test_nan_logits_are_an_error_not_tokens(policy):
    model, tok = policy
    ids = torch.tensor([tok("Q: 9=?\n")["input_ids"]])
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: out * float("nan"))
    try:
        with pytest.raises(FloatingPointError, match="NaN for 6 of the drawn tokens"):
            decode(model, ids, torch.ones_like(ids), n=3, max_new_tokens=2, sampling=Sampling(),
                   stop_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id, seeds=torch.tensor([0]))
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


# ---------------------------------------------------------------- the counter-based noise
def mix64_oracle(z: int) -> int:
    """SplitMix64's finaliser on Python integers (uint64), the reference."""
    z &= MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return z ^ (z >> 31)


def test_the_int64_mixer_is_splitmix64_bit_for_bit():
    xs = [0, 1, 2, 12345, 2**62 + 7, 2**63 - 1, -1, -(2**63), -987654321]
    assert [g & MASK64 for g in mix64(torch.tensor(xs)).tolist()] == [mix64_oracle(x) for x in xs]
    assert mix64_oracle(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # SplitMix64(seed 0)'s first output


def test_race_noise_is_a_function_of_seed_rollout_step_and_token():
    """Entry by entry against a Python loop over the same recipe; one prompt's rows alone give the same noise as in
    a batch of several prompts, whatever the rows next to them."""
    seeds, n, t, vocab = torch.tensor([5, 2**40 + 3]), 3, 7, 11
    noise = race_noise(step_keys(row_keys(seeds, n), t), vocab)
    gamma, gamma_step = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
    for b, s in enumerate(seeds.tolist()):
        for j in range(n):
            key = mix64_oracle(mix64_oracle(s) + (j + 1) * gamma)
            key = mix64_oracle(key + (t + 1) * gamma_step)
            for v in range(vocab):
                u = ((mix64_oracle(key + (v + 1) * gamma) >> 11) + 0.5) * 2.0 ** -53
                assert float(noise[b * n + j, v]) == pytest.approx(-math.log(u), rel=1e-6)
    alone = race_noise(step_keys(row_keys(seeds[1:], n), t), vocab)
    assert torch.equal(alone, noise[n:])


def test_race_noise_is_exponential_and_independent():
    """4M draws over rows, steps and tokens: E ~ Exp(1) (Kolmogorov-Smirnov), its uniforms u = exp(-E) flat over
    256 bins and jointly flat over 16 x 16 bins for neighbouring tokens, steps, rollouts and prompts (chi-square),
    and no correlation between neighbours."""
    keys = row_keys(torch.arange(16), 8)  # 16 prompts x 8 rollouts
    noise = torch.stack([race_noise(step_keys(keys, t), 1024) for t in range(32)])  # [T, R, V]
    e = noise.double().flatten()
    assert kstest(e[:200_000].numpy(), "expon").pvalue > 1e-3
    u = torch.exp(-noise.double())
    assert chisquare(torch.histc(u, 256, 0, 1).numpy()).pvalue > 1e-3
    pairs = {"tokens": (u[:, :, :-1], u[:, :, 1:]), "steps": (u[:-1], u[1:]), "rollouts": (u[:, :-1], u[:, 1:]),
             "prompts": (u[:, :-8], u[:, 8:])}
    for name, (a, b) in pairs.items():
        cells = (a * 16).long().clamp(max=15) * 16 + (b * 16).long().clamp(max=15)
        counts = torch.bincount(cells.flatten(), minlength=256).double()
        assert chisquare(counts.numpy()).pvalue > 1e-3, name
        assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 5e-3, name
    assert float(e.mean()) == pytest.approx(1.0, abs=3e-3) and float(e.var()) == pytest.approx(1.0, abs=1e-2)


# ---------------------------------------------------------------- noise seeded per prompt
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS[:2])
def test_the_same_seed_gives_the_same_rollouts_in_one_call_or_three(policy, temperature, top_k, top_p):
    """Prompt b's rollouts come from ``prompt_seed(seed, first + b)``: the batch in one call, in three calls with
    ``first``, or in chunks of one prompt gives the same rows; another ``first`` gives other rows."""
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, chunk=512)
    whole = engine.generate(PROMPTS, n=6, seed=4)
    parts = [engine.generate(PROMPTS[a:b], n=6, seed=4, first=a) for a, b in ((0, 1), (1, 3), (3, 4))]
    width = whole.completion_ids.shape[1]
    ids = torch.cat([torch.nn.functional.pad(g.completion_ids, (0, width - g.completion_ids.shape[1]),
                                             value=tok.pad_token_id) for g in parts])
    logp = torch.cat([torch.nn.functional.pad(g.logprobs, (0, width - g.logprobs.shape[1])) for g in parts])
    assert torch.equal(ids, whole.completion_ids)
    torch.testing.assert_close(logp, whole.logprobs, atol=1e-6, rtol=0)
    assert [t for g in parts for t in g.texts] == whole.texts
    chunked = HFEngine(model, tok, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, chunk=6)
    assert torch.equal(chunked.generate(PROMPTS, n=6, seed=4).completion_ids, whole.completion_ids)
    shifted = engine.generate(PROMPTS[1:3], n=6, seed=4, first=0)
    assert not torch.equal(shifted.completion_ids, parts[1].completion_ids)
    assert prompt_seed(4, 1) != prompt_seed(4, 0)


def test_a_decoder_reuses_its_buffers_for_calls_of_its_shape_and_counts_its_cache():
    """A second call of the same shape (rows, prompts padded to 16 columns, new tokens) reuses the buffers, a third
    of another shape gets new ones, and each equals a fresh decoder's result (a call does not depend on the calls
    before it: resume stays exact). The cache holds rows x (prompt + new - 1, rounded up to the width multiple 16)
    x layers x 2 x kv_heads x head_dim x bytes."""
    tok = build_tokenizer()
    model = lively_qwen2(tok)  # 2 layers, 2 KV heads of 16
    kw = dict(max_new_tokens=10, sampling=Sampling(0.9), stop_ids=(2,), pad_id=0)
    dec = Decoder(model, OPTIONS[1])
    calls = [(GREEDY_PROMPTS, 4), (GREEDY_PROMPTS[4:], 8), (GREEDY_PROMPTS[:3], 5)]
    caches = []
    for prompts, n in calls:
        enc = tok(prompts, return_tensors="pt", padding=True)
        args = (enc["input_ids"], enc["attention_mask"])
        got = dec(*args, n=n, seeds=torch.arange(len(prompts)), **kw)
        fresh = Decoder(model, OPTIONS[1])(*args, n=n, seeds=torch.arange(len(prompts)), **kw)
        assert torch.equal(got[0], fresh[0]) and torch.equal(got[1], fresh[1])
        caches.append(dec.cache)
        p = -(-enc["input_ids"].shape[1] // 16) * 16
        assert dec.kv_bytes == len(prompts) * n * -(-(p + 10 - 1) // 16) * 16 * 2 * 2 * 2 * 16 * 4
    assert caches[0] is caches[1] and caches[2] is not caches[1]


def test_the_fused_draw_falls_back_to_the_eager_function_when_compiling_fails(caplog):
    """On CUDA the race goes through ``torch.compile``; a compiler that fails (here one that raises as a missing
    C compiler would) leaves the eager function, the same draws, with one warning."""
    from tasks.generation.sampling import _FusedDraw, noise_constants, race_draw

    def broken(*args):
        raise RuntimeError("no C compiler found\nmore")

    fused = _FusedDraw(attempt=True)
    fused.fn = broken
    keys, c = keys_for(4), noise_constants("cpu")
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING"):
        for _ in range(2):
            got, want = fused(x, keys, 0.8, c), race_draw(x, keys, 0.8, c)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not fused.compiled and sum("no C compiler found" in r.message for r in caplog.records) == 1


def test_attention_reads_only_the_used_width_in_steps_of_the_multiple(policy):
    """With ``width_multiple`` w the step at t attends over the first ``P + t`` columns rounded up to w (the mask and
    the keys alike), growing with t: 16 (the GPU's layout in steps of 16), 1 (the CPU's default: the written columns
    only); the whole width every step without it."""
    model, tok = policy
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert DecodeOptions.for_device("cpu").width_multiple == 1
    for options in (OPTIONS[1], OPTIONS[0], DecodeOptions(graphs=False, exact_rows=False, check_every=3,
                                                          prompt_multiple=16)):
        p = -(-enc["input_ids"].shape[1] // options.prompt_multiple) * options.prompt_multiple
        widths: list[tuple[int, int]] = []

        def hook(_m, _a, kw, widths=widths):
            if kw["hidden_states"].shape[1] == 1:  # decode steps, not the prefill
                widths.append((kw["attention_mask"].shape[-1], kw["past_key_values"].update.__self__.width))

        handle = model.model.layers[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        dec = Decoder(model, options)
        try:
            dec(enc["input_ids"], enc["attention_mask"], n=2, max_new_tokens=40, sampling=None, stop_ids=(),
                pad_id=tok.pad_token_id)
        finally:
            handle.remove()
        full, w = dec.cache.length, options.width_multiple
        assert len(widths) == 39
        if w is None:
            assert full == p + 39 and all(x == (full, full) for x in widths)
        else:
            want = [min(full, -(-(p + t) // w) * w) for t in range(1, 40)]
            assert full == -(-(p + 39) // w) * w and [x for x, _ in widths] == want
            assert [c for _, c in widths] == want and want[0] < full
