"""Benchmark arithmetic: accuracy curves on the evaluation schedule, time to target, aggregation over seeds.

Pure functions on plain numbers and metric rows (no I/O), so hand-made curves can test them. The verdicts that
compare an arm with the baseline over seeds are in :mod:`tasks.bench.comparison`.

Conventions (``docs/benchmarks.md``; docs/algorithms.md sections 3.3 and 6.2, stage 7):

- A run's **curve** has one point per held-out evaluation: step 0 (the starting policy) and every
  ``eval.every`` steps (plus the last step). Each point carries the cumulative training wall-clock,
  rollouts generated, device hours and money spent *up to that evaluation, excluding evaluation itself*
  and excluding setup (ingest, policy preparation / warm start). Everything else counts: reference
  rollouts, selection, scoring, calibration (when the configuration uses them), update, tracking,
  checkpoints.
- **Time to target** is the first evaluation point whose accuracy reaches the target, read on the
  schedule without interpolation (the time of that evaluation). A run that never reaches it has none.
- Two targets, both taken from the baseline's (plain GRPO's) **mean curve** over seeds: (a) its accuracy
  at the end of its budget, (b) 99 percent of its best accuracy (PODS's convention: the authors'
  ``scripts/plot*.py`` use 99% of GRPO's best mean accuracy on the checkpoint grid).
- Seeds are aggregated on the common schedule: the mean curve averages accuracy, wall-clock, rollouts and
  device hours step by step. The headline time to target is read on the mean curve (as PODS does);
  per-seed crossings are reported beside it (how many seeds reached the target and their mean time).
- **Speed-up** = baseline time to target / configuration time to target (wall-clock).

Stage names come from ``tasks.records.cost.CostMeter`` metrics (``time/<stage>_s``, ``cost/<stage>_device_hours``,
``cost/<stage>_usd``): any stage whose name starts with ``eval`` and the setup stages ``SETUP_STAGES``
are left out of the clock; ``skip`` names more (e.g. calibrate and score for a configuration that does
not use them: plain GRPO would not pay for them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

#: Stages that set a run up and are the same for every configuration: not on the clock.
SETUP_STAGES = ("ingest", "prepare")
#: Stages that happen once before the first step (on the clock at step 0 when counted).
UPFRONT_STAGES = ("calibrate", "plan", "score")
#: Per-step stages of the step-time split, in the order of a step.
STEP_STAGES = ("reference", "selection", "rollout", "update", "tracking", "checkpoint")
#: Accuracy tolerance for "reaches the target" (accuracies are ratios k/n; means of them carry rounding).
TOL = 1e-9


@dataclass(frozen=True)
class Curve:
    """Held-out accuracy of one run (or a seed mean) on the evaluation schedule.

    All fields have one entry per evaluation point, in step order.

    Attributes:
        steps: optimizer steps done before the evaluation (0 = the starting policy).
        wall_s: training wall-clock seconds so far, evaluation and setup excluded.
        rollouts: completions generated so far (training, reference and calibration rollouts).
        device_hours: device hours so far (same stages as ``wall_s``).
        usd: money so far (same stages as ``wall_s``).
        accuracy: held-out greedy accuracy.
        tokens: completion tokens generated so far in training steps (empty when not logged).
    """

    steps: tuple[int, ...]
    wall_s: tuple[float, ...]
    rollouts: tuple[float, ...]
    device_hours: tuple[float, ...]
    usd: tuple[float, ...]
    accuracy: tuple[float, ...]
    tokens: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.steps)
        if n == 0:
            raise ValueError("a curve needs at least one evaluation point")
        for name in ("wall_s", "rollouts", "device_hours", "usd", "accuracy", *(("tokens",) if self.tokens else ())):
            if len(getattr(self, name)) != n:
                raise ValueError(f"curve field {name} has {len(getattr(self, name))} points, steps has {n}")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError(f"curve steps must be strictly increasing, got {self.steps}")

    def point(self, i: int) -> dict[str, float]:
        return {"step": self.steps[i], "wall_s": self.wall_s[i], "rollouts": self.rollouts[i],
                "device_hours": self.device_hours[i], "usd": self.usd[i], "accuracy": self.accuracy[i],
                **({"tokens": self.tokens[i]} if self.tokens else {})}


def counted(stage: str, skip: Collection[str] = ()) -> bool:
    """Whether a stage's time is on the benchmark clock (not setup, not evaluation, not skipped)."""
    return not (stage.startswith("eval") or stage in SETUP_STAGES or stage in skip)


def stage_totals(row: dict, prefix: str = "time/", suffix: str = "_s") -> dict[str, float]:
    """``{stage: value}`` from a metric row's cumulative ``<prefix><stage><suffix>`` keys.

    ``time/step_s`` (the step's own duration) is not a stage and is left out.
    """
    out = {}
    for key, v in row.items():
        if key.startswith(prefix) and key.endswith(suffix) and key != "time/step_s" and v is not None:
            out[key[len(prefix):len(key) - len(suffix)]] = float(v)
    return out


def _clock(row: dict, skip: Collection[str], only: Collection[str] | None = None) -> tuple[float, float, float]:
    """(seconds, device hours, usd) of the counted stages in a cumulative metric row."""
    def total(prefix: str, suffix: str) -> float:
        return sum(v for s, v in stage_totals(row, prefix, suffix).items()
                   if counted(s, skip) and (only is None or s in only))
    return total("time/", "_s"), total("cost/", "_device_hours"), total("cost/", "_usd")


def curve_from_metrics(rows: Sequence[dict], start_accuracy: float, *, skip: Collection[str] = (),
                       upfront_rollouts: float = 0.0, end_step: int | None = None,
                       end_accuracy: float | None = None, key: str = "eval/accuracy") -> Curve:
    """A run's curve from its per-step metric rows (``<run dir>/metrics.jsonl``).

    A row with ``step = s`` describes the step that ends with ``s + 1`` updates done; when it carries
    ``key`` that evaluation is the point at step ``s + 1``. Time, device hours and money are the row's
    cumulative stage totals over the counted stages; rollouts are the running sum of
    ``rollout/generated`` and ``select/reference_rollouts`` plus ``upfront_rollouts``.

    Args:
        rows: metric rows in step order (``step`` plus cumulative ``time/*``/``cost/*`` and per-step counts).
        start_accuracy: accuracy of the starting policy (the point at step 0).
        skip: more stages to leave off the clock (see :func:`counted`).
        upfront_rollouts: rollouts generated before the first step (calibration), counted from step 0.
        end_step, end_accuracy: a final evaluation after ``end_step`` steps when the schedule did not
            evaluate there (it takes the cumulative totals of the row ``step = end_step - 1``).
        key: the accuracy metric.

    Returns:
        The curve, starting at step 0 with the upfront (calibrate, score) cost when those are counted.
    """
    first = rows[0] if rows else {}
    w0, d0, u0 = _clock(first, skip, only=UPFRONT_STAGES)
    steps, wall, rolls, dh, usd, acc = [0], [w0], [float(upfront_rollouts)], [d0], [u0], [float(start_accuracy)]
    toks = [0.0]
    generated, tokens = float(upfront_rollouts), 0.0
    for row in rows:
        generated += float(row.get("rollout/generated") or 0.0) + float(row.get("select/reference_rollouts") or 0.0)
        tokens += float(row.get("rollout/tokens") or 0.0)
        at = int(row["step"]) + 1
        is_end = end_step is not None and at == end_step and end_accuracy is not None
        if row.get(key) is None and not is_end:
            continue
        if at <= steps[-1]:
            raise ValueError(f"metric rows are not in step order (step {at - 1} after {steps[-1] - 1})")
        w, d, u = _clock(row, skip)
        value = row[key] if row.get(key) is not None else end_accuracy
        steps.append(at), wall.append(w), rolls.append(generated), dh.append(d), usd.append(u)
        acc.append(float(value)), toks.append(tokens)
    logged = any("rollout/tokens" in row for row in rows)  # a run that does not log them (TRL) has none
    return Curve(tuple(steps), tuple(wall), tuple(rolls), tuple(dh), tuple(usd), tuple(acc),
                 tuple(toks) if logged else ())


def first_crossing(curve: Curve, target: float, tol: float = TOL) -> int | None:
    """Index of the first evaluation whose accuracy reaches ``target`` (within ``tol``), else None."""
    for i, a in enumerate(curve.accuracy):
        if a >= target - tol:
            return i
    return None


def time_to_target(curve: Curve, target: float) -> dict[str, float] | None:
    """Step, wall-clock, rollouts, device hours and money at the first crossing of ``target`` (None: never)."""
    i = first_crossing(curve, target)
    return None if i is None else curve.point(i)


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The seed-mean curve on the steps every curve evaluated (each field averaged step by step).

    Raises:
        ValueError: no curves, or no step that all of them share.
    """
    if not curves:
        raise ValueError("mean_curve needs at least one curve")
    common = sorted(set.intersection(*(set(c.steps) for c in curves)))
    if not common:
        raise ValueError("the curves share no evaluation step")
    idx = [{s: i for i, s in enumerate(c.steps)} for c in curves]

    def avg(field: str) -> tuple[float, ...]:
        return tuple(statistics.fmean(getattr(c, field)[ix[s]] for c, ix in zip(curves, idx, strict=True))
                     for s in common)

    return Curve(tuple(common), avg("wall_s"), avg("rollouts"), avg("device_hours"), avg("usd"), avg("accuracy"),
                 avg("tokens") if all(c.tokens for c in curves) else ())


def accuracy_band(curves: Sequence[Curve]) -> dict[str, list[float]]:
    """Mean, min and max accuracy and the mean clock (wall, rollouts, device hours) over seeds, on the common
    steps (for plots and the JSON report)."""
    m = mean_curve(curves)
    idx = [{s: i for i, s in enumerate(c.steps)} for c in curves]
    lo = [min(c.accuracy[ix[s]] for c, ix in zip(curves, idx, strict=True)) for s in m.steps]
    hi = [max(c.accuracy[ix[s]] for c, ix in zip(curves, idx, strict=True)) for s in m.steps]
    return {"steps": list(m.steps), "wall_s": list(m.wall_s), "rollouts": list(m.rollouts),
            "device_hours": list(m.device_hours), "mean": list(m.accuracy), "lo": lo, "hi": hi}


def targets(baseline: Sequence[Curve], best_frac: float = 0.99) -> dict[str, float]:
    """The two targets from the baseline's seed-mean curve.

    Returns:
        ``final``: its accuracy at the end of its budget; ``best``: ``best_frac`` times its best accuracy
        (any evaluation point, the start included).
    """
    if not 0 < best_frac <= 1:
        raise ValueError(f"best_frac must be in (0, 1], got {best_frac}")
    m = mean_curve(baseline)
    return {"final": m.accuracy[-1], "best": best_frac * max(m.accuracy)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min, max and count."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "n": len(vals)}


def speedup(baseline_s: float | None, config_s: float | None) -> float | None:
    """Baseline time over configuration time; None when either never reached the target.

    A configuration that is at the target before spending any time (both 0) has speed-up 1; one that
    is there at time 0 while the baseline needed time has an infinite speed-up.
    """
    if baseline_s is None or config_s is None:
        return None
    if config_s <= 0:
        return 1.0 if baseline_s <= 0 else math.inf
    return baseline_s / config_s


def reach(curves: Sequence[Curve], target: float) -> dict[str, float]:
    """Per-seed crossings: how many reached the target, and the mean step and wall-clock of those."""
    hits = [p for p in (time_to_target(c, target) for c in curves) if p is not None]
    return {"reached": len(hits), "seeds": len(curves),
            "step_mean": statistics.fmean(p["step"] for p in hits) if hits else None,
            "wall_s_mean": statistics.fmean(p["wall_s"] for p in hits) if hits else None}


def step_split(rows: Sequence[dict], skip: Collection[str] = ()) -> dict[str, float]:
    """Seconds per step by stage (``STEP_STAGES``) and upfront seconds, from a run's last metric row.

    Returns:
        ``{stage: seconds per step}`` for every per-step stage, ``other`` for any further counted stage,
        and ``{stage}_total`` for the upfront stages that are counted.
    """
    if not rows:
        return {}
    last, n = rows[-1], int(rows[-1]["step"]) + 1
    totals = stage_totals(last)
    out = {s: totals.get(s, 0.0) / n for s in STEP_STAGES}
    out["other"] = sum(v for s, v in totals.items()
                       if counted(s, skip) and s not in STEP_STAGES and s not in UPFRONT_STAGES) / n
    for s in UPFRONT_STAGES:
        if counted(s, skip):
            out[f"{s}_total"] = totals.get(s, 0.0)
    return out


def rollouts_per_informative(rows: Sequence[dict]) -> float | None:
    """Rollouts generated per informative group trained over a run's steps: the sum of ``rollout/generated`` over
    the sum of ``train/effective_ratio`` x ``train/groups`` (replayed groups count as trained; the reference and
    calibration rollouts a round or the plan draw are not in ``rollout/generated``). None without those metrics (TRL)
    or without an informative group."""
    steps = [r for r in rows if "rollout/generated" in r and "train/groups" in r]
    informative = sum(r["train/effective_ratio"] * r["train/groups"] for r in steps)
    return sum(r["rollout/generated"] for r in steps) / informative if steps and informative > 0 else None


def overlap_split(rows: Sequence[dict]) -> dict[str, float]:
    """An overlapped run's step against the overlap's limit (tasks/overlap/concurrent.py), in seconds per step.

    Over the steps that overlapped a draw, held no evaluation and do not follow one (that step's draw starts only
    after the evaluation, which its generator's idle time would count): ``step`` (``time/step_s``), ``draw`` (the
    next step's draw, ``overlap/draw_s``), ``update`` (``overlap/update_s``), ``limit``: the mean of the slower of
    the two, ``step_vs_limit``: step / limit, and each side's idle time. Empty for a run that did not overlap.
    """
    steps = [r for before, r in zip([{}, *rows], rows, strict=False)
             if r.get("overlap/draw_s") is not None and "eval/accuracy" not in r and "eval/accuracy" not in before]
    if not steps:
        return {}
    mean = statistics.fmean
    out = {"step": mean(r["time/step_s"] for r in steps), "draw": mean(r["overlap/draw_s"] for r in steps),
           "update": mean(r["overlap/update_s"] for r in steps),
           "limit": mean(max(r["overlap/draw_s"], r["overlap/update_s"]) for r in steps),
           "trainer_idle": mean(r["overlap/trainer_idle_s"] for r in steps),
           "generator_idle": mean(r["overlap/generator_idle_s"] for r in steps)}
    return out | {"step_vs_limit": out["step"] / out["limit"]}


def mean_dicts(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean of numeric dicts (keys missing from some dicts average over the others)."""
    keys = {k for d in dicts for k in d}
    return {k: statistics.fmean(d[k] for d in dicts if d.get(k) is not None) for k in sorted(keys)
            if any(d.get(k) is not None for d in dicts)}


def series_mean(rows_per_seed: Sequence[Sequence[dict]], key: str) -> tuple[list[int], list[float]]:
    """A per-step metric (e.g. ``train/effective_ratio``) averaged over seeds, on the steps all logged."""
    per = [{int(r["step"]): float(r[key]) for r in rows if r.get(key) is not None} for rows in rows_per_seed]
    if not per:
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per)))
    return steps, [statistics.fmean(p[s] for p in per) for s in steps]

