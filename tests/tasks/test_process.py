"""Nothing outlives a run (tasks/records/process.py): a child armed with ``die_with_parent`` dies on its parent's
``kill -9``; a run whose process is gone (pid free, or reused by another process) shows as ``stopped`` with the
command that finishes it, in ``rlsift ledger runs`` and in the next command that opens the ledger to write."""

import json
import logging
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tasks.records.ledger import STOPPED, Ledger
from tasks.records.process import START_TOLERANCE_S, ProcessMark
from tasks.records.resume import note_stopped, resume_command

ROOT = Path(__file__).resolve().parents[2]


def dead_process() -> ProcessMark:
    """The mark of a process that ran on this host and has exited (its pid may be reused later)."""
    proc = subprocess.Popen(["sleep", "30"])
    mark = ProcessMark(proc.pid, socket.gethostname(), psutil.Process(proc.pid).create_time())
    proc.kill()
    proc.wait()
    return mark


def wait_gone(mark: ProcessMark, timeout_s: float) -> float:
    """Seconds until ``mark`` is gone; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not mark.gone():
        assert time.monotonic() - t0 < timeout_s, f"process {mark.pid} still alive after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_child_armed_to_die_with_its_parent_dies_on_the_parents_kill_9():
    """The parent starts ``sleep 600`` with ``die_with_parent`` (what Prefect's temporary server and ``rlsift
    worker``'s Prefect worker get), prints its pid, and is killed with SIGKILL: no atexit, no cleanup of its own.
    Without the arming the sleep would run on for ten minutes."""
    code = ("import os, subprocess, sys, time\n"
            "from tasks.records.process import die_with_parent\n"
            "child = subprocess.Popen(['sleep', '600'], preexec_fn=die_with_parent(os.getpid()))\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        mark = ProcessMark(child, socket.gethostname(), psutil.Process(child).create_time())
        assert not mark.gone()
        parent.kill()
        parent.wait()
        assert wait_gone(mark, 5.0) < 5.0
    finally:
        parent.kill()
        parent.wait()


def test_a_process_is_gone_when_its_pid_is_free_or_another_process_holds_it():
    me = ProcessMark.current()
    assert not me.gone()
    assert ProcessMark(me.pid, me.host, me.started + 10 * START_TOLERANCE_S).gone()  # the pid reused since
    assert dead_process().gone()
    assert not ProcessMark(1, "another-host.example", 0.0).gone()  # cannot be told from here: not said gone


def ledger_with(root: Path, **runs: ProcessMark) -> None:
    with Ledger(root / "ledger.duckdb") as led:
        for run_id, process in runs.items():
            led.start_run(run_id, {}, None, process=process)


def test_ledger_runs_shows_a_run_whose_process_is_gone_as_stopped_with_its_resume_command(tmp_path):
    """A row marked running whose process was killed (``kill -9``: it never closed its stores) said ``running`` for
    ever; now ``rlsift ledger runs`` says ``stopped`` and prints the command that finishes it. The run of a live
    process stays ``running``."""
    root = tmp_path / "root"
    ledger_with(root, killed=dead_process(), alive=ProcessMark.current())
    p = subprocess.run([sys.executable, "-m", "flows.cli", "ledger", "runs", "--root", str(root)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    status = {line.split()[0]: line.split()[1] for line in p.stdout.splitlines()[1:]}
    assert status == {"killed": STOPPED, "alive": "running"}, p.stdout
    command = shlex.join([sys.executable, "-m", "flows.cli", "run", "--resume", "killed", f"paths.root={root}"])
    assert f"run killed stopped: `{command}` finishes it" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "flows.cli", "ledger", "runs", "--root", str(root), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    rows = {r["run"]: r for r in json.loads(p.stdout)}
    assert rows["killed"]["status"] == STOPPED and rows["killed"]["resume"] == command
    assert rows["alive"]["status"] == "running" and rows["alive"]["resume"] is None
    with Ledger(root / "ledger.duckdb", read_only=True) as led:  # the reader tells; it does not write
        assert led.run_status("killed") == STOPPED and led.progress("killed")["status"] == STOPPED
        assert led.query("SELECT status FROM runs WHERE run_id = 'killed'")[0]["status"] == "running"


def test_the_next_command_that_writes_the_ledger_records_and_says_a_stopped_run(tmp_path, caplog):
    """A writer (``rlsift run``, ``rlsift ingest``) records a dead run as stopped and says it, with its resume
    command, in one warning line; the run being resumed, a live run and a row without a process are left alone."""
    root = tmp_path / "root"
    ledger_with(root, killed=dead_process(), resumed=dead_process(), alive=ProcessMark.current())
    with Ledger(root / "ledger.duckdb") as led:
        led.con.execute("INSERT INTO runs (run_id, status) VALUES ('older', 'running')")  # before rlsift kept it
        with caplog.at_level(logging.WARNING, logger="rlsift"):
            assert note_stopped(led, root, but="resumed") == ["killed"]
        assert note_stopped(led, root, but="resumed") == []  # said once
        stored = {r["run_id"]: r["status"] for r in led.query("SELECT run_id, status FROM runs")}
    assert stored == {"killed": STOPPED, "resumed": "running", "alive": "running", "older": "running"}
    said = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert said == [f"run killed stopped: its process is gone and it never closed (killed?); "
                    f"`{resume_command('killed', root)}` finishes it"]


def test_a_resumed_run_takes_over_its_row_with_its_own_process(tmp_path):
    root = tmp_path / "root"
    ledger_with(root, run=dead_process())
    with Ledger(root / "ledger.duckdb") as led:
        assert led.run_status("run") == STOPPED
        led.start_run("run", {}, None)  # the resume, in this process
        assert led.run_status("run") == "running"
        row = led.query("SELECT pid, host FROM runs WHERE run_id = 'run'")[0]
    assert (row["pid"], row["host"]) == (ProcessMark.current().pid, socket.gethostname())
