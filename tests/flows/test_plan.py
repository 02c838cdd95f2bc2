"""The plan end to end: `rlsift plan` measures and chooses without training; `plan.auto` trains the choice."""

import json
import os
from pathlib import Path

import pytest
import torch

from flows.pipeline import pipeline, plan_flow
from tasks.overlap.lag import lag_from_json
from tasks.plan.record import Plan
from tasks.records.ledger import Ledger
from tasks.records.tracking import run_info
from tests.flows.test_pipeline import flow_run_artifacts
from tests.golden import plan_off_the_clock

SMOKE = str(Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny.yaml")


def test_plan_flow_measures_predicts_and_records_without_training(tmp_path, prefect_harness):
    root = tmp_path / "root"
    out = plan_flow(config=SMOKE, overrides=[f"paths.root={root}",
                                             "plan.candidates=[grpo_n4,dapo,dots_screen,dots_screen_waves]"])
    plan = Plan.load(Path(out["run_dir"]) / "plan.json")
    assert plan.to_json() == out["plan"]
    assert abs(sum(plan.shares.values()) - 1) < 1e-9 and plan.g == 4
    assert plan.costs.generate.time(1000) > 0 and plan.costs.update.time(1000) > 0 and plan.costs.completion_tokens > 0
    assert plan.costs.fixed.optimizer_s > 0 and plan.costs.fixed.step_s > 0 and plan.costs.fixed.round_s > 0
    assert plan.upfront_s > 0 and f"This run: {plan.clock.text()}." in out["table"]
    assert [p.name for p in plan.predictions] == ["grpo_n4", "dapo", "dots_screen", "dots_screen_waves"]
    assert plan.baseline.name == "grpo" and plan.baseline.clock == 1.0
    assert plan.choice in {"grpo", "grpo_n4", "dapo", "dots_screen", "dots_screen_waves"}
    assert plan.reason.startswith(plan.choice)
    # what the waves and the skip would save on this pool: dots_screen_waves against itself without each
    assert [line.split(":")[0] for line in plan.savings] == ["waves on dots_screen_waves", "skip on dots_screen_waves"]
    assert f"**{plan.savings[0]}**" in out["table"] and "rollouts_per_informative" in out["table"]
    dapo = next(p for p in plan.predictions if p.name == "dapo")
    assert 0 <= dapo.effective_ratio <= 1 and dapo.generated >= plan.baseline.generated  # it generates more
    assert "| composition |" in out["table"] and plan.reason in out["table"]
    assert plan.overlap is not None and f"**Overlap: {plan.overlap.reason}**" in out["table"]  # for the choice
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        assert led.run_status(out["run_id"]) == "planned"
        assert led.query("SELECT count(*) AS c FROM groups WHERE run_id = ?", [out["run_id"]])[0]["c"] == 0
    info = run_info(out["tracking_uri"], out["mlflow_run_id"])
    assert info["tags"]["rlsift.plan.choice"] == plan.choice and "plan.json" in info["artifacts"]
    assert info["name"] == "plan-grpo bundled:default s0"  # not a training run
    assert info["tags"]["rlsift.kind"] == "plan"
    assert info["tags"]["rlsift.plan.clock"] == plan.clock.text()
    assert f"- clock: {plan.clock.text()}" in info["tags"]["mlflow.note.content"]
    assert float(info["tags"]["plan/pool_mixed"]) == round(plan.shares["mixed"], 4)  # one value, not a chart
    assert float(info["tags"]["plan/overlap_lag"]) == plan.overlap.lag
    assert not any(k.startswith("plan/") for k in info["metrics"])

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert "plan" in {a.key for a in client.read_artifacts()}


def test_auto_trains_the_plans_choice(tmp_path, prefect_harness):
    root = tmp_path / "root"
    # groups of 8 against the candidate's groups of 4 (half the generation) with no signal floor: it is chosen
    # chosen off the clock: whether it earns back the seconds measured before training hangs on the load
    cores = len(os.sched_getaffinity(0))
    with plan_off_the_clock():
        s = pipeline(config=SMOKE, overrides=[f"paths.root={root}", "rollout.n=8", "plan.auto=true",
                                              "plan.candidates=[grpo_n4]", "plan.min_signal=0", "eval.samples=0",
                                              f"overlap.generator_threads={cores + 1}", "overlap.min_gain=0.99"])
    assert s["status"] == "completed" and s["plan"]["choice"] == "grpo_n4"
    plan = Plan.load(Path(s["run_dir"]) / "plan.json")
    assert plan.chosen.clock < 1 and s["plan"]["reason"].startswith("grpo_n4")
    # the run's own clock adds what it spent before training (calibration, plan, scoring) to the choice's steps;
    # both figures, named, the same in the summary, the CLI, MLflow's tags and Description, the Prefect artifact
    clock = plan.clock
    assert s["plan"]["predicted_clock_with_plan"] == clock.with_plan > clock.training == plan.chosen.clock == \
        s["plan"]["predicted_training_clock"] and plan.upfront_s > 0 and s["plan"]["clock"] == clock.text()
    from flows.cli_text import plan_text

    said = plan_text(s["plan"])  # one line, each figure once (this choice did not weigh the plan's own cost)
    assert said.startswith(f"  plan: {plan.reason}; ") and said.count(f"{clock.training:.2f}x") == 1
    assert said.endswith(f"; {clock.with_plan:.2f}x with the plan's own cost ({clock.upfront_s:.0f} s before the first "
                         "step)\n"), said
    tags = run_info(s["tracking_uri"], s["mlflow_run_id"])["tags"]
    assert tags["rlsift.plan.clock"] == clock.text() and f"- plan: {clock.text()}; " in tags["mlflow.note.content"]
    assert (float(tags["plan/predicted_training_clock"]), float(tags["plan/predicted_clock_with_plan"])) == (
        float(f"{clock.training:.4g}"), float(f"{clock.with_plan:.4g}"))
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        ns = {r["n"] for r in led.query("SELECT n FROM groups WHERE run_id = ?", [s["run_id"]])}
        stored = json.loads(led.query("SELECT config FROM runs WHERE run_id = ?", [s["run_id"]])[0]["config"])
        stages = {r["stage"] for r in led.query("SELECT stage FROM stages WHERE run_id = ?", [s["run_id"]])}
    assert ns == {4}  # trained with the choice's groups of 4, not the config's 8
    assert "score" not in stages and clock.upfront_s == plan.upfront_s  # grpo_n4 reads no score: none paid
    assert stored["plan"]["auto"] is True and stored["rollout"]["n"] == 8  # the run's own config is kept
    assert torch.tensor(s["plan"]["predicted_effective_ratio"]).isfinite()
    assert (Path(s["run_dir"]) / "plan.md").is_file()
    # overlap.lag=auto (the default) where sampler and trainer share the CPU's cores (more generator threads than
    # cores): 20 steps of the tiny model cannot earn back the overlap probe (the generator's start alone is
    # predicted at overlap.start_s), so the plan keeps lag 0 for its choice's config without probing, and the run
    # trains with it, sequentially, and says why in its summary, plan.md, its overlap.json and MLflow
    choice = Plan.load(Path(s["run_dir"]) / "plan.json").overlap
    o = s["overlap"]
    assert (o["lag"], o["basis"], o["reason"]) == (choice.lag, choice.basis, choice.reason) == (
        0, "cost", choice.reason) and o["reason"].startswith("lag 0 without the overlap probe: the probe, predicted")
    assert "update_s" not in o and choice.probe is None and not choice.worth.pays  # sequential: no overlap totals
    assert f"**Overlap: {choice.reason}**" in (Path(s["run_dir"]) / "plan.md").read_text()
    assert lag_from_json(json.loads((Path(s["run_dir"]) / "overlap.json").read_text())) == choice
    logged = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert {m["train/policy_lag"] for m in logged} == {0}
    tags = run_info(s["tracking_uri"], s["mlflow_run_id"])["tags"]
    assert (tags["rlsift.overlap.lag"], tags["rlsift.overlap.basis"], tags["rlsift.overlap.reason"]) == (
        "0", "cost", o["reason"])
    assert "rlsift.overlap.at_once_ratio" not in tags
    assert float(tags["plan/overlap_lag"]) == 0

    from flows.cli_text import overlap_text

    assert overlap_text(o) == f"  overlap {o['reason']}\n"

    # named after what it trains: in the summary, in MLflow and in the Prefect artifacts
    assert s["name"] == "auto→grpo_n4 bundled:default s0"
    info = run_info(s["tracking_uri"], s["mlflow_run_id"])
    assert info["name"] == info["tags"]["mlflow.runName"] == s["name"]
    flow_run_id = json.loads((Path(s["run_dir"]) / "info.json").read_text())["flow_run_id"]
    arts = flow_run_artifacts(flow_run_id)
    assert arts["run-summary"][-1].data.startswith(f"**{s['name']}**: completed")
    assert s["name"] in arts["plan"][-1].description and s["name"] in arts["time-by-stage"][-1].description
    assert f"This run: {clock.text()}." in arts["plan"][-1].description


def test_a_run_that_stops_after_the_plan_still_shows_what_it_chose(tmp_path, prefect_harness, monkeypatch):
    """Each stage's Prefect artifact is published when the stage ends, not when the run does: a run that fails in
    the stage after the plan shows the plan, the starting evaluation and the time so far; MLflow's Description
    names the plan's choice."""
    import flows.pipeline

    def stops(*args, **kwargs):  # the stage after the plan fails (a crash, a bad prompt, ...)
        raise RuntimeError("stopped after the plan")

    monkeypatch.setattr(flows.pipeline, "score_stage", stops)
    root = tmp_path / "root"
    with pytest.raises(RuntimeError, match="stopped after the plan"):
        pipeline(config=SMOKE, overrides=[f"paths.root={root}", "rollout.n=8", "plan.auto=true",
                                          "plan.candidates=[grpo_n4]", "plan.min_signal=0", "eval.samples=0"])
    (run_dir,) = (root / "runs").iterdir()
    plan = Plan.load(run_dir / "plan.json")
    arts = flow_run_artifacts(json.loads((run_dir / "info.json").read_text())["flow_run_id"])
    assert {"mlflow-run", "eval-by-level", "plan", "time-by-stage", "run-summary"} <= set(arts)
    assert [r["composition"] for r in json.loads(arts["plan"][-1].data)] == ["grpo", "grpo_n4"]
    assert plan.reason in arts["plan"][-1].description
    start = json.loads(arts["eval-by-level"][-1].data)[-1]
    assert start["level"] == "all" and start["start"] is not None and start["end"] is None
    assert {"ingest", "prepare", "eval_start", "calibrate", "plan"} <= {
        r["stage"] for r in json.loads(arts["time-by-stage"][-1].data)}
    assert "**: failed in " in arts["run-summary"][-1].data
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        mlflow_run_id = led.query("SELECT mlflow_run_id FROM runs")[0]["mlflow_run_id"]
    info = run_info(f"sqlite:///{root / 'mlflow.db'}", mlflow_run_id)
    assert info["status"] == "FAILED" and info["name"] == f"auto→{plan.choice} bundled:default s0"
    note = info["tags"]["mlflow.note.content"]
    assert f"- plan: {plan.clock.text()}; effective ratio" in note
