"""What a pipeline run did, for the people who read it: :class:`RunSummary` (``rlsift run``'s output and ``--json``
object, the ledger's ``runs.summary``) and :func:`describe` (the MLflow run's Description and the Prefect flow
run's ``run-summary`` artifact)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from tasks.evaluation.heldout import PairedChange
from tasks.plan.record import Plan
from tasks.records.stopping import CANCELLED
from tasks.run import Run
from tasks.stages import refusal, registration

#: RunSummary fields only a run of that status reports (the others report none of them).
_ONLY = {"skipped": ("reason", "model_version"), CANCELLED: ("reason",), "failed": ("reason",), "completed": (
    "steps", "eval_accuracy_start", "eval_accuracy_end", "eval_by_level_start", "eval_by_level_end", "eval_paired",
    "effective_ratio", "device", "precision", "device_hours", "cost_usd", "stage_seconds", "model_path",
    "adapter_path", "model_version", "parent_version", "data_fingerprint", "policy_path", "resumed", "overlap", "plan")}


@dataclass(frozen=True)
class RunSummary:
    """What a pipeline run did (:func:`execute`): the CLI's ``rlsift run`` output and ``--json`` object.

    Every run reports where it lives (``run_id``, ``mlflow_run_id``, ``ledger``, ``tracking_uri``,
    ``run_dir``; ``mlflow_ui``: where to see it in MLflow's UI, its page on a tracking server or the command that
    opens a UI on the local store, tasks/records/tracking/query.py ``ui_hint``), its ``name`` (the MLflow run's: what
    ran; an ``auto`` run's names the plan's choice), its ``status`` (``completed``, ``skipped``, ``failed`` or
    ``cancelled``), ``wall_s`` and, once ingest ran, the ``ingest`` counts.
    A ``skipped`` run (retrain with nothing new) adds ``reason`` and ``model_version`` (None); a ``completed`` run
    adds the rest: steps, held-out greedy accuracy before and after (overall and by level, level keys as strings),
    the paired change, the last step's effective-group ratio, the ``precision`` it trained in (``model.precision``
    resolved: the final model's weights are in its compute dtype), device hours and money, the final model (and a
    LoRA run's ``adapter_path``, its adapter folder; None otherwise) and its lineage, and ``overlap``: the lag
    trained with, its ``basis`` and ``reason`` (tasks/stages.py ``overlap_stage``) and, overlapped, the loop's
    totals in seconds (update, draw, at once, each side's idle) and ``plan``: what a ``plan.auto`` run chose and why
    (:func:`plan_summary`; None otherwise). :meth:`to_dict` holds exactly the fields of the run's status. A
    ``cancelled`` run (stopped by SIGINT or SIGTERM, tasks/records/stopping.py) adds ``reason``: the signal, the
    step and the checkpoint kept; a ``failed`` run's ``reason`` says its cause, what is kept, the command that
    continues it and where its traceback is (:func:`failed_note`).
    """

    run_id: str
    mlflow_run_id: str | None
    ledger: str
    tracking_uri: str
    run_dir: str
    mlflow_ui: str | None = None
    name: str | None = None
    status: str = "failed"
    wall_s: float = 0.0
    ingest: dict[str, Any] | None = None
    reason: str | None = None
    steps: int | None = None
    eval_accuracy_start: float | None = None
    eval_accuracy_end: float | None = None
    eval_by_level_start: dict[str, float] = field(default_factory=dict)
    eval_by_level_end: dict[str, float] = field(default_factory=dict)
    eval_paired: PairedChange | None = None
    effective_ratio: float | None = None
    device: str | None = None
    precision: str | None = None
    device_hours: float | None = None
    cost_usd: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    model_path: str | None = None
    adapter_path: str | None = None
    model_version: str | None = None
    parent_version: str | None = None
    data_fingerprint: str | None = None
    policy_path: str | None = None
    resumed: bool = False
    overlap: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``rlsift run --json`` (and the ledger's ``runs.summary``)."""
        only = {name for names in _ONLY.values() for name in names} - set(_ONLY.get(self.status, ()))
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in only and not (f.name == "ingest" and self.ingest is None)}
        if self.eval_paired is not None and "eval_paired" in out:
            out["eval_paired"] = self.eval_paired.to_dict()
        return out


def flow_run_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI when a Prefect API URL is configured (None for Prefect's temporary
    server, whose pages end with the run)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id, url_type="ui") if PREFECT_API_URL.value() else None


def describe(run: Run, summary: RunSummary, now: float | None = None) -> str:
    """What happened, in a few Markdown lines: the MLflow run's Description and the flow run's ``run-summary``
    artifact. The first line: the status and time, the rlsift run and the Prefect flow run (a link where the Prefect
    UI has a page; MLflow's Overview shows a Description's first lines and hides the rest behind "Show more"). Then
    held-out accuracy before and after, the plan's choice and predicted clock (``plan.json``, also of a run that
    stopped), cost, the registered version. A resumed run's time is this process's, and its time from its first
    start to ``now`` (default: now), the stop included: what MLflow's Duration shows."""
    s = summary
    prefect = ""
    if run.info.flow_run_id:
        url = flow_run_url(run.info.flow_run_id)
        prefect = f"; Prefect flow run {f'[{run.info.flow_run_id}]({url})' if url else run.info.flow_run_id}"
    lines = [f"**{s.name or s.run_id}**: {s.status} in {_took(run, s.wall_s, now)} (rlsift run `{s.run_id}`{prefect})"]
    if s.status == "completed":
        paired = s.eval_paired
        lines.append(f"- held-out greedy accuracy {s.eval_accuracy_start:.3f} → {s.eval_accuracy_end:.3f} "
                     f"({s.eval_accuracy_end - s.eval_accuracy_start:+.3f}) after {s.steps} steps" + (
                         f"; {paired.turned_right} prompts turned right, {paired.turned_wrong} wrong (McNemar p "
                         f"{paired.mcnemar_p:.3g})" if paired is not None else ""))
    elif s.reason:
        lines.append(f"- {s.status}: {s.reason}")
    plan_file = run.dir / "plan.json"
    if plan_file.is_file():
        plan = Plan.load(plan_file)
        lines.append(f"- plan: {plan.clock.text()}; effective ratio {plan.chosen.effective_ratio:.2f}")
    lines.append(f"- cost: {run.meter.device_hours():.4f} device hours on {run.meter.device} "
                 f"({run.precision.name}), ${run.meter.usd():.4f}")
    if s.status == "completed":
        tc = run.cfg.tracking
        why = refusal(s.eval_accuracy_start, s.eval_accuracy_end, tc.register_tolerance)
        lines.append(f"- model: {registration(tc.model_name, tc.register_model, s.model_version, why)}" + (
            f" (parent version {s.parent_version})" if s.parent_version else ""))
    elif s.status == "failed" and not s.reason:
        lines.append(f"- `{run.resume_command()}` continues it from its last checkpoint")
    return "\n".join(lines) + "\n"


def _took(run: Run, wall_s: float, now: float | None = None) -> str:
    """``131 s``; a resumed run's ``131 s after its resume, 18.8 min from its start to its end (MLflow's Duration,
    the stop included)``, when the run's info knows its start."""
    if not run.resumed or run.info.started is None:
        return f"{wall_s:.0f} s"
    span = (time.time() if now is None else now) - run.info.started
    return (f"{wall_s:.0f} s after its resume, {_duration(span)} from its start to its end (MLflow's Duration, the "
            "stop included)")


def _duration(seconds: float) -> str:
    """``95 s``, ``18.8 min``, ``2.5 h``: as a reader compares it with MLflow's Duration."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A plan in the run summary: the choice, why (``line``: both and the predicted clock in one line, what the
    terminal shows), the predicted clock against plain GRPO's (rlcore/plan_choice.py
    ``RunClock``: ``clock`` its text, ``predicted_training_clock`` the chosen candidate's steps, calibration and
    scoring, ``predicted_clock_with_plan`` with this run's ``upfront_s`` seconds before its first step, the plan's
    own included; ``predicted_seconds`` the same in seconds) and the predicted effective ratio."""
    clock = plan.clock
    return {"choice": plan.choice, "reason": plan.reason, "line": plan.line(), "clock": clock.text(),
            "predicted_training_clock": clock.training, "predicted_clock_with_plan": clock.with_plan,
            "predicted_seconds": clock.with_plan * plan.baseline.train_s,
            "upfront_s": clock.upfront_s, "predicted_effective_ratio": plan.chosen.effective_ratio,
            "pool": plan.shares}
