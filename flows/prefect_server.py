"""Prefect's temporary API server as ``rlsift`` starts it (flows/cli_commands.py): one that dies with rlsift,
``kill -9`` included (:func:`bound_server`); what its logging shows on the terminal; and which Prefect API a resume
reports to (:func:`resume_api`: the one the run reported to).

Light at import (the logging module only): the command line imports it before it has checked its input.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("rlsift")


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


def prefect_server(lifelong_thread: bool = False) -> None:
    """Start Prefect's temporary API server now, when no server is configured, with SIGINT blocked: the server
    inherits the blocked signal, so a Ctrl-C at the terminal (which reaches the whole process group) stops the run
    but not the server, which then records the flow run's end (an armed server also runs in a session of its own:
    :func:`bound_server`). Prefect stops the server when rlsift exits (atexit,
    with SIGTERM); when rlsift is killed (``kill -9``: no atexit), the kernel kills the server with it
    (:func:`bound_server`). Call from the main thread, or from a thread that lives as long as the process
    (``lifelong_thread``: flows/startup.py): the kernel sends the parent-death signal when the thread that forked
    the server ends."""
    import signal
    import threading

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    for handler in logging.getLogger().handlers:
        handler.addFilter(_RunFailures())
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    server_logging()
    bound_server(armed=lifelong_thread or threading.current_thread() is threading.main_thread())
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        get_client(sync_client=True)  # starts the server (once per process)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def bound_server(armed: bool = True):
    """The temporary API server this process's Prefect client starts (``SubprocessASGIServer()``: one per process,
    Prefect looks it up by port, None for "any free one"), made one that dies with this process and with nothing
    else: its uvicorn process (a single process: no workers, no children) gets the parent-death signal SIGKILL
    (tasks/records/process.py ``die_with_parent``), so a ``kill -9`` of rlsift leaves no server listening, and runs
    in a session of its own, so a signal to rlsift's whole process group (``timeout``, ``kill -- -PGID``, systemd's
    stop, a closed terminal's SIGHUP) reaches rlsift and not the server, which then records the run's end: before,
    the server died with the signal and rlsift's Prefect client retried the flow run's last states against it for
    minutes. Prefect keeps starting and stopping it as before (at rlsift's exit). ``armed`` False (a thread that ends
    before the process: the signal follows the thread that forks, so its end would kill the server) gives Prefect's
    plain server, in rlsift's session. Returns the server object (one already made is left as it is)."""
    from prefect.server.api.server import SubprocessASGIServer

    class BoundServer(SubprocessASGIServer):
        """Prefect's temporary server process started with ``preexec_fn``: Prefect's own command and environment
        (``SubprocessASGIServer._run_uvicorn_command``), passed on unchanged."""

        def _run_uvicorn_command(self):
            import subprocess

            from tasks.records.process import die_with_parent

            popen, arm = subprocess.Popen, die_with_parent(os.getpid())

            def spawn(*args, **kwargs):  # Prefect's call, with two arguments more (no other thread's call meanwhile)
                return popen(*args, **kwargs, **({"preexec_fn": arm, "start_new_session": True} if armed else {}))

            subprocess.Popen = spawn
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen

    known = SubprocessASGIServer._instances.get(None)
    if known is not None:
        return known
    return BoundServer(None)  # registered under port None, where get_client looks (SubprocessASGIServer.__new__)


def stored_api(root: str | os.PathLike, run_id: str) -> str | None:
    """The Prefect API a run reported to, as its ``info.json`` keeps it (tasks/run.py ``RunInfo.prefect_api``, set
    by flows/pipeline.py ``claim_flow_run``); None for a temporary server, an unknown run or one that predates it."""
    import json
    from pathlib import Path

    info = Path(root).resolve() / "runs" / run_id / "info.json"
    return json.loads(info.read_text()).get("prefect_api") if info.is_file() else None


def answers(api: str, timeout_s: float = 3.0) -> bool:
    """Whether the Prefect API at ``api`` (``.../api``) answers its health check now."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api.rstrip('/')}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def resume_api(root: str | os.PathLike, run_id: str) -> str | None:
    """The Prefect API a resume of run ``run_id`` (under ``root``) reports to: the one the run reported to
    (:func:`stored_api`), so its flow runs, the killed one marked Crashed and the resumed one, are on one server
    whatever the resuming shell exports; None (Prefect as configured: ``PREFECT_API_URL``, or a temporary server)
    when the run used a temporary server, when ``PREFECT_API_URL`` is set (it wins: said when it differs), or when
    the run's server does not answer now (said: the resume then reports to a temporary server)."""
    stored = stored_api(root, run_id)
    here = os.environ.get("PREFECT_API_URL")
    if stored is None:
        return None
    if here:
        if here.rstrip("/") != stored.rstrip("/"):
            log.warning("run %s reported to the Prefect server at %s; this resume reports to PREFECT_API_URL=%s, "
                        "where its earlier flow runs are not", run_id, stored, here)
        return None
    if not answers(stored):
        log.warning("run %s reported to the Prefect server at %s, which does not answer now: this resume reports to "
                    "a temporary server (start that server first to keep the run's flow runs in one place)",
                    run_id, stored)
        return None
    log.info("run %s: reporting to the Prefect server it ran under, %s", run_id, stored)
    return stored


@contextmanager
def reporting_to(api: str | None) -> Iterator[None]:
    """Within the block Prefect reports to ``api`` (``PREFECT_API_URL`` in this process's settings and
    environment, which its child processes inherit); None: as configured."""
    if api is None:
        yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before
