"""RunSummary.to_dict: exactly the keys of the run's status (what ``rlsift run --json`` prints)."""

import json
from dataclasses import replace

from flows.pipeline import RunSummary
from tasks.training.evaluate import PairedChange

WHERE = {"run_id", "mlflow_run_id", "name", "status", "wall_s", "ledger", "tracking_uri", "run_dir"}
COMPLETED = WHERE | {"ingest", "steps", "eval_accuracy_start", "eval_accuracy_end", "eval_by_level_start",
                     "eval_by_level_end", "eval_paired", "effective_ratio", "device", "precision", "device_hours",
                     "cost_usd", "stage_seconds", "model_path", "model_version", "parent_version", "data_fingerprint",
                     "policy_path", "resumed", "overlap", "plan"}


def base() -> RunSummary:
    return RunSummary(run_id="r", mlflow_run_id="m", ledger="/l", tracking_uri="sqlite:///x", run_dir="/d",
                      wall_s=1.5)


def test_keys_by_status():
    assert set(base().to_dict()) == WHERE and base().to_dict()["status"] == "failed"  # failed before ingest
    failed = replace(base(), ingest={"new": 3})
    assert set(failed.to_dict()) == WHERE | {"ingest"}
    skipped = replace(failed, status="skipped", reason="nothing new")
    assert skipped.to_dict() == {**failed.to_dict(), "status": "skipped", "reason": "nothing new",
                                 "model_version": None}
    done = replace(failed, status="completed", steps=4, eval_accuracy_start=0.5, eval_accuracy_end=0.75,
                   eval_by_level_start={"1": 0.5, "None": 0.0}, eval_paired=PairedChange(3, 1, 0.625))
    out = done.to_dict()
    assert set(out) == COMPLETED
    assert out["eval_paired"] == {"turned_right": 3, "turned_wrong": 1, "mcnemar_p": 0.625}
    assert json.loads(json.dumps(out))["eval_by_level_start"] == {"1": 0.5, "None": 0.0}
    assert replace(done, eval_paired=None).to_dict()["eval_paired"] is None
