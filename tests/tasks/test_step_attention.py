"""The one-token attention of a CPU decode step (tasks/generation/step_attention.py): what a slow loop over rows and
heads computes, SDPA's result to float rounding, used by the decode loop's steps and by nothing else."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tasks.generation.decode import Decoder
from tasks.generation.decode_options import DecodeOptions
from tasks.generation.sampling import Sampling
from tasks.generation.step_attention import NAME, one_token_attention, step_attention


class _Heads(torch.nn.Module):
    """What transformers' attention functions read off the module (GQA groups, causal flag, training)."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = heads // kv_heads, True


def _inputs(rows=5, heads=4, kv_heads=2, width=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, d, generator=g)
    k = torch.randn(rows, kv_heads, width, d, generator=g)
    v = torch.randn(rows, kv_heads, width, d, generator=g)
    allowed = torch.rand(rows, 1, 1, width, generator=g) < 0.7
    allowed[..., 0] = True  # every row attends somewhere
    mask = torch.zeros(rows, 1, 1, width).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return q, k, v, mask, allowed


def test_step_attention_is_the_slow_loop():
    """Each row and query head by hand: softmax over the allowed columns of its key-value head's keys, times its
    values (heads 2h and 2h + 1 share key-value head h); [R, 1, H, D] out."""
    q, k, v, mask, allowed = _inputs()
    out, weights = step_attention(_Heads(4, 2), q, k, v, mask, scaling=0.5)
    assert weights is None and out.shape == (5, 1, 4, 8)
    for r in range(5):
        for h in range(4):
            kv = h // 2
            cols = allowed[r, 0, 0].nonzero().flatten()
            s = torch.tensor([float(q[r, h, 0] @ k[r, kv, j]) * 0.5 for j in cols.tolist()])
            p = torch.softmax(s, 0)
            expected = sum(p[i] * v[r, kv, j] for i, j in enumerate(cols.tolist()))
            torch.testing.assert_close(out[r, 0, h], expected, rtol=1e-5, atol=1e-6)


def test_step_attention_matches_sdpa_and_leaves_other_passes_to_it():
    """One query: SDPA's output to float rounding. Several queries (a prefill, an update's pass): SDPA's function
    itself, bit for bit."""
    q, k, v, mask, _ = _inputs()
    module = _Heads(4, 2)
    ours, _ = step_attention(module, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    q3 = torch.randn(5, 4, 3, 8)
    mask3 = torch.zeros(5, 1, 3, 7)
    assert torch.equal(step_attention(module, q3, k, v, mask3, scaling=0.3)[0],
                       sdpa_attention_forward(module, q3, k, v, mask3, scaling=0.3)[0])


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_the_decode_loop_steps_with_it_and_restores_sdpa(model):
    """Inside a decode call the one-token steps run step_attention (a hook sees the implementation), the prefill
    SDPA's function; after the call, and after a failing block, the model attends with SDPA again. The tokens are
    SDPA's, the log-probs to float rounding."""
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((model.config._attn_implementation, kwargs["hidden_states"].shape[1])),
        with_kwargs=True)
    ids = torch.randint(3, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[0, :2] = 0
    call = {"n": 2, "max_new_tokens": 12, "sampling": Sampling(), "stop_ids": [], "pad_id": 0,
            "seeds": torch.arange(3)}
    try:  # the model's own forward in the steps (tests/tasks/test_step_forward.py: the loop's forward, the same bits)
        ours = Decoder(model, replace(DecodeOptions.for_device("cpu"), step_forward=False))(ids, am, **call)
    finally:
        hook.remove()
    assert seen[0] == (NAME, 6) and all(s == (NAME, 1) for s in seen[1:]) and len(seen) == 12
    assert model.config._attn_implementation == "sdpa"
    sdpa = Decoder(model, replace(DecodeOptions.for_device("cpu"), step_attention=False))
    theirs = sdpa(ids, am, **call)  # the same call under SDPA throughout
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="boom"), one_token_attention(model):
        assert model.config._attn_implementation == NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_other_implementations_are_left_alone(model):
    model.set_attn_implementation("eager")
    try:
        with one_token_attention(model):
            assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
