"""Reading runs back from MLflow: a run's UI page, its params, metrics, tags and artifacts, a metric's history
(reports, the CLI, tests)."""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from tasks.records.layout import mlflow_key


def run_page(uri: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run on the tracking server at ``uri``."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def run_url(uri: str, run_id: str) -> str | None:
    """The MLflow UI page of a run on a tracking server (None for a local store: no server to link to)."""
    if not uri.startswith(("http://", "https://")):
        return None
    return run_page(uri, MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id, run_id)


def run_info(uri: str, run_id: str) -> dict[str, Any]:
    """Params, latest metrics, tags, status, name and artifact names of a run (tests and reports)."""
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    arts = [a.path for a in client.list_artifacts(run_id)]
    return {"params": run.data.params, "metrics": run.data.metrics, "tags": run.data.tags,
            "status": run.info.status, "name": run.info.run_name, "artifacts": arts}


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged value of a metric, in step order."""
    client = MlflowClient(tracking_uri=uri)
    hist = sorted(client.get_metric_history(run_id, mlflow_key(key)), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in hist]
