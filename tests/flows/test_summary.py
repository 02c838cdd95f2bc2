"""RunSummary.to_dict: exactly the keys of the run's status (what ``rlsift run --json`` prints); what a user reads of a
run: one predicted clock in every place, the Description's first line and a resumed run's time, how to open MLflow."""

import json
from dataclasses import replace

from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.cli_text import plan_text, run_text
from flows.summary import RunSummary, describe, plan_summary
from rlcore.plan_choice import choose
from tasks.evaluation.heldout import PairedChange
from tasks.plan.artifact import plan_description
from tasks.records.layout import mlflow_layout
from tasks.run import open_run
from tests.tasks.test_plan_config import plan_choosing

WHERE = {"run_id", "mlflow_run_id", "mlflow_ui", "name", "status", "wall_s", "ledger", "tracking_uri", "run_dir"}
COMPLETED = WHERE | {"ingest", "steps", "eval_accuracy_start", "eval_accuracy_end", "eval_by_level_start",
                     "eval_by_level_end", "eval_paired", "effective_ratio", "device", "precision", "device_hours",
                     "cost_usd", "stage_seconds", "model_path", "adapter_path", "model_version", "parent_version",
                     "data_fingerprint", "policy_path", "resumed", "overlap", "plan"}


def base() -> RunSummary:
    return RunSummary(run_id="r", mlflow_run_id="m", ledger="/l", tracking_uri="sqlite:///x", run_dir="/d",
                      wall_s=1.5)


def test_keys_by_status():
    assert set(base().to_dict()) == WHERE | {"reason"} and base().to_dict()["status"] == "failed"  # before ingest
    failed = replace(base(), ingest={"new": 3}, reason="ValueError: no model (no checkpoint yet; ...)")
    assert set(failed.to_dict()) == WHERE | {"ingest", "reason"}
    skipped = replace(failed, status="skipped", reason="nothing new")
    assert skipped.to_dict() == {**failed.to_dict(), "status": "skipped", "reason": "nothing new",
                                 "model_version": None}
    done = replace(failed, status="completed", steps=4, eval_accuracy_start=0.5, eval_accuracy_end=0.75,
                   eval_by_level_start={"1": 0.5, "None": 0.0}, eval_paired=PairedChange(3, 1, 0.625))
    out = done.to_dict()
    assert set(out) == COMPLETED
    assert out["eval_paired"] == {"turned_right": 3, "turned_wrong": 1, "mcnemar_p": 0.625}
    assert json.loads(json.dumps(out))["eval_by_level_start"] == {"1": 0.5, "None": 0.0}
    assert replace(done, eval_paired=None).to_dict()["eval_paired"] is None


def test_one_predicted_clock_in_every_place(smoke_cfg):
    """The plan's choice is predicted at 0.50x GRPO's training clock (its 10 s of steps and 5 s of calibration and
    scoring over GRPO's 30 s) and this run at 0.73x (the same steps and the 12 s it spent before them, the plan
    included): the CLI, plan.md, the Prefect artifact, the MLflow Description and tags and the run summary all say
    both, named, with the same figures; the reason's figure is the training clock."""
    plan = plan_choosing("dots_n4")
    plan = replace(plan, reason=choose(plan.baseline, list(plan.predictions), 0.8)[1])
    text = ("dots_n4: training clock predicted 0.50x plain GRPO's (its steps, calibration and scoring); 0.73x with "
            "the plan's own cost (12 s before the first step: calibration and plan measured, scoring predicted)")
    assert plan.clock.text() == text and "predicted 0.50x plain GRPO's training clock" in plan.reason
    grpo = replace(plan, choice="grpo").clock  # plain GRPO chosen: it reads nothing before its steps
    assert grpo.text().startswith("grpo: training clock predicted 1.00x plain GRPO's (its steps); 1.40x with")
    run = open_run(smoke_cfg(), track=False)
    try:
        plan.save(run.dir / "plan.json")
        assert f"This run: {text}." in (run.dir / "plan.md").read_text()
        assert f"This run: {text}." in plan_description("run `x`", plan)
        assert plan.tags()["rlsift.plan.clock"] == text
        _, tags = mlflow_layout(plan.metrics())
        assert (tags["plan/predicted_training_clock"], tags["plan/predicted_clock_with_plan"]) == ("0.5", "0.7333")
        assert "plan/predicted_clock" not in tags  # the figure that did not say what it held
        summary = plan_summary(plan)
        assert (summary["clock"], summary["predicted_training_clock"], summary["predicted_clock_with_plan"],
                summary["upfront_s"]) == (text, plan.clock.training, plan.clock.with_plan, 12)
        assert plan_text(summary) == (  # one line: the reason's training clock, the clock with the plan's cost
            f"  plan: {plan.reason}; 0.73x with the plan's own cost (12 s before the first step)\n")
        chose_grpo = replace(plan, choice="grpo", reason="grpo: no candidate is predicted cheaper")
        assert plan_text(plan_summary(chose_grpo)) == (  # the baseline's reason says why; its clock is added
            "  plan: grpo: no candidate is predicted cheaper; training clock predicted 1.00x plain GRPO's (its "
            "steps); 1.40x with the plan's own cost (12 s before the first step: calibration and plan measured, "
            "scoring predicted)\n")
        note = describe(run, replace(base(), run_id=run.run_id, status="cancelled", reason="by SIGINT"))
        assert f"- plan: {text}; effective ratio 0.50" in note.splitlines()
    finally:
        run.close("failed", {})


def test_the_description_starts_with_the_prefect_link_and_a_resumed_runs_whole_time(smoke_cfg):
    """MLflow's Overview shows a Description's first lines (the rest behind "Show more"): the first names the Prefect
    flow run, a link where the Prefect UI has a page. A resumed run's first line gives this process's time and the
    time from its start to its end, the stop included, which is MLflow's Duration."""
    run = open_run(smoke_cfg(), track=False)
    try:
        assert run.info.started is not None  # kept in info.json from the run's first open
        run.info = replace(run.info, flow_run_id="f-1", started=1000.0)
        s = replace(base(), run_id=run.run_id, name="grpo x", status="cancelled", reason="by SIGTERM", wall_s=131.4)
        with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no Prefect API, whatever the tests started
            assert describe(run, s).splitlines()[0] == \
                f"**grpo x**: cancelled in 131 s (rlsift run `{run.run_id}`; Prefect flow run f-1)"
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
            first = describe(run, s).splitlines()[0]
        assert first.endswith("; Prefect flow run [f-1](http://127.0.0.1:4200/runs/flow-run/f-1))")
        run.resumed = True
        with temporary_settings(restore_defaults={PREFECT_API_URL}):
            assert describe(run, s, now=1000.0 + 1128).splitlines()[0] == (
                f"**grpo x**: cancelled in 131 s after its resume, 18.8 min from its start to its end (MLflow's "
                f"Duration, the stop included) (rlsift run `{run.run_id}`; Prefect flow run f-1)")
            assert "from its start" not in describe(run, s, now=1000.0 + 1128).split("\n", 1)[1]
    finally:
        run.close("failed", {})


def test_the_cli_says_how_to_open_mlflows_ui():
    """A completed run's summary names where to see it in MLflow: the command that opens a UI on a local store (and
    the run's page there), else the tracking URI."""
    done = replace(base(), status="completed", name="grpo x", steps=2, eval_accuracy_start=0.5, eval_accuracy_end=0.5,
                   device="cpu", device_hours=0.001, cost_usd=0.0001,
                   mlflow_ui="`mlflow ui --backend-store-uri sqlite:///x`, then http://127.0.0.1:5000/#/...").to_dict()
    assert "  MLflow run m: `mlflow ui --backend-store-uri sqlite:///x`, then http://127.0.0.1:5000/#/...\n" in \
        run_text(done)
    assert "  MLflow run m: sqlite:///x\n" in run_text({**done, "mlflow_ui": None})


def test_the_cli_gives_accuracy_by_level_only_where_the_prompts_have_levels():
    """The bundled task's levels get their line; a set without levels (GSM8K: its one group keyed None) gets none,
    rather than a line that repeats the overall accuracy under the name None."""
    done = replace(base(), status="completed", name="grpo x", steps=2, eval_accuracy_start=0.0, eval_accuracy_end=0.02,
                   device="cpu", device_hours=0.001, cost_usd=0.0001).to_dict()
    leveled = run_text({**done, "eval_by_level_start": {"1": 0.9, "3": 0.0}, "eval_by_level_end": {"1": 0.9, "3": 0.5}})
    assert "  by level: 1: 0.900, 3: 0.000 -> 1: 0.900, 3: 0.500\n" in leveled
    flat = run_text({**done, "eval_by_level_start": {"None": 0.0}, "eval_by_level_end": {"None": 0.02}})
    assert "by level" not in flat and "None" not in flat
    assert "held-out greedy accuracy 0.000 -> 0.020" in flat
