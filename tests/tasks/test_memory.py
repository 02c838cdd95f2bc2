"""Peak memory per phase (tasks/records/memory.py): each phase's own peak, reset between phases, in every step's
metrics, and the generator process's own."""

import json

import pytest
import torch

from tasks.records.cost import CostMeter
from tasks.records.memory import PeakMemory, own_peak_mb


def test_each_phase_gets_its_own_peak_and_take_forgets_them():
    mem = PeakMemory("cpu")
    meter = CostMeter(prices={"cpu": 0.1}, device="cpu", devices=1, memory=mem)
    with meter.stage("big"):
        block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched: well above what earlier tests left resident
        del block
    with meter.stage("small"):
        torch.ones(16)
    got = mem.take()
    assert set(got) == {"memory/big_peak_mb", "memory/small_peak_mb"} and meter.seconds.keys() == {"big", "small"}
    assert mem.resettable
    assert got["memory/big_peak_mb"] >= got["memory/small_peak_mb"] + 128  # the small phase does not inherit it
    assert got["memory/small_peak_mb"] <= own_peak_mb("cpu") + 1
    assert mem.take() == {}


def test_a_phase_run_twice_in_a_step_reports_its_larger_peak():
    mem = PeakMemory("cpu")
    with mem.phase("update"):
        block = torch.ones(192 * 2**20 // 4)
        del block
    first = mem.take()["memory/update_peak_mb"]
    with mem.phase("update"):
        block = torch.ones(192 * 2**20 // 4)
        del block
    with mem.phase("update"):
        torch.ones(16)
    assert mem.take()["memory/update_peak_mb"] == pytest.approx(first, abs=16)


@pytest.mark.parametrize("lag", [0, 1])
def test_every_step_logs_its_phases_peaks(smoke_cfg, pool, lag):
    from tests.tasks.test_train import SMALL, run_train

    *_, logged = run_train(smoke_cfg(*SMALL, f"overlap.lag={lag}"), pool)
    for m in logged:
        assert m["memory/update_peak_mb"] > 10 and m["memory/selection_peak_mb"] > 10
        drawn_by_child = bool(lag) and "overlap/drawn_here" not in m  # else made here while the generator started
        assert ("memory/generator_peak_mb" in m) == drawn_by_child or m["step"] == len(logged) - 1
    assert "memory/rollout_peak_mb" in logged[0]


@pytest.fixture(scope="module")
def pool():
    from tasks.data import arith

    return arith.generate(0, 40, "train", "default")


def test_a_resumed_step_reports_the_phases_an_uninterrupted_one_does(smoke_cfg, pool):
    """A run stopped after its step-2 checkpoint and resumed: step 2 reports the checkpoint write's peak (kept in the
    checkpoint pointer), as the uninterrupted run's step 2 does, not the stages the resuming process redid before
    training (here ``prepare``)."""
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training.entry import decided_lag, train, training
    from tests.tasks.test_train import SMALL, make_policy, run_train

    *_, want = run_train(smoke_cfg(*SMALL), pool)
    assert "memory/checkpoint_peak_mb" in want[2]


    cfg = smoke_cfg(*SMALL)
    policy = make_policy()
    feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
    run = open_run(cfg, track=False)
    with pytest.raises(RuntimeError, match="stopped"):
        with training(run, policy, pool, feats, decided_lag(run, policy, pool, None)) as trainer:
            for round_ in trainer.rounds():
                if round_.index == 1:
                    raise RuntimeError("stopped")
                trainer.play_round(round_)
    run.close("failed", {})
    resumed = open_run(cfg, run_id=run.run_id, track=False)
    try:
        with resumed.meter.stage("prepare"):  # a stage the pipeline redoes before training
            torch.ones(16)
        assert train(resumed, make_policy(), pool, feats).steps == 4
        got = [json.loads(line) for line in (resumed.dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        resumed.close("completed", {})
    phases = [[sorted(k for k in m if k.startswith("memory/")) for m in rows] for rows in (got, want)]
    assert phases[0] == phases[1]
    assert got[2]["memory/checkpoint_peak_mb"] > 10
