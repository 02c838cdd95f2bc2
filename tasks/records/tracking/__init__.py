"""Experiment tracking: the only package that imports MLflow. Import everything from here
(``from tasks.records.tracking import MlflowTracker``); the modules, by concern:

* ``protocol``: the :class:`Tracker` protocol a run logs through; :class:`NullTracker`, which tracks nothing;
  :func:`default_uri`, a root folder's local store (no MLflow).
* ``tracker``: :class:`MlflowTracker`, the run's logger (metrics, params, tags, artifacts, tables, the name and
  Description, model registration, the final status) through a write-ahead outbox;
  :func:`sync`, which sends what an outage left behind.
* ``outbox``: the outbox file and how its items are grouped into requests (no MLflow).
* ``registry``: the trained policy as an MLflow Model in the model registry, and back (:func:`champion_model`,
  :func:`latest_model`); the ``champion`` alias moved by ``champion``'s rule (no MLflow).
* ``describe``: the run's tags beyond metrics: name, Description, source commit, Prefect flow run (no MLflow).
* ``query``: reading runs back (:func:`run_info`, :func:`metric_history`, :func:`run_url`); the UI's pages on its
  model-training side (:func:`experiment_page`) and how to open a UI on a local store (:func:`ui_hint`).
* ``store``: a new local store's tables created ahead of its run (``create_local_store``, flows/startup.py).

See docs/operations.md "What MLflow shows" and "Tracking outages".
"""

import os

# Fail fast on an unreachable server instead of MLflow's default minutes of retries; the outbox retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow prints "View run ... at: <url>" on stdout when a run on a server ends; stdout is the CLI's --json channel.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

from tasks.records.tracking.champion import CHAMPION  # noqa: E402
from tasks.records.tracking.describe import flow_run_tags, pending_registration  # noqa: E402
from tasks.records.tracking.outbox import Outbox  # noqa: E402
from tasks.records.tracking.protocol import NullTracker, Tracker, default_uri  # noqa: E402
from tasks.records.tracking.query import (  # noqa: E402
    experiment_page,
    metric_history,
    mlflow_command,
    run_info,
    run_url,
    ui_hint,
)
from tasks.records.tracking.registry import (  # noqa: E402
    champion_model,
    checkpoint_folder,
    latest_model,
    model_version_tags,
    save_mlflow_model,
)
from tasks.records.tracking.tracker import EXPERIMENT_KIND, MlflowTracker, sync  # noqa: E402

__all__ = ["CHAMPION", "EXPERIMENT_KIND", "MlflowTracker", "NullTracker", "Outbox", "Tracker", "champion_model",
           "checkpoint_folder", "default_uri",
           "experiment_page", "flow_run_tags", "latest_model", "metric_history", "mlflow_command",
           "model_version_tags", "pending_registration", "run_info", "run_url", "save_mlflow_model", "sync", "ui_hint"]
