"""The benchmark report's plots: accuracy curves, the effective-group ratio per step, the selected levels per round.

Each plot takes plain aggregates (:func:`tasks.bench.report.analyse`'s result, metric rows, ledger selections) and
writes one PNG.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tasks.bench import analysis as ba  # noqa: E402

#: Line colours: tab20's ten dark shades, then its ten light ones, then tab20b's twenty, so up to 40 configurations
#: (the full ablation has 20 arms and TRL) each get their own colour; matplotlib's default cycle repeats after 10.
COLOURS = plt.get_cmap("tab20").colors[0::2] + plt.get_cmap("tab20").colors[1::2] + plt.get_cmap("tab20b").colors


def line_style(i: int, name: str) -> dict:
    """Colour and line style of the i-th configuration (TRL, the outside control, dashed)."""
    return {"color": COLOURS[i % len(COLOURS)], "ls": "--" if name == "trl" else "-"}


def plot_curves(result: dict, out: Path) -> Path:
    """Accuracy against wall-clock, rollouts and steps: seed mean and min-max band per configuration."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), sharey=True)
    tgt = result["targets"] or {}
    for i, r in enumerate(result["configurations"]):
        if "curve" not in r:
            continue
        c, style = r["curve"], line_style(i, r["name"])
        for ax, x in zip(axes, (c["wall_s"], c["rollouts"], c["steps"]), strict=True):
            ax.plot(x, c["mean"], marker=".", label=r["name"], **style)
            if len(r["seeds"]) > 1:
                ax.fill_between(x, c["lo"], c["hi"], color=style["color"], alpha=0.15)
    for ax, xl in zip(axes, ("training wall-clock (s, evaluation excluded)", "rollouts generated", "step"),
                      strict=True):
        for key, ls in (("final", ":"), ("best", "-.")):
            if tgt.get(key) is not None:
                ax.axhline(tgt[key], color="grey", ls=ls, lw=1)
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle("accuracy (seed mean, band = min-max over seeds); dotted: target (a), dash-dot: target (b)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_effective(rows_by_name: dict[str, list[list[dict]]], out: Path) -> Path:
    """Effective-group ratio per step, seed mean, smoothed over a few steps.

    Args:
        rows_by_name: ``{configuration: [metric rows of each completed seed]}``, in plotting order.
    """
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, (name, rows) in enumerate(rows_by_name.items()):
        steps, vals = ba.series_mean(rows, "train/effective_ratio")
        if not steps:
            continue
        w = max(1, len(steps) // 30)
        smooth = [sum(vals[max(0, i - w + 1):i + 1]) / len(vals[max(0, i - w + 1):i + 1]) for i in range(len(vals))]
        ax.plot([s + 1 for s in steps], smooth, label=name, **line_style(k, name))
    ax.set_xlabel("step")
    ax.set_ylabel("effective-group ratio (seed mean, moving mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_difficulty(selections: dict[str, list[dict]], out: Path) -> Path:
    """Per configuration: level shares of the selected prompts per round, and mean predicted success.

    Args:
        selections: ``{configuration: rows}`` with ``round``, ``level`` and ``pred_success`` (may be None).
    """
    names = [n for n, rows in selections.items() if rows]
    fig, axes = plt.subplots(len(names) or 1, 1, figsize=(9, 2.3 * max(1, len(names))), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=False):
        rows = selections[name]
        rounds = sorted({r["round"] for r in rows})
        levels = sorted({r["level"] for r in rows if r["level"] is not None})
        bottom = [0.0] * len(rounds)
        for lv in levels:
            share = []
            for rd in rounds:
                in_round = [r for r in rows if r["round"] == rd]
                share.append(sum(r["level"] == lv for r in in_round) / len(in_round))
            ax.bar(rounds, share, bottom=bottom, label=f"level {lv}", width=0.9)
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        pred = [(rd, [r["pred_success"] for r in rows if r["round"] == rd and r["pred_success"] is not None])
                for rd in rounds]
        pred = [(rd, sum(p) / len(p)) for rd, p in pred if p]
        if pred:
            twin = ax.twinx()
            twin.plot(*zip(*pred, strict=True), color="black", marker=".", label="mean predicted success")
            twin.set_ylim(0, 1)
            twin.set_ylabel("pred. success", fontsize=8)
        ax.set_ylim(0, 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_ylabel("level share", fontsize=8)
    if names:
        axes[0, 0].legend(fontsize=7, ncol=6, loc="upper right")
        axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
