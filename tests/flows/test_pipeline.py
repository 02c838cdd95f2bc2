"""The `pipeline` flow end to end on the smoke budget under Prefect's test harness: ledger and MLflow contents."""

from pathlib import Path

from flows.pipeline import pipeline
from tasks.records.ledger import Ledger
from tasks.records.tracking import metric_history, run_info

SMOKE = str(Path(__file__).resolve().parents[2] / "conf" / "smoke.yaml")


def test_pipeline_flow_records_everything(tmp_path, prefect_harness):
    root = tmp_path / "root"
    s = pipeline(config=SMOKE, overrides=[f"paths.root={root}", "eval.every=2"])
    assert s["status"] == "completed" and s["steps"] == 4
    assert 0 <= s["eval_accuracy_start"] <= 1 and 0 <= s["eval_accuracy_end"] <= 1
    assert s["device_hours"] > 0 and s["wall_s"] > 0
    paired = s["eval_paired"]  # prompt-by-prompt change over the 24 test prompts
    net = round(24 * (s["eval_accuracy_end"] - s["eval_accuracy_start"]))
    assert paired["turned_right"] - paired["turned_wrong"] == net
    assert 0 < paired["mcnemar_p"] <= 1

    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        run = led.query("SELECT * FROM runs WHERE run_id = ?", [s["run_id"]])[0]
        assert run["status"] == "completed" and run["mlflow_run_id"] == s["mlflow_run_id"]
        assert len(led.prompts(split="train")) == 120 and len(led.prompts(split="test")) == 24
        ref = led.query("SELECT * FROM reference WHERE run_id = ?", [s["run_id"]])
        assert len(ref) == 8 and all(r["n"] == 4 and 0 <= r["success_rate"] <= 1 for r in ref)
        steps = led.query("SELECT step, count(*) AS c FROM groups WHERE run_id = ? GROUP BY step ORDER BY step",
                          [s["run_id"]])
        assert [(r["step"], r["c"]) for r in steps] == [(0, 8), (1, 8), (2, 8), (3, 8)]
        assert len(led.query("SELECT * FROM features WHERE run_id = ?", [s["run_id"]])) == 120
        phases = {r["phase"] for r in led.query("SELECT phase FROM evals WHERE run_id = ?", [s["run_id"]])}
        assert phases == {"start", "during", "end"}
        stages = {r["stage"] for r in led.query("SELECT stage FROM stages WHERE run_id = ?", [s["run_id"]])}
        assert {"ingest", "prepare", "calibrate", "score", "train", "eval_start", "eval_end"} <= stages

    info = run_info(s["tracking_uri"], s["mlflow_run_id"])
    assert info["status"] == "FINISHED"
    assert info["params"]["train.steps"] == "4" and info["params"]["select.method"] == "uniform"
    for key in ("train/reward_mean", "train/effective_ratio", "eval/accuracy", "cost/device_hours",
                "time/rollout_s", "rollout/tokens_per_s", "calibrate/success_mean", "eval/mcnemar_p"):
        assert key in info["metrics"], key
    assert [st for st, _ in metric_history(s["tracking_uri"], s["mlflow_run_id"], "train/reward_mean")] == [0, 1, 2, 3]
    for art in ("config.json", "eval_table.md", "training_curves.png", "eval_end.json", "model"):
        assert art in info["artifacts"], art
    assert s["model_version"] == "1"
