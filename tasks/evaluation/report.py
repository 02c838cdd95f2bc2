"""What an evaluation shows people: accuracy by level before and after training as a plot, a markdown table
and the Prefect artifact ``eval-by-level`` (tasks/records/artifacts.py lists every artifact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.evaluation.heldout import EvalCell, EvalResult
from tasks.records.artifacts import publish
from tasks.records.plots import pyplot


def eval_by_level(run: str, start: EvalResult, end: EvalResult | None) -> None:
    """``eval-by-level``: greedy accuracy by level and overall (``all``) before training, and after it (``end``
    None: the run has not got there yet)."""
    from prefect.artifacts import create_table_artifact

    def row(level: str, a, b) -> dict[str, Any]:
        return {"level": level, "start": None if a is None else round(a.greedy_acc, 3),
                "end": None if b is None else round(b.greedy_acc, 3),
                "change": None if a is None or b is None else round(b.greedy_acc - a.greedy_acc, 3)}

    after = end.by_level if end is not None else {}
    levels = sorted(set(start.by_level) | set(after), key=str)
    rows = [row(str(lv), start.by_level.get(lv), after.get(lv)) for lv in levels]
    rows.append(row("all", start.overall, end.overall if end is not None else None))
    when = "before and after training" if end is not None else "before training (the end evaluation is to come)"
    publish("eval-by-level", lambda: create_table_artifact(
        key="eval-by-level", table=rows, description=f"Held-out greedy accuracy of {run}, {when}"))


def eval_levels(start: EvalResult, end: EvalResult, out: Path) -> list[Path]:
    """Greedy accuracy by level, before and after training."""
    levels = [lv for lv in end.by_level if lv is not None]
    if not levels:
        return []
    x = range(len(levels))
    plt = pyplot()
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
    """Markdown: greedy accuracy, avg@k and pass@k by level (where the prompts have levels) and source, before and
    after."""
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
    for lv, c in end.by_level.items() if set(end.by_level) != {None} else ():  # no levels: the overall row again
        lines.append(row(f"level {lv}", start.by_level.get(lv), c))
    for src, c in end.by_source.items():
        lines.append(row(f"source {src}", start.by_source.get(src), c))
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> float:
    return float("nan") if x is None else x
