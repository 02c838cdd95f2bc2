"""A run and its resume report to one Prefect server, and nothing of Prefect outlives a run.

- A run keeps the Prefect API it reported to (``info.json`` ``prefect_api``); a resume from a shell that exports no
  ``PREFECT_API_URL`` reports to it when it answers (flows/prefect_server.py ``resume_api``); a run of a temporary
  server resumes on a temporary server, as does one whose server is down (said).
- The killed flow run is marked Crashed with its task runs still Running or Pending (flows/pipeline.py
  ``crash_flow_run``); finished task runs keep their state.
- (slow) ``kill -9`` of a process that started Prefect's temporary API server (flows/prefect_server.py
  ``prefect_server``) takes the server with it within 5 s.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from flows.prefect_server import reporting_to, resume_api, stored_api
from tests.flows.conftest import ROOT, cli_env
from tests.servers import free_port


def test_crashing_a_killed_flow_run_ends_its_running_task_runs_too(prefect_harness):
    """A ``kill -9`` leaves the flow run and its ``train`` and ``round-2`` task runs Running; a resume marked the
    flow run Crashed only, so the task runs' bars grew for ever in the UI."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    from flows.pipeline import crash_flow_run

    @flow(name="pipeline")
    def killed_flow() -> None: ...

    @task(name="train")
    def train() -> None: ...

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(killed_flow, state=Running())
        made = {name: client.create_task_run(train, run.id, dynamic_key=name, name=name, state=state)
                for name, state in (("train", Running()), ("round-2", Running()), ("round-3", Pending()),
                                    ("ingest", Completed()))}
        other = client.create_flow_run(killed_flow, state=Running())  # another run's: not touched
        theirs = client.create_task_run(train, other.id, dynamic_key="x", name="train", state=Running())

        assert crash_flow_run(str(run.id), "its process died") == 4  # the flow run and three task runs
        assert client.read_flow_run(run.id).state.type.value == "CRASHED"
        states = {name: client.read_task_run(t.id).state for name, t in made.items()}
        assert {n: s.type.value for n, s in states.items()} == {
            "train": "CRASHED", "round-2": "CRASHED", "round-3": "CRASHED", "ingest": "COMPLETED"}
        assert states["train"].message == "its process died"
        assert client.read_task_run(theirs.id).state.type.value == "RUNNING"
        assert client.read_flow_run(other.id).state.type.value == "RUNNING"
        assert crash_flow_run(str(run.id), "again") == 0  # nothing left unfinished


def info_with(tmp_path, api: str | None, run_id: str = "r1"):
    folder = tmp_path / "root" / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "info.json").write_text(json.dumps({"flow_run_id": "f", "prefect_api": api}))
    return tmp_path / "root"


def test_a_resume_reports_to_the_prefect_server_the_run_used(prefect_harness, tmp_path, monkeypatch, caplog):
    """Pasted in a fresh shell (no PREFECT_API_URL), the resume went to a temporary server: "could not mark the
    killed flow run ... as crashed" and the real UI kept only the Crashed run. Now the run's own server, when it
    answers; a temporary server when the run used one, or when its server is down (said); an exported
    PREFECT_API_URL wins (said when it differs)."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()  # the harness's server
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = info_with(tmp_path, api)
    assert stored_api(root, "r1") == api and resume_api(root, "r1") == api
    with reporting_to(api):
        assert PREFECT_API_URL.value() == api and os.environ["PREFECT_API_URL"] == api
    assert "PREFECT_API_URL" not in os.environ
    assert resume_api(info_with(tmp_path / "temp", None), "r1") is None  # a temporary server's run: one again
    assert resume_api(root, "nosuchrun") is None
    down = f"http://127.0.0.1:{free_port()}/api"
    with caplog.at_level(logging.WARNING, logger="rlsift"):
        assert resume_api(info_with(tmp_path / "down", down), "r1") is None
        monkeypatch.setenv("PREFECT_API_URL", down)
        assert resume_api(root, "r1") is None  # the shell's choice wins
    said = [r.getMessage() for r in caplog.records]
    assert any(f"at {down}, which does not answer now" in m for m in said), said
    assert any(f"reported to the Prefect server at {api}; this resume reports to PREFECT_API_URL={down}" in m
               for m in said), said


def test_a_run_records_the_prefect_api_of_its_flow_run(prefect_harness, smoke_cfg, monkeypatch):
    """``claim_flow_run`` keeps the API beside the flow run id (what ``resume_api`` reads)."""
    from prefect import flow
    from prefect.settings import PREFECT_API_URL

    from flows.pipeline import claim_flow_run
    from tasks.run import RunInfo, open_run

    run = open_run(smoke_cfg(), track=False)

    @flow(name="claim")
    def claim() -> None:
        claim_flow_run(run)

    claim()
    run.close("completed", {})
    info = RunInfo.load(run.dir / "info.json")
    assert info.flow_run_id and info.prefect_api == PREFECT_API_URL.value()
    assert stored_api(run.root, run.run_id) == PREFECT_API_URL.value()
    assert replace(info, prefect_api=None) != info


@pytest.mark.slow
@pytest.mark.parametrize("start", ["from flows.prefect_server import prefect_server\nprefect_server()\n",
                                   "from flows.startup import ServerStart\nServerStart().wait()\n"],
                         ids=["main-thread", "startup-thread"])
def test_kill_9_of_the_process_that_started_the_temporary_server_takes_the_server_with_it(tmp_path, start):
    """The temporary API server was still listening 14 minutes after a ``kill -9`` of its run (Prefect stops it at
    exit, and a SIGKILL runs no exit handler). Started in the main thread or, as `rlsift run` does, from the
    startup's thread (flows/startup.py)."""
    env = cli_env(tmp_path)
    code = ("from flows.cli import _env\n_env()\n" + start +
            "from prefect.server.api.server import SubprocessASGIServer\n"
            "s = SubprocessASGIServer._instances[None]\n"
            "print(s.server_process.pid, s.port, flush=True)\n"
            "import time\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pid, port = (int(x) for x in proc.stdout.readline().split())
        server = psutil.Process(pid)
        assert "uvicorn" in server.cmdline()
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) == 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() - t0 < 5, "the temporary server outlived its process by 5 s"
            time.sleep(0.05)
        # (the port itself is not checked: on a shared machine another test's server may take it at once)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("server", ["prefect-server", "temporary"])
def test_kill_9_then_the_printed_resume_in_a_fresh_shell_ends_on_the_same_prefect_server(tmp_path, server):
    """The issue's path end to end: ``rlsift run`` (reporting to a Prefect server, or to its own temporary one) is
    killed with SIGKILL during training. Within 5 s nothing of it runs; ``rlsift ledger runs`` says ``stopped`` and
    prints the resume command; that command, run from a shell that exports no PREFECT_API_URL, finishes the run on
    the server the run used: the killed flow run Crashed, the resumed one Completed, no task run left Running."""
    from tests.flows.conftest import rlsift
    from tests.flows.test_resume import signal_during_training
    from tests.flows.test_signals import FAST, TINY, leftovers, prefect_states
    from tests.servers import start, stop, wait_http

    fresh = cli_env(tmp_path)  # no PREFECT_API_URL
    proc_server, api = None, None
    if server == "prefect-server":
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        proc_server = start([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], fresh, tmp_path / "server.log")
    try:
        if proc_server is not None:
            wait_http(f"{api}/health", proc_server, tmp_path / "server.log")
        root = tmp_path / "root"
        env = cli_env(tmp_path, **({"PREFECT_API_URL": api} if api else {}))
        proc, run_id, _, err = signal_during_training(root, ["-c", str(TINY), *FAST, f"paths.root={root}"], env, 3,
                                                      signal.SIGKILL, group=False)
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
        deadline = time.monotonic() + 5
        home = tmp_path / "prefect-home" if server == "temporary" else None  # not the test's own server
        while leftovers(proc.pid, home) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(proc.pid, home) == []  # the temporary server, the generator process: gone with it

        p = rlsift("ledger", "runs", "--root", str(root), "--json", env=fresh, timeout=300)
        (row,) = json.loads(p.stdout)
        assert row["status"] == "stopped" and row["resume"], p.stdout
        resumed = subprocess.run(row["resume"], shell=True, cwd=tmp_path, env=fresh, capture_output=True, text=True,
                                 timeout=900)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "could not mark the killed flow run" not in resumed.stderr, resumed.stderr[-3000:]
        if api is None:
            states = prefect_states(tmp_path / "prefect-home")
            flows, tasks = sorted(states["flow_run"]), states["task_run"]
        else:
            from prefect.client.orchestration import get_client
            from prefect.settings import PREFECT_API_URL, temporary_settings

            with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
                flows = sorted(r.state_type.value for r in client.read_flow_runs())
                tasks = [r.state_type.value for r in client.read_task_runs()]
        assert flows == ["COMPLETED", "CRASHED"], flows
        assert not {"RUNNING", "PENDING"} & set(tasks), tasks
    finally:
        if proc_server is not None:
            stop(proc_server)
