"""The one-token forward of a CPU decode step (tasks/generation/step_forward.py): transformers' logits bit for bit on
Llama and Qwen2 (biased projections) at any row count, the decode loop's tokens and log-probs unchanged with it, the
model's own forward left to the prefill, and no forward where a part is not the plain one."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tasks.generation.decode import Decoder
from tasks.generation.decode_options import DecodeOptions
from tasks.generation.sampling import Sampling
from tasks.generation.slot_cache import SlotCache
from tasks.generation.step_attention import one_token_attention
from tasks.generation.step_forward import step_forward


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def _qwen2():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def _caches(rows: int, width: int, layers: int, seed: int) -> tuple[SlotCache, SlotCache]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(rows, 2, width, 8, generator=g) for _ in range(layers)]
    values = [torch.randn(rows, 2, width, 8, generator=g) for _ in range(layers)]
    out = []
    for _ in range(2):
        c = SlotCache(rows, width, [k.clone() for k in keys], [v.clone() for v in values])
        c.slot = torch.tensor([width - 3])
        out.append(c)
    return out[0], out[1]


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_the_step_forward_is_the_models_bit_for_bit(build, rows):
    """A step at column S - 3 of a random cache: the same logits as the model's forward under the one-token
    attention, to the bit, and the same keys and values written into the cache."""
    model = build()
    forward = step_forward(model)
    assert forward is not None
    width = 12
    ours, theirs = _caches(rows, width, 2, seed=rows)
    g = torch.Generator().manual_seed(rows + 1)
    tokens = torch.randint(0, 40, (rows, 1), generator=g)
    positions = torch.randint(0, 9, (rows, 1), generator=g)
    mask = torch.zeros(rows, 1, 1, width).masked_fill_(torch.rand(rows, 1, 1, width, generator=g) < 0.3,
                                                        torch.finfo(torch.float32).min)
    mask[..., width - 3] = 0
    with torch.inference_mode(), one_token_attention(model):
        expected = model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=theirs,
                         use_cache=True).logits[:, -1]
        got = forward(tokens, mask, positions, ours)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(ours.keys + ours.values, theirs.keys + theirs.values, strict=True))


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_the_decode_loop_draws_the_same_with_it_and_calls_the_model_only_for_the_prefill(build):
    model = build()
    calls = []
    own = model.forward

    def counted(**kwargs):  # not a hook: a forward hook turns the loop's forward off
        calls.append(kwargs["input_ids"].shape[1])
        return own(**kwargs)

    model.forward = counted
    ids = torch.randint(3, 40, (3, 6), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[0, :2] = 0
    call = {"n": 2, "max_new_tokens": 12, "sampling": Sampling(), "stop_ids": [5], "pad_id": 0,
            "seeds": torch.arange(3)}
    try:
        assert DecodeOptions.for_device("cpu").step_forward
        decoder = Decoder(model)
        ours = decoder(ids, am, **call)
        assert calls == [6]  # the prefill; every step ran the loop's forward
        # a pass for hidden states (the scoring's) installs transformers' output-capturing hooks:
        # idle outside its forward, they do not turn the loop's forward off for the next call
        own(input_ids=ids, output_hidden_states=True)
        assert any(m._forward_hooks for m in model.modules())
        assert torch.equal(decoder(ids, am, **call)[0], ours[0]) and calls == [6, 6]  # prefill only
        theirs = Decoder(model, replace(DecodeOptions.for_device("cpu"), step_forward=False))(ids, am, **call)
    finally:
        del model.forward
    assert len(calls) > 3 and calls[2] == 6 and set(calls[3:]) == {1}  # the model's forward for every step
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_no_step_forward_where_a_part_is_not_the_plain_one():
    """Under LoRA adapters (the projections are not plain linear layers), with a sliding window, for another
    architecture, with a forward hook on a module (it must see every step), or off the CPU: None, and the loop
    calls the model."""
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_llama(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    assert step_forward(lora) is None
    windowed = _llama()
    windowed.model.layers[1].self_attn.sliding_window = 4
    assert step_forward(windowed) is None
    other = _llama()
    other.config.model_type = "gemma"
    assert step_forward(other) is None
    hooked = _llama()
    handle = hooked.lm_head.register_forward_hook(lambda _m, _i, out: out)
    assert step_forward(hooked) is None
    handle.remove()
    assert step_forward(hooked) is not None
    assert DecodeOptions.for_device("cuda").step_forward is False
