"""The update's forward pass: length buckets, selective log-softmax, bucketed log-probs against slow oracles; the
contiguous mask-free layout against the generation layout, and what attention receives."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.angle import online_angle_signal
from tasks.generation.rollout import HFEngine
from tasks.model.forward import (
    capture_mlp_input,
    contiguous_rows,
    least_padding_buckets,
    length_buckets,
    pack,
    prompt_batches,
    right_pad,
    selective_log_softmax,
    token_logprobs,
)
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.model.logprob_head import CompletionIndex
from tasks.update.policy_update import gradient_checkpointing

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


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=9), st.integers(1, 80))
def test_least_padding_buckets_are_the_fewest_padded_tokens_in_the_greedy_cuts_passes(lens, budget):
    """Against a loop over every cut of the length-ordered rows: as many passes as the greedy cut at most, each
    within the budget (a lone row may exceed it), the fewest padded tokens of all such cuts, never more than the
    greedy's."""
    import itertools

    p, c = torch.tensor([a for a, _ in lens]), torch.tensor([b for _, b in lens])
    greedy, best = length_buckets(p, c, budget), least_padding_buckets(p, c, budget)
    width = (p + c).tolist()

    def padded(bucket):
        return len(bucket) * max(width[i] for i in bucket)

    order = torch.cat(greedy).tolist()
    assert torch.cat(best).tolist() == order, "the same rows in the same length order"
    assert len(best) <= len(greedy) and all(len(b) == 1 or padded(b.tolist()) <= budget for b in best)
    n, oracle = len(order), None
    for k in range(len(greedy)):
        for cut in itertools.combinations(range(1, n), k):
            parts = [order[i:j] for i, j in zip((0, *cut), (*cut, n), strict=True)]
            if all(len(b) == 1 or padded(b) <= budget for b in parts):
                total = sum(padded(b) for b in parts)
                oracle = total if oracle is None else min(oracle, total)
    got = sum(padded(b.tolist()) for b in best)
    assert got == oracle <= sum(padded(b.tolist()) for b in greedy)


def test_least_padding_buckets_by_hand():
    """Rows of 10, 9, 8, 3 and 2 tokens. At 40 a pass the greedy cut fills the first pass, [10, 9, 8, 3] (4 x 10) and
    [2], 42 padded tokens; the least padding cut in two passes is [10, 9, 8] (30) and [3, 2] (6), 36. At 30 a pass
    the greedy cut is already that one."""
    p, c = torch.tensor([1, 1, 1, 1, 1]), torch.tensor([9, 8, 7, 2, 1])
    assert [b.tolist() for b in least_padding_buckets(p, c, 30)] == [[0, 1, 2], [3, 4]]
    assert [b.tolist() for b in length_buckets(p, c, 40)] == [[0, 1, 2, 3], [4]]
    assert [b.tolist() for b in least_padding_buckets(p, c, 40)] == [[0, 1, 2], [3, 4]]
    assert [b.tolist() for b in least_padding_buckets(p, c, 0)] == [[0, 1, 2, 3, 4]], "0: one pass"


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


# ------------------------------------------------------- contiguous rows without an attention mask (the update's)
def test_contiguous_rows_and_completion_index_by_hand():
    prompts = [torch.tensor([5, 6]), torch.tensor([7])]
    comp = torch.tensor([[8, 9, PAD], [10, PAD, PAD]])
    mask = comp != PAD
    rows = contiguous_rows(prompts, comp, mask, PAD)
    assert rows.input_ids.tolist() == [[5, 6, 8, 9], [7, 10, PAD, PAD]]
    assert rows.lengths.tolist() == [4, 2] and rows.prompt_lens.tolist() == [2, 1]
    assert rows.mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    index = CompletionIndex.of(rows.prompt_lens, rows.input_ids.shape[1], comp, mask)
    # token 8 (row 0, column 0) is predicted by the state at position 1 (the prompt's last token), 9 by 2's, 10 by 0's
    assert index.rows.tolist() == [0, 0, 1] and index.columns.tolist() == [0, 1, 0]
    assert index.positions.tolist() == [1, 2, 0] and index.targets.tolist() == [8, 9, 10]
    assert index.keep == 4  # row 1's prompt is one token: every position is needed
    assert index.hidden(torch.arange(8).reshape(2, 4)).tolist() == [1, 2, 4]  # (row, position) of a [2, 4] grid
    # prompts of 2 and 3 tokens (rows of 4 and 4): no completion token is predicted by position 0, so the head keeps
    # the last 3 positions of 4
    two_rows = contiguous_rows([torch.tensor([5, 6]), torch.tensor([5, 6, 7])], comp, mask, PAD)
    two = CompletionIndex.of(two_rows.prompt_lens, two_rows.input_ids.shape[1], comp, mask)
    assert two.width == 4 and two.positions.tolist() == [1, 2, 2] and two.keep == 3
    assert two.hidden(torch.arange(6).reshape(2, 3)).tolist() == [0, 1, 4]  # kept column = position - 1
    assert index.scatter(torch.tensor([1.0, 2.0, 3.0]), 3).tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]


def test_contiguous_rows_reject_holes_and_empty_prompts():
    comp = torch.tensor([[8, 9]])
    with pytest.raises(ValueError, match=r"rows \[0\] have masked tokens before real ones"):
        contiguous_rows([torch.tensor([5])], comp, torch.tensor([[False, True]]), PAD)
    with pytest.raises(ValueError, match=r"prompts \[0\] are empty"):
        contiguous_rows([torch.tensor([], dtype=torch.long)], comp, torch.tensor([[True, True]]), PAD)


def _generation_layout_logprobs(model, prompts, comp, mask, temperature=1.0):
    """The oracle: the generation layout (:func:`pack`: left-padded prompts, an explicit attention mask, positions
    its cumulative sum) and the full logits' log-softmax at every completion column."""
    ids, am, pos, width = pack(prompts, comp, mask, PAD)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, width - 1:-1]
    return selective_log_softmax(logits, comp, temperature) * mask


def _grads(model, fn, weights):
    model.zero_grad()
    lp = fn(model)
    (lp * weights).sum().backward()
    return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("budget", [0, 60])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_contiguous_rows_equal_the_generation_layout_float32(budget, checkpointing):
    """Log-probs and gradients of the mask-free contiguous layout equal the left-padded masked layout's (float32
    rounding), with and without micro-batching (budget 60: several passes) and activation checkpointing."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    gradient_checkpointing(model, checkpointing)
    model.train()
    prompts, comp, mask = _batch(14, 3)
    weights = torch.randn(comp.shape, generator=torch.Generator().manual_seed(1))
    layer_calls = [0]
    model.model.layers[0].self_attn.register_forward_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))
    got_lp, got_g = _grads(model, lambda m: token_logprobs(m, prompts, comp, mask, PAD, 0.8, max_tokens=budget),
                           weights)
    passes = len(length_buckets(torch.tensor([len(p) for p in prompts]), mask.sum(-1), budget))
    assert passes == 1 if budget == 0 else passes >= 3
    assert layer_calls[0] == passes * (2 if checkpointing else 1)  # the recompute ran in the backward pass
    want_lp, want_g = _grads(model, lambda m: _generation_layout_logprobs(m, prompts, comp, mask, 0.8), weights)
    assert float(want_g.abs().max()) > 1e-3  # not vacuous
    torch.testing.assert_close(got_lp, want_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_g, want_g, atol=1e-6, rtol=1e-4)


def _qwen2(seed: int = 0):
    """A tiny Qwen2 with grouped-query attention (4 query heads over 2 key/value heads), as Qwen2.5's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sdpa_gets_no_mask_and_is_causal_forward_recompute_and_backward(arch, monkeypatch):
    """Every attention call of the update's passes (forward and the recompute under checkpointing) reaches
    ``scaled_dot_product_attention`` with ``attn_mask=None, is_causal=True``: no mask tensor, so no fully masked
    query row and none of pytorch#196678's trigger; with a mask it would be the generation layout's oracle."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0) if arch == "llama" else _qwen2()
    assert model.config._attn_implementation == "sdpa"
    gradient_checkpointing(model, True)
    model.train()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    prompts, comp, mask = _batch(9, 4)
    lp = token_logprobs(model, prompts, comp, mask, PAD, max_tokens=70)
    passes = len(length_buckets(torch.tensor([len(p) for p in prompts]), mask.sum(-1), 70))
    assert len(calls) == 2 * passes  # two layers a pass
    lp.sum().backward()
    assert len(calls) == 4 * passes  # and their recompute
    assert set(calls) == {(True, True)}
    calls.clear()  # the spy sees a mask when there is one: the generation layout's passes have it
    with torch.no_grad():
        _generation_layout_logprobs(model, prompts, comp, mask)
    assert set(calls) == {(False, False)}


def test_prompt_batches_without_a_mask_equal_the_left_padded_pass(monkeypatch):
    """Scoring's pass (right-padded, no mask): embeddings and angle scores as the left-padded masked pass's."""
    from rlcore.angle import angle_concentration

    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0).eval()
    texts = ["Q: 1+2\n", "Q: 12*34-5+678\n", "Q: 9\n", "Q: 7-3*2\n"]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, is_causal=False, **kw: calls.append((attn_mask is None, is_causal))
                        or sdpa(*a, attn_mask=attn_mask, is_causal=is_causal, **kw))
    got = list(prompt_batches(model, tok, texts, batch_size=3))
    assert len(got) == 2 and set(calls) == {(True, True)}
    enc = tok(texts, return_tensors="pt", padding=True)  # left-padded (the tokenizer's side), with a mask
    assert tok.padding_side == "left" and not enc["attention_mask"].all()
    am = enc["attention_mask"]
    with torch.no_grad(), capture_mlp_input(model) as box:
        out = model(input_ids=enc["input_ids"], attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                    output_hidden_states=True)
    m = am.unsqueeze(-1).float()
    emb = (out.hidden_states[-1] * m).sum(1) / m.sum(1)
    torch.testing.assert_close(torch.cat([e for e, _, _ in got]), emb, atol=1e-5, rtol=0)
    want = angle_concentration(box[0].float(), am.bool(), 1, 1, inter_weight=1.0).score
    score = torch.cat([angle_concentration(h, mk, 1, 1, inter_weight=1.0).score for _, h, mk in got])
    torch.testing.assert_close(score, want, atol=1e-5, rtol=0)
    assert all(mk[:, 0].all() for _, _, mk in got)  # right padding: each row's real tokens first


def test_the_head_sees_only_real_completion_tokens_and_an_empty_pass_keeps_its_graph():
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    prompts, comp, mask = _batch(11, 5)
    rows_seen = []
    model.lm_head.register_forward_hook(lambda _m, args, _o: rows_seen.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        token_logprobs(model, prompts, comp, mask, PAD)
    assert rows_seen == [int(mask.sum())]  # one chunk of exactly the real completion tokens, no padding column
    none = torch.zeros_like(mask)
    lp = token_logprobs(model, prompts[:3], comp[:3], none[:3], PAD)
    assert lp.shape == (3, 15) and not lp.any()
    lp.sum().backward()  # a pass with nothing to score still has a graph (the update backs every pass up)
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()
