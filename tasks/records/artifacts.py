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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # records sit below training: the types only, no import at run time
    from tasks.training.evaluate import EvalResult
    from tasks.training.plan import Plan

log = logging.getLogger("rlsift")


def title(run_id: str, name: str | None) -> str:
    """How artifacts name a run: ``run `<id>` (<its MLflow name>)``."""
    return f"run `{run_id}`" + (f" ({name})" if name else "")


def _publish(key: str, make: Callable[[], Any]) -> None:
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
        _publish("mlflow-run", lambda: create_link_artifact(key="mlflow-run", link=url,
                                                            link_text=f"MLflow run {mlflow_run_id}",
                                                            description=f"The MLflow run of {run}"))
    else:
        _publish("mlflow-run", lambda: create_markdown_artifact(key="mlflow-run", markdown=(
            f"MLflow run `{mlflow_run_id}` of {run} in a local store: open it with {ui}. Run folder: `{run_dir}`.")))


def eval_by_level(run: str, start: EvalResult, end: EvalResult | None) -> None:
    """``eval-by-level``: greedy accuracy by level and overall (``all``) before training, and after it (``end``
    None: the run has not got there yet)."""
    from prefect.artifacts import create_table_artifact

    def row(level: str, a, b) -> dict[str, Any]:
        return {"level": level, "start": None if a is None else round(a.greedy_acc, 3),
                "end": None if b is None else round(b.greedy_acc, 3),
                "change": None if a is None or b is None else round(b.greedy_acc - a.greedy_acc, 3)}

    after = end.by_level if end is not None else {}
    levels = sorted(set(start.by_level) | set(after), key=str)
    rows = [row(str(lv), start.by_level.get(lv), after.get(lv)) for lv in levels]
    rows.append(row("all", start.overall, end.overall if end is not None else None))
    when = "before and after training" if end is not None else "before training (the end evaluation is to come)"
    _publish("eval-by-level", lambda: create_table_artifact(
        key="eval-by-level", table=rows, description=f"Held-out greedy accuracy of {run}, {when}"))


def plan_table(run: str, plan: Plan) -> None:
    """``plan``: every composition's predictions as a table, the choice and its reason above it."""
    from prefect.artifacts import create_table_artifact

    _publish("plan", lambda: create_table_artifact(key="plan", table=plan.rows(),
                                                   description=plan_description(run, plan)))


def plan_description(run: str, plan: Plan) -> str:
    """The ``plan`` artifact's description: the choice and why, the run's predicted clock (the text every place
    shows, tasks/training/plan.py ``Plan.clock``), the pool and costs, the overlap."""
    overlap = f"; overlap {plan.overlap.reason}" if plan.overlap is not None else ""
    return f"Plan of {run}: **{plan.reason}**. This run: {plan.clock.text()}. ({plan.summary()}{overlap})"


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
    _publish("time-by-stage", lambda: create_table_artifact(key="time-by-stage", table=table, description=(
        f"{run}: {total['device_hours']:.4f} device hours on {total['device']}, ${total['usd']:.4f} so far")))


def run_summary(markdown: str) -> None:
    """``run-summary``: what the run did (its MLflow Description, flows/pipeline.py ``describe``)."""
    from prefect.artifacts import create_markdown_artifact

    _publish("run-summary", lambda: create_markdown_artifact(key="run-summary", markdown=markdown))
