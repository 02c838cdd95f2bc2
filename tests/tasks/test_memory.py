"""Peak memory per phase (tasks/records/memory.py): each phase's own peak, reset between phases, in every step's
metrics, and the generator process's own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT


def _in_a_fresh_process(body: str) -> dict:
    """``body`` run by a new Python process, which prints one JSON object: a process's resident set moves with
    whatever else it runs, so the pytest process (threads and freed arenas that earlier tests left) cannot time a
    phase's peak to the megabyte; a process of its own can."""
    code = ("import json, torch\nfrom tasks.records.cost import CostMeter\n"
            "from tasks.records.memory import PeakMemory, own_peak_mb\n" + textwrap.dedent(body))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_phase_gets_its_own_peak_and_take_forgets_them():
    got = _in_a_fresh_process("""
        mem = PeakMemory("cpu")
        meter = CostMeter(prices={"cpu": 0.1}, device="cpu", devices=1, memory=mem)
        with meter.stage("big"):
            block = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
            del block
        with meter.stage("small"):
            torch.ones(16)
        got = mem.take()
        print(json.dumps({"got": got, "stages": sorted(meter.seconds), "resettable": mem.resettable,
                          "now": own_peak_mb("cpu"), "again": mem.take()}))
    """)
    peaks = got["got"]
    assert set(peaks) == {"memory/big_peak_mb", "memory/small_peak_mb"} and got["stages"] == ["big", "small"]
    assert got["resettable"]
    assert peaks["memory/big_peak_mb"] >= peaks["memory/small_peak_mb"] + 128  # the small phase does not inherit it
    assert peaks["memory/small_peak_mb"] <= got["now"] + 1
    assert got["again"] == {}


def test_a_phase_run_twice_in_a_step_reports_its_larger_peak():
    got = _in_a_fresh_process("""
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
        print(json.dumps({"first": first, "twice": mem.take()["memory/update_peak_mb"], "small": own_peak_mb("cpu")}))
    """)
    assert got["twice"] == pytest.approx(got["first"], abs=16)
    assert got["first"] >= got["small"] + 128  # the 192 MiB phase's peak was seen at all


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
