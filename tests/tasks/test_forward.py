"""The update's forward pass: length buckets, selective log-softmax, bucketed log-probs against slow oracles."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.angle import online_angle_signal
from tasks.generation.rollout import HFEngine
from tasks.model.forward import (
    capture_mlp_input,
    length_buckets,
    pack,
    right_pad,
    selective_log_softmax,
    token_logprobs,
)
from tasks.model.policy import build_tiny_model, build_tokenizer

PAD = 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 40)), min_size=1, max_size=60),
       st.integers(0, 600))
def test_length_buckets_partition_rows_within_budget(lens, budget):
    p = torch.tensor([a for a, _ in lens])
    c = torch.tensor([b for _, b in lens])
    buckets = length_buckets(p, c, budget)
    rows = torch.cat(buckets).tolist()
    assert sorted(rows) == list(range(len(lens)))  # every row exactly once
    if budget == 0:
        assert len(buckets) == 1 and rows == list(range(len(lens)))
        return
    def padded(b):  # contiguous rows: the bucket's longest prompt + completion, times its rows
        return len(b) * int((p[b] + c[b]).max())

    for b in buckets:
        assert len(b) == 1 or padded(b) <= budget  # a lone row may exceed the budget, nothing else does
    # buckets are cut greedily: the first row of the next bucket would have broken the budget
    for b, nxt in zip(buckets, buckets[1:], strict=False):
        assert padded(torch.cat([b, nxt[:1]])) > budget


def test_length_buckets_by_hand():
    p = torch.tensor([2, 2, 2, 2])
    c = torch.tensor([1, 8, 2, 7])
    # longest completions first: rows 1 (8), 3 (7), 2 (2), 0 (1); budget 20: [1, 3] pads to 2 x 10 = 20,
    # adding row 2 would be 3 x 10 = 30; then [2, 0] pads to 2 x 4 = 8
    assert [b.tolist() for b in length_buckets(p, c, 20)] == [[1, 3], [2, 0]]
    # a long prompt with a short completion and the reverse pad to their longest sum, not the sum of the longest:
    # rows of 9 + 1, 1 + 9 and 5 + 5 are 3 x 10 = 30 tokens (not 3 x 18); ties by completion length, longest first
    p, c = torch.tensor([9, 1, 5]), torch.tensor([1, 9, 5])
    assert [b.tolist() for b in length_buckets(p, c, 30)] == [[1, 2, 0]]
    assert [b.tolist() for b in length_buckets(p, c, 29)] == [[1, 2], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_matches_log_softmax_in_chunks(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 5, 11, generator=g) * 3).to(dtype)
    index = torch.randint(0, 11, (7, 5), generator=g)
    oracle = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    for max_elements in (1, 55, 2 * 55, 1 << 26):  # one row per chunk, exactly a row, two rows, everything
        out = selective_log_softmax(logits, index, temperature, max_elements=max_elements)
        assert out.dtype == torch.float32 and out.shape == (7, 5)
        torch.testing.assert_close(out, oracle, atol=1e-5, rtol=0)  # |log-prob| up to ~20: float32 ulps


def _batch(n_rows: int, seed: int):
    """Rows with prompts of 3..12 tokens and completions of 0..15 real tokens, right-padded to 15."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g)
               for _ in range(n_rows)]
    lens = torch.randint(0, 16, (n_rows,), generator=g)
    comp = torch.randint(4, 90, (n_rows, 15), generator=g)
    mask = torch.arange(15) < lens.unsqueeze(1)
    return prompts, torch.where(mask, comp, torch.full_like(comp, PAD)), mask


def _oracle(model, prompts, comp, mask, temperature):
    """Slow loop: each row alone, unpadded, full-vocabulary log-softmax."""
    out = torch.zeros(comp.shape, dtype=torch.float64)
    for i, p in enumerate(prompts):
        c = comp[i, mask[i]]
        ids = torch.cat([p, c]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, len(p) - 1:-1].double() / temperature
        out[i, :len(c)] = torch.log_softmax(logits, -1).gather(-1, c.unsqueeze(-1)).squeeze(-1)
    return out


@pytest.mark.parametrize("budget", [0, 1, 60, 200, 10_000])
def test_bucketed_logprobs_equal_the_unpadded_oracle_float64(budget):
    """In float64 the bucketing changes nothing but rounding (1e-10); every budget matches the slow loop."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0).double().eval()
    prompts, comp, mask = _batch(13, 0)
    with torch.no_grad():
        lp = token_logprobs(model, prompts, comp, mask, PAD, temperature=0.8, max_tokens=budget)
        oracle = _oracle(model, prompts, comp, mask, 0.8)
    assert lp.shape == comp.shape
    torch.testing.assert_close(lp.double(), oracle, atol=1e-6, rtol=0)  # lp is float32 by contract
    with torch.no_grad():
        one = token_logprobs(model, prompts, comp, mask, PAD, temperature=0.8, max_tokens=0)
    torch.testing.assert_close(lp, one, atol=1e-10, rtol=0)


def test_bucketed_logprobs_float32_and_gradient_match_one_pass():
    """The update's case: float32 with grad; log-probs within 1e-5, gradients within float rounding."""
    prompts, comp, mask = _batch(24, 1)
    grads = []
    for budget in (0, 150):
        model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
        lp = token_logprobs(model, prompts, comp, mask, PAD, max_tokens=budget)
        (lp.sum() / mask.sum()).backward()
        grads.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert len(length_buckets(torch.tensor([len(p) for p in prompts]), mask.sum(-1), 150)) > 2
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-4)


def test_bucketed_mlp_inputs_give_the_one_pass_angle_signal():
    """GAIN-RL's online angle (per bucket, from the hook) equals the angle of one unbucketed forward pass."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0).double().eval()
    prompts, comp, mask = _batch(10, 2)
    hidden: list = []
    with torch.no_grad():
        token_logprobs(model, prompts, comp, mask, PAD, max_tokens=80, mlp_inputs=hidden)
        ids, am, pos, _ = pack(prompts, comp, mask, PAD)
        with capture_mlp_input(model) as box:
            model(input_ids=ids, attention_mask=am, position_ids=pos)
    assert len(hidden) > 1
    bucketed = sum(float(online_angle_signal(h, m).sum()) for h, m in hidden)
    one = float(online_angle_signal(box[0].float(), am.bool()).sum())
    assert bucketed == pytest.approx(one, rel=1e-5)


def test_engine_tokenizes_once_and_keeps_each_prompt_unpadded():
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    engine = HFEngine(model, tok, max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, chunk=4)
    prompts = ["Q: 1+2\n", "Q: 12*34-5\n", "Q: 9\n"]
    gen = engine.generate(prompts, n=2, seed=0)  # chunk 4 / n 2: two calls, the second one prompt alone
    for text, ids in zip(prompts, gen.prompt_ids, strict=True):
        assert ids.tolist() == tok(text)["input_ids"]
    assert gen.completion_ids.shape[0] == 6


def test_right_pad_by_hand():
    ids, mask = right_pad([[5, 6, 7], [], [8]], pad_id=PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, PAD], [8, PAD, PAD]] and ids.dtype == torch.long
    assert mask.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    empty, none = right_pad([[], []], pad_id=PAD)
    assert empty.shape == none.shape == (2, 0)
