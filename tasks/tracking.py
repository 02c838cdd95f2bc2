"""Experiment tracking: the only module that imports MLflow.

:class:`MlflowTracker` logs by explicit run id through ``MlflowClient`` (MLflow's fluent "active run" is
thread-local and Prefect may run tasks on other threads: stack.md §2). Metrics are queued and sent in
batches by a background thread, so the training loop never waits on the tracking server. When the
server does not answer, nothing is lost: pending metrics, params and artifacts stay in an on-disk
outbox (``<run dir>/outbox.jsonl``) and are sent when it answers again, or by :meth:`finish`, with a
warning while it is away. :class:`NullTracker` is the do-nothing stand-in for tests and dry runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Protocol

# Fail fast on an unreachable server instead of MLflow's default minutes of retries; the outbox retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

log = logging.getLogger("rlsift.tracking")


class Tracker(Protocol):
    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def register_model(self, local_dir: str | Path, name: str, tags: dict[str, str]) -> str | None: ...
    def finish(self, status: str = "FINISHED") -> None: ...


def default_uri(root: str | Path) -> str:
    return f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def _clean(key: str) -> str:
    """MLflow-safe metric/param keys (no '@')."""
    return key.replace("@", "_at_")


class MlflowTracker:
    """Logs one MLflow run, surviving tracking-server outages through an on-disk outbox."""

    def __init__(self, uri: str, experiment: str, run_dir: str | Path, *, run_name: str | None = None,
                 run_id: str | None = None, parent_run_id: str | None = None, flush_s: float = 2.0):
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.outbox = self.run_dir / "outbox.jsonl"
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._away_since: float | None = None
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                art = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri() \
                    if uri.startswith("sqlite:") else None
                exp_id = self.client.create_experiment(experiment, artifact_location=art)
            else:
                exp_id = exp.experiment_id
            tags = {"mlflow.runName": run_name} if run_name else {}
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            run_id = self.client.create_run(exp_id, tags=tags, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(flush_s,), daemon=True, name="mlflow-flush")
        self._thread.start()

    # ---- queueing -------------------------------------------------------------------------------
    def _put(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(item)

    def log_params(self, params: dict[str, Any]) -> None:
        self._put({"kind": "params", "params": {_clean(k): str(v)[:6000] for k, v in params.items()}})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._put({"kind": "metrics", "step": int(step), "ts": ts,
                   "metrics": {_clean(k): float(v) for k, v in metrics.items() if v is not None}})

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queue a file or folder; it is copied first so later changes or deletion cannot lose it."""
        src = Path(path)
        keep = self.run_dir / "outbox-artifacts" / f"{time.time_ns()}" / src.name
        keep.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, keep)
        self._put({"kind": "artifact", "path": str(keep), "artifact_path": artifact_path})

    def log_dict(self, data: Any, name: str) -> None:
        path = self.run_dir / name
        path.write_text(json.dumps(data, indent=2, default=str))
        self.log_artifact(path)

    # ---- sending --------------------------------------------------------------------------------
    def _send(self, item: dict[str, Any]) -> None:
        kind = item["kind"]
        if kind == "metrics":
            self.client.log_batch(self.run_id, metrics=[
                Metric(k, v, item["ts"], item["step"]) for k, v in item["metrics"].items()])
        elif kind == "params":
            params = [Param(k, v) for k, v in item["params"].items()]
            for i in range(0, len(params), 90):
                self.client.log_batch(self.run_id, params=params[i:i + 90])
        elif kind == "tags":
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in item["tags"].items()])
        elif kind == "artifact":
            p = Path(item["path"])
            if p.is_dir():
                self.client.log_artifacts(self.run_id, str(p), item["artifact_path"] or p.name)
            else:
                self.client.log_artifact(self.run_id, str(p), item["artifact_path"])

    def flush(self) -> bool:
        """Send the outbox, then everything queued. Returns True when nothing is left unsent."""
        with self._lock:
            items, self._pending = self._pending, []
        backlog = [json.loads(x) for x in self.outbox.read_text().splitlines()] if self.outbox.exists() else []
        todo = backlog + items
        if not todo:
            return True
        # merge consecutive metric items into fewer requests
        sent = 0
        try:
            for item in todo:
                self._send(item)
                sent += 1
        except Exception as err:  # noqa: BLE001 -- any transport error: keep everything, retry later
            rest = todo[sent:]
            self.outbox.write_text("".join(json.dumps(x) + "\n" for x in rest))
            if self._away_since is None:
                self._away_since = time.time()
                log.warning("MLflow at %s is not answering (%s); keeping %d items in %s and retrying",
                            self.uri, type(err).__name__, len(rest), self.outbox)
            return False
        if self.outbox.exists():
            self.outbox.unlink()
        if self._away_since is not None:
            log.warning("MLflow is back after %.0f s; sent %d kept items", time.time() - self._away_since, len(todo))
            self._away_since = None
        shutil.rmtree(self.run_dir / "outbox-artifacts", ignore_errors=True) if not self._pending else None
        return True

    def _loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self.flush()

    def register_model(self, local_dir: str | Path, name: str, tags: dict[str, str]) -> str | None:
        """Log a model folder under ``model/`` and register it as a new version of ``name``."""
        self.log_artifact(local_dir, "model")
        if not self.flush():
            log.warning("model not registered: MLflow unreachable (the folder is kept at %s)", local_dir)
            return None
        try:
            self.client.get_registered_model(name)
        except mlflow.exceptions.MlflowException:
            self.client.create_registered_model(name)
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/model"
        mv = self.client.create_model_version(name, source, run_id=self.run_id, tags=tags)
        return str(mv.version)

    def latest_model(self, name: str) -> tuple[str, str] | None:
        """(version, local path of its files) of the newest registered version, or None."""
        try:
            versions = self.client.search_model_versions(f"name = '{name}'")
        except Exception:  # noqa: BLE001 -- no such model yet
            return None
        if not versions:
            return None
        mv = max(versions, key=lambda v: int(v.version))
        path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, tracking_uri=self.uri)
        return str(mv.version), path

    def finish(self, status: str = "FINISHED") -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        deadline = time.time() + float(os.environ.get("RLSIFT_TRACKING_FINAL_WAIT_S", "30"))
        while not self.flush():
            if time.time() > deadline:
                log.warning("MLflow still unreachable: %s keeps the unsent items; `rlsift sync %s` sends them",
                            self.outbox, self.run_dir)
                return
            time.sleep(2)
        self.client.set_terminated(self.run_id, status=status)


def sync(run_dir: str | Path, uri: str, run_id: str) -> bool:
    """Send a run folder's outbox (after an outage that outlived the run)."""
    t = MlflowTracker.__new__(MlflowTracker)
    t.uri, t.client, t.run_dir, t.run_id = uri, MlflowClient(tracking_uri=uri), Path(run_dir), run_id
    t.outbox, t._lock, t._pending, t._away_since = Path(run_dir) / "outbox.jsonl", threading.Lock(), [], None
    return t.flush()


class NullTracker:
    """Tracks nothing (tests, dry runs)."""

    run_id = "none"

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_dict(self, data: Any, name: str) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def register_model(self, local_dir: str | Path, name: str, tags: dict[str, str]) -> str | None:
        return None
    def flush(self) -> bool:
        return True
    def finish(self, status: str = "FINISHED") -> None: ...


def run_info(uri: str, run_id: str) -> dict[str, Any]:
    """Params, latest metrics, tags and artifact names of a run (tests and reports)."""
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    arts = [a.path for a in client.list_artifacts(run_id)]
    return {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags,
            "status": run.info.status, "artifacts": arts}


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
