"""Progress of long work that has no count to show (a plan's probes, ``rlsift deploy``): a log line as each part
starts, and while one part runs long, a line every few seconds that says it still runs, so no stage is silent for
more than :data:`PULSE_S` seconds, on a terminal (stderr) and in a Prefect flow run's log (the ``rlsift`` logger is
one of Prefect's extra loggers: flows/cli.py ``ENV_DEFAULTS``, infra/prefect.yaml).

Light on purpose (stdlib only): ``rlsift deploy`` uses it without importing torch. Work with a count uses
:func:`progress_bar` (a tqdm bar on a terminal, :class:`LogProgress` lines off it).
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: Seconds of silence after which a running part says it still runs.
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


def show_progress() -> bool:
    """Progress bars only on an interactive terminal, never in CI logs."""
    return sys.stderr.isatty() and not os.environ.get("CI")


class LogProgress:
    """Progress off a terminal (logs, CI, a Prefect worker): one log line every ``every`` seconds, with the
    count, the share done, the time so far and left, and the last ``set_postfix`` values; a last line at the
    end. Same calls as the ``tqdm`` bar it stands in for (iterate, ``update``, ``set_postfix``, ``close``)."""

    def __init__(self, iterable=None, *, total: int | None = None, desc: str, unit: str = "it", initial: int = 0,
                 every: float = 10.0):
        self.iterable, self.desc, self.unit, self.every = iterable, desc, unit, every
        self.total = total if total is not None or iterable is None else len(iterable)
        self.n = self.start = initial
        self.t0 = self.last = time.monotonic()
        self.postfix = ""

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every:
            self._log()

    def _log(self, final: bool = False) -> None:
        self.last = now = time.monotonic()
        spent = now - self.t0
        line = f"{self.desc}: {self.n}" + (f"/{self.total}" if self.total else "") + f" {self.unit}"
        if self.total:
            line += f" ({100 * self.n / self.total:.0f}%)"
        line += f", {spent:.0f} s"
        done = self.n - self.start
        if self.total and done and not final:
            line += f", about {spent / done * (self.total - self.n):.0f} s left"
        logging.getLogger("rlsift.progress").info(line + (f"; {self.postfix}" if self.postfix else ""))

    def close(self) -> None:
        if self.n > self.start:
            self._log(final=True)
            self.start = self.n  # closing twice logs once


def progress_bar(iterable=None, *, total: int | None = None, desc: str, unit: str = "it", initial: int = 0):
    """A tqdm bar on an interactive terminal, else :class:`LogProgress` (a line every 10 s)."""
    if show_progress():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial)
    return LogProgress(iterable, total=total, desc=desc, unit=unit, initial=initial)


def quiet_libraries() -> None:
    """No third-party progress bars (transformers' weight loading/saving) off a terminal or in CI."""
    if show_progress():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub loads (transformers' too)
    if "huggingface_hub" in sys.modules:  # loaded already (not imported here: seconds before the first stage)
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
