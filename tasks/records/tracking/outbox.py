"""The tracking outbox: a file-backed FIFO of JSON items that the tracker appends to and one sender drains
(tasks/records/tracking/tracker.py), how queued items are grouped into MLflow requests, and the record of the times
MLflow did not answer (:class:`OutageLog`). No MLflow here.

One item a line in ``<run dir>/outbox.jsonl``; a writer killed mid-line leaves a torn last line, which is skipped
(the item was never acknowledged to its caller's process). See docs/operations.md "Tracking outages".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tasks.records.files import write_json, write_text

#: MLflow's log_batch limit on metrics per request.
BATCH_METRICS = 1000


class Outbox:
    """A file-backed FIFO of JSON items (one per line): appended by loggers, drained by one sender."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, item: dict[str, Any]) -> None:
        line = json.dumps(item) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    def peek(self) -> list[dict[str, Any]]:
        """Every queued item, oldest first (a torn last line from a killed writer is skipped)."""
        with self._lock:
            if not self.path.exists():
                return []
            lines = self.path.read_text().splitlines()
        items = []
        for i, line in enumerate(lines):
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise
        return items

    def drop(self, n: int) -> None:
        """Remove the ``n`` oldest items (what was sent); items appended meanwhile stay."""
        if n <= 0:
            return
        with self._lock:
            lines = self.path.read_text().splitlines(keepends=True) if self.path.exists() else []
            rest = lines[n:]
            if rest:
                write_text(self.path, "".join(rest))
            else:
                self.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self.peek())


def requests(items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Group queued items into requests, in order: consecutive ``metrics`` items merged up to
    :data:`BATCH_METRICS` values, every other item alone."""
    group: list[dict[str, Any]] = []
    size = 0
    for item in items:
        n = len(item["metrics"]) if item["kind"] == "metrics" else 0
        if group and (item["kind"] != "metrics" or size + n > BATCH_METRICS):
            yield group
            group, size = [], 0
        if item["kind"] != "metrics":
            yield [item]
            continue
        group.append(item)
        size += n
    if group:
        yield group


@dataclass(frozen=True)
class Outage:
    """A time MLflow did not answer a run: from ``since`` (seconds since the epoch: the first send that failed) to
    ``until`` (the first that went through again; None while it lasts), and who sent what the outbox held then
    (``sent_by``: ``the run`` when MLflow came back while it ran, ``rlsift sync`` after it ended)."""

    since: float
    until: float | None = None
    sent_by: str | None = None


class OutageLog:
    """The outages of one run, oldest first, in a JSON file beside its outbox (``outbox-outages.json``): what the
    run's Description says of them (tasks/records/tracking/describe.py ``settled``), also when the process that saw
    the outage begin is gone and ``rlsift sync`` ends it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def entries(self) -> list[Outage]:
        return [Outage(**o) for o in json.loads(self.path.read_text())] if self.path.is_file() else []

    def open(self) -> Outage | None:
        """The outage that lasts (its sends have not gone through since), if any."""
        last = next(reversed(self.entries()), None)
        return last if last is not None and last.until is None else None

    def began(self, at: float) -> None:
        """A send failed at ``at``: a new outage, unless one already lasts."""
        if self.open() is None:
            write_json(self.path, [asdict(o) for o in [*self.entries(), Outage(since=at)]])

    def ended(self, at: float, sent_by: str) -> None:
        """Sends go through again since ``at``: the lasting outage (if any) ends, its items sent by ``sent_by``."""
        entries = self.entries()
        if entries and entries[-1].until is None:
            entries[-1] = replace(entries[-1], until=at, sent_by=sent_by)
            write_json(self.path, [asdict(o) for o in entries])
