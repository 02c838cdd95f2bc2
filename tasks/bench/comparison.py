"""Verdicts of an arm against the baseline over seeds: time to a target, final accuracy, each level's change.

Pure statistics on the curves of :mod:`tasks.bench.analysis` and per-prompt 0/1 correctness (no I/O). Time to a
target is compared with Welch's interval over seeds, accuracy prompt by prompt with the exact McNemar test
(``docs/benchmarks.md``, "Conventions").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from scipy import stats

from tasks.bench.analysis import Curve, time_to_target
from tasks.evaluation.heldout import paired_counts

#: What "time to target" is measured in, for the verdicts (Curve fields).
MEASURES = ("step", "rollouts", "tokens", "wall_s")
#: Verdict words: the confidence interval of (arm - baseline) time lies below 0, contains 0, lies above 0.
FASTER, SAME, SLOWER = "faster", "no different", "slower"


def seed_times(curves: Sequence[Curve], target: float, measure: str) -> list[float | None]:
    """Per seed, the ``measure`` (a :data:`MEASURES` name) at the first crossing of ``target`` (None: never)."""
    out = []
    for c in curves:
        hit = time_to_target(c, target)
        out.append(None if hit is None or measure not in hit else float(hit[measure]))
    return out


def compare_times(baseline: Sequence[float | None], arm: Sequence[float | None],
                  level: float = 0.95) -> dict:
    """An arm's time to a target against the baseline's, over seeds, with a verdict word.

    The interval is Welch's t interval for the difference of means (arm - baseline; scipy's
    ``ttest_ind(equal_var=False)``), so seeds need not pair up. Verdict: :data:`FASTER` when the whole
    interval is below 0, :data:`SLOWER` when above, :data:`SAME` otherwise. With fewer than two seeds per side
    there is no interval and no verdict. An arm whose seeds did not all reach the target is ``not reached``
    when fewer of its seeds reached it than the baseline's (its mean would flatter it).

    Returns:
        ``{"baseline_mean", "arm_mean", "ratio" (arm / baseline), "diff", "ci" ([lo, hi] or None),
        "reached" ("k/n"), "verdict"}``.
    """
    b = [x for x in baseline if x is not None]
    a = [x for x in arm if x is not None]
    out: dict = {"baseline_mean": statistics.fmean(b) if b else None, "arm_mean": statistics.fmean(a) if a else None,
                 "reached": f"{len(a)}/{len(arm)}", "ratio": None, "diff": None, "ci": None, "verdict": None}
    if not a or len(a) < len(b):
        out["verdict"] = f"not reached ({len(a)}/{len(arm)} seeds)"
        return out
    if not b:
        out["verdict"] = "baseline never reached it"
        return out
    out["diff"] = out["arm_mean"] - out["baseline_mean"]
    out["ratio"] = out["arm_mean"] / out["baseline_mean"] if out["baseline_mean"] else None
    if len(a) < 2 or len(b) < 2:
        out["verdict"] = ("one seed: no interval" if len(arm) < 2 else
                          f"no interval: {len(a)} of {len(arm)} seeds reached it, {len(b)} of {len(baseline)} of the "
                          "baseline's")
        return out
    if statistics.pvariance(a) == 0 and statistics.pvariance(b) == 0:
        lo = hi = out["diff"]
    else:
        ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
        lo, hi = float(ci.low), float(ci.high)
    out["ci"] = [lo, hi]
    out["verdict"] = FASTER if hi < 0 else SLOWER if lo > 0 else SAME
    return out


def mcnemar_pooled(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, float]:
    """Final-accuracy difference of an arm against the baseline, paired prompt by prompt and pooled over seeds.

    Args:
        pairs: per seed, (baseline's, arm's) 0/1 greedy correctness on the same held-out prompts, same order.

    Returns:
        ``turned_right`` (right under the arm, wrong under the baseline), ``turned_wrong``, ``diff`` (mean
        accuracy difference, arm - baseline) and the exact McNemar ``p`` (two-sided binomial test of
        ``turned_right`` among the discordant prompts at 1/2).
    """
    for base, arm in pairs:
        if len(base) != len(arm):
            raise ValueError(f"paired evaluations differ in length: {len(base)} vs {len(arm)}")
    change = paired_counts([x for base, _ in pairs for x in base], [y for _, arm in pairs for y in arm])
    total = sum(len(base) for base, _ in pairs)
    return {"turned_right": change.turned_right, "turned_wrong": change.turned_wrong,
            "diff": (change.turned_right - change.turned_wrong) / total if total else math.nan,
            "p": change.mcnemar_p, "prompts": total}


#: Verdicts of a level's final accuracy against its start (:func:`level_change`).
BELOW_START, ABOVE_START = "below start", "above start"


def level_change(runs: Sequence[tuple[Sequence[int | None], Sequence[int], Sequence[int]]],
                 alpha: float = 0.05) -> list[dict]:
    """Each difficulty level's held-out accuracy at the end against the start, paired prompt by prompt and
    pooled over seeds: does training let a solved skill slip (docs/benchmarks.md, "Conventions")?

    Args:
        runs: per seed, (level, start 0/1 greedy correctness, end 0/1 correctness) of the same held-out prompts
            in the same order (level None: a prompt without one).
        alpha: the exact McNemar test's level for a verdict other than "no different" (per level, not corrected
            for the number of levels).

    Returns:
        One dict per level, in level order (None last): ``level``, ``prompts`` (per seed), ``start`` and ``end``
        (mean accuracy over seeds), ``turned_right`` (wrong at the start, right at the end), ``turned_wrong``,
        ``p`` and ``verdict`` (:data:`BELOW_START`, :data:`ABOVE_START` or :data:`SAME`).
    """
    cells: dict[int | None, tuple[list[int], list[int]]] = {}
    for levels, start, end in runs:
        if not len(levels) == len(start) == len(end):
            raise ValueError(f"per-prompt lists differ in length: {len(levels)} levels, {len(start)} start, "
                             f"{len(end)} end")
        for lv, a, b in zip(levels, start, end, strict=True):
            before, after = cells.setdefault(lv, ([], []))
            before.append(int(a))
            after.append(int(b))
    out = []
    for lv in sorted(cells, key=lambda x: (x is None, x or 0)):
        before, after = cells[lv]
        change = paired_counts(before, after)
        start, end = statistics.fmean(before), statistics.fmean(after)
        verdict = SAME if change.mcnemar_p >= alpha else BELOW_START if end < start else ABOVE_START
        out.append({"level": lv, "prompts": len(before) // len(runs), "start": start, "end": end,
                    "turned_right": change.turned_right, "turned_wrong": change.turned_wrong,
                    "p": change.mcnemar_p, "verdict": verdict})
    return out
