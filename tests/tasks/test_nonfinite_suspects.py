"""Suspects for the update's non-finite gradient at the real shape (docs/performance.md, "On a GPU: what one H200
measured"), each a CPU test that fails if the suspect were real: the additive mask's ``finfo.min`` in bf16 scores, the
recompute under activation checkpointing, the chunked LM head at Qwen2.5's 151,936 vocabulary, bf16 gradient
accumulation over 61 micro-batches. The first suspect, cuDNN's SDPA backward with a mask (pytorch#196678), has no CPU
kernel: the layout that avoids its trigger and the guard are tested in tests/tasks/test_forward.py and
test_attention.py."""

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tasks.model.logprob_head as head
from tasks.model.forward import pack, token_logprobs
from tasks.model.loading import build_tiny_model
from tasks.update.policy_update import gradient_checkpointing

PAD = 0
BF16 = torch.bfloat16


def _batch(n_rows: int, seed: int, vocab: int = 90, longest_prompt: int = 12, width: int = 15):
    """Prompts of 3..``longest_prompt`` tokens, completions of 1..``width`` real tokens right-padded to ``width``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (int(torch.randint(3, longest_prompt + 1, (1,), generator=g)),), generator=g)
               for _ in range(n_rows)]
    lens = torch.randint(1, width + 1, (n_rows,), generator=g)
    mask = torch.arange(width) < lens.unsqueeze(1)
    comp = torch.randint(4, vocab, (n_rows, width), generator=g)
    return prompts, torch.where(mask, comp, torch.full_like(comp, PAD)), mask


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


# ------------------------------------------------------------ the additive mask's finfo.min in bf16 attention scores
def test_a_fully_masked_row_with_finfo_min_in_bf16_scores_stays_finite():
    """Left-padded rows give query rows that see no key; eager attention adds ``finfo(bf16).min`` to their scores,
    so their log-sum-exp is about -3.4e38, far below -88.7 (the cuDNN trigger's bound), and ``min + score`` could
    round to -inf for huge scores. With scores beyond +-1e3 (a massive-activation head), the eager formula (bf16 scores
    plus the additive mask, float32 softmax, as transformers' ``eager_attention_forward``) and SDPA's math kernel
    (additive and boolean masks) give finite outputs and gradients on every row."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 2, 64, 32
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(BF16) for _ in range(3))
    q = q * 400  # scaled scores beyond 1e3: a massive-activation head
    pads = 8  # the first 8 query rows of row 0 see no key at all (left padding)
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    allowed[0, :, :, :pads] = False
    additive = torch.zeros(b, 1, s, s, dtype=BF16).masked_fill(~allowed, torch.finfo(BF16).min)

    def eager(q_, k_, v_):
        scores = q_ @ k_.transpose(-1, -2) * d**-0.5 + additive  # bf16, as the eager path adds it
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(BF16) @ v_, scores

    qs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, scores = eager(*qs)
    lse = torch.logsumexp(scores.detach()[0, :, :pads].float(), dim=-1)
    assert float(scores.detach().float().abs().max()) > 3e38 and float(lse.max()) < -1e38  # the trigger's regime
    assert float((q @ k.transpose(-1, -2)).float().abs().max()) * d**-0.5 > 1e3  # and huge real scores
    out.float().square().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in qs)
    for mask in (additive, allowed):
        qs = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(*qs, attn_mask=mask)
        out.float().square().sum().backward()
        assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in qs), mask.dtype


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_left_padded_layout_in_bf16_has_finite_logits_and_gradients(implementation):
    """The generation layout (left pads, explicit mask) through a bf16 model whose first layer's queries are scaled
    by 50 (huge scores): logits at every position, pads included, and every gradient are finite, in transformers'
    eager attention and in SDPA's math kernel."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0).to(BF16)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(50)
    prompts, comp, mask = _batch(6, 0)
    ids, am, pos, _ = pack(prompts, comp, mask, PAD)
    assert not am[:, 0].all()  # some rows start with pads: fully masked query rows
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
        (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    assert torch.isfinite(logits).all()
    grads = _grads(model)
    assert torch.isfinite(grads).all() and float(grads.abs().max()) > 0


# ------------------------------------------------------------------------- the recompute under activation checkpointing
def test_the_recompute_under_checkpointing_gives_the_same_logprobs_and_gradients_in_bf16():
    """bf16, several micro-batches: with checkpointing the layers run again in the backward pass and give the same
    log-probs and gradients (CPU kernels are deterministic: equal to the bit)."""
    prompts, comp, mask = _batch(10, 1)
    out = []
    for checkpointing in (False, True):
        model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0).to(BF16)
        gradient_checkpointing(model, checkpointing)
        model.train()
        calls = [0]
        model.model.layers[1].self_attn.register_forward_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        lp = token_logprobs(model, prompts, comp, mask, PAD, max_tokens=80)
        forward_calls = calls[0]
        (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
        assert calls[0] == forward_calls * (2 if checkpointing else 1)  # the recompute ran
        out.append((lp.detach(), _grads(model)))
    assert torch.isfinite(out[1][1]).all()
    torch.testing.assert_close(out[1][0], out[0][0], atol=0, rtol=0)
    torch.testing.assert_close(out[1][1], out[0][1], atol=0, rtol=0)


# --------------------------------------------------------------------------- the chunked head at a 151,936 vocabulary
def test_the_chunked_head_at_qwen_vocabulary_matches_the_full_log_softmax_in_bf16(monkeypatch):
    """Qwen2.5's vocabulary (151,936) with bf16 weights, chunks of 4 tokens (several, recomputed in the backward):
    finite log-probs equal to the full logits' float32 log-softmax within 1e-4, and gradients within 1 % (relative
    L2; bf16 weight gradients of the same sums taken in another order)."""
    vocab = 151_936
    model = build_tiny_model(hidden=64, layers=1, heads=2, seed=0, vocab_size=vocab).to(BF16)
    prompts, comp, mask = _batch(3, 2, vocab=vocab, longest_prompt=5, width=5)
    weights = torch.linspace(-1, 1, comp.numel()).reshape(comp.shape)
    monkeypatch.setattr(head, "HEAD_CHUNK_ELEMENTS", 4 * vocab)
    head_rows = []
    model.lm_head.register_forward_hook(lambda _m, args, _o: head_rows.append(args[0].shape[0]))
    lp = token_logprobs(model, prompts, comp, mask, PAD)
    (lp * weights).sum().backward()
    assert max(head_rows) == 4 and sum(head_rows) == 2 * int(mask.sum())  # chunks of 4, each run twice
    got = _grads(model)
    model.zero_grad()
    rows = []
    for i, p in enumerate(prompts):  # the oracle: each row's full [L, V] logits, log-softmax over the vocabulary
        logits = model(input_ids=torch.cat([p, comp[i]]).unsqueeze(0)).logits[0, p.numel() - 1:-1]
        rows.append(torch.log_softmax(logits.float(), -1).gather(-1, comp[i].unsqueeze(-1)).squeeze(-1))
    want = torch.stack(rows) * mask
    (want * weights).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(got).all()
    assert float(lp.detach()[mask].min()) < -11  # log(151,936) = 11.9: a near-uniform random model
    torch.testing.assert_close(lp.detach(), want.detach(), atol=1e-4, rtol=0)
    want_g = _grads(model)
    assert float((got - want_g).norm() / want_g.norm()) < 1e-2


# ---------------------------------------------------------------- bf16 gradient accumulation over 61 micro-batches
def test_bf16_gradient_accumulation_over_61_micro_batches_stays_finite_and_close():
    """The real shape's 61 micro-batches, one row each here: bf16 gradients accumulated in the bf16 ``.grad`` (as
    the update does before the float32 masters take them) are finite and within 3 % (relative L2) of the float32
    one-pass gradient of the same weights. bf16's unit roundoff is 2^-8 = 0.39 %: the bf16 passes alone are about
    0.6 % off, and 61 rounded additions a random walk of about sqrt(61) x 0.39 % / 2 = 1.5 % at most (1.1 %
    measured). A lost micro-batch (1/61 of the gradient) or one swamped by the sum would be off by more."""
    prompts, comp, mask = _batch(61, 3, longest_prompt=6, width=6)
    adv = torch.randn(61, generator=torch.Generator().manual_seed(4))
    bf16 = build_tiny_model(hidden=64, layers=1, heads=2, seed=0).to(BF16)
    fp32 = copy.deepcopy(bf16).float()  # the same (bf16-representable) weights

    def loss(model, rows):  # the token-mean loss's share of these rows
        lp = token_logprobs(model, [prompts[i] for i in rows], comp[rows], mask[rows], PAD)
        return -(lp * adv[rows, None]).sum() / mask.sum()

    loss(fp32, torch.arange(61)).backward()
    want = _grads(fp32)
    for i in range(61):
        loss(bf16, torch.tensor([i])).backward()
    got = _grads(bf16)
    assert torch.isfinite(got).all()
    rel = float((got - want).norm() / want.norm())
    assert rel < 3e-2, f"accumulated bf16 gradient {rel:.2%} off the float32 one"
    one = build_tiny_model(hidden=64, layers=1, heads=2, seed=0).to(BF16)  # a lost micro-batch is visible:
    for i in range(60):
        loss(one, torch.tensor([i])).backward()
    assert float((_grads(one) - want).norm() / want.norm()) > rel
