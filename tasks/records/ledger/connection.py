"""Opening the ledger's file while other processes may hold it.

The ledger is read while a run writes it (``rlsift ledger runs`` mid-training). DuckDB lets one process hold a
file for writing, or any number hold it for reading, never both (https://duckdb.org/docs/stable/connect/concurrency).
A run keeps its connection: opening one for each step's writes (closing it checkpoints the file) measured 120 ms
a step against 30 ms on the embedded default, on a loaded 2-core machine. A reader that finds the file held reads a
snapshot instead (:func:`connect_to_snapshot`): a copy of the file and of its write-ahead log, taken while the file
itself did not change. Between the writer's checkpoints duckdb only appends committed transactions to the log, and
it replays a log whose last entry is cut short up to the last whole transaction, so the copy shows the run as of its
last commit. A writer that finds the file held by a reader waits for it (:func:`connect_to_write`,
:data:`LOCK_WAIT_S`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import duckdb

log = logging.getLogger(__name__)

#: How long a writer waits for the file (readers let go in milliseconds) before it fails naming the holder.
LOCK_WAIT_S = 60.0
#: Copies a snapshot tries while a checkpoint rewrites the file under it.
SNAPSHOT_TRIES = 20


def held_elsewhere(err: Exception) -> bool:
    """Whether opening the file failed only because it is held now: another process's lock, or this process's
    connection of the other mode (duckdb admits one configuration per file and process)."""
    text = str(err)
    return "Could not set lock on file" in text or "different configuration than existing connections" in text


def connect_to_write(path: Path) -> duckdb.DuckDBPyConnection:
    """A writing connection; while readers hold the file (a query takes milliseconds), wait and try again, up to
    :data:`LOCK_WAIT_S`."""
    start, pause = time.monotonic(), 0.01
    while True:
        try:
            return duckdb.connect(str(path))
        except (duckdb.IOException, duckdb.ConnectionException) as err:
            if not held_elsewhere(err):
                raise
            if time.monotonic() - start > LOCK_WAIT_S:
                raise duckdb.IOException(f"the ledger {path} stayed held by another process for more than "
                                         f"{LOCK_WAIT_S:.0f} s (runs that share a root must not overlap): {err}"
                                         ) from err
            time.sleep(pause)
            pause = min(2 * pause, 0.2)


def connect_to_snapshot(path: Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to a copy of ``path`` and its write-ahead log, taken while the file's size and time
    stayed the same (a checkpoint rewrites it; then copy again). The copy lies in a temporary folder that is
    removed once the connection is open (the open connection keeps reading it), so nothing is left behind."""
    wal = path.with_name(path.name + ".wal")
    for attempt in range(SNAPSHOT_TRIES):
        folder = Path(tempfile.mkdtemp(prefix="rlsift-ledger-"))
        copy = folder / path.name
        try:
            before = os.stat(path)
            shutil.copyfile(path, copy)
            with contextlib.suppress(FileNotFoundError):  # none right after a checkpoint
                shutil.copyfile(wal, copy.with_name(wal.name))
            after = os.stat(path)
            if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
                con = duckdb.connect(str(copy), read_only=True)
                log.debug("ledger %s is being written: reading a snapshot", path)
                return con
        except duckdb.Error as err:  # a copy the writer's checkpoint changed under us in the same instant
            log.debug("ledger snapshot %d of %s failed: %s", attempt + 1, path, err)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        time.sleep(0.05 * (attempt + 1))
    raise duckdb.IOException(f"could not take a consistent snapshot of the ledger {path} in {SNAPSHOT_TRIES} tries "
                             "while another process writes it; try again")
