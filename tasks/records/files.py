"""Crash-safe file writes: a file is either its old content or its new content, never a torn mix.

The content goes to ``<name>.tmp`` next to the target, is flushed and fsynced, then renamed over the
target (``os.replace`` is atomic on POSIX and Windows within one file system) and the folder is fsynced
so the rename itself survives a power cut. Used for checkpoints (tasks/training/checkpoint.py), the run's
JSON files (tasks/run.py, tasks/stages.py) and the tracking outbox (tasks/records/tracking/outbox.py). A cached
folder (the warm start, a converted GGUF model) is built under a temporary name and published whole
(:func:`publish_folder`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Replace ``path`` with what ``write(f)`` puts into a binary file object, atomically. If ``write``
    raises, ``path`` keeps its old content and the temporary file is removed; where the disk is full (which
    ``torch.save`` reports as ``unexpected pos ...``), the error is an ``OSError`` (ENOSPC) that names the folder,
    the space left and what was kept."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = _disk_full(err)  # torch.save reports it as "unexpected pos ...", raised while handling it
        if full is None:
            raise
        kept = f"the old {path.name} is kept" if path.exists() else "nothing was written"
        free = shutil.disk_usage(path.parent).free / 2**30
        raise OSError(full.errno, f"no space left on the device of {path.parent} to write {path.name} ({free:.1f} "
                                  f"GiB free now; {kept}): free some, or set paths.root to a larger disk") from err
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _disk_full(err: BaseException) -> OSError | None:
    """The out-of-space error (ENOSPC, EDQUOT) among ``err`` and the errors it was raised from or during, or None."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        err = err.__cause__ or err.__context__
    return None


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8), atomically."""
    data = text.encode()
    atomic_write(path, lambda f: f.write(data))


def write_json(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as indented JSON (values JSON cannot hold as their ``str``), atomically."""
    write_text(path, json.dumps(data, indent=2, default=str))


def publish_folder(tmp: Path, final: Path, meta_file: str) -> None:
    """Rename the finished folder ``tmp`` to ``final`` in one step, so a reader sees a whole folder or none. Where
    another process published the same ``final`` first (a cache keyed by fingerprint: the same content), ``tmp`` is
    removed and theirs kept; raises if ``final`` exists without its ``meta_file`` (not a finished folder)."""
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (Path(final) / meta_file).is_file():
            raise
