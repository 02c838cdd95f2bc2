"""Reading runs back from MLflow: a run's UI page, its params, metrics, tags and artifacts, a metric's history
(reports, the CLI, tests), and how to open MLflow's UI on a local store.

MLflow 3.17's UI has two sides, GenAI and model training, and opens an experiment on the side its page's
``workflowType`` names, else the one the browser last chose, GenAI at first (its traces overview: "Traces 0" for
rlsift). The experiment's ``mlflow.experimentKind`` tag (tasks/records/tracking/tracker.py ``EXPERIMENT_KIND``)
chose the side in earlier 3.x releases; 3.17 reads only the page's ``workflowType`` and the browser's choice. So
every link rlsift gives names the model-training side (:data:`TRAINING_SIDE`).
"""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from tasks.records.commands import command, program
from tasks.records.layout import mlflow_key

#: The query that opens a page of MLflow 3.17's UI on its model-training side (runs, not traces).
TRAINING_SIDE = "workflowType=machine_learning"
#: Where ``mlflow ui`` serves when given no host or port.
MLFLOW_UI = "http://127.0.0.1:5000"


def run_page(uri: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run on the tracking server at ``uri``, on the model-training side."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_SIDE}"


def experiment_page(uri: str, experiment_id: str) -> str:
    """The MLflow UI page of an experiment's runs on the tracking server at ``uri`` (not its GenAI overview)."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs?{TRAINING_SIDE}"


def mlflow_command() -> str:
    """This Python's own ``mlflow`` by its full path (tasks/records/commands.py ``program``): a command printed with
    it runs in a shell whose ``PATH`` has no venv."""
    return program("mlflow")


def ui_hint(uri: str, experiment_id: str | None, run_id: str) -> str:
    """Where to see a run in MLflow's UI: its page on a tracking server; for a local store (``sqlite:///...``) the one
    command that opens a UI on it, then the run's page there."""
    if uri.startswith(("http://", "https://")):
        return run_page(uri, experiment_id, run_id) if experiment_id else f"{uri} (run {run_id})"
    page = f", then {run_page(MLFLOW_UI, experiment_id, run_id)}" if experiment_id else ""
    return f"`{command('ui', '--backend-store-uri', uri, tool='mlflow')}`{page}"


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
