"""What the training stage's phases hand one another and its caller (tasks/training/loop.py): the phases' names
(:data:`TRAIN_PHASES`), an in-training evaluation (:class:`HeldoutEval`, :data:`EvaluateFn`), a round as this process
plays it (:class:`Round`), what a step's update leaves for the rest of the step (:class:`StepUpdate`), what a draw
changes of a checkpoint's state (:class:`DrawState`) and what the stage did (:class:`TrainSummary`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlcore.types import RolloutGroup
from tasks.overlap.concurrent import OverlapTimes
from tasks.training.draw import CarriedRollouts
from tasks.update.nan_locator import SkippedUpdate

#: The cost meter's names for the phases of the training stage (their sum is the stage's wall time).
TRAIN_PHASES = ("reference", "selection", "rollout", "update", "tracking", "eval_during", "checkpoint", "weight_sync")


@dataclass(frozen=True)
class HeldoutEval:
    """One in-training held-out evaluation (``eval.every``): greedy accuracy in [0, 1] and the metrics to log."""

    accuracy: float
    metrics: dict[str, float]


#: ``step -> HeldoutEval``: evaluates the current policy after ``step`` updates (the pipeline's train stage passes
#: one that also writes the ledger's ``during`` rows, tasks/stages.py).
EvaluateFn = Callable[[int], HeldoutEval]


@dataclass(frozen=True)
class TrainSummary:
    """What the training stage did: ``steps`` done in all (a resumed run counts the crashed run's too), the
    ``last`` step's metrics (empty when no step ran in this process) and, overlapped, the ``overlap`` totals over
    every step (seconds: ``update_s``, ``draw_s``, ``overlap_s``, ``trainer_idle_s``, ``generator_idle_s``)."""

    steps: int
    last: dict[str, float] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Round:
    """A training round as this process plays it: its ``index`` and ``steps`` (all of them, or a resumed round's
    rest)."""

    index: int
    steps: tuple[int, ...]


@dataclass(frozen=True)
class StepUpdate:
    """What a step's update phase leaves for its observe and record phases.

    Attributes:
        fresh: the fresh groups trained, each with its behaviour log-probs (the update's pi_old where the group had
            none: what Rollout Replay stores).
        batch: every group trained (the fresh ones as drawn, then the replayed ones).
        replayed: replayed groups in ``batch``.
        lr: the step's learning rate.
        stats: the updater's metrics (:class:`~tasks.update.updater.UpdateResult`).
        seconds: the update's wall seconds.
        timing: the overlap's timing when the update ran beside the next step's draw (lag 1), else None.
        skipped: the minibatches the update did not apply (non-finite loss or gradient), with cause and site.
    """

    fresh: list[RolloutGroup]
    batch: list[RolloutGroup]
    replayed: int
    lr: float
    stats: dict[str, float]
    seconds: float
    timing: OverlapTimes | None
    skipped: tuple[SkippedUpdate, ...] = ()


@dataclass(frozen=True)
class DrawState:
    """What a step's draw changes of the state a checkpoint saves: the selector's (``Selector.state_dict``, copied)
    and the rollouts the latest draw left for the next one to complete (``waves.carry``), as they were before a draw
    launched ahead of the checkpoint (tasks/training/loop.py ``launch_ahead``)."""

    selector: dict
    carry: CarriedRollouts | None
