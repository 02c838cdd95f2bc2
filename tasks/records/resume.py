"""What rlsift prints for a person to run again: the command that finishes a stopped or failed run
(:func:`resume_command`), started as the person started rlsift (tasks/records/commands.py).

Light on purpose (the standard library only): ``rlsift ledger runs`` prints it for runs whose process is gone, and
every command that opens the ledger to write says such runs (:func:`note_stopped`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from tasks.records.commands import command, launcher  # noqa: F401 -- launcher: also named here

if TYPE_CHECKING:
    from tasks.records.ledger import Ledger

log = logging.getLogger("rlsift")


def resume_command(run_id: str, root: str | os.PathLike) -> str:
    """The command that finishes a stopped or failed run, pasted as printed from any folder: ``LAUNCHER run --resume
    ID paths.root=/abs/root`` (:func:`launcher`). The root is all a resume needs to find the run: it takes the rest
    from the run's stored config.json, whose paths are absolute (tasks/preflight.py ``resume_config``)."""
    return command("run", "--resume", run_id, f"paths.root={os.path.abspath(root)}")


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
