"""Progress of long work that has no count to show (a plan's probes, ``rlsift deploy``): a log line as each part
starts, and while one part runs long, a line every few seconds that says it still runs, so no stage is silent for
more than :data:`PULSE_S` seconds, on a terminal (stderr) and in a Prefect flow run's log (the ``rlsift`` logger is
one of Prefect's extra loggers: flows/cli.py ``ENV_DEFAULTS``, infra/prefect.yaml).

Light on purpose (stdlib only): ``rlsift deploy`` uses it without importing torch. Work with a count uses
tasks/run.py ``progress_bar`` instead.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: Seconds of silence after which a running part says it still runs (the issue's bound is 15 s).
PULSE_S = 10.0


class Pulse:
    """Say what long work does now (:meth:`__call__`: one line at once), and from a background thread, while a part
    runs longer than ``every`` seconds, ``<what>: <part> (still running, 23 s)`` every ``every`` seconds. Use as a
    context manager (:func:`pulse`); the thread runs in a copy of the caller's context, so inside a Prefect flow
    run its lines reach the flow run's log."""

    def __init__(self, what: str, logger: logging.Logger, every: float = PULSE_S):
        self.what, self.log, self.every = what, logger, every
        self.part, self.since = "", time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, part: str) -> None:
        """A new part starts: log ``<what>: <part>``."""
        with self._lock:
            self.part, self.since = part, time.monotonic()
        self.log.info("%s: %s", self.what, part)

    def _beat(self) -> None:
        last = time.monotonic()  # the last line this thread logged
        while True:
            with self._lock:
                since = self.since
            if self._done.wait(max(0.0, max(last, since) + self.every - time.monotonic())):
                return
            with self._lock:
                part, since = self.part, self.since
            now = time.monotonic()
            if now - max(last, since) >= self.every - 1e-3:  # else a new part began meanwhile: wait from it
                self.log.info("%s: %s (still running, %.0f s)", self.what, part or "working", now - since)
                last = now

    def start(self) -> Pulse:
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._beat,), name="rlsift-pulse", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


@contextmanager
def pulse(what: str, logger: logging.Logger | None = None, every: float = PULSE_S) -> Iterator[Pulse]:
    """``with pulse("plan") as say: say("timing generation"); ...``: see :class:`Pulse`."""
    beat = Pulse(what, logger or logging.getLogger("rlsift.progress"), every).start()
    try:
        yield beat
    finally:
        beat.stop()
