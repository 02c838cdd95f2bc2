"""Plots and tables people would rather look at than numbers: training curves, accuracy by level."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # records sit below training: the evaluation's types only, no import at run time
    from tasks.training.evaluate import EvalCell, EvalResult

CURVES = (("train/reward_mean", "train reward"), ("train/effective_ratio", "effective-group ratio"),
          ("eval/accuracy", "held-out greedy accuracy"), ("time/step_s", "step time (s)"))


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve_points(rows: list[dict], heldout: Sequence[tuple[int, float]] = ()) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each curve in :data:`CURVES`, in step order, from ``metrics.jsonl``'s rows; ``heldout``:
    the held-out accuracy the pipeline measures outside the loop (the start at step 0, the end at the last step),
    added to ``eval/accuracy`` as MLflow's chart has them (docs/operations.md "What MLflow shows")."""
    out = {key: [(r["step"], r[key]) for r in rows if key in r] for key, _ in CURVES}
    out["eval/accuracy"] = sorted([*heldout, *out["eval/accuracy"]], key=lambda p: p[0])  # the start first at 0
    return out


def _pyplot():
    """matplotlib's pyplot on the file backend, imported when a run draws its plots (its report stage), not before
    its first stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def training_curves(metrics_path: Path, out: Path, heldout: Sequence[tuple[int, float]] = ()) -> list[Path]:
    """One panel per curve in ``CURVES`` over training steps (:func:`curve_points`)."""
    points = curve_points(read_metrics(metrics_path), heldout)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, (key, title) in zip(axes, CURVES, strict=True):
        pts = points[key]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def eval_levels(start: EvalResult, end: EvalResult, out: Path) -> list[Path]:
    """Greedy accuracy by level, before and after training."""
    levels = [lv for lv in end.by_level if lv is not None]
    if not levels:
        return []
    x = range(len(levels))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([i - 0.2 for i in x], [start.by_level[lv].greedy_acc if lv in start.by_level else 0 for lv in levels],
           0.4, label="before RL")
    ax.bar([i + 0.2 for i in x], [end.by_level[lv].greedy_acc for lv in levels], 0.4, label="after RL")
    ax.set_xticks(list(x), [f"level {lv}" for lv in levels])
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]


def eval_table(start: EvalResult, end: EvalResult) -> str:
    """Markdown: greedy accuracy, avg@k and pass@k by level and source, before and after."""
    k = end.k
    head = "| group | n | greedy before | greedy after |" + (
        f" avg@{k} before | avg@{k} after | pass@{k} before | pass@{k} after |" if k else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def row(name: str, a: EvalCell | None, b: EvalCell) -> str:
        s = f"| {name} | {b.n} | {_num(a.greedy_acc if a else None):.3f} | {b.greedy_acc:.3f} |"
        if k:
            s += (f" {_num(a.avg_at_k if a else None):.3f} | {_num(b.avg_at_k):.3f} |"
                  f" {_num(a.pass_at_k if a else None):.3f} | {_num(b.pass_at_k):.3f} |")
        return s

    lines.append(row("overall", start.overall, end.overall))
    for lv, c in end.by_level.items():
        lines.append(row(f"level {lv}", start.by_level.get(lv), c))
    for src, c in end.by_source.items():
        lines.append(row(f"source {src}", start.by_source.get(src), c))
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> float:
    return float("nan") if x is None else x
