"""The memory check before training (tasks/update/memory_check.py): hand-worked estimates, and a run that would not fit
stops with what to lower."""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import tasks.update.memory_check as fit
from tasks.config.load import validate
from tasks.model.loading import build_tiny_model
from tasks.update.backend import build_updater
from tasks.update.memory_check import GIB, DoesNotFit, GenerationMemory, ModelShape, check_update_fits, estimate
from tasks.update.precision import Precision
from tests.policies import policy_of

#: Qwen2.5-1.5B's shape (its config.json): hidden 1536, MLP 8960, 12 heads and 2 key-value heads of 128, 28 layers,
#: tied embeddings of a 151,936-token vocabulary (the counts: ModelShape.of on the model built on the meta device).
QWEN_1_5B = ModelShape(params=1_543_714_304, trainable=1_543_714_304, hidden=1536, intermediate=8960, heads=12,
                       kv_heads=2, head_dim=128, layers=28, vocab=151_936, largest=233_373_696, root=233_375_232)
BF16_TRUE = Precision("bf16-true", torch.bfloat16, torch.bfloat16)
MIXED = Precision("bf16-mixed", torch.bfloat16, torch.float32)
SMALL = ModelShape(params=1000, trainable=100, hidden=8, intermediate=32, heads=2, kv_heads=1, head_dim=4, layers=3,
                   vocab=50, largest=400, root=400)


def test_the_shape_of_a_model():
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151_936)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    assert ModelShape.of(model, cfg) == QWEN_1_5B


def test_the_shape_says_whether_the_head_and_the_embedding_are_trained():
    from tasks.config import LoraConfig
    from tasks.model.lora import apply_lora

    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)  # tied embeddings
    full = ModelShape.of(model, model.config)
    assert full.head_trained and full.embedding_trained
    lora = ModelShape.of(apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0), seed=0), model.config)
    assert not lora.head_trained and not lora.embedding_trained and lora.trainable < lora.params
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False, vocab_size=100)
    untied = Qwen2ForCausalLM(cfg)
    untied.model.embed_tokens.weight.requires_grad_(False)
    shape = ModelShape.of(untied, cfg)
    assert shape.head_trained and not shape.embedding_trained


def test_estimate_by_hand():
    s = SMALL
    # a layer keeps 2 norms x (4*8 + 2*2*8) = 128, q/out/o_proj input + k, v repeated 2 * (3*8 + 2*8) = 80, the
    # log-sum-exp 4 * 2 = 8, the mask's bias 2 * 16 (10 columns padded to 16) = 32, the MLP 4 * 2 * 32 = 256
    assert s.layer_kept(2, padded=True, row_tokens=10) == 504
    assert s.layer_kept(2, padded=False, row_tokens=10) == 504 - 2 * 2 * (8 - 4) - 32  # k, v unrepeated, no mask
    assert s.layer_backward(2) == 2 * (3 * 32 + 4 * 8 + 2 * 8)
    e = estimate(s, MIXED, tokens=10, checkpointing=False, row_tokens=10, reference_copy=True)
    assert (e.weights, e.master, e.optimizer, e.gradients, e.held_gradients, e.copies) == (2000, 400, 800, 200, 200,
                                                                                           2000)
    assert e.activations == 10 * (3 * 504 + (4 * 8 + 2 * 2 * 8) + 2 * 2 * 4)  # layers, final norm, cos and sin
    assert e.layer == 10 * 288
    assert e.head == 10 * 2 * 8 + 500 * (3 * 4 + 2 * 2) + 4 * 500  # input, one chunk's backward, its kept logits
    assert e.step == 100 * 4 + 100 * (4 - 2) + 400 * 2  # AdamW's buffer, the gradients made float32; a weight
    assert e.step_peak == e.state + 100 * 4 * 2 + 400 * 2  # copied into the policy
    # the head's weight gradient summed in autograd's buffer (one chunk: no other temporary), and the embedding's
    # dense backward buffer at the end of the backward pass: [V, H] in bf16 each, 50 x 8 x 2
    assert e.head_gradient == 800 and e.embedding_gradient == 800
    assert e.backward_peak == 5200 + 200 + e.activations + e.head + 800 + e.layer
    assert e.backward_end_peak == 5200 + 200 + 800
    assert e.total == pytest.approx(fit.MARGIN * e.backward_peak)
    many = dataclasses.replace(s, vocab=2**25)  # 2 tokens a chunk of the head: 5 chunks, the buffer and a temporary
    assert estimate(many, MIXED, tokens=10, checkpointing=False).head_gradient == 2 * 2**25 * 8 * 2
    lora = dataclasses.replace(s, head_trained=False, embedding_trained=False)  # frozen: no gradient of either
    frozen = estimate(lora, MIXED, tokens=10, checkpointing=False)
    assert frozen.head_gradient == frozen.embedding_gradient == 0
    ckpt = estimate(s, MIXED, tokens=10, checkpointing=True, row_tokens=10, accumulating=False, generator_copy=True)
    assert ckpt.activations == 10 * (3 * 2 * 8 + 64 + 16)  # each layer's input
    assert ckpt.layer == 10 * (288 + 504)  # one layer recomputed, with its backward buffers
    assert ckpt.held_gradients == 0 and ckpt.copies == 2000
    zero3 = estimate(s, MIXED, tokens=10, checkpointing=True, backend="deepspeed_zero3", world=4)
    assert (zero3.weights, zero3.master, zero3.optimizer, zero3.gradients) == (500, 100, 200, 50)  # 12 / param / W
    assert zero3.copies == 2000 and zero3.gathered == 2000 and zero3.step == 100 + 2000 + 800
    zero2 = estimate(s, MIXED, tokens=10, checkpointing=True, backend="deepspeed_zero2", world=4)
    assert (zero2.weights, zero2.master, zero2.optimizer, zero2.gradients) == (2000, 100, 200, 50)
    fsdp = estimate(s, MIXED, tokens=10, checkpointing=True, backend="fsdp2", world=4)
    assert (fsdp.weights, fsdp.master, fsdp.optimizer, fsdp.gradients) == (1000, 0, 200, 100)
    assert fsdp.gathered == (2 * 200 + 400) * 2 + 200 * (2 + 4)  # two layers and the root; a layer's gradient
    ddp = estimate(s, MIXED, tokens=10, checkpointing=True, backend="ddp", world=4)
    assert ddp.held_gradients == 2 * 200 and ddp.copies == 2000  # DDP's buckets; rank 0's policy
    gen = estimate(s, MIXED, tokens=10, checkpointing=True,
                   generation=GenerationMemory(rows=6, context=20, overlaps=False))
    assert gen.kv_cache == 6 * (20 * 3 * 2 * 4 * 2 + 4 * 50)
    assert gen.generation_peak == gen.state + gen.kv_cache and gen.backward_peak == ckpt.backward_peak - 2000 + 200


def old_head(shape: ModelShape, rows: int, tokens: int) -> float:
    """The LM head as the H100 table ran it (commit 660fe51; tasks/model/forward.py ``selective_log_softmax``):
    the bf16 logits of every completion token, upcast a row at a time (2^26 elements hold less than one row of
    1,024 x 151,936) and each float32 row kept by ``logsumexp`` for the backward pass (4 V a completion token); in
    the backward pass, one length bucket's bf16 logit gradient [7 x 1,024, V] and one row's float32 chunk and its
    gradient. ``rows`` of 128 + 1,024 tokens, buckets of at most 8,192 padded tokens (7 rows)."""
    v = shape.vocab
    return rows * 1024 * 4 * v + 7 * 1024 * v * 2 + 1024 * v * (4 + 4)


#: One H100 (docs/performance.md, docs/scale-out.md "A GPU check"): random Qwen2.5-1.5B in bf16 with bf16 AdamW
#: state, rows of 128 + 1,024 tokens of equal length, one forward and backward of all the tokens (their length
#: buckets of 8,192 tokens all kept until one backward pass), then AdamW: torch.cuda.max_memory_allocated.
H100_TABLE = [  # tokens, checkpointing, measured peak GiB
    (9_216, False, 42.9),
    (18_432, False, 72.2),
    (18_432, True, 24.3),
    (73_728, True, 57.9),
]


@pytest.mark.parametrize("tokens,checkpointing,measured", H100_TABLE)
def test_the_estimate_is_within_15_percent_of_each_h100_peak(tokens, checkpointing, measured):
    """The table's runs had rows of one length (transformers then passes no mask: no key-value repeat, no bias),
    one backward pass (no gradient held across micro-batches) and the old head (:func:`old_head`); what a layer
    keeps, its recompute and backward buffers (of one bucket of 7 rows, each bucket a forward pass of its own),
    the head weight's gradient buffers (autograd's sum over the buckets and one bucket's [V, H] temporary), the
    embedding's backward buffer, the state and the optimizer step are the estimate's own: 5-8 % above each peak
    (3-7 % before the two [V, H] buffers were counted)."""
    rows, bucket = tokens // 1152, 7 * 1152
    e = estimate(QWEN_1_5B, BF16_TRUE, tokens=tokens, checkpointing=checkpointing, accumulating=False, padded=False)
    layer = bucket * (QWEN_1_5B.layer_backward(2)
                      + (QWEN_1_5B.layer_kept(2, padded=False, row_tokens=1152) if checkpointing else 0))
    then = dataclasses.replace(e, head=old_head(QWEN_1_5B, rows, tokens), layer=layer)
    assert then.total / GIB == pytest.approx(measured, rel=0.15)
    assert then.total / GIB >= measured  # a check that holds: not below what was measured


def test_the_chunked_head_and_mixed_precision_at_the_1_5b_shape():
    """Today's step at the GPU check's target (1.5B, full weights, checkpointing, micro-batches of 8,192 padded
    tokens, bf16-mixed): the chunked head keeps the hidden states, not the [T, V] logits; the state is 16 bytes a
    trained parameter."""
    e = estimate(QWEN_1_5B, MIXED, tokens=8192, checkpointing=True, row_tokens=1152)
    state = QWEN_1_5B.params * MIXED.bytes_per_trained_param() - QWEN_1_5B.trainable * 2  # gradients apart
    assert e.state == state and e.held_gradients == QWEN_1_5B.trainable * 2
    assert e.head < 1.5 * GIB and 25 * GIB < e.total < 40 * GIB


def test_a_micro_batch_that_does_not_fit_stops_with_what_to_lower():
    cfg = validate({"train": {"micro_batch_tokens": 65536}})
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    prec = Precision("fp32", torch.float32, torch.float32)
    small = check_update_fits(validate({"train": {"micro_batch_tokens": 512}}), model, model.config, "cpu",
                              precision=prec, lora=False, budget=1e15).total
    with pytest.raises(DoesNotFit) as err:
        check_update_fits(cfg, model, model.config, "cpu", precision=prec, lora=False, budget=small)
    msg = str(err.value)
    assert "lower train.micro_batch_tokens to 512 or less" in msg and "gradient_checkpointing=true" in msg
    assert "model.lora.enabled=true" in msg
    # the suggestion fits
    assert check_update_fits(validate({"train": {"micro_batch_tokens": 512}}), model, model.config, "cpu",
                             precision=prec, lora=False, budget=small).tokens == 512


def test_the_run_checks_before_training(monkeypatch):
    """build_updater (what the training stage calls first) stops when the device has too little memory."""
    cfg = validate({})
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    monkeypatch.setattr(fit, "available_bytes", lambda device: 1e6)  # a device with 1 MB
    with pytest.raises(DoesNotFit, match="available"):
        build_updater(cfg, policy_of(model), device="cpu")
    monkeypatch.setattr(fit, "available_bytes", lambda device: 64e9)
    assert build_updater(cfg, policy_of(model), device="cpu") is not None


def test_available_bytes_on_this_machine():
    assert fit.available_bytes(torch.device("cpu")) > 1e8


def test_the_fused_adamw_has_no_step_buffer_and_the_decoder_s_graphs_and_long_prompts_count():
    s = SMALL
    foreach = estimate(s, MIXED, tokens=10, checkpointing=True, row_tokens=10)
    fused = estimate(s, MIXED, tokens=10, checkpointing=True, row_tokens=10, fused_adamw=True)
    assert foreach.step - fused.step == 100 * 4  # foreach AdamW's float32 buffer of the trained parameters
    eager = GenerationMemory(rows=4, context=20, overlaps=True)
    graphs = dataclasses.replace(eager, graphs=True)
    assert eager.kv_bytes(s, 2) == 4 * (20 * 3 * 2 * 1 * 4 * 2 + 4 * 50) and eager.graph_pool_bytes(s, 2) == 0
    # each bucket's logits (under 2 x 4 rows x 50 x 2 bytes) and one layer's keys and values repeated to 2 heads
    assert graphs.graph_pool_bytes(s, 2) == 2 * 4 * 50 * 2 + 2 * 4 * (2 * 4) * 20 * 2
    with_graphs = estimate(s, MIXED, tokens=10, checkpointing=True, generation=graphs)
    assert with_graphs.kv_cache == eager.kv_bytes(s, 2) + graphs.graph_pool_bytes(s, 2)


def test_the_run_s_longest_prompt_and_the_device_set_the_generation_counted():
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    cfg = validate({"rollout": {"max_new_tokens": 64, "chunk": 32}, "train": {"micro_batch_tokens": 512}})
    short = check_update_fits(cfg, model, model.config, "cpu", precision=MIXED, lora=False, budget=1e12)
    long = check_update_fits(cfg, model, model.config, "cpu", precision=MIXED, lora=False, budget=1e12,
                             prompt_tokens=1000)
    per_token = 32 * 2 * 2 * model.config.num_key_value_heads * (64 // 2) * 2  # rows, layers, k+v, KV width, bf16
    assert long.kv_cache - short.kv_cache == (1000 - fit.PROMPT_TOKENS) * per_token


def test_the_readmes_table_is_what_the_count_prints():
    """README.md's "what fits" table is infra/fits-table.py's output (the estimate itself), row for row."""
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    table = runpy.run_path(str(root / "infra" / "fits-table.py"), run_name="fits_table")["rows"]()
    readme = (root / "README.md").read_text().splitlines()
    start = readme.index(table[0])
    assert readme[start:start + len(table)] == table
