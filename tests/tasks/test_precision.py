"""Mixed precision (``model.precision``, tasks/update/precision.py): under ``bf16-mixed`` the updater steps float32
master weights with float32 AdamW state behind the model's bf16 weights, so a small update survives.

The target (issue 44): the project's updater, built as a run builds it (``build_updater``) on a bf16 model, after
10 AdamW steps at lr 1e-6 on a fixed batch, has moved its master weights by the float32 run's update within 2 %
(norm ratio 0.98-1.02, cosine >= 0.99). Here for the single process and LoRA; DDP, FSDP2 and DeepSpeed ZeRO-2/3 on
2 gloo ranks in tests/tasks/test_precision_dist.py. Measured: single 0.998 / 0.997, LoRA 0.999 / 0.996 (the
adapters are bf16 in the model, like every weight, with float32 masters).
``bf16-true`` (the old training in bf16) keeps about a fifth of the update (0.21 / 0.13): the comparison can fail.
The batch is tests/tasks/dist_update_helper.py's (4 groups, a replayed one, uneven lengths), cut into micro-batches
of 40 padded tokens (7 a step: gradients accumulate in bf16 before the float32 step).
"""

import copy
import functools
import logging

import pytest
import torch

from tasks.config import ConfigError
from tasks.config.load import load_config, validate
from tasks.model.loading import build_tiny_model
from tasks.model.lora import apply_lora
from tasks.update import precision
from tasks.update.backend import build_updater
from tasks.update.distributed import optimizer_step
from tasks.update.policy_update import policy_update
from tasks.update.precision import (
    MasterWeights,
    Precision,
    build_optimizer,
    model_dtype,
    resolve_precision,
)
from tasks.update.updater import LossSettings
from tests.policies import policy_of
from tests.tasks import dist_update_helper as h
from tests.tasks.test_lora import LORA

BF16, F32 = torch.bfloat16, torch.float32
STEPS, LR, MICRO = 10, 1e-6, 40


def updater_config(precision: str, backend: str = "single", **train):
    return validate({"model": {"precision": precision}, "scale": {"backend": backend},
                     "train": {"lr": LR, "minibatches": 1, "grad_clip": 1.0, "micro_batch_tokens": MICRO, **train}})


def trained_update(precision: str, lora: bool = False, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """What ``steps`` updates of the run's updater under ``precision`` move the weights the optimizer steps (the
    masters under bf16-mixed), by name, in float32; each from its own start (bf16-rounded for a bf16 model)."""
    model = h.tiny_model()
    batch = h.make_batch(model)
    model.to(F32 if precision == "fp32" else BF16)
    if lora:
        model = apply_lora(model, LORA, seed=0)
    updater = build_updater(updater_config(precision), policy_of(model), device="cpu")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    start = dict(zip(names, (t.detach().float().clone() for t in weights_stepped(updater.optimizer, model)),
                     strict=True))
    for _ in range(steps):
        updater.step(copy.deepcopy(batch))
    end = dict(zip(names, (t.detach().float() for t in weights_stepped(updater.optimizer, model)), strict=True))
    return {n: end[n] - start[n] for n in names}


def weights_stepped(optimizer, model) -> list[torch.Tensor]:
    if isinstance(optimizer, MasterWeights):
        return optimizer.masters
    return [p for p in model.parameters() if p.requires_grad]


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(norm ratio, cosine) of two updates over every weight."""
    a = torch.cat([got[k].flatten() for k in want])
    b = torch.cat([want[k].flatten() for k in want])
    return float(a.norm() / b.norm()), float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.fixture(scope="module")
def float32_update():
    return trained_update("fp32")


def test_bf16_mixed_moves_the_master_weights_by_the_float32_update(float32_update):
    got = trained_update("bf16-mixed")
    ratio, cosine = compare(got, float32_update)
    assert 0.98 <= ratio <= 1.02 and cosine >= 0.99, (ratio, cosine)
    moved = torch.cat([d.flatten() for d in got.values()])
    assert float((moved != 0).float().mean()) > 0.99  # every master weight moved (bf16-true: 2 %)


def test_bf16_true_loses_most_of_the_update(float32_update, caplog, monkeypatch):
    """The comparison can fail: bf16 weights with bf16 AdamW state round most of a 1e-6 step away."""
    monkeypatch.setattr(precision, "_warned", set())  # the warning comes once a process
    with caplog.at_level(logging.WARNING, logger="tasks.update.precision"):
        got = trained_update("bf16-true")
    assert "bf16-true" in caplog.text and "rounded away" in caplog.text
    ratio, cosine = compare(got, float32_update)
    assert ratio < 0.5 and cosine < 0.5, (ratio, cosine)


def test_lora_adapters_are_bf16_with_float32_masters_and_track_the_float32_update():
    """The adapters compute in bf16 (no cast of the activations to float32 in each adapted layer); their float32
    masters and AdamW state keep the small update, as for full weights."""
    want = trained_update("fp32", lora=True)
    got = trained_update("bf16-mixed", lora=True)
    ratio, cosine = compare(got, want)
    assert 0.98 <= ratio <= 1.02 and cosine >= 0.99, (ratio, cosine)
    moved = torch.cat([d.flatten() for d in got.values()])
    assert float((moved != 0).float().mean()) > 0.99
    model = apply_lora(h.tiny_model().to(BF16), LORA, seed=0)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in adapters} == {BF16} and model_dtype(model) == BF16
    updater = build_updater(updater_config("bf16-mixed"), policy_of(model), device="cpu")
    opt = updater.optimizer
    assert isinstance(opt, MasterWeights) and len(opt.copied) == len(adapters)
    assert all(m.dtype == F32 for m in opt.masters)


def test_master_weights_step_float32_state_and_round_into_the_bf16_weights():
    model = h.tiny_model().to(BF16)
    updater = build_updater(updater_config("bf16-mixed"), policy_of(model), device="cpu")
    opt = updater.optimizer
    assert isinstance(opt, MasterWeights) and len(opt.copied) == len(list(model.parameters()))
    updater.step(h.make_batch(h.tiny_model()))
    assert all(p.dtype == BF16 for p in model.parameters())  # the sampler's weights stay bf16
    assert all(m.dtype == F32 for m in opt.masters)
    assert {t.dtype for s in opt.state.values() for t in s.values() if t.dim()} == {F32}  # AdamW's moments
    for p, m in zip(opt.params, opt.masters, strict=True):
        assert torch.equal(p, m.to(BF16))  # the weights are the masters, rounded
        assert p.grad is None  # the bf16 gradient was moved into the master's
    assert updater.optimizer.param_groups[0]["lr"] == LR


def test_gradient_clipping_clips_the_float32_master_gradients():
    model = h.tiny_model().to(BF16)
    opt = build_optimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.0), resolve_precision(
        "bf16-mixed", torch.device("cpu")))
    seen = []
    sgd_step = opt.optimizer.step
    opt.optimizer.step = lambda: (seen.append([m.grad.clone() for m in opt.masters]), sgd_step())
    policy_update(model, opt, copy.deepcopy(h.make_batch(h.tiny_model())), LossSettings(aggregation="token",
                  kl_coef=0.0, **{**h.SETTINGS, "minibatches": 1, "grad_clip": 1e9}))
    (grads,) = seen  # what the step saw (MasterWeights frees them after it)
    norm = float(torch.cat([g.flatten() for g in grads]).norm())
    for m, g in zip(opt.masters, grads, strict=True):  # put the gradients back and clip them to a tenth
        m.grad = g.clone()
    assert optimizer_step(model, opt, norm / 10) == pytest.approx(norm, rel=1e-5)
    clipped = float(torch.cat([g.flatten() for g in seen[-1]]).norm())
    assert clipped == pytest.approx(norm / 10, rel=1e-4) and all(g.dtype == F32 for g in seen[-1])


def test_a_nan_step_reaches_neither_the_masters_nor_the_weights():
    model = h.tiny_model().to(BF16)
    updater = build_updater(updater_config("bf16-mixed", minibatches=2), policy_of(model), device="cpu")
    before = copy.deepcopy(model.state_dict())
    masters = [m.detach().clone() for m in updater.optimizer.masters]
    calls = {"n": 0}

    def nan_logits(_module, _inputs, output):
        calls["n"] += 1
        return output * float("nan")

    handle = model.lm_head.register_forward_hook(nan_logits)
    stats = updater.step(copy.deepcopy(h.make_batch(h.tiny_model()))).metrics
    handle.remove()
    assert calls["n"] > 0 and stats["train/skipped_updates"] == 2.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(m, b) for m, b in zip(updater.optimizer.masters, masters, strict=True))
    assert not updater.optimizer.state and all(m.grad is None for m in updater.optimizer.masters)


def test_the_float32_master_gradients_are_freed_after_the_step():
    """They would stay through the next generation (4 bytes a trained parameter): after a step no master and no
    weight holds a gradient, and the step did run (AdamW's state exists, the weights moved)."""
    model = h.tiny_model().to(BF16)
    updater = build_updater(updater_config("bf16-mixed", lr=1e-2), policy_of(model), device="cpu")
    before = [p.detach().clone() for p in model.parameters()]
    stats = updater.step(copy.deepcopy(h.make_batch(h.tiny_model()))).metrics
    opt = updater.optimizer
    assert stats["train/skipped_updates"] == 0 and opt.state
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(m.grad is None for m in opt.masters) and all(p.grad is None for p in model.parameters())


def test_the_checkpoint_s_masters_are_copies_on_the_host():
    """``state_dict``'s masters are on the CPU and are copies: a later step does not change them (on a GPU they are
    no longer cloned on the device: the CUDA test below)."""
    model = h.tiny_model().to(BF16)
    updater = build_updater(updater_config("bf16-mixed", lr=1e-2), policy_of(model), device="cpu")
    batch = h.make_batch(h.tiny_model())
    updater.step(copy.deepcopy(batch))
    state = updater.state_dict()
    saved = {i: t.clone() for i, t in state["master"].items()}
    assert all(t.device.type == "cpu" and t.dtype == F32 for t in state["master"].values())
    assert all(t.untyped_storage().data_ptr() != updater.optimizer.masters[i].untyped_storage().data_ptr()
               for i, t in state["master"].items())
    updater.step(copy.deepcopy(batch))
    assert all(torch.equal(state["master"][i], saved[i]) for i in saved)
    assert any(not torch.equal(updater.optimizer.masters[i], saved[i]) for i in saved)


def test_adamw_runs_fused_where_torch_has_the_kernel_and_foreach_elsewhere():
    """The kernel is chosen by the parameters' device in build_optimizer, whatever the factory asked; on the CPU
    (where torch 2.13 has the fused kernel) fused, foreach and the single-tensor loop take the same 5 steps."""
    assert precision.adamw_kernel("cuda") == {"fused": True, "foreach": False}
    assert precision.adamw_kernel(torch.device("cpu")) == {"fused": True, "foreach": False}
    assert precision.adamw_kernel("meta") == {"fused": None, "foreach": True}
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, foreach=False)
    for name in ("fp32", "bf16-mixed"):
        opt = build_optimizer(h.tiny_model().to(F32 if name == "fp32" else BF16).parameters(), adamw,
                              resolve_precision(name, torch.device("cpu")))
        inner = opt.optimizer if isinstance(opt, MasterWeights) else opt
        group = inner.param_groups[0]
        assert group["fused"] is True and not group["foreach"] and group["betas"] == (0.8, 0.9)
        assert group["lr"] == 1e-2 and group["weight_decay"] == 0.1

    def steps(**kernel) -> list[torch.Tensor]:
        model = h.tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kernel)
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach() for p in model.parameters()]

    loop = steps(foreach=False)
    for kernel in ({"fused": True}, {"foreach": True}):
        for a, b in zip(steps(**kernel), loop, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(loop, h.tiny_model().parameters(), strict=True))


def test_a_resumed_bf16_mixed_run_is_the_uninterrupted_one():
    """Checkpoint after 2 steps (the bf16 weights as the checkpoint keeps them, the updater's state: masters and
    AdamW's moments); a fresh model and updater restored from it take steps 3-4 exactly as the uninterrupted run."""
    batch = h.make_batch(h.tiny_model())
    cfg = updater_config("bf16-mixed", lr=1e-3)

    def build(seed: int):
        model = build_tiny_model(hidden=64, layers=2, heads=2, seed=seed).to(BF16)
        return model, build_updater(cfg, policy_of(model), device="cpu")

    model, updater = build(0)
    for _ in range(2):
        updater.step(copy.deepcopy(batch))
    saved = copy.deepcopy({"model": policy_of(model).checkpoint_state(), "optimizer": updater.state_dict()})
    assert all(t.dtype == F32 for t in saved["optimizer"]["master"].values())
    for _ in range(2):
        updater.step(copy.deepcopy(batch))
    again, resumed = build(7)  # another start: everything comes from the checkpoint
    policy_of(again).load_checkpoint_state(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    for _ in range(2):
        resumed.step(copy.deepcopy(batch))
    for (k, v), w in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for m, r in zip(updater.optimizer.masters, resumed.optimizer.masters, strict=True):
        assert torch.equal(m, r)
    # without the masters (the bf16 weights alone) the resumed run differs: the checkpoint's masters matter
    lossy, lossy_updater = build(7)
    policy_of(lossy).load_checkpoint_state(saved["model"])
    lossy_updater.load_state_dict(saved["optimizer"]["optimizer"])  # a plain AdamW state: masters from bf16
    for _ in range(2):
        lossy_updater.step(copy.deepcopy(batch))
    assert any(not torch.equal(m, r) for m, r in zip(updater.optimizer.masters, lossy_updater.optimizer.masters,
                                                      strict=True))


def test_a_checkpoint_of_another_model_is_refused():
    model = h.tiny_model().to(BF16)
    updater = build_updater(updater_config("bf16-mixed"), policy_of(model), device="cpu")
    state = updater.state_dict()
    state["master"].pop(0)
    with pytest.raises(ValueError, match="master weights"):
        updater.load_state_dict(state)


def test_the_model_must_be_in_the_compute_dtype():
    with pytest.raises(ValueError, match="computes in torch.bfloat16"):
        build_updater(updater_config("bf16-mixed"), policy_of(h.tiny_model()), device="cpu")


def test_resolve_precision_and_bytes():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == Precision("fp32", F32, F32)  # a CPU computes bf16 slowly
    mixed = resolve_precision("bf16-mixed", cpu)
    assert mixed == Precision("bf16-mixed", BF16, F32) and mixed.mixed
    assert mixed.bytes_per_trained_param() == 2 + 2 + 4 + 8
    assert mixed.bytes_per_trained_param_at_step() == 2 + 4 + 4 + 8  # float32 gradients replace the bf16 ones
    assert resolve_precision("fp32", cpu).bytes_per_trained_param_at_step() == 16
    assert resolve_precision("fp32", cpu).bytes_per_trained_param() == 16
    assert resolve_precision("bf16-true", cpu).bytes_per_trained_param() == 8
    with pytest.raises(ValueError, match="model.precision must be one of"):
        resolve_precision("float16", cpu)
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), torch.optim.AdamW, resolve_precision("fp32", cpu))
    assert type(opt) is torch.optim.AdamW  # fp32: the optimizer as before


def test_config_precision_and_the_old_dtype_key():
    assert validate({}).model.precision == "auto"
    assert load_config(None, ["model.precision=bf16-mixed"]).model.precision == "bf16-mixed"
    with pytest.raises(ConfigError, match="model.dtype .*'bfloat16'.* replaced by model.precision"):
        load_config(None, ["model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="replaced by model.precision"):
        validate({"model": {"dtype": "auto"}})
    with pytest.raises(ConfigError, match="precision"):
        validate({"model": {"precision": "float16"}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU check runs it)")
def test_on_cuda_the_checkpoint_s_masters_take_no_device_memory():
    model = torch.nn.Linear(1024, 1024).to("cuda", BF16)
    opt = build_optimizer(model.parameters(), torch.optim.AdamW, resolve_precision("bf16-mixed", "cuda"))
    assert opt.optimizer.param_groups[0]["fused"] is True
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    state = opt.state_dict()
    assert all(t.device.type == "cpu" for t in state["master"].values())
    assert torch.cuda.max_memory_allocated() == before


def test_ddp_sums_bf16_gradient_buckets_in_float32(monkeypatch, tmp_path):
    """One gloo rank (the hook is DDP's, whatever the world size; tests/tasks/test_precision_dist.py trains on two):
    every bucket is all-reduced as float32, and the gradients come back in bf16 equal to the process's own."""
    import torch.distributed as dist

    from tasks.update import distributed

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        seen = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (seen.append(t.dtype), real(t, *a, **k))[1])
        model = h.tiny_model().to(BF16)
        alone = copy.deepcopy(model)
        ddp, opt = distributed.wrap(model, functools.partial(torch.optim.AdamW, lr=1e-3),
                                    updater_config("bf16-mixed", "ddp"), torch.device("cpu"),
                                    resolve_precision("bf16-mixed", torch.device("cpu")))
        assert isinstance(opt, MasterWeights)
        ids = torch.randint(4, 90, (2, 9), generator=torch.Generator().manual_seed(0))
        ddp(input_ids=ids).logits.float().square().mean().backward()
        alone(input_ids=ids).logits.float().square().mean().backward()
        assert seen and set(seen) == {F32}
        for p, q in zip(model.parameters(), alone.parameters(), strict=True):
            assert p.grad.dtype == BF16 and torch.equal(p.grad, q.grad)
    finally:
        dist.destroy_process_group()
