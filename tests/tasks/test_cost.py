"""Device-hour and money accounting (tasks/records/cost.py) and its records: the ledger's stages table, the cost/*
totals in MLflow and the per-stage cost table."""

import json
import time
from pathlib import Path

import pytest
import torch
from mlflow.artifacts import download_artifacts

from tasks.records.cost import CostMeter, detect_device
from tasks.records.tracking import metric_history, run_info
from tasks.run import COST_TABLE, open_run

PRICES = {"cpu": 0.10, "nvidia-h200": 3.50, "cuda": 2.00}


def test_half_an_hour_on_two_h200s_is_one_device_hour():
    meter = CostMeter(prices=PRICES, device="nvidia-h200", devices=2)
    meter.add("train", 1800.0)
    # 1800 s = 0.5 h, times 2 devices = 1.0 device hour; at $3.50 per device hour = $3.50
    assert meter.device_hours("train") == pytest.approx(1.0)
    assert meter.usd("train") == pytest.approx(3.50)
    assert meter.usd() == pytest.approx(3.50)


def test_stages_add_up_per_stage_and_in_total():
    meter = CostMeter(prices=PRICES, device="cpu", devices=1)
    meter.add("ingest", 36.0)
    meter.add("rollout", 540.0)
    meter.add("update", 180.0)
    meter.add("rollout", 180.0)  # a stage met twice accumulates
    # ingest: 36 s = 0.01 h -> 0.01 device h, $0.001; rollout: 720 s = 0.2 device h, $0.02;
    # update: 180 s = 0.05 device h, $0.005; all: 936 s = 0.26 device h, $0.026
    m = meter.metrics()
    assert m["time/rollout_s"] == pytest.approx(720.0)
    assert m["cost/ingest_device_hours"] == pytest.approx(0.01) and m["cost/ingest_usd"] == pytest.approx(0.001)
    assert m["cost/rollout_usd"] == pytest.approx(0.02) and m["cost/update_device_hours"] == pytest.approx(0.05)
    assert m["cost/device_hours"] == pytest.approx(0.26) and m["cost/usd"] == pytest.approx(0.026)
    # a group of stages (the training loop's phases): 900 s -> 0.25 device h, $0.025
    assert meter.wall_seconds(("rollout", "update")) == pytest.approx(900.0)
    assert meter.usd(("rollout", "update", "missing")) == pytest.approx(0.025)


def test_unpriced_devices_fall_back_to_the_generic_price():
    # an NVIDIA type without its own price costs the generic "cuda" price; anything else the CPU price
    b200 = CostMeter(prices=PRICES, device="nvidia-b200", devices=4)
    b200.add("update", 900.0)  # 0.25 h x 4 devices = 1 device hour at $2.00
    assert b200.usd() == pytest.approx(2.00)
    other = CostMeter(prices=PRICES, device="tpu-v5", devices=1)
    other.add("update", 3600.0)
    assert other.usd() == pytest.approx(0.10)


def test_stage_timer_counts_elapsed_time_even_when_the_stage_fails():
    meter = CostMeter(prices=PRICES, device="cpu", devices=1)
    with meter.stage("score"):
        time.sleep(0.05)
    with pytest.raises(RuntimeError), meter.stage("score"):
        time.sleep(0.05)
        raise RuntimeError("boom")
    assert 0.1 <= meter.seconds["score"] < 5


def test_state_dict_round_trip():
    meter = CostMeter(prices=PRICES, device="cpu", devices=1)
    meter.add("rollout", 12.5)
    again = CostMeter(prices=PRICES, device="cpu", devices=1)
    again.load_state_dict(meter.state_dict())
    assert again.metrics() == meter.metrics()


def test_detected_device():
    kind, count = detect_device()
    if torch.cuda.is_available():
        assert kind.startswith("nvidia-") or kind == "cuda"
        assert count == torch.cuda.device_count()
    else:
        assert (kind, count) == ("cpu", 1)


def test_stage_costs_reach_the_ledger_and_mlflow(smoke_cfg, tmp_path):
    cfg = smoke_cfg(f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "cost.device=cpu",
                    "cost.prices={cpu: 0.10}")
    run = open_run(cfg)
    run.meter.devices = 1
    run.meter.add("ingest", 36.0)
    run.log_stage_cost("ingest")
    run.meter.add("rollout", 1800.0)
    run.meter.add("update", 1800.0)
    run.log_stage_cost("train", 5, parts=("rollout", "update"))
    stages = run.ledger.query("SELECT stage, wall_s, device, device_hours, cost FROM stages WHERE run_id = ?",
                              [run.run_id])
    uri, rid = run.tracking_uri, run.tracker.run_id
    run.close("completed", {})
    # train = rollout + update = 3600 s on 1 CPU = 1 device hour at $0.10
    assert stages == [
        {"stage": "ingest", "wall_s": 36.0, "device": "cpu", "device_hours": pytest.approx(0.01),
         "cost": pytest.approx(0.001)},
        {"stage": "train", "wall_s": 3600.0, "device": "cpu", "device_hours": pytest.approx(1.0),
         "cost": pytest.approx(0.10)}]
    info = run_info(uri, rid)
    # MLflow: the run totals as series, the per-stage cost as one table (no chart per stage)
    assert [k for k in info["metrics"] if k.startswith("cost/")] == ["cost/device_hours", "cost/usd"]
    assert info["metrics"]["time/train_s"] == pytest.approx(3600.0)
    table = json.loads(Path(download_artifacts(run_id=rid, artifact_path=COST_TABLE, dst_path=str(tmp_path / "got"),
                                               tracking_uri=uri)).read_text())
    rows = {r[0]: dict(zip(table["columns"], r, strict=True)) for r in table["data"]}
    assert table["columns"] == ["stage", "seconds", "device_hours", "usd", "device"]
    assert rows["rollout"]["usd"] == pytest.approx(0.05) and rows["ingest"]["usd"] == pytest.approx(0.001)
    assert rows["update"]["device_hours"] == pytest.approx(0.5) and rows["update"]["device"] == "cpu"
    assert rows["total"] == {"stage": "total", "seconds": 3636.0, "device_hours": pytest.approx(1.01),
                             "usd": pytest.approx(0.101), "device": "cpu"}
    # the run total after each stage: $0.001 at step 0, $0.101 at step 5
    assert metric_history(uri, rid, "cost/usd") == [(0, pytest.approx(0.001)), (5, pytest.approx(0.101))]


def test_describe_machine_names_the_cpu_its_cores_and_torch_threads():
    import os
    import re

    import torch

    from tasks.records.cost import describe_machine

    text = describe_machine()
    cores = len(os.sched_getaffinity(0))
    assert f"{cores} cores" in text and f"torch {torch.get_num_threads()} threads" in text
    if os.path.exists("/proc/cpuinfo"):
        model = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
        if model:
            assert text.startswith(model.group(1).strip()) and " MHz" in text
