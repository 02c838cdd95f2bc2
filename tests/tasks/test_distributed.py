"""Sharded policy updates (DDP, FSDP2, DeepSpeed ZeRO-2/3 on 2 CPU processes), in micro-batches, match the
single-process update of each whole minibatch in one pass.

One ``torchrun --nproc_per_node 2`` launch runs ``dist_update_helper.py`` for all four backends (about 45 s
on 2 cores once DeepSpeed's ``deepspeed_shm_comm`` op is in the JIT cache ``.cache/torch_extensions``; the
very first run also builds it: 30 s to 3 min depending on load). Each backend does two ``policy_update``
calls (two minibatches each, grad clipping active, one replayed group, uneven completion lengths across
the two ranks; DDP with sequence aggregation and a KL term, two silent groups left out by the update's skip
but for the one ``train.kl_sample = 1/2`` draws for its KL term) and a resume from its step-1 state. The same
launch then runs the training loop's path for DDP and ZeRO-2: rank 0's ``Driver`` with a learning-rate
warm-up set through ``Updater.set_lr`` (the lr travels with each update to rank 1).

Tolerances (fp32): losses and metrics 1e-6 absolute (measured <= 1.3e-7), weights 1e-5 absolute after two
AdamW steps that move them by ~4e-3 (measured <= 1.1e-6). The cause of the difference: the rank-averaged
gradient sums the same per-token terms in another order than one process does (rounding ~1e-7 relative),
and AdamW's first steps (m / sqrt(v) ~ sign(g)) amplify that for near-zero gradient entries. A resume
from the gathered model + optimizer state is bit-exact (measured 0.0).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tasks.config.load import validate
from tasks.update.distributed import DataShard, decoder_layers, deepspeed_config, wrap
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings
from tests.servers import torchrun_two_ranks

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("dist_update_helper.py")
BACKENDS = ("ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")


def _helper():
    spec = importlib.util.spec_from_file_location("dist_update_helper", HELPER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod



@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    return torchrun_two_ranks(HELPER, tmp_path_factory.mktemp("dist") / "results.pt", *BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_update_matches_single_process(sharded_results, backend):
    torch.set_num_threads(1)
    got = sharded_results[backend]
    ref = _helper().reference(backend)
    assert len(got["stats"]) == len(ref["stats"]) == 2
    if backend in _helper().SILENT:  # groups 0 and 2 for their gradient, group 1 drawn for its KL term; not 3
        assert got["stats"][0]["train/update_rows"] == 12.0
    for step, (want, have) in enumerate(zip(ref["stats"], got["stats"], strict=True)):
        assert set(want) == set(have), step
        # the sharded runs cut each minibatch into micro-batches (the references: one pass each); same step
        assert want["train/micro_batches"] == 2 and have["train/micro_batches"] > 2, step
        for key in set(want) - {"train/micro_batches"}:
            if key == "behaviour":  # fresh groups' behaviour log-probs, gathered from both ranks
                torch.testing.assert_close(have[key], want[key], atol=2e-6, rtol=0)
            else:
                assert have[key] == pytest.approx(want[key], abs=1e-6), (step, key)
    for name, w in ref["state"].items():
        torch.testing.assert_close(got["state"][name], w, atol=1e-5, rtol=0, msg=name)
    moved = max(float((ref["state"][k] - _helper().tiny_model().state_dict()[k]).abs().max()) for k in ref["state"])
    assert moved > 1e-3  # the comparison is not vacuous: two steps moved the weights by far more than atol
    for name, w in got["state"].items():  # resume from the gathered step-1 state: exactly the same step 2
        torch.testing.assert_close(got["resumed_state"][name], w, atol=0, rtol=0, msg=name)
    assert got["resumed_stats"][0]["train/loss"] == got["stats"][1]["train/loss"]


@pytest.mark.parametrize("backend", _helper().DRIVER_BACKENDS)
def test_warmup_reaches_every_rank(sharded_results, backend):
    """With ``train.warmup_steps``, the Driver's steps equal the single-process updater's under the same lr
    schedule, and not the no-warm-up steps (the warm-up did something on both ranks)."""
    torch.set_num_threads(1)
    h = _helper()
    got = sharded_results[f"driver/{backend}"]
    warm, plain = h.local_reference(), h.local_reference(warmup=0)
    assert len(got) == len(warm) == h.STEPS
    for step in range(h.STEPS):
        for name, w in warm[step].items():
            torch.testing.assert_close(got[step][name], w, atol=1e-5, rtol=0, msg=f"step {step + 1} {name}")
    # the first step runs at lr / 4: AdamW's first move (about lr per weight) is a quarter of the plain one
    gap = max(float((got[0][k] - plain[0][k]).abs().max()) for k in plain[0])
    assert gap > 100 * 1e-5, gap


def test_world_of_one_shard_is_the_plain_update():
    """shard=DataShard(0, 1) (no process group) must give exactly the single-process step."""
    h = _helper()
    results = []
    for shard in (None, DataShard(0, 1)):
        model = h.tiny_model()
        batch = h.make_batch(model)
        opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
        stats = policy_update(model, opt, batch, LossSettings(aggregation="token", kl_coef=0.0, **h.SETTINGS),
                              shard=shard).metrics
        results.append((stats, model.state_dict()))
    (s0, w0), (s1, w1) = results
    assert s0 == s1
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k


def test_shard_rows_split_and_too_small_minibatch():
    rows = torch.arange(7)
    parts = [DataShard(r, 3).rows(rows).tolist() for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]  # torch.tensor_split: the first 7 % 3 parts get one more
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        DataShard(0, 3).rows(torch.arange(2))


def test_sum_metrics_world_of_one_is_the_metrics():
    assert DataShard(0, 1).sum_metrics({"train/loss": 0.5}) == {"train/loss": 0.5}


def test_deepspeed_config_and_layers():
    c = deepspeed_config(3, grad_clip=0.7, dtype=torch.bfloat16, offload_optimizer=True)
    assert c["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert c["gradient_clipping"] == 0.7 and c["bf16"]["enabled"] and not c["fp16"]["enabled"]
    assert c["train_micro_batch_size_per_gpu"] == 1 and c["gradient_accumulation_steps"] == 1
    assert c["managed_gradient_accumulation"] is False  # the update's micro-batches accumulate; step() applies
    model = _helper().tiny_model()
    assert len(decoder_layers(model)) == 2  # the tiny model's two LlamaDecoderLayers


def test_wrap_single_and_missing_process_group():
    model = _helper().tiny_model()
    m, opt = wrap(model, lambda p: torch.optim.SGD(p, lr=0.1), validate({}))
    assert m is model and isinstance(opt, torch.optim.SGD)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="needs a process group"):
            wrap(model, lambda p: torch.optim.SGD(p, lr=0.1), validate({"scale": {"backend": "ddp"}}))
    with pytest.raises(ValueError, match="not one of"):
        wrap(model, lambda p: torch.optim.SGD(p, lr=0.1), validate({}).model_copy(
            update={"scale": validate({}).scale.model_copy(update={"backend": "megatron"})}))
