"""The tracking outbox: a file-backed FIFO of JSON items that the tracker appends to and one sender drains
(tasks/records/tracking/tracker.py), and how queued items are grouped into MLflow requests. No MLflow here.

One item a line in ``<run dir>/outbox.jsonl``; a writer killed mid-line leaves a torn last line, which is skipped
(the item was never acknowledged to its caller's process). See docs/operations.md "Tracking outages".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.records.files import write_text

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
