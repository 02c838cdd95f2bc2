"""The ledger's row records: one frozen record per table a run appends to, whose field names are the table's
columns (tasks/records/ledger/store.py writes them), and :func:`used_signals`, which trims the ``selections``
rows a reader shows to the columns of the techniques that chose them. No SQL here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReferenceRow:
    """One reference prompt rolled out ``n`` times (table ``reference``): the calibrate stage (round and step
    -1) and DOTS's per-round reference set (tasks/selection/rounds.py). ``predicted``: the predictor's
    held-out prediction, None for the prompts it was fitted on."""

    round: int
    step: int
    prompt_id: str
    n: int
    successes: int
    success_rate: float
    predicted: float | None


@dataclass(frozen=True)
class FeatureRow:
    """Static features of one pool prompt (table ``features``; tasks/selection/features.py)."""

    prompt_id: str
    prompt_tokens: int
    level: int
    cot_tokens: int
    angle_intra: float
    angle_inter: float
    angle_score: float


@dataclass(frozen=True)
class SelectionRow:
    """Why one prompt was chosen at a step (table ``selections``; tasks/selection/selector.py ``choose``).

    ``selector``: the techniques that chose (``scalingrl+gain+dots+screen``, ..., ``uniform``); ``weight``: its
    selection probability; ``pred_success``: DOTS's prediction; ``gain_rank``: its rank in GAIN-RL's angle
    order; ``des*``: ScalingRL's Data Effectiveness Score and its parts; ``screen_success``: the likelihood
    screen's pass rate (``select.screen``, tasks/selection/screen.py) (None when a technique is off).
    """

    prompt_id: str
    selector: str
    weight: float
    pred_success: float | None = None
    angle_score: float | None = None
    gain_rank: int | None = None
    des: float | None = None
    des_difficulty: float | None = None
    des_cot: float | None = None
    des_adaptability: float | None = None
    screen_success: float | None = None


@dataclass(frozen=True)
class GroupRow:
    """One rollout group that entered an update (table ``groups``; tasks/training/loop.py): ``n`` generated,
    ``kept`` after PODS, ``replayed`` from step ``from_step`` (its own step when fresh); ``policy_version``: updates
    the weights that sampled it had received, and ``lag``: the step that trains it minus that (0 on-policy, 1 with
    ``overlap.lag`` 1, more for a replayed group; None where unknown)."""

    prompt_id: str
    n: int
    successes: int
    mean_reward: float
    kept: int
    kept_mean_reward: float | None
    replayed: bool
    from_step: int
    policy_version: int | None = None
    lag: int | None = None


@dataclass(frozen=True)
class SkippedUpdateRow:
    """One minibatch whose update was not applied at a step (table ``skipped_updates``; tasks/update/skip_guard.py):
    ``cause`` (``loss``, ``inputs``: the log-probs feeding the loss, ``gradient``), ``detail`` (the value or norm
    seen) and ``site``: where the first non-finite value appeared (tasks/update/nan_locator.py), or why it was not
    located."""

    minibatch: int
    cause: str
    detail: str
    site: str


@dataclass(frozen=True)
class StepRows:
    """One training step's rows of every step table (:data:`~tasks.records.ledger.schema.STEP_TABLES`), held by the
    training stage's recorder until the checkpoint that covers the step and then written with the other steps it
    holds (:meth:`~tasks.records.ledger.store.Ledger.add_steps`): the round start's ``references`` (when the step
    started one), a row per selected prompt, per trained group and per skipped minibatch."""

    round: int
    step: int
    references: tuple[ReferenceRow, ...]
    selections: tuple[SelectionRow, ...]
    groups: tuple[GroupRow, ...]
    skipped: tuple[SkippedUpdateRow, ...] = ()


@dataclass(frozen=True)
class StageRow:
    """A finished stage's wall time, device hours and money (table ``stages``; tasks/run.py)."""

    stage: str
    wall_s: float
    device: str
    device_hours: float
    cost: float


@dataclass(frozen=True)
class EvalRow:
    """One group of one evaluation (table ``evals``; tasks/evaluation/heldout.py ``table_rows``): ``grp`` is
    ``overall``, ``level_<L>`` or ``source:<name>``; ``phase`` is ``start``, ``during`` or ``end``."""

    phase: str
    step: int
    grp: str
    n: int
    greedy_acc: float
    avg_at_k: float | None
    pass_at_k: float | None = None


#: The ``selections`` columns each selection technique decides on (:class:`SelectionRow`); the selector
#: records some of them whether or not its technique is on (GAIN-RL's angle and rank are always computed).
SIGNALS = {"gain": ("angle_score", "gain_rank"), "dots": ("pred_success",),
           "scalingrl": ("des", "des_difficulty", "des_cot", "des_adaptability"), "screen": ("screen_success",)}


def used_signals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of the ``selections`` table without the columns of techniques that chose none of them (a
    ``uniform`` draw used neither the angle score nor the GAIN rank): each row's ``selector`` names the
    techniques that chose it."""
    used = {t for r in rows for t in str(r.get("selector") or "").split("+")}
    unused = {c for t, cols in SIGNALS.items() if t not in used for c in cols}
    return [{k: v for k, v in r.items() if k not in unused} for r in rows]
