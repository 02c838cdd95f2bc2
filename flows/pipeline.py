"""The ``pipeline`` flow: ingest -> prepare policy -> calibrate -> score -> train -> evaluate -> report.

``rlsift run --resume RUN_ID`` reopens a run: its stored ``config.json`` is used (command-line overrides
may only change where things live and how they run: tasks/preflight.py ``RESUME_MAY_CHANGE``), finished stages are
reused (tasks/stages.py) and training continues from the last checkpoint into the same MLflow run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.summary import RunSummary, describe, flow_run_url, plan_summary
from tasks.config import Config
from tasks.config.load import default_config
from tasks.data.ingest import IngestResult
from tasks.evaluation.heldout import paired_change
from tasks.plan.planner import planned_config
from tasks.preflight import RunRequest, checked_config
from tasks.records import artifacts
from tasks.records.label import run_label
from tasks.records.stopping import CANCELLED, stop_signal, stopping, watch_worker
from tasks.records.tracking import flow_run_tags
from tasks.run import Run, RunInfo, open_run
from tasks.stages import (
    calibrate_stage,
    evaluate_stage,
    ingest_stage,
    overlap_stage,
    plan_stage,
    prepare_stage,
    report_stage,
    score_stage,
    train_stage,
)
from tasks.training import checkpoint

log = logging.getLogger("rlsift")
if log.level == logging.NOTSET:  # stage summaries at INFO also where the root logger is quieter (a Prefect
    log.setLevel(logging.INFO)   # worker's flow run, whose log Prefect's extra-logger handler sends to the UI)

def run_pipeline(cfg: Config, resume: str | None = None, parent_run_id: str | None = None,
                 run_name: str | None = None, *, config: str | None = None,
                 overrides: tuple[str, ...] | list[str] = ()) -> RunSummary:
    """The stages in order, in the calling flow. Returns the run summary (``to_dict()``: the CLI's ``--json``).
    ``config`` and ``overrides``: the YAML file and dotted overrides ``cfg`` was loaded from, kept in the run's
    ``info.json`` (a resume's flow run shows them as its parameters: :func:`resumed_parameters`)."""
    run = open_run(cfg, run_id=resume, parent_run_id=parent_run_id, run_name=run_name)
    if resume is None:
        run.info = replace(run.info, config=config and str(Path(config).absolute()), overrides=tuple(overrides))
        run.save_info()
    claim_flow_run(run)
    if resume is not None:
        show_parameters(resumed_parameters(run.info, overrides, run.run_id))
    return execute(run)


def resumed_parameters(info: RunInfo, overrides: list[str] | tuple[str, ...], run_id: str) -> dict[str, Any] | None:
    """The ``pipeline`` flow's parameters for a resume of run ``run_id``: the config file and overrides the run
    was started with (its ``info.json``, :class:`~tasks.run.RunInfo`), then those of ``overrides`` (the resume's,
    which :func:`resume_config` lets only move paths or change how it runs) it did not already have, and
    ``resume``. With them the flow run shows what the run computes, not the resume command's defaults, and run
    again as they stand they resume the same run. None for a run whose ``info.json`` does not say (one started by
    the benchmark from a config object, or one whose info.json predates these fields)."""
    if info.config is None and not info.overrides:
        return None
    own = list(info.overrides)
    return {"config": info.config, "overrides": own + [o for o in overrides if o not in own], "resume": run_id}


def show_parameters(parameters: dict[str, Any] | None) -> None:
    """Set the calling Prefect flow run's parameters (what its page's Parameters tab shows) to ``parameters``;
    nothing outside a flow run or for None, a warning when the API refuses."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    current = flow_run.get_id()
    if parameters is None or not current:
        return
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(current, parameters=parameters)
    except Exception as err:  # noqa: BLE001 - the flow run shows the resume command's parameters; the run goes on
        log.warning("flow run %s: could not record the run's own parameters: %s", current, err)
        return
    log.info("flow run parameters: the run's own, config %s, overrides %s", parameters["config"],
             " ".join(parameters["overrides"]) or "none")


def claim_flow_run(run: Run) -> None:
    """Record the calling Prefect flow run and the Prefect API it reports to in the run's info (``flow_run_id``,
    ``prefect_api``: a resume from any shell reports to the same server, flows/prefect_server.py ``resume_api``) and
    link it with the MLflow run (:func:`link_flow_run`); on a resume, end the killed process's flow run and its task
    runs as Crashed (:func:`crash_flow_run`: a SIGKILL leaves them Running for ever, no process is left to report
    their end)."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    current = flow_run.get_id()
    killed = run.info.flow_run_id
    if killed and killed != current:
        try:
            crash_flow_run(killed, f"its process died; run {run.run_id} resumed in flow run {current}")
        except Exception as err:  # noqa: BLE001 - another API server, or a flow run it no longer has
            where = run.info.prefect_api or "a temporary Prefect server"
            log.warning("could not mark the killed flow run %s (on %s) as crashed: %s", killed, where,
                        f"{type(err).__name__}: {err}")
    if current:
        run.info = replace(run.info, flow_run_id=str(current), prefect_api=PREFECT_API_URL.value() or None)
        run.save_info()
    link_flow_run(run)


def crash_flow_run(flow_run_id: str, message: str) -> int:
    """End a flow run whose process died (``kill -9``) as Crashed with ``message``, and with it every task run of it
    still unfinished (Running, Pending: ``train``, ``round-2``, ...), whose bars in the UI would otherwise grow for
    ever. Forced: the API's orchestration rules refuse a Crashed state from outside the run. A flow run already
    final keeps its state (its unfinished task runs still end). Returns how many runs it ended (flow and task
    runs); raises what the API raises (no such flow run on this server, an unreachable server)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[
        StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED, StateType.CANCELLING])))
    ended = 0
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
        if state is not None and not state.is_final():
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
            ended += 1
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                      task_run_filter=unfinished)
        for task_run in tasks:
            client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
    log.info("flow run %s%s marked Crashed, and its %d unfinished task run(s) (%s)", flow_run_id,
             "" if ended else " (already final)", len(tasks), message)
    return ended + len(tasks)


def link_flow_run(run: Run) -> None:
    """Link the two UIs: the MLflow run gets the Prefect flow run's id and page as tags
    (tasks/records/tracking/describe.py), the flow run gets the MLflow run as its ``mlflow-run`` artifact."""
    if run.info.flow_run_id:
        run.tracker.set_tags(flow_run_tags(run.info.flow_run_id, flow_run_url(run.info.flow_run_id)))
    artifacts.mlflow_run(artifacts.title(run.run_id, run.tracker.name), run.tracker.run_id, run.tracker.url,
                         run.tracker.ui, str(run.dir))


def data_fingerprint(data: IngestResult) -> str:
    """sha256 of the sorted train and test prompt ids (content hashes): what a model was trained on."""
    ids = {"train": sorted(r.id for r in data.train), "test": sorted(r.id for r in data.test)}
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def execute(run: Run, only_new: bool = False) -> RunSummary:
    """Run every stage of an opened run and close it. ``only_new``: train on prompts new to the ledger
    only, and stop with status ``skipped`` when there are none (the retrain flow)."""
    t0 = time.perf_counter()
    summary = RunSummary(run_id=run.run_id, mlflow_run_id=run.tracker.run_id, ledger=str(run.ledger.path),
                         tracking_uri=run.tracking_uri, run_dir=str(run.dir), mlflow_ui=run.tracker.ui)
    note, unwatch = "", watch_worker()
    try:
        data = ingest_stage(run, only_new=only_new)
        summary = replace(summary, ingest=data.summary())
        if not data.train:
            summary = replace(summary, status="skipped", reason="no new training prompts since the last run")
            log.info("run %s: nothing new to train on; skipped", run.run_id)
            run.tracker.set_tags({"rlsift.skipped": "no new training prompts"})
        else:
            summary = _train(run, data, summary)
    except BaseException as err:
        if (sig := stop_signal(err)) is not None:
            note = stopped_note(run, sig)
            summary = replace(summary, status=CANCELLED, reason=note, wall_s=time.perf_counter() - t0)
            stop = stopping(err)
            stop.rlsift_summary = summary.to_dict()  # what `rlsift run --json` prints for a stopped run
            if stop is not err:  # an error raised while the stop unwound, e.g. torch's RuntimeError from the
                # checkpoint it cut short: Prefect reports the stop (Crashed by its signal), not that error (Failed)
                raise stop  # noqa: B904
        else:
            note = failed_note(run, err)
            summary = replace(summary, status="failed", reason=note, wall_s=time.perf_counter() - t0)
            err.rlsift_summary = summary.to_dict()  # the CLI prints no traceback for a failure the run has told
        raise
    finally:
        unwatch()
        summary = replace(summary, wall_s=time.perf_counter() - t0, name=run.tracker.name)
        try:
            text = describe(run, summary)
            run.tracker.describe(text)
            artifacts.run_summary(text)
        finally:
            run.close(summary.status, summary.to_dict(), note)
    return summary


def stopped_note(run: Run, sig: signal.Signals) -> str:
    """Why a run stopped and what is kept, for its log line and summary: ``by SIGINT at step 7 (checkpoint at step 6
    kept; `/abs/.venv/bin/rlsift run --resume ID paths.root=/abs/root` finishes it)`` (tasks/run.py
    ``Run.resume_command``)."""
    steps = _steps_logged(run)
    where = f" at step {steps}" if steps else " before training"
    return f"by {sig.name}{where} ({_kept(run)}; `{run.resume_command()}` finishes it)"


def failed_note(run: Run, err: BaseException) -> str:
    """A failure in one line, for the run's log line (the one line the terminal shows of it) and summary: its cause,
    where, what is kept, the command that continues the run and where the traceback went: ``GeneratorDied: the
    generator process exited with code -9 at step 3 (checkpoint at step 2 kept; `/abs/.venv/bin/rlsift run --resume
    ID paths.root=/abs/root` continues it; traceback in /abs/root/runs/ID/run.log)``."""
    log_file = run.failed(err)
    cause = next(iter(str(err).strip().splitlines()), "")
    steps = _steps_logged(run)
    where = f" at step {steps}" if steps else ""
    return (f"{type(err).__name__}{': ' + cause if cause else ''}{where} ({_kept(run)}; `{run.resume_command()}` "
            f"continues it; traceback in {log_file})")


def _steps_logged(run: Run) -> int:
    logged = run.dir / "metrics.jsonl"
    return len(logged.read_text().splitlines()) if logged.exists() else 0


def _kept(run: Run) -> str:
    """What a run that ends now leaves to its resume: ``checkpoint at step 6 kept``, or ``no checkpoint yet``."""
    kept = checkpoint.latest(run)
    return f"checkpoint at step {int(kept.stem.split('-')[1])} kept" if kept else "no checkpoint yet"


def _train(run: Run, data: IngestResult, summary: RunSummary) -> RunSummary:
    """The stages after ingest, on a run with training prompts: ``summary`` completed."""
    if run.info.data_fingerprint is None:  # a resumed run keeps its own
        run.info = replace(run.info, data_fingerprint=data_fingerprint(data))
    policy = prepare_stage(run)
    run.save_info()
    start = evaluate_stage(run, policy, data.test, "start", 0)
    calibration = calibrate_stage(run, policy, data.train)
    plan = None
    if run.cfg.plan.auto:  # train the plan's choice (conf/presets/auto.yaml)
        plan = plan_stage(run, policy, data.train, calibration)
        run.cfg = planned_config(run.cfg, plan)
    calibration = replace(calibration, draw=None)  # its rollouts served the plan's probe; training reads the rates
    features = score_stage(run, policy, data.train)
    lag = overlap_stage(run, policy, data.train, calibration, plan)
    trained = train_stage(run, policy, data.train, features, data.test, calibration, lag)
    end = evaluate_stage(run, policy, data.test, "end", trained.steps)
    paired = paired_change(start, end)
    if paired is not None:
        run.log_metrics({f"eval/{k}": float(v) for k, v in paired.to_dict().items()}, trained.steps)
    report = report_stage(run, policy, start, end, trained)
    summary = replace(
        summary, status="completed", steps=trained.steps,
        eval_accuracy_start=start.overall.greedy_acc, eval_accuracy_end=end.overall.greedy_acc,
        eval_by_level_start={str(k): v.greedy_acc for k, v in start.by_level.items()},
        eval_by_level_end={str(k): v.greedy_acc for k, v in end.by_level.items()},
        eval_paired=paired, effective_ratio=trained.last.get("train/effective_ratio"),
        device=run.meter.device, precision=run.precision.name,
        device_hours=run.meter.device_hours(), cost_usd=run.meter.usd(),
        stage_seconds=dict(run.meter.seconds), model_path=report.model_path, adapter_path=report.adapter_path,
        model_version=report.model_version,
        parent_version=run.info.parent_version, data_fingerprint=run.info.data_fingerprint,
        policy_path=run.info.policy_path, resumed=run.resumed,
        overlap={"lag": lag.lag, "basis": lag.basis, "reason": lag.reason, **trained.overlap},
        plan=None if plan is None else plan_summary(plan))
    return summary


@flow(name="plan", log_prints=True)
def plan_flow(config: str | None = None, overrides: list[str] | None = None) -> dict:
    """``rlsift plan``: ingest, the policy and the reference rollouts a run would do, the plan (tasks/plan/planner.py),
    and no training. Returns the plan (:meth:`Plan.to_json`) with the run's ids; the run ends ``planned``."""
    cfg = checked_config(RunRequest.here(config or default_config(), overrides or ()))
    run = open_run(cfg, run_name=f"plan-{run_label(cfg)}")  # MLflow lists it beside the training runs: told apart
    run.tracker.set_tags({"rlsift.kind": "plan"})
    claim_flow_run(run)
    status, out = "failed", {}
    note, unwatch = "", watch_worker()
    try:
        data = ingest_stage(run)
        policy = prepare_stage(run)
        run.save_info()
        calibration = calibrate_stage(run, policy, data.train)
        plan = plan_stage(run, policy, data.train, calibration)
        status = "planned"
        out = {"run_id": run.run_id, "mlflow_run_id": run.tracker.run_id, "run_dir": str(run.dir),
               "tracking_uri": run.tracking_uri, "mlflow_ui": run.tracker.ui, "plan": plan.to_json(),
               "table": plan.markdown()}
    except BaseException as err:
        if (sig := stop_signal(err)) is not None:
            status, note = CANCELLED, f"by {sig.name}"
            if (stop := stopping(err)) is not err:  # as in execute
                raise stop  # noqa: B904
        raise
    finally:
        run.tracker.describe(f"**{run.tracker.name or run.run_id}**: {status} (`rlsift plan`, no training)" + (
            f"\n- plan: {plan.reason}\n- clock: {plan.clock.text()}\n" if status == "planned" else "\n"))
        unwatch()
        run.close(status, {k: v for k, v in out.items() if k != "table"}, note)
    get_run_logger().info("plan of run %s: %s", run.run_id, plan.reason)
    return out


@flow(name="pipeline", log_prints=True)
def pipeline(config: str | None = None, overrides: list[str] | None = None, resume: str | None = None) -> dict:
    """The whole rlsift pipeline on one config (a YAML path plus dotted overrides). Returns
    :meth:`RunSummary.to_dict` (what ``rlsift run --json`` prints)."""
    overrides = list(overrides or [])
    config = config or default_config()
    cfg = checked_config(RunRequest.here(config, overrides, resume))  # the command line's, when it checked them
    summary = run_pipeline(cfg, resume=resume, config=config, overrides=overrides)
    get_run_logger().info("run %s %s in %.0f s%s", summary.run_id, summary.status, summary.wall_s, (
        f": accuracy {summary.eval_accuracy_start:.3f} -> {summary.eval_accuracy_end:.3f}; " + (
            f"registered {cfg.tracking.model_name} version {summary.model_version}" if summary.model_version
            else "no model version registered (the report stage's log says why)")
        if summary.status == "completed" else f" ({summary.reason})" if summary.reason else ""))
    return summary.to_dict()
