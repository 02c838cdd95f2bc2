"""Plots people would rather look at than numbers: the training curves (the evaluation draws its own,
tasks/evaluation/report.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CURVES = (("train/reward_mean", "train reward"), ("train/effective_ratio", "effective-group ratio"),
          ("eval/accuracy", "held-out greedy accuracy"), ("time/step_s", "step time (s)"))


def pyplot():
    """matplotlib's pyplot on the file backend, imported when a run draws its plots (its report stage), not before
    its first stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def training_curves(metrics_path: Path, out: Path, heldout: Sequence[tuple[int, float]] = ()) -> list[Path]:
    """One panel per curve in ``CURVES`` over training steps (:func:`curve_points`)."""
    points = curve_points(read_metrics(metrics_path), heldout)
    plt = pyplot()
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
