"""What the Prefect UI shows of a run: artifacts of its flow run, each published when the stage that makes it ends,
so a run that stops still shows what it did up to there (docs/operations.md "Start the UIs").

=================  ===================================================================  ==========================
key                what                                                                 published
=================  ===================================================================  ==========================
``mlflow-run``     the MLflow run: a link on a tracking server, else how to open it     when the run opens
``eval-by-level``  held-out greedy accuracy by level and overall, before and after      each evaluation stage's end
``plan``           every candidate's predictions, the choice, its reason and clock      the plan stage's end
``time-by-stage``  seconds, share, device hours and money of each stage and phase       every stage's end
``run-summary``    what the run did, in a few lines (its MLflow Description)            the run's end
=================  ===================================================================  ==========================

An artifact published again under its key is a new version of it: the UI shows the latest. Outside a Prefect
flow or task run nothing is published (no API to publish to); a failure to publish is a warning, never the run's
end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlsift")


def title(run_id: str, name: str | None) -> str:
    """How artifacts name a run: ``run `<id>` (<its MLflow name>)``."""
    return f"run `{run_id}`" + (f" ({name})" if name else "")


def publish(key: str, make: Callable[[], Any]) -> None:
    """Call ``make`` (which creates artifact ``key``) inside a Prefect run; a failure is logged, not raised."""
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    try:
        make()
    except Exception as err:  # noqa: BLE001 -- the UI misses one artifact; the run goes on
        log.warning("Prefect artifact %s not published: %s: %s", key, type(err).__name__, err)


def mlflow_run(run: str, mlflow_run_id: str, url: str | None, ui: str | None, run_dir: str) -> None:
    """``mlflow-run``: a link to the MLflow run's page (``url``), else how to open the local store (``ui``: the
    tracker's ``ui``, the command that opens MLflow's UI on it and the run's page there)."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    if url:
        publish("mlflow-run", lambda: create_link_artifact(key="mlflow-run", link=url,
                                                            link_text=f"MLflow run {mlflow_run_id}",
                                                            description=f"The MLflow run of {run}"))
    else:
        publish("mlflow-run", lambda: create_markdown_artifact(key="mlflow-run", markdown=(
            f"MLflow run `{mlflow_run_id}` of {run} in a local store: open it with {ui}. Run folder: `{run_dir}`.")))


def stage_costs(run: str, rows: list[dict[str, Any]]) -> None:
    """``time-by-stage``: the run's cost table so far (tasks/run.py ``Run.cost_table``: a row per stage and training
    phase and a ``total`` row, with seconds, device hours, money and device) with each row's share of the time."""
    from prefect.artifacts import create_table_artifact

    total = next((r for r in rows if r["stage"] == "total"), None)
    if total is None:
        return
    whole = total["seconds"] or 1.0
    table = [{"stage": r["stage"], "seconds": round(r["seconds"], 1), "share": f"{100 * r['seconds'] / whole:.1f}%",
              "device_hours": r["device_hours"], "usd": r["usd"]} for r in rows]
    publish("time-by-stage", lambda: create_table_artifact(key="time-by-stage", table=table, description=(
        f"{run}: {total['device_hours']:.4f} device hours on {total['device']}, ${total['usd']:.4f} so far")))


def run_summary(markdown: str) -> None:
    """``run-summary``: what the run did (its MLflow Description, flows/summary.py ``describe``)."""
    from prefect.artifacts import create_markdown_artifact

    publish("run-summary", lambda: create_markdown_artifact(key="run-summary", markdown=markdown))
