"""A run that stops training on nothing: skipped updates said where users look, and a stop after a few in a row.

An update whose loss or gradient is not finite is not applied (tasks/update/policy_update.py); a step whose every
minibatch was skipped moved no weight. :class:`SkipGuard` takes each step's update metrics and the updater's
:class:`~tasks.update.nan_locator.SkippedUpdate` records and

- gives a ledger row per skipped minibatch (:func:`skipped_rows`, table ``skipped_updates``: cause, value, the
  locator's site), which the training's recorder writes,
- logs a warning line naming the step and the site, adds ``train/skipped_in_row`` to the step's metrics (beside
  the updater's ``train/skipped_updates``) and ``skipped=<in a row>/<limit>`` to the progress bar,
- and, once ``train.max_skipped_steps`` steps in a row were skipped, asks for a checkpoint (:attr:`stuck`: the
  skipped steps' metrics then reach MLflow, tasks/run.py commits metrics with checkpoints) and stops the run with
  :class:`SkippedStepsError`, which names the cause, the site and the steps.

The count in a row starts at 0 in each process (a resumed run counts again from its first step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tasks.records.commands import command
from tasks.records.ledger import SkippedUpdateRow
from tasks.update.nan_locator import SkippedUpdate

log = logging.getLogger("rlsift.train")


class SkippedStepsError(RuntimeError):
    """The run's updates were skipped ``train.max_skipped_steps`` steps in a row: nothing trains."""


class SkipGuard:
    """See the module docstring.

    Args:
        limit: ``train.max_skipped_steps`` (0: never stop).
        minibatches: ``train.minibatches``: a step is skipped when that many of its minibatches were.
    """

    def __init__(self, limit: int, minibatches: int):
        if limit < 0 or minibatches < 1:
            raise ValueError(f"SkipGuard: limit must be >= 0 and minibatches >= 1, got {limit} and {minibatches}")
        self.limit, self.minibatches = limit, minibatches
        self.steps: list[int] = []  # the skipped steps in a row, oldest first
        self.last: tuple[SkippedUpdate, ...] = ()  # the last skipped step's records

    @property
    def in_row(self) -> int:
        return len(self.steps)

    @property
    def stuck(self) -> bool:
        """Whether the run must stop after this step (:meth:`check` raises)."""
        return bool(self.limit) and self.in_row >= self.limit

    def observe(self, step: int, stats: dict[str, float], skipped: Sequence[SkippedUpdate]) -> dict[str, float]:
        """Take ``step``'s update metrics (``train/skipped_updates``) and the updater's records of it
        (``UpdateResult.skipped``: empty where the backend does not report them); log what was skipped. Returns
        the metrics to add to the step's: ``train/skipped_in_row``. Its ledger rows: :func:`skipped_rows`."""
        count = int(stats.get("train/skipped_updates", 0))
        if count >= self.minibatches:
            self.steps.append(step)
            self.last = tuple(skipped)
            log.warning("step %d: update skipped, no weight moved (%d in a row%s): %s", step, self.in_row,
                        f", the run stops at {self.limit}" if self.limit else "", self.cause())
        else:
            self.steps = []
        return {"train/skipped_in_row": float(self.in_row)}

    def cause(self) -> str:
        """The last skipped step's first record, described (cause and site)."""
        return self.last[0].describe() if self.last else "no record of the cause (see the run's log)"

    def postfix(self) -> dict[str, str]:
        """The progress bar's field while steps are being skipped: ``skipped=2/3`` (``2`` without a limit)."""
        if not self.steps:
            return {}
        return {"skipped": f"{self.in_row}/{self.limit}" if self.limit else str(self.in_row)}

    def check(self) -> None:
        """Raise :class:`SkippedStepsError` once :attr:`stuck`."""
        if self.stuck:
            first, last = self.steps[0], self.steps[-1]
            raise SkippedStepsError(
                f"the update was skipped at {self.in_row} steps in a row (steps {first}-{last}; "
                f"train.max_skipped_steps={self.limit}): no weight has moved since step {first}. Cause: "
                f"{self.cause()}. The ledger's skipped_updates table lists every skipped minibatch "
                f"(`{command('ledger', 'sql', '--help')}` says how to ask it); docs/operations.md says how to read "
                "the site.")


def skipped_rows(stats: dict[str, float], skipped: Sequence[SkippedUpdate]) -> list[SkippedUpdateRow]:
    """The ledger rows (table ``skipped_updates``) of one step's skipped minibatches: one per record, and one
    ``unknown`` row for each the update counted (``train/skipped_updates``) but did not describe."""
    rows = [SkippedUpdateRow(minibatch=s.minibatch, cause=s.cause, detail=s.detail,
                             site=s.site.describe() if s.site is not None else s.note) for s in skipped]
    missing = int(stats.get("train/skipped_updates", 0)) - len(rows)
    return rows + [SkippedUpdateRow(minibatch=-1, cause="unknown", detail="",
                                    site="not reported by this backend: see the run's log")] * max(missing, 0)
