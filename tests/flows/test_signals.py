"""SIGINT and SIGTERM during training end a run cleanly (tasks/records/stopping.py), and its resume finishes it.

``rlsift run`` runs in a session of its own and gets the signal once ``metrics.jsonl`` shows three finished steps
(its checkpoint at step 2 is on disk): SIGTERM to the process alone (``kill PID``), SIGINT to its process group (a
Ctrl-C at the terminal: the temporary Prefect server and the generator process get it too). Then:

- it exits with 128 + the signal, its ``--json`` object says ``cancelled``, and its log says so in one line;
- the three stores hold no "Running" record: the ledger says ``cancelled``, the MLflow run ``KILLED``, and Prefect's
  local database (``PREFECT_HOME``) has the flow run ``CRASHED`` (Prefect's word for a run stopped by a signal from
  outside) and no flow or task run still ``RUNNING``;
- no process of its session is left (Prefect's temporary API server, the overlap's generator process, the
  multiprocessing resource tracker), and its temporary directory holds nothing of it (no ``rlsift-*`` folder, no
  multiprocessing ``pymp-*`` folder with a listener socket);
- (slow tier) the ``rlsift run --resume`` command its message prints, pasted in another folder, finishes it, equal
  to an uninterrupted run: weights, ledger, metrics.jsonl
  (the per-phase peak-memory keys of every step included).

The default tier runs the SIGTERM case up to the checks of the stores and the process table (about a minute on
2 cores); ``-m slow`` runs both signals with the resume, on test_resume.py's stateful configuration.
"""

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tasks.records.ledger import Ledger
from tasks.records.tracking import run_info
from tests.flows.conftest import ROOT, cli_env, rlsift
from tests.flows.test_resume import args, ledger_rows, memory_phases, signal_during_training, step_metrics

TINY = ROOT / "tests" / "fixtures" / "tiny.yaml"
#: long enough for the signal to land in training; a checkpoint every 2 steps, so step 2's is kept
FAST = ["model.threads=1", "train.steps=12", "train.round_steps=4", "train.checkpoint_every=2", "eval.samples=0"]


def leftovers(session: int, prefect_home: Path | None = None) -> list[str]:
    """The processes still running in ``session`` (one that outlived its parent keeps its session; one that has
    exited and waits for init to reap it, e.g. multiprocessing's resource tracker, which ends after its parent, is
    not running), and those with ``prefect_home`` as their ``PREFECT_HOME``: the temporary Prefect server runs in a
    session of its own (flows/prefect_server.py)."""
    def ours(p: psutil.Process) -> bool:
        return os.getsid(p.pid) == session or (
            prefect_home is not None and p.environ().get("PREFECT_HOME") == str(prefect_home))

    out = []
    for p in psutil.process_iter(["pid", "ppid", "name", "status", "cmdline"]):
        try:
            if ours(p) and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.info['pid']} (parent {p.info['ppid']}, {p.info['status']}) {p.info['name']}: "
                           + " ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def prefect_states(prefect_home: Path) -> dict[str, list[str]]:
    """Flow and task run state types in Prefect's local database (the temporary server's, read directly)."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return {table: [r[0] for r in db.execute(f"SELECT state_type FROM {table}")]  # noqa: S608
                for table in ("flow_run", "task_run")}


def check_stopped(tmp: Path, root: Path, proc, run_id: str, out: str, err: str, sig: signal.Signals) -> None:
    """Exit code, output, the three stores, the process table and the temporary directory of a stopped run."""
    assert proc.returncode == 128 + sig, err[-3000:]
    stopped = json.loads(out)
    assert stopped["status"] == "cancelled" and stopped["run_id"] == run_id
    kept = (root / "runs" / run_id / "checkpoints" / "latest").read_text().split()[0]  # step 2's or a later one
    assert (root / "runs" / run_id / "checkpoints" / kept).is_file()
    assert stopped["reason"].startswith(f"by {sig.name} at step ")
    assert f"checkpoint at step {int(kept[5:11])} kept" in stopped["reason"]
    command = shlex.join([sys.executable, "-m", "flows.cli", "run", "--resume", run_id, f"paths.root={root.resolve()}"])
    assert f"`{command}` finishes it" in stopped["reason"]  # as this test ran rlsift: python -m flows.cli
    lines = [ln for ln in err.splitlines() if f"run {run_id} cancelled by {sig.name}" in ln]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        row = led.query("SELECT status, mlflow_run_id FROM runs WHERE run_id = ?", [run_id])[0]
    assert row["status"] == "cancelled"
    assert run_info(f"sqlite:///{root / 'mlflow.db'}", row["mlflow_run_id"])["status"] == "KILLED"
    states = prefect_states(tmp / "prefect-home")
    assert states["flow_run"] == ["CRASHED"] and "RUNNING" not in states["task_run"], states
    assert leftovers(proc.pid, tmp / "prefect-home") == []
    assert sorted(p.name for p in (tmp / "tmp").iterdir() if p.name.startswith(("rlsift-", "pymp-"))) == []


def stop_env(tmp: Path) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    return cli_env(tmp, TMPDIR=str(tmp / "tmp"))


@pytest.mark.parametrize("group", [False, True], ids=["alone", "group"])
def test_sigterm_during_training_ends_the_run_cancelled_and_leaves_nothing_running(tmp_path, group):
    """To the process alone (``kill PID``), or to its whole process group, as ``timeout``, ``kill -- -PGID`` and
    systemd's stop (every process of the unit) send it: the temporary Prefect server must not die first, or the
    run's last states go nowhere and Prefect's client retries them for minutes (it took over two)."""
    root = tmp_path / "root"
    proc, run_id, out, err = signal_during_training(
        root, ["-c", str(TINY), *FAST, f"paths.root={root}"], stop_env(tmp_path), 3, signal.SIGTERM, group=group,
        within_s=60)
    check_stopped(tmp_path, root, proc, run_id, out, err, signal.SIGTERM)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, easy_task):
    """test_resume.py's stateful run, uninterrupted: (its root, its ``--json`` summary)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    done = rlsift("run", *args(tmp / "root", easy_task), "--json", env=stop_env(tmp))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "root", json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["sigint-group", "sigterm"])
def test_a_signal_during_training_then_resume_equals_an_uninterrupted_run(tmp_path, easy_task, uninterrupted, sig,
                                                                           group):
    root_a, ref = uninterrupted
    root = tmp_path / "root"
    env = stop_env(tmp_path)
    proc, run_id, out, err = signal_during_training(root, args(root, easy_task), env, 3, sig, group)
    check_stopped(tmp_path, root, proc, run_id, out, err, sig)

    with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:  # rounds the stop found finished
        rounds = dict(db.execute("SELECT name, state_name FROM task_run WHERE name LIKE 'round-%'").fetchall())
    assert rounds and "RolledBack" not in rounds.values(), rounds

    # the command the stop message prints, pasted as printed in another folder, without the run's other arguments
    (pasted,) = re.findall(r"`([^`]+ run --resume [^`]+)` finishes it", json.loads(out)["reason"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resumed = subprocess.run([*shlex.split(pasted), "--json"], cwd=elsewhere,
                             env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = json.loads(resumed.stdout)
    assert res["status"] == "completed" and res["resumed"] and res["run_id"] == run_id
    with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db") as db:  # the resume's flow run shows the run's own
        params = [json.loads(p) for (p,) in db.execute("SELECT parameters FROM flow_run WHERE state_type = "
                                                        "'COMPLETED'")]
    assert params == [{"config": str(TINY), "overrides": args(root, easy_task)[2:], "resume": run_id}], params
    for table, order in (("groups", "step, prompt_id, replayed, from_step"), ("selections", "step, prompt_id"),
                         ("reference", "step, prompt_id, round"), ("evals", "phase, step, grp")):
        assert ledger_rows(root_a, table, order) == ledger_rows(root, table, order), f"{table} differs after resume"
    run_dir, ref_dir = root / "runs" / run_id, root_a / "runs" / ref["run_id"]
    got, want = step_metrics(run_dir), step_metrics(ref_dir)
    differ = [(m["step"], k) for m, w in zip(got, want, strict=True) for k in m.keys() | w.keys()
              if m.get(k) != w.get(k) and not (m.get(k) != m.get(k) and w.get(k) != w.get(k))]  # NaN equals NaN
    assert len(got) == len(want) and not differ, differ
    assert memory_phases(run_dir) == memory_phases(ref_dir)
    wa, wb = (load_file(Path(s["model_path"]) / "model.safetensors") for s in (ref, res))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    assert res["eval_accuracy_end"] == ref["eval_accuracy_end"]
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        assert led.run_status(run_id) == "completed"
    assert run_info(res["tracking_uri"], res["mlflow_run_id"])["status"] == "FINISHED"
    assert sorted(prefect_states(tmp_path / "prefect-home")["flow_run"]) == ["COMPLETED", "CRASHED"]
    assert leftovers(proc.pid, tmp_path / "prefect-home") == [] and not list((tmp_path / "tmp").glob("rlsift-*"))


def test_a_resume_removes_the_temporary_folder_a_killed_generator_left(smoke_cfg):
    """A generator process killed with SIGKILL leaves its multiprocessing folder (with a listener socket in it where
    its replies share their tensors, as a GPU's do; empty on a CPU, whose replies carry them), which its run
    recorded: the resume removes it, and keeps one whose process still lives."""
    from tasks.generation.rollout import HFEngine
    from tasks.model.loading import build_tiny_model, build_tokenizer
    from tasks.model.lora import plain_copy
    from tasks.overlap.generator_process import GeneratorProcess
    from tasks.run import TEMP_RECORD, open_run

    cfg = smoke_cfg()
    run = open_run(cfg, track=False)
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    gp = GeneratorProcess(HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=8), 1,
                          plain_copy(model),
                          on_temp_dir=run.note_temp)
    gp.ready(wait=True)  # a call asked while it starts is made here, and leaves no folder of the child's
    gp.generate(["Q: 1+1=?\n"], 2, 0)
    left = Path(gp.temp_dir)
    assert left.is_dir()
    os.kill(gp.pid, signal.SIGKILL)
    gp.close()
    assert left.exists()  # what a SIGKILL of the whole run leaves (a clean end removes it, test_sigterm_... above)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mine = Path(str(left) + "-live")
    try:
        mine.mkdir()
        run.note_temp(str(mine), live.pid)
        run.ledger.close()  # as a killed process: its close never ran
        resumed = open_run(cfg, run_id=run.run_id, track=False)
        assert not left.exists() and mine.exists()
        assert json.loads((run.dir / TEMP_RECORD).read_text()) == [{"path": str(mine), "pid": live.pid}]
        resumed.close("failed", {})
    finally:
        live.kill()
        live.wait()
        shutil.rmtree(mine, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c-to-rlsift-worker", "sigkill-to-prefect-worker", "sigkill-to-rlsift-worker"])
def test_a_stopped_or_killed_worker_ends_its_run_in_flight_cancelled(tmp_path, how):
    """A Prefect server, the deployments, a worker running the pipeline deployment; during training either a Ctrl-C
    at the terminal of ``rlsift worker`` (SIGINT to its process group; flows/worker.py sends the flow-run process
    SIGTERM, waits for it, then stops the worker) or a SIGKILL to Prefect's own worker (its flow-run process,
    orphaned, sends itself SIGTERM: tasks/records/stopping.py ``watch_worker``). Either way the run ends: flow run
    ``CRASHED``, ledger ``cancelled``, MLflow ``KILLED``, and no process of the worker, the flow run or its
    generator is left. A SIGKILL to ``rlsift worker`` (what ``infra/worker.sh`` runs) takes Prefect's worker with it
    (the parent-death signal), and its flow run then ends as in the case before."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.worker import flow_processes
    from tests.servers import free_port, start, stop, wait_http

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = cli_env(tmp_path, PREFECT_API_URL=api, PREFECT_WORKER_QUERY_SECONDS="2")
    prefect = str(Path(sys.executable).with_name("prefect"))
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    server = start([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env,
                   tmp_path / "server.log")
    worker, sessions = None, []
    try:
        wait_http(f"{api}/health", server, tmp_path / "server.log")
        assert rlsift("deploy", env=env).returncode == 0
        root = tmp_path / "root"
        # steps enough that the kill lands in training: the worker's death is seen within a second (stopping.py
        # watch_worker), and FAST's 12 steps now end sooner than that after the third
        params = {"config": str(TINY), "overrides": [*FAST, "train.steps=400", f"paths.root={root}"]}
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            flow_run = client.create_flow_run_from_deployment(
                client.read_deployment_by_name("pipeline/pipeline").id, parameters=params)
            ours = how.endswith("rlsift-worker")
            command = ([sys.executable, "-m", "flows.cli", "worker"] if ours else
                       [prefect, "worker", "start", "--type", "process"])
            worker = start([*command, "--pool", "rlsift-process"], env, tmp_path / "worker.log", cwd=ROOT)
            deadline = time.time() + 600
            while not ((root / "runs").exists() and any(
                    len(f.read_text().splitlines()) >= 3 for f in (root / "runs").glob("*/metrics.jsonl"))):
                assert worker.poll() is None and time.time() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
                time.sleep(0.2)
            prefect_worker = psutil.Process(worker.pid).children()[0] if ours else psutil.Process(worker.pid)
            (flow_process,) = flow_processes(prefect_worker.pid)
            sessions = sorted({os.getsid(p) for p in (worker.pid, prefect_worker.pid, flow_process.pid)})
            if how == "ctrl-c-to-rlsift-worker":
                os.killpg(worker.pid, signal.SIGINT)
                assert worker.wait(180) == 0, (tmp_path / "worker.log").read_text()[-3000:]
            else:
                worker.kill()
                flow_process.wait(180)
                assert not prefect_worker.is_running() or prefect_worker.status() == psutil.STATUS_ZOMBIE
            state = client.read_flow_run(flow_run.id).state
        log = (tmp_path / "worker.log").read_text()
        assert state.is_crashed() and "termination signal" in state.message, log[-3000:]
        with Ledger(root / "ledger.duckdb", read_only=True) as led:
            row = led.query("SELECT run_id, status, mlflow_run_id FROM runs")[0]
        assert row["status"] == "cancelled"
        assert run_info(f"sqlite:///{root / 'mlflow.db'}", row["mlflow_run_id"])["status"] == "KILLED"
        if how == "ctrl-c-to-rlsift-worker":  # the flow run's log reaches the worker's output while it lives
            assert "1 flow run(s) in flight get SIGTERM" in log and "still running" not in log
            assert f"run {row['run_id']} cancelled by SIGTERM" in log
        time.sleep(2)
        assert [p for s in sessions for p in leftovers(s)] == []
    finally:
        if worker is not None:
            stop(worker, signal.SIGKILL, timeout=5)
        for s in sessions:
            try:
                os.killpg(s, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop(server, signal.SIGTERM, timeout=30)
