"""LoRA (``model.lora``, tasks/model/lora.py): only the adapters train; the KL reference is the base model without a
copy; the sampler, the saved model and vLLM's export get merged weights; checkpoints hold the adapters and resume
exactly; a LoRA run learns.
"""

import copy

import pytest
import torch

from tasks.config import ConfigError, LoraConfig
from tasks.config.load import validate
from tasks.model.loading import build_tiny_model, build_tokenizer, load_policy, save_policy
from tasks.model.lora import (
    BaseModelView,
    apply_lora,
    checkpoint_state,
    is_lora,
    load_checkpoint_state,
    plain_copy,
    plain_state_dict,
    trainable_parameters,
)
from tasks.update.backend import build_updater
from tests.policies import policy_of
from tests.tasks import dist_update_helper as h

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def lora_model(seed: int = 0, trained: bool = True):
    """A tiny Llama with adapters; ``trained``: B set away from its zero start, so the adapters change the model."""
    model = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), LORA, seed)
    if trained:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(4, 90, (3, 11), generator=torch.Generator().manual_seed(1))


def test_only_the_adapters_train_and_the_base_weights_freeze():
    model = lora_model(trained=False)
    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert [id(p) for p in trainable_parameters(model)] == [id(p) for p in trainable.values()]
    # B starts at 0: the adapted model is the base model
    torch.testing.assert_close(logits(model, IDS), logits(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), IDS))


def test_merged_weights_equal_peft_merge_and_unload_and_give_the_adapted_models_outputs():
    """The oracle is PEFT's own merge on a copy; the merged weights are new tensors (the policy is untouched)."""
    model = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = plain_state_dict(model)
    oracle = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == oracle.keys() - {"lm_head.weight"} or merged.keys() == oracle.keys()
    for k, v in merged.items():
        torch.testing.assert_close(v, oracle[k], rtol=0, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    sampler = plain_copy(model)
    assert not is_lora(sampler) and not any(p.requires_grad for p in sampler.parameters())
    torch.testing.assert_close(logits(sampler, IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_a_saved_lora_policy_loads_as_a_full_model_with_the_adapted_outputs(tmp_path):
    model = lora_model()
    save_policy(model, build_tokenizer(), tmp_path / "m")
    loaded, _ = load_policy(tmp_path / "m")
    assert not is_lora(loaded) and not any("lora" in k for k in loaded.state_dict())
    torch.testing.assert_close(logits(loaded, IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_the_vllm_export_of_a_lora_policy_holds_the_merged_untied_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from tasks.generation.vllm_export import export_for_vllm

    model = lora_model()
    folder = export_for_vllm(model, build_tokenizer(), tmp_path / "served")
    served = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert not served.config.tie_word_embeddings
    torch.testing.assert_close(logits(served, IDS), logits(model, IDS), rtol=0, atol=1e-5)


def test_the_kl_reference_is_the_base_model_without_a_copy():
    model = lora_model()
    cfg = validate({"train": {"kl_coef": 0.1}})
    updater = build_updater(cfg, policy_of(model), device="cpu")
    assert isinstance(updater.ref_model, BaseModelView) and updater.ref_model.model is model
    base = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    torch.testing.assert_close(logits(updater.ref_model, IDS), logits(base, IDS))
    assert (logits(updater.ref_model, IDS) - logits(model, IDS)).abs().max() > 1e-3  # the adapters are back after


def test_a_lora_step_moves_only_the_adapters_and_its_optimizer_state_is_a_tenth_of_a_full_updates():
    """Measured after one real update each: trainable parameters and AdamW's state (bytes) of the LoRA update are at
    most a tenth of the full update's."""
    def step(model):
        cfg = validate({"train": {"lr": 1e-2, "kl_coef": 0.05}})
        updater = build_updater(cfg, policy_of(model), device="cpu")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        stats = updater.step(h.make_batch(model)).metrics
        state = updater.optimizer.state_dict()["state"]
        nbytes = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))
        params = sum(p.numel() * p.element_size() for p in trainable_parameters(model))
        return before, stats, nbytes, params

    full = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    _, _, full_state, full_params = step(full)
    model = lora_model(trained=False)
    before, stats, state, params = step(model)
    assert stats["train/skipped_updates"] == 0 and stats["train/kl"] >= 0
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".lora_" in k for k in changed)
    assert any(".lora_B." in k for k in changed)  # B leaves 0: the adapters learn
    assert 0 < state <= full_state / 10 and 0 < params <= full_params / 10, (state, full_state, params, full_params)


def test_gradient_checkpointing_and_the_shared_prefix_keep_a_lora_updates_loss_and_gradients():
    from tasks.update.policy_update import gradient_checkpointing, policy_update
    from tasks.update.updater import LossSettings

    grads, losses, tokens = {}, {}, {}
    # (checkpointing, each group's prompt once): the shared prefix's attention also in the recomputation
    for arm in ((False, False), (True, False), (True, True)):
        model = lora_model()
        gradient_checkpointing(model.get_base_model(), arm[0])
        opt = torch.optim.SGD(trainable_parameters(model), lr=0.0)
        stats = policy_update(model, opt, copy.deepcopy(h.make_batch(h.tiny_model())),
                              LossSettings(aggregation="token", kl_coef=0.0, shared_prefix=arm[1],
                                  **{**h.SETTINGS, "minibatches": 1, "grad_clip": 1e9})).metrics
        grads[arm] = torch.cat([p.grad.flatten() for p in trainable_parameters(model)])
        losses[arm], tokens[arm] = stats["train/loss"], stats["train/update_tokens"]
        assert model.get_base_model().config._attn_implementation == "sdpa"
    assert tokens[True, True] < tokens[True, False]  # the packed passes ran
    for arm in ((True, False), (True, True)):
        assert losses[arm] == pytest.approx(losses[False, False], abs=1e-6)
        torch.testing.assert_close(grads[arm], grads[False, False], rtol=1e-4 if arm[1] else 0, atol=1e-6)
    assert float(grads[False, False].abs().max()) > 1e-4


def test_checkpoints_hold_the_adapters_and_refuse_a_model_they_do_not_fit():
    model = lora_model(seed=3)
    state = checkpoint_state(model)
    assert state and all(".lora_" in k for k in state)
    fresh = lora_model(trained=False)
    load_checkpoint_state(fresh, state)
    torch.testing.assert_close(logits(fresh, IDS), logits(model, IDS), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not fit this LoRA model"):
        load_checkpoint_state(fresh, build_tiny_model(hidden=64, layers=2, heads=2, seed=0).state_dict())
    with pytest.raises(ValueError, match="do not fit this LoRA model"):
        load_checkpoint_state(apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0),
                                         LoraConfig(enabled=True, rank=2), 0), state)


def test_lora_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.lora is built for scale.backend=single"):
        validate({"model": {"lora": {"enabled": True}}, "scale": {"backend": "ddp"}})
    with pytest.raises(ConfigError, match="model.lora.dropout > 0"):
        validate({"model": {"lora": {"enabled": True, "dropout": 0.1}}})
    assert validate({"model": {"lora": {"enabled": True, "dropout": 0.1}}, "train": {"behaviour": "trainer"}})
    with pytest.raises(ConfigError, match="rank"):
        validate({"model": {"lora": {"rank": 0}}})
    with pytest.raises(ValueError, match="model.lora.target_modules=.*nope"):
        apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0),
                   LoraConfig(enabled=True, target_modules=("nope",)), 0)


def test_the_adapters_start_from_the_seed_and_leave_the_global_random_state_alone():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), LORA, 7).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    b = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), LORA, 7).state_dict()
    c = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), LORA, 8).state_dict()
    lora_a = [k for k in a if "lora_A" in k]
    assert all(torch.equal(a[k], b[k]) for k in lora_a) and not all(torch.equal(a[k], c[k]) for k in lora_a)


def _fused(y: torch.Tensor) -> bool:
    """Whether ``y`` came out of the fused LoRA function (under the view back to the input's shape)."""
    return type(y.grad_fn.next_functions[0][0]).__name__ == "_LoraLinearBackward"


def _forward_backward(model, ids):
    """Logits and the gradients of a fixed loss (the adapters', and the input embeddings')."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in both runs
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=emb).logits
    (out.float().square().mean()).backward()
    return out.detach(), emb.grad, [p.grad.clone() for p in trainable_parameters(model)]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_fused_lora_layer_computes_peft_s_outputs_and_gradients(monkeypatch, dropout):
    """Oracle: PEFT's own ``lora.Linear.forward`` on the same layers (the fused function replaced by it); the
    fused layer is the one that ran (its backward node), and the frozen base weights get no gradient."""
    from peft.tuners.lora.layer import Linear

    from tasks.model.lora_linear import LeanLoraLinear

    model = lora_model()
    if dropout:
        model = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0),
                           LoraConfig(enabled=True, rank=4, alpha=8.0, dropout=dropout), 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    model.train()
    layers = [m for m in model.modules() if isinstance(m, LeanLoraLinear)]
    assert len(layers) == 2 * 7  # every linear layer of the 2 decoder layers, not the head
    x = torch.randn(5, layers[0].in_features)
    assert _fused(layers[0](x))
    fused = _forward_backward(model, IDS)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    monkeypatch.setattr(LeanLoraLinear, "forward", Linear.forward)
    assert not _fused(layers[0](x))
    peft = _forward_backward(model, IDS)
    torch.testing.assert_close(fused[0], peft[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], peft[1], rtol=1e-5, atol=1e-7)
    for a, b in zip(fused[2], peft[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert float(fused[2][0].abs().max()) > 0


def test_adapters_are_held_in_the_base_s_dtype_and_run_fused_in_bf16():
    """Under a bf16 base the adapters are bf16 (their float32 masters are the optimizer's: tests/tasks/
    test_precision.py); the fused layer then runs with no cast: its forward's output is PEFT's to bf16 rounding."""
    from peft.tuners.lora.layer import Linear

    model = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0).to(torch.bfloat16), LORA, 0)
    assert {p.dtype for p in trainable_parameters(model)} == {torch.bfloat16}
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, layer.in_features, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and _fused(y)
    torch.testing.assert_close(y, Linear.forward(layer, x), rtol=1.6e-2, atol=1e-2)


def _peft_loads(base_dir, adapter_dir):
    """The adapted model as plain PEFT loads it: the base folder in float32, the adapter folder over it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def test_the_adapter_folder_loads_with_plain_peft_and_gives_the_adapted_models_outputs(tmp_path):
    """PEFT's files and key names, the config naming the base folder, rank, alpha and target modules; plain PEFT
    over the base folder gives the adapted model's logits (the oracle: the model itself)."""
    import json

    from safetensors.torch import load_file

    from tasks.model.lora import save_adapter

    save_policy(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), build_tokenizer(), tmp_path / "base")
    model = lora_model()
    folder = save_adapter(model, tmp_path / "adapter", tmp_path / "base")
    assert sorted(f.name for f in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base") and config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"] and config["inference_mode"]
    weights = load_file(folder / "adapter_model.safetensors")
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert a in weights and len(weights) == 2 * 7 * 2 and {v.dtype for v in weights.values()} == {torch.float32}
    torch.testing.assert_close(weights[a], model.state_dict()[a.replace("lora_A.", "lora_A.default.")],
                               rtol=0, atol=0)
    loaded = _peft_loads(tmp_path / "base", folder)
    torch.testing.assert_close(logits(loaded, IDS), logits(model, IDS), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), tmp_path / "x", tmp_path / "base")


def test_under_bf16_mixed_the_adapter_folder_holds_the_float32_masters_not_their_bf16_rounding(tmp_path):
    """After a real bf16-mixed step the adapters' masters (``Updater.master_weights``) are what the folder holds,
    to the bit; the bf16 weights the model computes with are their rounding, which differs."""
    from safetensors.torch import load_file

    from tasks.model.lora import save_adapter
    from tasks.update.precision import resolve_precision

    model = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, seed=0).to(torch.bfloat16), LORA, 0)
    cfg = validate({"train": {"lr": 1e-2}, "model": {"precision": "bf16-mixed"}})
    updater = build_updater(cfg, policy_of(model), device="cpu", precision=resolve_precision("bf16-mixed",
                                                                                              torch.device("cpu")))
    assert updater.step(h.make_batch(model)).metrics["train/skipped_updates"] == 0
    masters = updater.master_weights()
    params = dict(model.named_parameters())
    assert set(masters) == {n for n, p in params.items() if p.requires_grad}
    assert all(m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), params[n]) for n, m in masters.items())
    weights = load_file(save_adapter(model, tmp_path / "adapter", tmp_path / "base", masters)
                        / "adapter_model.safetensors")
    by_peft_name = {n.replace(".default.", "."): m for n, m in masters.items()}
    assert weights.keys() == by_peft_name.keys()
    for k, v in weights.items():
        assert torch.equal(v, by_peft_name[k]), k
    assert any(not torch.equal(v, by_peft_name[k].to(torch.bfloat16).float()) for k, v in weights.items())
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())  # the step moved B off 0
