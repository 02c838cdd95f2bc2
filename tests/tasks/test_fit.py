"""The memory check before training (tasks/update/fit.py): hand-worked estimates, and a run that would not fit
stops with what to lower."""

import pytest
import torch

import tasks.update.fit as fit
from tasks.config_load import validate
from tasks.model.policy import build_tiny_model
from tasks.update.backend import build_updater
from tasks.update.fit import DoesNotFit, ModelShape, check_update_fits, estimate
from tests.policies import policy_of

#: Qwen2.5-1.5B's shape (its config.json): hidden 1536, MLP 8960, 2 key-value heads of 128, 28 layers, bf16.
QWEN_1_5B = ModelShape(params=1_543_714_304, trainable=1_543_714_304, dtype_bytes=2, hidden=1536, intermediate=8960,
                       kv_width=256, layers=28, vocab=151_936)


def test_estimate_by_hand():
    s = ModelShape(params=1000, trainable=100, dtype_bytes=2, hidden=8, intermediate=32, kv_width=4, layers=3,
                   vocab=50)
    # one layer keeps 2 * (6*8 + 4*4 + 4*32) + 4 * 2 * 8 = 2 * 192 + 64 = 448 bytes a token
    assert s.layer_bytes_per_token() == 448
    e = estimate(s, tokens=10, checkpointing=False, reference_copy=True, generator_copy=False)
    assert (e.weights, e.gradients, e.optimizer, e.copies) == (2000, 200, 400, 2000)
    assert e.activations == 10 * (3 * 448 + 2 * 8)  # every layer, and the head's input
    assert e.head == 3 * 4 * 10 * 50  # the logits fit one chunk
    ckpt = estimate(s, tokens=10, checkpointing=True, reference_copy=False, generator_copy=True)
    assert ckpt.activations == 10 * (3 * 2 * 8 + 448 + 2 * 8)  # each layer's input, one layer recomputed
    assert ckpt.copies == 2000 and e.total == pytest.approx(fit.MARGIN * (4600 + e.activations + e.head))
    zero3 = estimate(s, tokens=10, checkpointing=True, reference_copy=False, generator_copy=False,
                     backend="deepspeed_zero3", world=4)
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (500, 50, 100)


def test_the_1_5b_shape_per_token_matches_the_h100_measurement():
    """Per token on the H100 (issue figures, full logits): 3.4 MB without checkpointing, 0.65 MB with; the
    [T, V] logits then held about 0.45 MB of it, which the chunked head removes."""
    per_token = {ckpt: estimate(QWEN_1_5B, tokens=1, checkpointing=ckpt, reference_copy=False,
                                generator_copy=False).activations for ckpt in (False, True)}
    assert 2.6e6 < per_token[False] < 3.2e6
    assert 0.15e6 < per_token[True] < 0.3e6


def test_a_micro_batch_that_does_not_fit_stops_with_what_to_lower():
    cfg = validate({"train": {"micro_batch_tokens": 65536}})
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    small = estimate(ModelShape.of(model, model.config), tokens=512, checkpointing=False, reference_copy=False,
                     generator_copy=True).total
    with pytest.raises(DoesNotFit) as err:
        check_update_fits(cfg, model, model.config, "cpu", lora=False, budget=small)
    msg = str(err.value)
    assert "lower train.micro_batch_tokens to 512 or less" in msg and "gradient_checkpointing=true" in msg
    assert "model.lora.enabled=true" in msg
    # the suggestion fits
    assert check_update_fits(validate({"train": {"micro_batch_tokens": 512}}), model, model.config, "cpu",
                             lora=False, budget=small).tokens == 512


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
