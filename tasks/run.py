"""The run context every stage receives: config, folders, ledger, tracker and cost meter of one run."""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasks.config import Config, to_json
from tasks.cost import CostMeter
from tasks.ledger import Ledger
from tasks.tracking import MlflowTracker, NullTracker, Tracker, default_uri

log = logging.getLogger("rlsift")


def show_progress() -> bool:
    """Progress bars only on an interactive terminal, never in CI logs."""
    return sys.stderr.isatty() and not os.environ.get("CI")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is visible")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, name)


@dataclass
class Run:
    """One pipeline run. Created by :func:`open_run`; closed by :meth:`close`."""

    cfg: Config
    run_id: str
    root: Path
    dir: Path
    ledger: Ledger
    tracker: Tracker
    meter: CostMeter
    device: torch.device
    tracking_uri: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)

    def log_stage_cost(self, stage: str, step: int = 0) -> None:
        """Record a finished stage's wall time, device hours and money in the ledger and as metrics."""
        s = self.meter.seconds.get(stage, 0.0)
        self.ledger.add_rows("stages", self.run_id, [{
            "stage": stage, "wall_s": s, "device": self.meter.device,
            "device_hours": self.meter.device_hours(stage), "cost": self.meter.usd(stage)}])
        self.log_metrics({k: v for k, v in self.meter.metrics().items() if stage in k or "/" in k and
                          k in ("cost/device_hours", "cost/usd")}, step)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        self.ledger.finish_run(self.run_id, status, summary)
        self.ledger.close()
        self.tracker.finish("FINISHED" if status == "completed" else "FAILED")


def open_run(cfg: Config, *, run_id: str | None = None, track: bool = True, parent_run_id: str | None = None,
             run_name: str | None = None) -> Run:
    """Create (or, given an existing ``run_id``, reopen) a run under ``cfg.paths.root``."""
    root = Path(cfg.paths.root).resolve()
    resume = run_id is not None
    run_id = run_id or f"{uuid.uuid4().hex[:12]}"
    run_dir = root / "runs" / run_id
    if resume and not run_dir.exists():
        raise FileNotFoundError(f"no run {run_id} under {root / 'runs'}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(root / "ledger.duckdb")
    uri = cfg.tracking.uri or default_uri(root)
    mlflow_id = None
    if resume:
        row = ledger.query("SELECT mlflow_run_id FROM runs WHERE run_id = ?", [run_id])
        mlflow_id = row[0]["mlflow_run_id"] if row else None
    tracker: Tracker = (MlflowTracker(uri, cfg.tracking.experiment, run_dir, run_name=run_name or run_id,
                                      run_id=mlflow_id, parent_run_id=parent_run_id) if track else NullTracker())
    ledger.start_run(run_id, cfg.model_dump(mode="json"), tracker.run_id)
    (run_dir / "config.json").write_text(to_json(cfg))
    if not resume:
        tracker.log_params(cfg.flat())
        tracker.set_tags({"rlsift.run_id": run_id, "rlsift.root": str(root)})
        tracker.log_artifact(run_dir / "config.json")
    device = resolve_device(cfg.model.device)
    meter = CostMeter(prices=dict(cfg.cost.prices), device=cfg.cost.device)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    run = Run(cfg=cfg, run_id=run_id, root=root, dir=run_dir, ledger=ledger, tracker=tracker, meter=meter,
              device=device, tracking_uri=uri)
    log.info("run %s: ledger %s, MLflow %s (run %s)", run_id, ledger.path, uri, tracker.run_id)
    return run


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
