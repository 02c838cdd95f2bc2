"""What rlsift prints for a person to run again: the command that finishes a stopped or failed run
(:func:`resume_command`), started as the person started rlsift (:func:`launcher`).

Light on purpose (the standard library only): ``rlsift ledger runs`` prints it for runs whose process is gone, and
every command that opens the ledger to write says such runs (:func:`note_stopped`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.records.ledger import Ledger

log = logging.getLogger("rlsift")


def launcher() -> list[str]:
    """How this process was started, as the start of a command that runs rlsift the same way from any folder:
    ``/abs/.venv/bin/rlsift`` when it runs the ``rlsift`` script (by its absolute path, not the one the shell's
    ``PATH`` may find: a venv that was never activated has none; symbolic links kept, a venv's own), ``/abs/python -m
    flows.cli`` when Python ran the module, else ``rlsift`` (a Prefect worker's flow run, a test, a script)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "flows.cli":
        return [sys.executable, "-m", "flows.cli"]
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name == "rlsift" and Path(script).is_file():
        return [os.path.abspath(script)]
    return ["rlsift"]


def resume_command(run_id: str, root: str | os.PathLike) -> str:
    """The command that finishes a stopped or failed run, pasted as printed from any folder: ``LAUNCHER run --resume
    ID paths.root=/abs/root`` (:func:`launcher`). The root is all a resume needs to find the run: it takes the rest
    from the run's stored config.json, whose paths are absolute (tasks/preflight.py ``resume_config``)."""
    return shlex.join([*launcher(), "run", "--resume", run_id, f"paths.root={os.path.abspath(root)}"])


def note_stopped(ledger: Ledger, root: str | os.PathLike, but: str | None = None) -> list[str]:
    """Find the runs of ``ledger`` (a writer, under run root ``root``) whose row says running but whose process is
    gone (``kill -9``: tasks/records/ledger ``Ledger.stopped_runs``), record them as stopped, and say each in one
    warning line with the command that finishes it. ``but``: a run to leave alone (the one being resumed). Returns
    their ids. Every command that opens the ledger to write calls it (``rlsift run``, ``rlsift ingest``), so the
    next one after a kill tells."""
    stopped = [r for r in ledger.stopped_runs() if r != but]
    ledger.mark_stopped(stopped)
    for run_id in stopped:
        log.warning("run %s stopped: its process is gone and it never closed (killed?); `%s` finishes it", run_id,
                    resume_command(run_id, root))
    return stopped
