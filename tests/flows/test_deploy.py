"""Deployments end to end: a real Prefect server on a free loopback port, ``rlsift deploy``, a process worker,
and a pipeline flow run triggered through the API that completes and leaves its MLflow run.

Only the processes the test starts are stopped, each by its own process group: the worker first (SIGINT: a
worker whose server is already gone has been seen to ignore SIGTERM), then the server (SIGTERM).
"""

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tasks.records.ledger import Ledger
from tasks.records.tracking import default_uri, run_info
from tests.flows.conftest import ROOT, cli_env, rlsift
from tests.servers import free_port, start, stop, wait_http

pytestmark = pytest.mark.slow

TINY = ["model.warmstart.steps=2", "model.hidden=64", "model.heads=2", "model.layers=1", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.steps=2", "train.prompts_per_step=4", "train.round_steps=1",
        "calibrate.k=4", "calibrate.g=2", "eval.samples=0",
        "data.sources=[{kind: bundled, n_train: 12, n_test: 4, seed: 0}]"]


def test_deploy_and_run_the_pipeline_through_a_worker(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = cli_env(tmp_path, PREFECT_API_URL=api, PREFECT_WORKER_QUERY_SECONDS="2",
                  PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5")
    server_env = dict(env)
    server_env.pop("PREFECT_API_URL")
    prefect = str(Path(sys.executable).with_name("prefect"))
    server = start([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env,
                   tmp_path / "server.log")
    worker = None
    try:
        wait_http(f"{api}/health", server, tmp_path / "server.log")
        t0 = time.time()
        done = rlsift("deploy", env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        deploy_s = time.time() - t0
        for says in ("loading Prefect", "deploy: checking the Prefect server at",
                     "deploy: work pool rlsift-process (created)", "deploy: registering pipeline, retrain"):
            assert says in done.stderr, done.stderr[-3000:]  # a line per step, not 46 s of silence
        # a person's summary: each deployment and its schedule, and the worker to start next (JSON with --json)
        assert "retrain/retrain" in done.stdout and "cron 0 3 * * *" in done.stdout, done.stdout
        assert f"next: start the worker that runs them (Ctrl-C stops it): env PREFECT_API_URL={api} " in done.stdout
        assert len(done.stdout.splitlines()) < 10 and "{" not in done.stdout, done.stdout
        assert "work pool rlsift-process (created)" in done.stdout.splitlines()[0], done.stdout
        # a second deploy updates in place and keeps the pool
        again = rlsift("deploy", "--json", env=env)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        registered = json.loads(again.stdout)
        assert set(registered["deployments"]) >= {"pipeline/pipeline", "retrain/retrain"}
        assert registered["work_pools"] == {"rlsift-process": "existing"}
        nightly = registered["deployments"]["retrain/retrain"]["schedules"]
        assert nightly == [{"cron": "0 3 * * *", "active": True}]
        assert registered["deployments"]["pipeline/pipeline"]["schedules"] == []

        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        root = tmp_path / "root"
        params = {"config": str(ROOT / "tests" / "fixtures" / "tiny.yaml"), "overrides": [*TINY, f"paths.root={root}"]}
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("pipeline/pipeline")
            flow_run = client.create_flow_run_from_deployment(dep.id, parameters=params)
            worker = start([prefect, "worker", "start", "--pool", "rlsift-process", "--type", "process"], env,
                           tmp_path / "worker.log", cwd=tmp_path)
            deadline = time.time() + 900
            while time.time() < deadline:
                state = client.read_flow_run(flow_run.id).state
                if state is not None and state.is_final():
                    break
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                time.sleep(2)
            else:
                raise TimeoutError("the flow run did not finish")
            run_s = time.time() - t0 - deploy_s
        assert state.is_completed(), f"{state}\n{(tmp_path / 'worker.log').read_text()[-5000:]}"
        print(f"deploy {deploy_s:.0f} s, triggered run to completion {run_s:.0f} s")

        with Ledger(root / "ledger.duckdb", read_only=True) as ledger:
            (row,) = ledger.query("SELECT status, mlflow_run_id FROM runs")
        assert row["status"] == "completed"
        info = run_info(default_uri(root), row["mlflow_run_id"])
        assert info["status"] == "FINISHED" and "eval_table.md" in info["artifacts"]
        from mlflow import MlflowClient

        (mv,) = MlflowClient(tracking_uri=default_uri(root)).search_model_versions("name = 'rlsift-policy'")
        assert mv.run_id == row["mlflow_run_id"]  # registered as the run's logged MLflow Model
        assert info["params"]["train.steps"] == "2"
        assert info["metrics"]["cost/usd"] > 0 and info["metrics"]["cost/device_hours"] > 0  # per stage: its table
    finally:
        if worker is not None:
            stop(worker, signal.SIGINT, timeout=30)
        stop(server, signal.SIGTERM, timeout=30)
