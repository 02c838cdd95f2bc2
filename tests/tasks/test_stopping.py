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


class BrokenPipe:
    """A stream whose reader is gone, as a dead worker's end of a flow-run process's output."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self):
        return False

    def fileno(self):
        return -1


def test_prefects_console_goes_quiet_when_its_pipe_breaks():
    """A dead worker breaks its flow-run process's output: the next log line must not raise SystemExit (rich's
    default), which ended the run "failed" before the worker watch stopped it "cancelled"."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from tasks.records.stopping import quiet_broken_console

    logger = logging.getLogger("rlsift.test-broken-pipe")
    handler = PrefectConsoleHandler(stream=BrokenPipe())
    logger.addHandler(handler)
    logger.propagate = False
    def exit_as_rich_does():  # rich's Console.on_broken_pipe, without its dup2 over this process's stdout
        raise SystemExit(1)

    try:
        handler.console.on_broken_pipe = exit_as_rich_does
        with pytest.raises(SystemExit):
            logger.warning("a line to a dead worker")
        quiet_broken_console()
        logger.warning("a line to a dead worker")  # no SystemExit
        assert handler.console.quiet
        logger.warning("and the next")
    finally:
        logger.removeHandler(handler)
