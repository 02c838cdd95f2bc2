"""What a command that runs the pipeline (``rlsift run``, ``plan``, ``bench``) does between its checked command line
and the flow's first stage, arranged so that the waits overlap: Prefect's temporary API server boots in its own
process (seconds of imports and of its database on disk) while this process imports torch, MLflow and the pipeline,
and a new local MLflow store creates its tables (schema migrations that wait on the disk more than the CPU) before
the server has answered.

Light at import (the standard library only): the command line imports it before it has checked its input.

The server is started from a thread (flows/prefect_server.py ``prefect_server``: the thread inherits its blocked
SIGINT, so the server's process still does) that then waits until the process ends: the server's parent-death signal
(a ``kill -9`` of rlsift takes the server with it) follows the thread that forked it, so that thread must not end
first; every module that start imports is imported first, here, in the
calling thread (:data:`SERVER_MODULES`), so the thread imports nothing while the calling thread imports the rest:
two threads importing modules that import each other can stop on Python's module locks (``_DeadlockError``).
tests/test_startup.py checks that the thread imports nothing.
"""

from __future__ import annotations

import importlib
import threading

#: What starting the temporary server imports (Prefect's client, its server app, httpx's IDNA codec).
SERVER_MODULES = ("prefect", "prefect.settings", "prefect.client.orchestration", "prefect.server.api.server",
                  "flows.prefect_server", "tasks.records.process", "encodings.idna")


class ServerStart:
    """Prefect's temporary API server (where no server is configured), started in a thread now; :meth:`wait` until it
    answers. Its start's modules are imported in the calling thread first."""

    def __init__(self) -> None:
        for name in SERVER_MODULES:
            importlib.import_module(name)
        self.error: BaseException | None = None
        self.imported: set[str] = set()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        import sys

        from flows.prefect_server import prefect_server

        before = set(sys.modules)
        try:
            prefect_server(lifelong_thread=True)
        except BaseException as err:  # noqa: BLE001 - raised again by wait(), in the calling thread
            self.error = err
        self.imported = set(sys.modules) - before
        self._started.set()
        threading.Event().wait()  # lives as long as the process (a daemon): the server's parent-death signal

    def wait(self) -> None:
        """Until the server answers (or its start failed: that error, raised here)."""
        self._started.wait()
        if self.error is not None:
            raise self.error


def create_local_store(uri: str) -> None:
    """A new local MLflow store's tables, created now (tasks/records/tracking/store.py); nothing for a server or a
    store that exists."""
    from tasks.records.tracking.store import create_local_store as create

    create(uri)
