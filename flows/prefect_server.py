"""Prefect's temporary API server as ``rlsift`` starts it (flows/cli.py), and what its logging shows on the terminal.

Light at import (the logging module only): the command line imports it before it has checked its input.
"""

from __future__ import annotations

import logging
import os


class _RunFailures(logging.Filter):
    """Keeps Prefect's reports of a failed task or flow run (each with the exception's traceback: one for every
    stage the failure passes through) off the terminal; the run says its failure in one line and keeps the traceback
    in its ``run.log`` (flows/pipeline.py ``failed_note``). The Prefect UI still shows them: Prefect's API handler sits
    on those loggers themselves, not on the terminal's."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith(self.LOGGERS))


class ServerShutdown(logging.Filter):
    """Drops what Prefect's temporary API server logs of its own shutdown: rlsift stops it at exit (Prefect's
    ``atexit``: SIGTERM), and uvicorn's shutdown cancels the server's services (the task-run recorder, the event
    persister) while they may still write the run's last events to the server's SQLite database; each cancelled
    write logs a traceback (``sqlalchemy.pool ... Exception during reset or similar``, ``Error flushing ... events``),
    though nothing of the run is lost (its own stores are closed by then). A record is dropped only when a
    cancellation (``asyncio.CancelledError``) caused its exception, which happens at shutdown; every other error of
    the server still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        err = record.exc_info[1] if record.exc_info else None
        while err is not None:
            if isinstance(err, asyncio.CancelledError):
                return False
            err = err.__cause__ or err.__context__
        return True


def server_logging() -> None:
    """The temporary server's logging: Prefect's own configuration (prefect/logging/logging.yml) with
    :class:`ServerShutdown` on its terminal handler, written under ``PREFECT_HOME`` and named by
    ``PREFECT_LOGGING_SETTINGS_PATH``, which the server's process inherits (a path already set wins). This process has
    configured its logging already and keeps it."""
    if os.environ.get("PREFECT_LOGGING_SETTINGS_PATH"):
        return
    import yaml
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH
    from prefect.settings import PREFECT_HOME

    config = yaml.safe_load(DEFAULT_LOGGING_SETTINGS_PATH.read_text())
    config.setdefault("filters", {})["server_shutdown"] = {"()": f"{__name__}.ServerShutdown"}
    config["handlers"]["console"]["filters"] = ["server_shutdown"]
    path = PREFECT_HOME.value() / "rlsift-server-logging.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(path)


def prefect_server() -> None:
    """Start Prefect's temporary API server now, when no server is configured, with SIGINT blocked: the server
    inherits the blocked signal, so a Ctrl-C at the terminal (which reaches the whole process group) stops the run
    but not the server, which then records the flow run's end. Prefect stops the server when rlsift exits (atexit,
    with SIGTERM)."""
    import signal

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    for handler in logging.getLogger().handlers:
        handler.addFilter(_RunFailures())
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    server_logging()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        get_client(sync_client=True)  # starts the server (once per process)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
