"""The ``pipeline`` flow: ingest -> prepare policy -> calibrate -> score -> train -> evaluate -> report."""

from __future__ import annotations

import logging
import time

from prefect import flow, get_run_logger

from tasks.config import Config, load_config
from tasks.run import open_run
from tasks.stages import (calibrate_stage, evaluate_stage, ingest_stage, prepare_stage, report_stage, score_stage,
                          train_stage)


def run_pipeline(cfg: Config, resume: str | None = None, parent_run_id: str | None = None,
                 run_name: str | None = None) -> dict:
    """The stages in order, in the calling flow. Returns the run summary (the CLI's ``--json`` object)."""
    t0 = time.perf_counter()
    run = open_run(cfg, run_id=resume, parent_run_id=parent_run_id, run_name=run_name)
    status, summary = "failed", {"run_id": run.run_id, "mlflow_run_id": run.tracker.run_id}
    try:
        data = ingest_stage(run)
        policy = prepare_stage(run)
        start = evaluate_stage(run, policy, data.test, "start", 0)
        calibration = calibrate_stage(run, policy, data.train)
        features = score_stage(run, policy, data.train)
        trained = train_stage(run, policy, data.train, features, data.test, calibration)
        end = evaluate_stage(run, policy, data.test, "end", trained["steps"])
        report = report_stage(run, policy, start, end, trained)
        status = "completed"
        summary |= {
            "status": status, "steps": trained["steps"],
            "eval_accuracy_start": start["overall"]["greedy_acc"], "eval_accuracy_end": end["overall"]["greedy_acc"],
            "eval_by_level_start": {str(k): v["greedy_acc"] for k, v in start["by_level"].items()},
            "eval_by_level_end": {str(k): v["greedy_acc"] for k, v in end["by_level"].items()},
            "effective_ratio": trained.get("last", {}).get("train/effective_ratio"),
            "wall_s": time.perf_counter() - t0, "device": run.meter.device,
            "device_hours": run.meter.device_hours(), "cost_usd": run.meter.usd(),
            "stage_seconds": dict(run.meter.seconds), "ingest": data.summary(),
            "model_path": report["model_path"], "model_version": report["model_version"],
            "ledger": str(run.ledger.path), "tracking_uri": run.tracking_uri, "run_dir": str(run.dir),
        }
        return summary
    finally:
        summary["status"] = status
        summary.setdefault("wall_s", time.perf_counter() - t0)
        run.close(status, summary)


@flow(name="pipeline", log_prints=True)
def pipeline(config: str | None = None, overrides: list[str] | None = None, resume: str | None = None) -> dict:
    """The whole rlsift pipeline on one config (a YAML path plus dotted overrides)."""
    cfg = load_config(config, overrides or [])
    logging.getLogger("rlsift").info("config validated")
    summary = run_pipeline(cfg, resume=resume)
    get_run_logger().info("run %s %s: accuracy %.3f -> %.3f in %.0f s", summary["run_id"], summary["status"],
                          summary["eval_accuracy_start"], summary["eval_accuracy_end"], summary["wall_s"])
    return summary
