"""What an MLflow run's page says about the run besides its metrics: its name, its Description, the code it ran
and the Prefect flow run that ran it, as MLflow's run tags. No MLflow import: tag names and values only.

* ``mlflow.runName``: what ran (tasks/run.py ``run_label``; an ``auto`` run is renamed after the plan's choice).
* ``mlflow.note.content``: the run's Description, the first thing the run's Overview shows (Markdown); the
  pipeline writes a few lines when the run ends (flows/summary.py ``describe``). What the tracker learns only when it
  sends them is settled then (:func:`settled`): a registration that waited out an MLflow outage, and the outage.
* ``mlflow.source.git.commit``, ``mlflow.source.git.branch``, ``mlflow.source.name``, ``mlflow.source.type``: the
  project's commit (``git rev-parse HEAD``), branch and folder, when it is a git checkout (the run's Overview shows
  its Source only when it has a name).
* ``rlsift.prefect.flow_run_id``, ``rlsift.prefect.flow_run_url``: the Prefect flow run, and its page in the
  Prefect UI when a Prefect API URL is configured (a temporary server's page is gone when the run ends).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tasks.records.tracking.outbox import Outage

RUN_NAME = "mlflow.runName"
DESCRIPTION = "mlflow.note.content"
PARENT_RUN = "mlflow.parentRunId"
GIT_COMMIT = "mlflow.source.git.commit"
GIT_BRANCH = "mlflow.source.git.branch"
SOURCE_NAME = "mlflow.source.name"
SOURCE_TYPE = "mlflow.source.type"
FLOW_RUN_ID = "rlsift.prefect.flow_run_id"
FLOW_RUN_URL = "rlsift.prefect.flow_run_url"

#: The project's folder (the one holding ``tasks/``).
PROJECT = Path(__file__).resolve().parents[3]


def source_tags(project: Path = PROJECT) -> dict[str, str]:
    """The commit, branch (none when detached) and folder of ``project`` when it is the top of a git checkout (a clone
    or a worktree), else ``{}`` (an installed copy, no git)."""
    try:
        out = subprocess.run(["git", "-C", str(project), "rev-parse", "--show-toplevel", "HEAD", "--abbrev-ref",
                              "HEAD"], capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    if len(out) != 3 or Path(out[0]).resolve() != project.resolve():
        return {}
    return {SOURCE_NAME: str(project), SOURCE_TYPE: "LOCAL", GIT_COMMIT: out[1],
            **({GIT_BRANCH: out[2]} if out[2] != "HEAD" else {})}


def flow_run_tags(flow_run_id: str, ui_url: str | None) -> dict[str, str]:
    """The Prefect flow run that runs the run: its id, and ``ui_url`` (its page) when there is one."""
    return {FLOW_RUN_ID: flow_run_id, **({FLOW_RUN_URL: ui_url} if ui_url else {})}


def pending_registration(name: str) -> str:
    """How a Description says that the registration of model ``name`` waits in the outbox (MLflow unreachable when
    the run registered it); the tracker replaces it once it has sent the registration (:func:`settled`)."""
    return f"{name} not registered yet: MLflow unreachable, the registration is queued"


def settled(text: str, registered: dict[str, str], outages: list[Outage], now: float | None = None) -> str:
    """A Description as it is sent: each model in ``registered`` (name -> version, the registrations sent) said
    registered where it said :func:`pending_registration`, and a last line on the MLflow ``outages`` the run went
    through (a lasting one ends ``now``: the Description goes out with what the outbox held)."""
    for name, version in registered.items():
        text = text.replace(pending_registration(name), f"registered {name} version {version} (registered once "
                            "MLflow answered again)")
    if not outages:
        return text
    now = time.time() if now is None else now
    spans = "; ".join(f"from {_clock(o.since)} to {_clock(o.until or now)}, its items sent by "
                      f"{o.sent_by or 'the run'}" for o in outages)
    return (text.rstrip("\n") + f"\n- MLflow outage{'s' if len(outages) > 1 else ''}: unreachable {spans} (what the "
            "run logged meanwhile waited in its outbox; nothing lost)\n")


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at))
