"""The declared interfaces between the training loop and its parts: the rollout engine and the updater."""

from dataclasses import replace

import pytest
import torch

from tasks.config import ConfigError
from tasks.config.load import validate
from tasks.generation.rollout import HFEngine, RolloutEngine
from tasks.generation.vllm_engine import VLLMEngine
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.update.backend import build_updater
from tasks.update.policy_update import LocalUpdater
from tasks.update.sharded_update import Driver
from tasks.update.updater import LossSettings, Updater, scheduled_lr
from tests.policies import policy_of


def test_engines_are_rollout_engines_and_hf_sync_is_a_no_op(tmp_path):
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    engine = HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=512)
    assert isinstance(engine, RolloutEngine)
    vllm = VLLMEngine("http://127.0.0.1:9", tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                      stop_ids=(tok.eos_token_id,))
    assert isinstance(vllm, RolloutEngine)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert engine.sync_weights(model, tok, tmp_path / "w") == 0.0
    assert not (tmp_path / "w").exists() and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    other = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=1)
    with pytest.raises(ValueError, match="cannot sync another"):
        engine.sync_weights(other, tok, tmp_path / "w")


@pytest.mark.parametrize("schedule, floor, expected", [
    # steps 0-1 warm up to 1e-3, then hold
    ("constant", 0.0, [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]),
    # the decay spans steps 1..5 (done = 0, 1/4, 1/2, 3/4, 1) down to 1e-3 * 0.2
    ("linear", 0.2, [5e-4, 1e-3, 8e-4, 6e-4, 4e-4, 2e-4, 2e-4]),
    # 0.2 + 0.8 * (1 + cos(pi * done)) / 2: done 1/4 -> 0.2 + 0.4 * (1 + 0.70711) = 0.88284
    ("cosine", 0.2, [5e-4, 1e-3, 8.8284e-4, 6e-4, 3.1716e-4, 2e-4, 2e-4]),
])
def test_scheduled_lr_warms_up_then_decays_to_its_floor_at_the_last_step(schedule, floor, expected):
    cfg = validate({"train": {"lr": 1e-3, "warmup_steps": 2, "steps": 6, "lr_schedule": schedule,
                              "min_lr_ratio": floor}})
    assert [scheduled_lr(cfg, s) for s in range(7)] == pytest.approx(expected, rel=1e-4)  # step 6: past the end
    assert scheduled_lr(validate({"train": {"lr": 1e-3}}), 0) == 1e-3  # warmup_steps 0: off
    one = validate({"train": {"lr": 1e-3, "steps": 1, "lr_schedule": "linear"}})
    assert scheduled_lr(one, 0) == 1e-3  # a one-step run has nothing to decay over


def test_a_learning_rate_floor_without_a_decay_is_refused():
    with pytest.raises(ConfigError, match="min_lr_ratio=0.1 is the floor of a decay"):
        validate({"train": {"min_lr_ratio": 0.1}})


def test_local_updater_sets_lr_and_round_trips_state():
    cfg = validate({"train": {"lr": 1e-3, "kl_coef": 0.1}, "gain": {"enabled": True}})
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    updater = build_updater(cfg, policy_of(model), device="cpu")
    assert isinstance(updater, LocalUpdater) and isinstance(updater, Updater)
    assert updater.settings == LossSettings(clip_eps=0.2, aggregation="token", grad_clip=cfg.train.grad_clip,
                                            temperature=1.0, pad_id=0, minibatches=1, kl_coef=0.1,
                                            micro_batch_tokens=cfg.train.micro_batch_tokens,
                                            skip_zero_advantage=True, angle=True, behaviour_cap=2.0,
                                            shared_prefix="auto")
    assert updater.ref_model is not None and updater.ref_model is not model
    updater.set_lr(2e-4)
    assert [g["lr"] for g in updater.optimizer.param_groups] == [2e-4]
    state = updater.state_dict()
    again = build_updater(cfg, policy_of(model), device="cpu")
    again.load_state_dict(state)
    assert again.optimizer.param_groups[0]["lr"] == 2e-4
    with pytest.raises(ValueError, match="reference model"):
        LocalUpdater(model, updater.settings, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def test_driver_is_an_updater_and_deepspeed_clips_by_its_config():
    assert issubclass(Driver, Updater)
    cfg = validate({"scale": {"backend": "deepspeed_zero2"}, "train": {"grad_clip": 1.0}})
    settings = LossSettings.from_config(cfg, pad_id=0)
    with pytest.raises(ValueError, match="DeepSpeed clips by its config"):
        Driver(cfg, build_tiny_model(hidden=64, layers=2, heads=2, seed=0), replace(settings, grad_clip=0.5))


def test_adam_eps_reaches_the_optimizer():
    from tasks.config.load import load_config

    cfg = load_config(None, ["train.adam_eps=1e-4"])
    updater = build_updater(cfg, policy_of(torch.nn.Linear(2, 2)), device="cpu")
    assert updater.optimizer.param_groups[0]["eps"] == 1e-4


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_gradient_checkpointing_keeps_loss_and_gradients(aggregation):
    """``train.gradient_checkpointing``: the update's loss and every gradient equal the update without it (float32,
    1e-6), on a batch with a replayed group; the model really recomputes (transformers' flag is on)."""
    import copy as _copy

    from tasks.update.policy_update import gradient_checkpointing, policy_update
    from tests.tasks import dist_update_helper as h

    grads, losses = {}, {}
    for on in (False, True):
        model = h.tiny_model()
        gradient_checkpointing(model, on)
        assert model.is_activation_checkpointing == on
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stats = policy_update(model, opt, _copy.deepcopy(h.make_batch(h.tiny_model())),
                              LossSettings(aggregation=aggregation, kl_coef=0.0,
                                  **{**h.SETTINGS, "minibatches": 1, "grad_clip": 1e9})).metrics
        grads[on] = torch.cat([p.grad.flatten() for p in model.parameters()])
        losses[on] = stats["train/loss"]
    assert losses[True] == pytest.approx(losses[False], abs=1e-6)
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=1e-6)
    assert float(grads[False].abs().max()) > 1e-4  # a real gradient


def test_gradient_checkpointing_refuses_a_model_without_it():
    from tasks.update.policy_update import gradient_checkpointing

    with pytest.raises(ValueError, match="does not support it"):
        gradient_checkpointing(torch.nn.Linear(2, 2), True)


def test_build_updater_turns_gradient_checkpointing_on():
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    build_updater(validate({"train": {"gradient_checkpointing": True}}), policy_of(model), device="cpu")
    assert model.is_activation_checkpointing
