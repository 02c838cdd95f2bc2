"""The `pipeline` flow end to end on the smoke budget under Prefect's test harness: ledger and MLflow contents."""

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest

from flows.pipeline import pipeline
from tasks.records.ledger import Ledger
from tasks.records.tracking import metric_history, run_info

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "tests" / "fixtures" / "tiny.yaml")


class KeptLines(logging.Handler):
    """Every message a logger hands it, from INFO up."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def test_pipeline_flow_records_everything(tmp_path, prefect_harness, caplog):
    root = tmp_path / "root"
    flow_lines = KeptLines()  # the flow run's own logger (Prefect's: it need not propagate to caplog's root handler)
    flow_logger = logging.getLogger("prefect.flow_runs")
    flow_logger.addHandler(flow_lines)
    try:
        with caplog.at_level("INFO"), caplog.at_level("INFO", logger="rlsift"), \
                caplog.at_level("INFO", logger="prefect.flow_runs"):  # an earlier in-process CLI call may quiet them
            s = pipeline(config=SMOKE, overrides=[f"paths.root={root}", "eval.every=2"])
    finally:
        flow_logger.removeHandler(flow_lines)
    assert s["status"] == "completed" and s["steps"] == 4
    assert 0 <= s["eval_accuracy_start"] <= 1 and 0 <= s["eval_accuracy_end"] <= 1
    assert s["device_hours"] > 0 and s["wall_s"] > 0
    paired = s["eval_paired"]  # prompt-by-prompt change over the 24 test prompts
    net = round(24 * (s["eval_accuracy_end"] - s["eval_accuracy_start"]))
    assert paired["turned_right"] - paired["turned_wrong"] == net
    assert 0 < paired["mcnemar_p"] <= 1

    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        run = led.query("SELECT * FROM runs WHERE run_id = ?", [s["run_id"]])[0]
        assert run["status"] == "completed" and run["mlflow_run_id"] == s["mlflow_run_id"]
        assert len(led.prompts(split="train")) == 120 and len(led.prompts(split="test")) == 24
        ref = led.query("SELECT * FROM reference WHERE run_id = ?", [s["run_id"]])
        assert len(ref) == 8 and all(r["n"] == 4 and 0 <= r["success_rate"] <= 1 for r in ref)
        steps = led.query("SELECT step, count(*) AS c FROM groups WHERE run_id = ? GROUP BY step ORDER BY step",
                          [s["run_id"]])
        assert [(r["step"], r["c"]) for r in steps] == [(0, 8), (1, 8), (2, 8), (3, 8)]
        # plain GRPO reads no embedding or angle: the pool is not scored (no forward pass, no features rows)
        assert not led.query("SELECT * FROM features WHERE run_id = ?", [s["run_id"]])
        chosen = led.query("SELECT angle_score, gain_rank FROM selections WHERE run_id = ?", [s["run_id"]])
        assert chosen and all(r["angle_score"] is None and r["gain_rank"] is None for r in chosen)
        phases = {r["phase"] for r in led.query("SELECT phase FROM evals WHERE run_id = ?", [s["run_id"]])}
        assert phases == {"start", "during", "end"}
        stages = {r["stage"] for r in led.query("SELECT stage FROM stages WHERE run_id = ?", [s["run_id"]])}
        assert {"ingest", "prepare", "calibrate", "train", "eval_start", "eval_end"} <= stages
        assert "score" not in stages

    info = run_info(s["tracking_uri"], s["mlflow_run_id"])
    assert info["status"] == "FINISHED"
    assert info["params"]["train.steps"] == "4" and info["params"]["select.method"] == "uniform"
    assert info["params"]["precision"] == s["precision"] == "fp32"  # model.precision auto, resolved on the CPU
    for key in ("train/reward_mean", "train/effective_ratio", "eval/accuracy", "cost/device_hours", "cost/usd",
                "time/rollout_s", "rollout/tokens_per_s", "eval/mcnemar_p",
                "perf/update_tokens_per_s", "perf/update_mfu", "perf/rollout_mfu", "time/reference_share"):
        assert key in info["metrics"], key
    assert [st for st, _ in metric_history(s["tracking_uri"], s["mlflow_run_id"], "train/reward_mean")] == [0, 1, 2, 3]
    # the layout (docs/operations.md "What MLflow shows"): the compared series first, single figures not as charts
    assert metric_history(s["tracking_uri"], s["mlflow_run_id"], "0_progress/reward_mean") == \
        metric_history(s["tracking_uri"], s["mlflow_run_id"], "train/reward_mean")
    assert {"0_progress/heldout_accuracy", "0_progress/effective_ratio"} <= set(info["metrics"])
    assert min(info["metrics"]).startswith("0_progress/")
    assert not any(k.startswith("calibrate/") for k in info["metrics"])
    assert [k for k in info["metrics"] if k.startswith("cost/")] == ["cost/device_hours", "cost/usd"]
    assert 0 <= float(info["tags"]["calibrate/success_mean"]) <= 1
    for art in ("config.json", "eval_table.md", "training_curves.png", "eval_end.json", "cost_by_stage.json"):
        assert art in info["artifacts"], art
    from mlflow.artifacts import download_artifacts

    table = json.loads(Path(download_artifacts(run_id=s["mlflow_run_id"], artifact_path="cost_by_stage.json",
                                               dst_path=str(tmp_path / "got"), tracking_uri=s["tracking_uri"]))
                       .read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    rows_by_stage = {r["stage"]: r for r in rows}
    assert {"ingest", "prepare", "rollout", "update", "eval_end", "report", "total"} <= set(rows_by_stage)
    assert rows[-1]["usd"] == pytest.approx(s["cost_usd"], abs=1e-5)
    assert json.loads(info["tags"]["mlflow.loggedArtifacts"]) == [{"path": "cost_by_stage.json", "type": "table"}]
    # the logs say what the run did and which model version it registered
    said = [r.getMessage() for r in caplog.records] + flow_lines.said
    assert any(m.startswith("report: held-out accuracy ") and m.endswith("registered rlsift-policy version 1")
               for m in said), said
    assert any(m.startswith(f"run {s['run_id']} completed in ") and m.endswith("registered rlsift-policy version 1")
               for m in said), said
    assert s["model_version"] == "1"
    from mlflow import MlflowClient

    mv = MlflowClient(tracking_uri=s["tracking_uri"]).get_model_version("rlsift-policy", "1")
    assert mv.run_id == s["mlflow_run_id"] and "/models/m-" in mv.source  # the run's logged MLflow Model
    assert info["tags"]["mlflow.runName"] == "grpo bundled:default s0" and info["tags"]["rlsift.run_id"] == s["run_id"]

    # what the Prefect UI's Artifacts tab shows for the flow run: the latest version of each key
    flow_run_id = json.loads((Path(s["run_dir"]) / "info.json").read_text())["flow_run_id"]
    arts = {k: v[-1] for k, v in flow_run_artifacts(flow_run_id).items()}
    assert set(arts) == {"eval-by-level", "time-by-stage", "mlflow-run", "run-summary"}
    levels = json.loads(arts["eval-by-level"].data)
    assert levels[-1] == {"level": "all", "start": round(s["eval_accuracy_start"], 3),
                          "end": round(s["eval_accuracy_end"], 3),
                          "change": round(s["eval_accuracy_end"] - s["eval_accuracy_start"], 3)}
    times = {r["stage"]: r for r in json.loads(arts["time-by-stage"].data)}
    assert {"ingest", "prepare", "eval_end", "report", "total"} <= set(times)  # the report stage too
    assert times["total"]["usd"] == pytest.approx(s["cost_usd"], abs=1e-5) and times["report"]["seconds"] > 0
    assert times["rollout"]["device_hours"] == pytest.approx(rows_by_stage["rollout"]["device_hours"])
    assert s["mlflow_run_id"] in arts["mlflow-run"].data and "mlflow ui" in arts["mlflow-run"].data
    assert arts["run-summary"].data == info["tags"]["mlflow.note.content"]

    # MLflow's first screen says what happened, and where the run came from
    note = info["tags"]["mlflow.note.content"]
    assert note.startswith("**grpo bundled:default s0**: completed in ") and s["run_id"] in note
    assert (f"held-out greedy accuracy {s['eval_accuracy_start']:.3f} → {s['eval_accuracy_end']:.3f}" in note
            and f"${s['cost_usd']:.4f}" in note and "registered rlsift-policy version 1" in note), note
    assert info["tags"]["rlsift.prefect.flow_run_id"] == flow_run_id
    assert info["tags"]["rlsift.prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")  # the harness's API
    assert f"[{flow_run_id}]({info['tags']['rlsift.prefect.flow_run_url']})" in note
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert info["tags"]["mlflow.source.git.commit"] == head
    # the registered version: a description, its held-out accuracy, no empty parent tag (it has no parent)
    assert mv.tags["heldout_accuracy"] == f"{s['eval_accuracy_end']:.4f}" and "parent_version" not in mv.tags
    assert (mv.tags["precision"], mv.tags["weights_dtype"]) == ("fp32", "float32")
    assert mv.description.startswith(f"Trained by rlsift run {s['run_id']} (grpo bundled:default s0), 4 steps")

    # the flow-run graph shows the design's rounds (train.steps=4, round_steps=2): a task run each, in the train stage's
    runs = task_runs(flow_run_id, lambda rs: sum(r.name.startswith("round-") for r in rs) >= 2)
    train = [r for r in runs if r.name.startswith("train-")]
    rounds = {r.name: r for r in runs if r.name.startswith("round-")}
    assert len(train) == 1 and set(rounds) == {"round-0", "round-1"}
    assert sorted(r.name for r in runs if r.name.startswith("evaluate")) == ["evaluate-end", "evaluate-start"]
    for r in rounds.values():
        assert r.state_name == "Completed" and [p.id for p in r.task_inputs["__parents__"]] == [train[0].id]


def flow_run_artifacts(flow_run_id: str) -> dict[str, list]:
    """The flow run's artifacts by key, each key's versions oldest first (the UI shows the latest)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    out: dict[str, list] = {}
    for a in sorted(arts, key=lambda a: a.created):
        out.setdefault(a.key, []).append(a)
    return out


def task_runs(flow_run_id: str, ready, timeout: float = 30.0) -> list:
    """The flow run's task runs, read until ``ready(task_runs)`` (the API records them from events, a moment
    after they end) or ``timeout`` seconds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    end = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if ready(runs) or time.monotonic() > end:
                return runs
            time.sleep(0.2)


@pytest.mark.parametrize("lag", [0, 1])
def test_heldout_accuracy_moves_scalingrl_rho(tmp_path, prefect_harness, easy_task, lag, monkeypatch):
    """In-training evaluations (eval.every) feed ScalingRL's scheduler: at each round start, rho moves by rho_step
    when the latest held-out accuracy differs from the one the previous round start saw (up when it fell).

    Each evaluation runs for real (the pipeline's ``eval_during``: the policy, the ledger's rows), and its accuracy
    is then shifted by a step-dependent amount, so that it moves between round starts whatever the short run's
    greedy answers do (on a held-out share the fixture's policy has learned they may not move in 8 steps)."""
    import dataclasses

    from tasks import stages

    real = stages.eval_during

    def moving(run, policy, test, step):
        held = real(run, policy, test, step)
        acc = held.accuracy * 0.5 + 0.1 * (step % 3)  # 3 values a cycle: consecutive round starts differ
        return dataclasses.replace(held, accuracy=acc, metrics={**held.metrics, "eval/accuracy": acc})

    monkeypatch.setattr(stages, "eval_during", moving)
    folder, model = easy_task
    root = tmp_path / "root"
    s = pipeline(config=SMOKE, overrides=[
        f"paths.root={root}", f"model.path={model}", "data.test_from_train=0.3",
        f"data.sources=[{{kind: file, path: {folder / 'easy_train.jsonl'}, reward: arith}}]",
        "rollout.max_new_tokens=32", "curriculum.enabled=true", "curriculum.rho0=0.2",
        "curriculum.rho_step=0.05", "eval.every=1", "train.steps=8",
        "train.round_steps=2", "train.lr=5e-4", f"overlap.lag={lag}"])
    assert s["status"] == "completed" and s["steps"] == 8
    assert (s["overlap"]["lag"], s["overlap"]["basis"]) == (lag, "config")  # an explicit lag wins
    logged = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    heldout = {m["step"]: m["eval/accuracy"] for m in logged if "eval/accuracy" in m}
    rho = {m["step"]: m["curriculum/rho"] for m in logged}
    assert sorted(heldout) == list(range(8))
    # the rule replayed by hand: round starts at 0, 2, 4, 6; the one at r sees the evaluation after step r - 1 - lag
    # (overlapped, a round start is drawn during the update before it: docs/algorithms.md section 8.1)
    expected, prev, moves = 0.2, None, 0
    for r in (0, 2, 4, 6):
        seen = heldout.get(r - 1 - lag)
        if seen is not None and prev is not None and seen != prev:
            expected += 0.05 if seen < prev else -0.05
            moves += 1
        prev = seen if seen is not None else prev
        # logged by the steps whose selection reads the round: overlapped, each step logs the next one's draw
        assert all(rho[s] == pytest.approx(expected) for s in (r - lag, r + 1 - lag) if s >= 0), (r, heldout, rho)
    assert moves, f"the test needs held-out accuracy to change between round starts: {heldout}"


def test_a_stop_that_cuts_a_checkpoint_short_is_reported_as_the_stop(tmp_path, prefect_harness, monkeypatch):
    """A SIGTERM that lands in ``torch.save`` comes out of it as torch's ``RuntimeError`` (raised while the
    ``TerminationSignal`` was handled): the run ends cancelled, and Prefect's flow run Crashed by the termination
    signal, not Failed by torch's error."""
    import signal

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import TerminationSignal

    import tasks.training.checkpoint as checkpoint
    from tasks.records.stopping import sigterm_raises

    def cut_short(path, write):  # the checkpoint's torch.save, as a SIGTERM in it ends
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310") from None

    monkeypatch.setattr(checkpoint, "atomic_write", cut_short)
    root = tmp_path / "root"
    with pytest.raises(TerminationSignal), sigterm_raises():  # Prefect sends the signal on once it has reported it
        pipeline(config=SMOKE, overrides=[f"paths.root={root}", "train.checkpoint_every=2", "eval.samples=0"])
    with get_client(sync_client=True) as client:
        (last,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    assert last.state.is_crashed() and "termination signal" in last.state.message, last.state
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        assert [r["status"] for r in led.query("SELECT status FROM runs")] == ["cancelled"]
