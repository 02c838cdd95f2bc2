"""``rlsift worker``: a Prefect process worker whose Ctrl-C (or SIGTERM) lets its runs in flight end cleanly.

Prefect's own worker (3.8.8), stopped by a signal, cancels its tasks; the subprocess transport of each flow run it
runs is then closed, and asyncio kills the flow-run process with SIGKILL at once: the run cannot mark its stores,
and its Prefect flow run, MLflow run and ledger row stay "Running". ``rlsift worker`` runs ``prefect worker start``
as its child, in a session of its own, so that a Ctrl-C at the terminal reaches ``rlsift worker`` alone (on Linux
the worker is killed when ``rlsift worker`` dies, by the parent-death signal; its flow-run processes, orphaned,
then stop their runs themselves: tasks/records/stopping.py ``watch_worker``). On SIGINT, SIGTERM or SIGHUP it

1. sends SIGTERM to each flow-run process of the worker (its children that carry ``PREFECT__FLOW_RUN_ID``), which
   ends its run as any signalled run ends (tasks/records/stopping.py: the last checkpoint kept, ledger ``cancelled``,
   MLflow ``KILLED``, Prefect ``Crashed``, its generator process stopped);
2. waits for them, ``--grace`` seconds at most (a second signal stops the wait);
3. stops the worker with SIGINT, as one Ctrl-C does (SIGKILL if it has not stopped 30 s later).

The worker may pick up a scheduled flow run during the grace period; that one is then killed as Prefect's worker
kills it. ``rlsift run --resume RUN_ID`` finishes a stopped run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tasks.records.process import die_with_parent

log = logging.getLogger("rlsift.worker")

#: The signals that stop ``rlsift worker`` (SIGHUP: its terminal closed).
STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def flow_processes(worker_pid: int) -> list[psutil.Process]:
    """The worker's flow-run processes: its children whose environment names a flow run."""
    out = []
    for child in psutil.Process(worker_pid).children():
        try:
            if "PREFECT__FLOW_RUN_ID" in child.environ():
                out.append(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def serve(pool: str, grace: float = 60.0) -> int:
    """Run a process worker on ``pool`` until it stops or a stop signal comes (then as the module docstring says).
    Returns the worker's exit code. Call from the main thread."""
    prefect = str(Path(sys.executable).with_name("prefect"))
    # killed with rlsift worker (SIGKILL, not SIGTERM: Prefect's worker, stopped by a signal, kills its flow runs at
    # once; killed, it leaves them to stop themselves, tasks/records/stopping.py ``watch_worker``)
    worker = subprocess.Popen([prefect, "worker", "start", "--pool", pool, "--type", "process"],
                              start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
    stops: list[int] = []
    asked = threading.Event()

    def on_signal(signum: int, frame) -> None:
        stops.append(signum)
        asked.set()

    for sig in STOP:
        signal.signal(sig, on_signal)
    while worker.poll() is None and not asked.wait(0.5):
        pass
    if worker.poll() is not None:
        return worker.returncode
    runs = flow_processes(worker.pid)
    log.warning("rlsift worker: %s; %d flow run(s) in flight get SIGTERM and up to %.0f s to end cleanly, then the "
                "worker stops", signal.Signals(stops[0]).name, len(runs), grace)
    for p in runs:
        p.send_signal(signal.SIGTERM)
    deadline, first = time.monotonic() + grace, len(stops)
    while runs and time.monotonic() < deadline and len(stops) == first:
        _, runs = psutil.wait_procs(runs, timeout=0.5)
    if runs:
        log.warning("rlsift worker: %d flow run(s) still running; stopping the worker kills them", len(runs))
    worker.send_signal(signal.SIGINT)
    try:
        return worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        return worker.wait()
