"""The plan as the Prefect UI shows it: the ``plan`` artifact (tasks/records/artifacts.py lists every artifact)."""

from __future__ import annotations

from tasks.plan.record import Plan
from tasks.records.artifacts import publish


def plan_table(run: str, plan: Plan) -> None:
    """``plan``: every composition's predictions as a table, the choice and its reason above it."""
    from prefect.artifacts import create_table_artifact

    publish("plan", lambda: create_table_artifact(key="plan", table=plan.rows(),
                                                   description=plan_description(run, plan)))


def plan_description(run: str, plan: Plan) -> str:
    """The ``plan`` artifact's description: the choice and why, the run's predicted clock (the text every place
    shows, tasks/plan/record.py ``Plan.clock``), the pool and costs, the overlap."""
    overlap = f"; overlap {plan.overlap.reason}" if plan.overlap is not None else ""
    return f"Plan of {run}: **{plan.reason}**. This run: {plan.clock.text()}. ({plan.summary()}{overlap})"
