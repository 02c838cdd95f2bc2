"""How a signal stops a run (tasks/records/stopping.py): which exception stands for which signal, SIGTERM as an
exception outside a flow run, a second signal held while a stopping run marks its stores, and a flow-run process
whose Prefect worker dies stopping itself."""

import signal
import subprocess
import sys
import textwrap

import pytest
from prefect.exceptions import TerminationSignal

from tasks.records.stopping import held_signals, sigterm_raises, stop_signal
from tests.flows.conftest import ROOT


def test_the_exceptions_that_stand_for_a_signal():
    assert stop_signal(KeyboardInterrupt()) == signal.SIGINT
    assert stop_signal(TerminationSignal(signal.SIGTERM)) == signal.SIGTERM
    assert stop_signal(RuntimeError("a failure")) is None


def test_sigterm_raises_termination_signal_and_prefects_resend_keeps_the_same_one():
    with sigterm_raises():
        with pytest.raises(TerminationSignal) as first:
            signal.raise_signal(signal.SIGTERM)
        try:
            raise first.value
        except TerminationSignal as handling:  # as Prefect's handler re-sends the signal it handles
            handling.note = "kept"
            with pytest.raises(TerminationSignal) as again:
                signal.raise_signal(signal.SIGTERM)
        assert again.value is first.value and again.value.note == "kept"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_signal_during_held_signals_arrives_after_the_block():
    # Ctrl-C's handler as in a terminal (a background job of a shell script starts with SIGINT ignored, and keeps it)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    ran_on = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with held_signals():
                signal.raise_signal(signal.SIGINT)
                ran_on.append(True)
        assert ran_on == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {grandchild!r}, {out!r}], stdout=subprocess.PIPE,
                         env=dict(os.environ, PREFECT__FLOW_RUN_ID="x"))
child.stdout.readline()  # it watches this process, its worker
print(child.pid)  # and this process ends, without stopping it
"""
GRANDCHILD = """
import sys, time
from tasks.records.stopping import sigterm_raises, watch_worker
with sigterm_raises():
    watch_worker(poll_s=0.1)
    print("watching", flush=True)
    try:
        time.sleep(60)
    except BaseException as err:
        open(sys.argv[1], "w").write(f"{type(err).__name__} {err.signal}")
"""


def test_a_flow_run_process_whose_worker_dies_gets_sigterm(tmp_path):
    import psutil

    out = tmp_path / "out"
    script = ORPHAN.format(grandchild=textwrap.dedent(GRANDCHILD), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    try:
        psutil.Process(int(done.stdout)).wait(30)
    except psutil.NoSuchProcess:
        pass
    assert out.read_text() == "TerminationSignal 15"


def test_an_error_raised_while_handling_a_stop_is_that_stop():
    try:
        try:
            raise TerminationSignal(signal.SIGTERM)
        except TerminationSignal:
            raise ConnectionError("the server the signal also stopped")  # noqa: B904 - as Prefect's client does
    except ConnectionError as err:
        assert stop_signal(err) == signal.SIGTERM
