"""The in-process engine's decode loop drops finished rows and still draws exactly what ``model.generate`` draws."""

import pytest
import torch

from rlcore.seeding import derive_seed
from tasks.model.policy import build_tiny_model, build_tokenizer
from tasks.model.rollout import HFEngine, completion_mask

PROMPTS = ["Q: 1+2=?\n", "Q: 12*34-5=?\n", "Q: 9=?\n", "Q: 40-3*7=?\n"]


def generate_reference(model, tok, prompts, n, seed, greedy, **sampling):
    """The oracle: ``model.generate`` with the settings the engine had before it decoded itself."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(derive_seed(seed, 0))
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, **sampling)
    out = model.generate(**enc, max_new_tokens=12, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, **kw)
    ids = out[:, enc["input_ids"].shape[1]:]
    return torch.where(completion_mask(ids, tok.eos_token_id), ids, torch.full_like(ids, tok.pad_token_id))


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    with torch.no_grad():  # make EOS likely, so rows end at different steps and leave the batch early
        model.lm_head.weight[tok.eos_token_id] *= 3
    return model.eval(), tok


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)])
def test_sampling_matches_generate_token_for_token(policy, temperature, top_k, top_p):
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, chunk=512)
    for seed in range(3):
        gen = engine.generate(PROMPTS, n=6, seed=seed)
        ref = generate_reference(model, tok, PROMPTS, 6, seed, False, temperature=temperature,
                                 top_k=top_k, top_p=top_p)
        lens = gen.completion_mask.sum(1)
        assert lens.min() < lens.max()  # rows did finish at different steps
        assert torch.equal(gen.completion_ids, ref)


def test_greedy_matches_generate(policy):
    model, tok = policy
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, chunk=512)
    gen = engine.generate(PROMPTS, n=1, seed=0, greedy=True)
    assert torch.equal(gen.completion_ids, generate_reference(model, tok, PROMPTS, 1, 0, True))


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
