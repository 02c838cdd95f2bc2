"""How a run stops on SIGINT or SIGTERM: as an exception, so every ``finally`` runs and the stores are marked.

A signal becomes an exception in the main thread: SIGINT is Python's ``KeyboardInterrupt``; SIGTERM is Prefect's
``TerminationSignal``, raised by the SIGTERM handler its flow engine installs while a flow run runs
(``prefect.utilities.engine.capture_sigterm``), and outside a flow run by :func:`sigterm_raises` (the ``rlsift``
command line). The run's cleanup (tasks/run.py ``Run.close``, flows/pipeline.py ``execute``) then ends it as
``cancelled`` in the ledger and ``KILLED`` in MLflow; Prefect's engine reports its flow run ``Crashed`` (a signal
from outside) or ``Cancelled`` (a cancellation asked of Prefect, delivered by the worker as SIGTERM).

Prefect's handler, once its flow run has been reported, sends the signal again to the handler that was installed
before it: Python's default one kills the process on the spot (no ``atexit``: Prefect's temporary API server is
then killed by its parent-death signal, flows/prefect_server.py, not stopped cleanly); :func:`sigterm_raises`'
raises again, so the process ends through its ``atexit`` handlers.

A flow-run process whose Prefect worker dies without stopping it (a SIGKILL) would train on, orphaned:
:func:`watch_worker` sends it SIGTERM then, so it ends as above. Its output went to the worker through a pipe, which
the worker's death breaks: Prefect's console handler (rich) would end the run on its next line with ``SystemExit(1)``
("failed" in the ledger) before the watch sees the worker gone; :func:`quiet_broken_console` keeps it running.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("rlsift")

#: The status a stopped run ends with in the ledger and the run summary.
CANCELLED = "cancelled"
#: The MLflow run status of each final run status (any other: FINISHED).
TRACKER_STATUS = {"failed": "FAILED", CANCELLED: "KILLED"}
#: The signals that stop a run cleanly (SIGKILL cannot be caught: a resume cleans up after it).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stopping(err: BaseException) -> BaseException | None:
    """The exception a stop signal raised: ``err`` itself, or the one being handled when ``err`` was raised (e.g.
    Prefect's client failing to report the stop to a server the same signal stopped); None for a failure."""
    from prefect.exceptions import TerminationSignal

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt | TerminationSignal):
            return seen
        seen = seen.__context__
    return None


def stop_signal(err: BaseException) -> signal.Signals | None:
    """The signal that stopped the run ``err`` ended: SIGINT for ``KeyboardInterrupt``, the signal of Prefect's
    ``TerminationSignal`` (:func:`stopping`); None for any other exception (a failure)."""
    stop = stopping(err)
    if stop is None:
        return None
    return signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.Signals(stop.signal)


def _raise_termination(signum: int, frame) -> None:
    from prefect.exceptions import TerminationSignal

    handling = sys.exc_info()[1]
    if isinstance(handling, TerminationSignal):  # Prefect re-sending the signal it handles: the same stop goes on,
        raise handling                          # with what the run attached to it (flows/pipeline.py ``execute``)
    raise TerminationSignal(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises ``TerminationSignal`` in the main thread, as it does inside a Prefect flow
    run (outside the main thread, where handlers cannot be set, the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_termination)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


@contextmanager
def held_signals() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then arrive as usual (the first of them, once): a second
    Ctrl-C while a stopping run marks its stores does not cut that short. Python's handlers are swapped for ones
    that note the signal (a blocked signal mask would not hold them: another thread can take the signal); outside
    the main thread, where handlers cannot be set, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if caught:
            signal.raise_signal(caught[0])


def watch_worker(poll_s: float = 1.0) -> Callable[[], None]:
    """In a flow-run process that a Prefect worker started (``PREFECT__FLOW_RUN_ID`` in its environment), watch the
    worker: when it dies (this process gets another parent), send this process SIGTERM, so its run ends cleanly.
    Elsewhere (``rlsift run``: its parent may leave, e.g. a shell that started it in the background) nothing.
    Returns the function that ends the watch."""
    done = threading.Event()
    if "PREFECT__FLOW_RUN_ID" not in os.environ:
        return done.set
    quiet_broken_console()
    worker = os.getppid()

    def watch() -> None:
        while not done.wait(poll_s):
            if os.getppid() != worker:
                log.warning("the Prefect worker (process %d) of this flow run is gone: stopping the run", worker)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="rlsift-watch-worker", daemon=True).start()
    return done.set


def quiet_broken_console() -> None:
    """Prefect's console handlers (``PrefectConsoleHandler``, a rich ``Console`` on the process's output) go quiet
    when their output's pipe breaks, instead of raising ``SystemExit(1)`` from the logging call that met it (rich's
    ``Console.on_broken_pipe``, which rich documents as the method to change): a flow-run process whose worker died
    would otherwise fail its run on its next log line. Its run's ``run.log`` and the Prefect API still get every
    line."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        console = handler.console

        def go_quiet(console=console) -> None:
            console.quiet = True

        console.on_broken_pipe = go_quiet
