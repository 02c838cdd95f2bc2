"""Tracking that survives MLflow outages: the write-ahead outbox, idempotent resends, rejected items, metrics
committed with checkpoints, and (slow) a real ``mlflow server`` stopped and restarted under a logging run."""

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasks.records.tracking import MlflowTracker, Outbox, metric_history, run_info
from tasks.run import open_run

ROOT = Path(__file__).resolve().parents[2]


# ---- the outbox -----------------------------------------------------------------------------------------
def test_outbox_is_a_fifo_that_keeps_items_appended_while_draining(tmp_path):
    box = Outbox(tmp_path / "outbox.jsonl")
    for i in range(5):
        box.append({"i": i})
    items = box.peek()
    assert [x["i"] for x in items] == [0, 1, 2, 3, 4]
    box.append({"i": 5})  # arrives while the sender works on the first five
    box.drop(len(items))
    assert [x["i"] for x in box.peek()] == [5]
    box.drop(1)
    assert box.peek() == [] and not box.path.exists()


def test_outbox_skips_a_torn_last_line_but_not_a_torn_middle_one(tmp_path):
    path = tmp_path / "outbox.jsonl"
    path.write_text('{"i": 0}\n{"i": 1}\n{"i": ')  # a writer killed mid-line
    assert Outbox(path).peek() == [{"i": 0}, {"i": 1}]
    path.write_text('{"i": 0}\n{"i": \n{"i": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        Outbox(path).peek()


def test_outbox_concurrent_appends_lose_nothing(tmp_path):
    box = Outbox(tmp_path / "outbox.jsonl")
    drained: list[int] = []
    stop = threading.Event()

    def sender():
        while not stop.is_set() or box.peek():
            items = box.peek()
            drained.extend(x["i"] for x in items)
            box.drop(len(items))

    t = threading.Thread(target=sender)
    t.start()
    for i in range(500):
        box.append({"i": i})
    stop.set()
    t.join()
    assert drained == list(range(500))


# ---- delivery to a real (sqlite) store -------------------------------------------------------------------
@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    """One store for the module's tests (creating an MLflow database takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_resending_the_outbox_creates_no_duplicates(tmp_path, sqlite_uri):
    """A process killed after sending but before dropping the items resends them: MLflow ignores the repeats."""
    t = MlflowTracker(sqlite_uri, "resend", tmp_path / "run", flush_s=3600)
    t.log_params({"lr": 0.1})
    for step in range(5):
        t.log_metrics({"loss": 1.0 / (step + 1), "acc": step / 10}, step)
    (tmp_path / "notes.txt").write_text("hello")
    t.log_artifact(tmp_path / "notes.txt")
    unsent = t.outbox.path.read_text()
    assert t.flush()
    t.outbox.path.write_text(unsent)  # as if the drop never happened
    assert t.flush()
    t.finish()
    assert metric_history(sqlite_uri, t.run_id, "loss") == [(s, 1.0 / (s + 1)) for s in range(5)]
    info = run_info(sqlite_uri, t.run_id)
    assert info["params"] == {"lr": "0.1"} and info["artifacts"] == ["notes.txt"] and info["status"] == "FINISHED"
    copies = tmp_path / "run" / "outbox-artifacts"
    assert not copies.exists() or not any(copies.iterdir()), "sent artifact copies are removed"


def test_an_item_mlflow_rejects_is_set_aside_and_the_rest_is_sent(tmp_path, sqlite_uri):
    t = MlflowTracker(sqlite_uri, "reject", tmp_path / "run", flush_s=3600)
    t.log_params({"seed": 0})
    assert t.flush()
    t.log_params({"seed": 1})  # MLflow params are immutable: INVALID_PARAMETER_VALUE
    t.log_metrics({"loss": 0.5}, 0)
    assert t.flush()
    t.finish()
    rejected = [json.loads(x) for x in (tmp_path / "run" / "outbox-rejected.jsonl").read_text().splitlines()]
    assert [r["params"] for r in rejected] == [{"seed": "1"}]
    assert metric_history(sqlite_uri, t.run_id, "loss") == [(0, 0.5)]
    assert run_info(sqlite_uri, t.run_id)["params"] == {"seed": "0"}


def test_step_metrics_reach_mlflow_only_with_their_checkpoint(smoke_cfg, sqlite_uri):
    """Run.defer_metrics / commit_metrics (called by training/checkpoint.py): a failed run drops what no checkpoint
    covers (a resume recomputes it), a completed run sends everything."""
    run = open_run(smoke_cfg(f"tracking.uri={sqlite_uri}"))
    run.log_metrics({"ingest/rows": 3.0}, 0)  # before training: sent at once
    run.defer_metrics(0)
    for step in range(3):
        run.log_metrics({"train/loss": float(step)}, step)
    run.commit_metrics(2)  # checkpoint after step 1
    run.tracker.flush()
    uri, rid = run.tracking_uri, run.tracker.run_id
    assert metric_history(uri, rid, "train/loss") == [(0, 0.0), (1, 1.0)]
    run.close("failed", {})
    assert metric_history(uri, rid, "train/loss") == [(0, 0.0), (1, 1.0)]
    assert metric_history(uri, rid, "ingest/rows") == [(0, 3.0)]

    again = open_run(smoke_cfg(f"tracking.uri={sqlite_uri}"), run_id=run.run_id)
    assert again.tracker.run_id == rid and again.resumed
    again.defer_metrics(2)
    again.log_metrics({"train/loss": 2.0}, 2)
    again.log_metrics({"eval/accuracy": 0.5}, 3)
    again.close("completed", {})
    assert metric_history(uri, rid, "train/loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert metric_history(uri, rid, "eval/accuracy") == [(3, 0.5)]
    assert run_info(uri, rid)["status"] == "FINISHED"


# ---- a real server going away and coming back ----------------------------------------------------------------
@pytest.mark.slow
def test_mlflow_server_outage_loses_nothing_and_duplicates_nothing(tmp_path):
    from tests.servers import free_port, start, stop, wait_http, wait_port_free

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = tmp_path / "mlflow.log"
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
           "--artifacts-destination", str(tmp_path / "store" / "artifacts")]
    (tmp_path / "store").mkdir()
    env = {**__import__("os").environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = start(cmd, env, log)
    try:
        wait_http(f"{uri}/health", server, log)
        a = MlflowTracker(uri, "outage", tmp_path / "a", flush_s=0.5)
        b = MlflowTracker(uri, "outage", tmp_path / "b", final_wait_s=1.0)
        a.log_params({"lr": 0.1})
        for step in range(5):
            a.log_metrics({"loss": float(step)}, step)
        (tmp_path / "before.txt").write_text("before")
        a.log_artifact(tmp_path / "before.txt")
        assert a.flush()

        stop(server, signal.SIGTERM)
        wait_port_free(port)
        slowest = 0.0
        for step in range(5, 25):  # training goes on
            t0 = time.perf_counter()
            a.log_metrics({"loss": float(step)}, step)
            slowest = max(slowest, time.perf_counter() - t0)
        t0 = time.perf_counter()
        a.log_params({"batch": 8})
        a.set_tags({"phase": "outage"})
        (tmp_path / "during.txt").write_text("during")
        a.log_artifact(tmp_path / "during.txt")
        slowest = max(slowest, time.perf_counter() - t0)
        assert slowest < 0.5, f"a logging call took {slowest:.2f} s while MLflow was down"
        from tasks.model.loading import build_tiny_model, build_tokenizer, save_policy

        tok = build_tokenizer()  # a real checkpoint: registration saves it as an MLflow Model first (not timed)
        model = save_policy(build_tiny_model(hidden=64, layers=1, heads=2, seed=0, tokenizer=tok), tok,
                            tmp_path / "model")
        assert a.register_model(model, "outage-model", {"parent_version": ""}) is None  # queued, not lost
        time.sleep(1.5)  # the background sender tries and keeps everything
        assert len(a.outbox) > 0

        b.log_metrics({"loss": 1.0}, 0)
        (tmp_path / "b.txt").write_text("b")
        b.log_artifact(tmp_path / "b.txt")
        t0 = time.perf_counter()
        b.finish()  # at the end of a run, MLflow still down: the outbox stays for `rlsift sync`
        assert time.perf_counter() - t0 < 10
        assert (tmp_path / "b" / "outbox.jsonl").exists()

        server = start(cmd, env, log)  # same port, same backend
        wait_http(f"{uri}/health", server, log)
        a.finish()
        assert not a.outbox.path.exists()
        assert metric_history(uri, a.run_id, "loss") == [(s, float(s)) for s in range(25)]
        info = run_info(uri, a.run_id)
        assert info["params"] == {"lr": "0.1", "batch": "8"} and info["tags"]["phase"] == "outage"
        assert {"before.txt", "during.txt"} <= set(info["artifacts"]) and info["status"] == "FINISHED"
        from mlflow.tracking import MlflowClient

        versions = MlflowClient(uri).search_model_versions("name = 'outage-model'")
        assert [(v.version, v.run_id) for v in versions] == [("1", a.run_id)]

        synced = subprocess.run([sys.executable, "-m", "flows.cli", "sync", str(tmp_path / "b"), uri, b.run_id],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert synced.returncode == 0, synced.stderr[-2000:]
        assert synced.stdout == "sent\n"  # nothing else on stdout (MLflow's "View run" line is suppressed)
        assert metric_history(uri, b.run_id, "loss") == [(0, 1.0)]
        info_b = run_info(uri, b.run_id)
        assert info_b["artifacts"] == ["b.txt"] and info_b["status"] == "FINISHED"
        assert not (tmp_path / "b" / "outbox.jsonl").exists()
    finally:
        stop(server, signal.SIGTERM)


def test_experiments_are_marked_as_model_training(tmp_path, sqlite_uri):
    """MLflow 3 opens an experiment on runs and charts (not its GenAI pages) when its kind says so; an
    experiment made without the tag gets it from the next run."""
    from mlflow import MlflowClient

    from tasks.records.tracking import EXPERIMENT_KIND

    client = MlflowClient(tracking_uri=sqlite_uri)
    for name in ("fresh", "older"):
        if name == "older":
            client.create_experiment(name)
        t = MlflowTracker(sqlite_uri, name, tmp_path / name, background=False)
        assert client.get_experiment_by_name(name).tags[EXPERIMENT_KIND[0]] == EXPERIMENT_KIND[1]
        t.client.set_terminated(t.run_id)


def test_system_metrics_are_sampled_into_the_run(tmp_path, sqlite_uri):
    t = MlflowTracker(sqlite_uri, "system", tmp_path / "run", flush_s=3600, system_metrics_s=0.5)
    time.sleep(2.0)
    t.finish()
    metrics = run_info(sqlite_uri, t.run_id)["metrics"]
    assert "system/cpu_utilization_percentage" in metrics and "system/system_memory_usage_megabytes" in metrics


def test_metrics_are_laid_out_for_the_run_page(tmp_path, sqlite_uri):
    """MLflow's Model metrics tab sorts chart groups by name: the compared series get a copy under a group that
    sorts first, calibration shares become tags, per-stage cost stays out of the series (the cost table has it)."""
    from tasks.records.layout import HEADLINE, mlflow_layout

    logged = {"eval/accuracy": 0.5, "train/reward_mean": 0.25, "train/effective_ratio": 0.75, "train/loss": 1.0,
              "calibrate/effective": 0.333333, "cost/rollout_usd": 0.1, "cost/rollout_device_hours": 1.0,
              "cost/usd": 0.2, "cost/device_hours": 2.0, "time/rollout_s": 3.0}
    series, values = mlflow_layout(logged)
    assert values == {"calibrate/effective": "0.3333"}
    assert set(series) == {"eval/accuracy", "train/reward_mean", "train/effective_ratio", "train/loss", "cost/usd",
                           "cost/device_hours", "time/rollout_s", *HEADLINE.values()}
    groups = sorted({k.rsplit("/", 1)[0] for k in series} | {"adapt", "calibrate", "eval_end", "ingest"})
    assert groups[0] == "0_progress" and sorted(groups, key=str.lower)[0] == "0_progress"

    t = MlflowTracker(sqlite_uri, "layout", tmp_path / "run", background=False)
    t.log_metrics(logged, 3)
    t.log_table([{"stage": "ingest", "usd": 0.5}, {"stage": "total", "usd": 0.5, "device": "cpu"}], "table.json")
    t.log_table([{"stage": "total", "usd": 0.7}], "table.json")  # replaced, not appended
    assert t.flush()
    info = run_info(sqlite_uri, t.run_id)
    assert set(info["metrics"]) == set(series) and info["tags"]["calibrate/effective"] == "0.3333"
    assert metric_history(sqlite_uri, t.run_id, "0_progress/heldout_accuracy") == [(3, 0.5)]
    from mlflow.artifacts import download_artifacts

    got = download_artifacts(run_id=t.run_id, artifact_path="table.json", dst_path=str(tmp_path / "got"),
                             tracking_uri=sqlite_uri)
    assert json.loads(Path(got).read_text()) == {"columns": ["stage", "usd"], "data": [["total", 0.7]]}
    assert json.loads(info["tags"]["mlflow.loggedArtifacts"]) == [{"path": "table.json", "type": "table"}]
    t.finish()


def test_the_run_link_opens_the_run_not_the_server(tmp_path, sqlite_uri):
    """The log line and the Prefect artifact link the MLflow run's page, on the UI's model-training side (MLflow
    3.17 opens the GenAI side unless the page's workflowType says otherwise); a local store has no page to link:
    the run says the one command that opens a UI on it, and the run's page there."""
    from tasks.records.tracking import experiment_page, mlflow_command, run_url

    t = MlflowTracker(sqlite_uri, "links", tmp_path / "run", background=False)
    assert t.url is None and run_url(sqlite_uri, t.run_id) is None
    exp = t.experiment_id
    assert t.ui == (f"`{mlflow_command()} ui --backend-store-uri {sqlite_uri}`, then "
                    f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{t.run_id}?workflowType=machine_learning")
    cmd = mlflow_command()  # this Python's own mlflow, by name where the PATH finds it, else by its full path
    assert Path(shutil.which(cmd) or cmd).resolve() == (Path(sys.executable).parent / "mlflow").resolve()
    t.uri = "http://mlflow.example:5000/"  # as if on a server: the link needs no request
    assert t.url == t.ui == \
        f"http://mlflow.example:5000/#/experiments/{exp}/runs/{t.run_id}?workflowType=machine_learning"
    assert experiment_page(t.uri, exp) == \
        f"http://mlflow.example:5000/#/experiments/{exp}/runs?workflowType=machine_learning"
    t.uri = sqlite_uri
    t.finish()


def test_sync_settles_the_description_a_registration_waited_for(tmp_path, sqlite_uri):
    """MLflow away from the registration to the run's end: the Description queued then says "not registered yet".
    `rlsift sync` (tracker.py ``sync``) sends the registration, then the Description, which now names the registered
    version and the outage (when, and that `rlsift sync` sent what it held); the outage's record says so too."""
    from mlflow.tracking import MlflowClient

    from tasks.records.tracking import pending_registration, sync
    from tasks.records.tracking.describe import DESCRIPTION
    from tasks.records.tracking.outbox import OutageLog

    run_dir = tmp_path / "run"
    t = MlflowTracker(sqlite_uri, "sync-description", run_dir, flush_s=3600, final_wait_s=0.0)
    t.log_metrics({"loss": 1.0}, 0)
    assert t.flush()
    t.client = MlflowClient(tracking_uri="http://127.0.0.1:9")  # the server goes away (nothing listens on port 9)
    model = run_dir / "outbox-artifacts" / "mlflow-model-sync-model"  # a saved MLflow Model (as register_model saves)
    model.mkdir(parents=True)
    (model / "MLmodel").write_text("flavors: {}\n")
    assert t.register_model(tmp_path / "unused", "sync-model", {"steps": "1"}) is None  # queued
    text = f"**run**: completed\n- model: {pending_registration('sync-model')}\n"
    t.describe(text)
    t.finish()  # MLflow still away: the outbox keeps the registration, the Description and the status
    (outage,) = OutageLog(run_dir / "outbox-outages.json").entries()
    assert outage.until is None and outage.since > 0
    before = run_info(sqlite_uri, t.run_id)["tags"].get(DESCRIPTION)
    assert before is None  # nothing of it has reached MLflow

    assert sync(run_dir, sqlite_uri, t.run_id)
    info = run_info(sqlite_uri, t.run_id)
    said = info["tags"][DESCRIPTION]
    assert "not registered yet" not in said and "- model: registered sync-model version 1" in said, said
    last = said.rstrip("\n").splitlines()[-1]
    assert last.startswith("- MLflow outage: unreachable from ") and "sent by `rlsift sync`" in last, last
    (outage,) = OutageLog(run_dir / "outbox-outages.json").entries()
    assert outage.until is not None and outage.sent_by == "`rlsift sync`"
    versions = MlflowClient(tracking_uri=sqlite_uri).search_model_versions("name = 'sync-model'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", t.run_id)] and info["status"] == "FINISHED"


def test_a_description_without_an_outage_is_sent_as_written(tmp_path, sqlite_uri):
    from tasks.records.tracking.describe import DESCRIPTION

    t = MlflowTracker(sqlite_uri, "plain-description", tmp_path / "run", background=False)
    t.describe("**run**: completed\n- model: registered m version 3\n")
    t.finish()
    said = run_info(sqlite_uri, t.run_id)["tags"][DESCRIPTION]
    assert said == "**run**: completed\n- model: registered m version 3\n"
    assert not (tmp_path / "run" / "outbox-outages.json").exists()


def test_the_end_of_a_run_says_it_waits_for_mlflow_and_prints_a_sync_that_runs(tmp_path, sqlite_uri, caplog,
                                                                                 monkeypatch):
    """MLflow gone at the end of a run: a line says the run waits for it (the terminal was silent for 30 s), then the
    `rlsift sync` line, with the full path of this environment's rlsift (printed bare, it failed with exit 127 where
    the venv was not activated; tests/test_printed_commands.py runs it)."""
    import logging
    import os
    import shlex

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    t = MlflowTracker(sqlite_uri, "ends-in-an-outage", tmp_path / "run", background=False, final_wait_s=1.0)
    t.uri, t.client = "http://127.0.0.1:9", MlflowClient(tracking_uri="http://127.0.0.1:9")  # nothing listens there
    t.log_metrics({"loss": 1.0}, 0)
    with caplog.at_level(logging.INFO, logger="rlsift"):
        t.finish()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("rlsift")]
    waits = next(i for i, m in enumerate(said) if "MLflow at http://127.0.0.1:9 does not answer; sending" in m)
    gives_up = next(i for i, m in enumerate(said) if m.startswith("MLflow still unreachable"))
    assert waits < gives_up, said
    printed = shlex.split(re.search(r"`([^`]+)` sends them", said[gives_up]).group(1))
    assert os.path.isabs(printed[0]) and printed[1:] == ["sync", str(tmp_path / "run"), "http://127.0.0.1:9", t.run_id]


def test_the_final_wait_for_an_unreachable_server_says_so_first(tmp_path, sqlite_uri, caplog):
    """A run whose MLflow server is away at its end waits ``final_wait_s`` for it: it says so when the wait starts
    (the terminal was silent for 30 s after MLflow's "Stopping system metrics monitoring"), then, the time up, where
    the unsent items are and the `rlsift sync` command."""
    import logging

    from mlflow.tracking import MlflowClient

    from tests.servers import free_port

    t = MlflowTracker(sqlite_uri, "away-at-the-end", tmp_path / "run", flush_s=3600, final_wait_s=0.5)
    t.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t.log_params({"lr": 0.1})
    with caplog.at_level(logging.INFO, logger="rlsift.tracking"):
        t.finish()
    said = [r.getMessage() for r in caplog.records if r.name == "rlsift.tracking"]
    waits = [i for i, m in enumerate(said) if "does not answer; sending the run's last items again for up to" in m]
    assert len(waits) == 1 and waits[0] < len(said) - 1, said  # once, before the wait's end
    assert "MLflow still unreachable" in said[-1] and "rlsift sync" in said[-1], said
