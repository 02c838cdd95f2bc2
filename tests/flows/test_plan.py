"""The plan end to end: `rlsift plan` measures and chooses without training; `plan.auto` trains the choice."""

import json
from pathlib import Path

import torch

from flows.pipeline import pipeline, plan_flow
from tasks.records.ledger import Ledger
from tasks.records.tracking import run_info
from tasks.training.plan import Plan

SMOKE = str(Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny.yaml")


def test_plan_flow_measures_predicts_and_records_without_training(tmp_path, prefect_harness):
    root = tmp_path / "root"
    out = plan_flow(config=SMOKE, overrides=[f"paths.root={root}", "plan.candidates=[grpo_n4,dapo,dots_screen]"])
    plan = Plan.load(Path(out["run_dir"]) / "plan.json")
    assert plan.to_json() == out["plan"]
    assert abs(sum(plan.shares.values()) - 1) < 1e-9 and plan.g == 4
    assert plan.costs.generate_s > 0 and plan.costs.update_s > 0 and plan.costs.completion_tokens > 0
    assert [p.name for p in plan.predictions] == ["grpo_n4", "dapo", "dots_screen"]  # the bundled task has solutions
    assert plan.baseline.name == "grpo" and plan.baseline.clock == 1.0
    assert plan.choice in {"grpo", "grpo_n4", "dapo", "dots_screen"} and plan.reason.startswith(plan.choice)
    dapo = next(p for p in plan.predictions if p.name == "dapo")
    assert 0 <= dapo.effective_ratio <= 1 and dapo.generated >= plan.baseline.generated  # it generates more
    assert "| composition |" in out["table"] and plan.reason in out["table"]
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        assert led.run_status(out["run_id"]) == "planned"
        assert led.query("SELECT count(*) AS c FROM groups WHERE run_id = ?", [out["run_id"]])[0]["c"] == 0
    info = run_info(out["tracking_uri"], out["mlflow_run_id"])
    assert info["tags"]["rlsift.plan.choice"] == plan.choice and "plan.json" in info["artifacts"]
    assert float(info["tags"]["plan/pool_mixed"]) == round(plan.shares["mixed"], 4)  # one value, not a chart
    assert not any(k.startswith("plan/") for k in info["metrics"])

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert "plan" in {a.key for a in client.read_artifacts()}


def test_auto_trains_the_plans_choice(tmp_path, prefect_harness):
    root = tmp_path / "root"
    # groups of 8 against the candidate's groups of 4 (half the generation) with no signal floor: it is chosen
    s = pipeline(config=SMOKE, overrides=[f"paths.root={root}", "rollout.n=8", "plan.auto=true",
                                          "plan.candidates=[grpo_n4]", "plan.min_signal=0", "eval.samples=0"])
    assert s["status"] == "completed" and s["plan"]["choice"] == "grpo_n4"
    assert s["plan"]["predicted_clock"] < 1 and s["plan"]["reason"].startswith("grpo_n4")
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        ns = {r["n"] for r in led.query("SELECT n FROM groups WHERE run_id = ?", [s["run_id"]])}
        stored = json.loads(led.query("SELECT config FROM runs WHERE run_id = ?", [s["run_id"]])[0]["config"])
    assert ns == {4}  # trained with the choice's groups of 4, not the config's 8
    assert stored["plan"]["auto"] is True and stored["rollout"]["n"] == 8  # the run's own config is kept
    assert torch.tensor(s["plan"]["predicted_effective_ratio"]).isfinite()
    assert (Path(s["run_dir"]) / "plan.md").is_file()
