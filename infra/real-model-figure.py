"""The learning curve of docs/benchmarks.md, "A real model": held-out greedy accuracy against the training clock
(evaluation and setup excluded, as the benchmark counts it), every arm of one ``rlsift bench`` report on one plot,
with each run's accuracy before and after (exact McNemar, from the run's summary) and the plan's choice and its
predicted against measured clock. The figure goes to ``--out`` and, with a small Markdown table, to the bench's
MLflow parent run.

Usage: python infra/real-model-figure.py <paths.root>/reports/bench-<stamp> [--out docs/img/real-model.png]
       [--note "measured under load"]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tasks.bench.plots import line_style  # noqa: E402
from tasks.bench.report import read_eval  # noqa: E402
from tasks.evaluation.heldout import paired_change  # noqa: E402
from tasks.records.tracking import MlflowTracker  # noqa: E402


def arm_facts(result: dict) -> dict[str, dict]:
    """Per arm: its run's held-out change start -> end (``eval_start.json``, ``eval_end.json``: prompts that
    turned right and wrong, exact McNemar p) and its plan (``plan.json``, an ``auto`` run's), by arm name."""
    out = {}
    for c in result["configurations"]:
        run_dir = Path((c.get("runs") or [{}])[0].get("run_dir") or "")
        start, end = read_eval(run_dir, "start"), read_eval(run_dir, "end")
        plan = run_dir / "plan.json"
        out[c["name"]] = {"paired": paired_change(start, end) if start and end else None,
                          "plan": json.loads(plan.read_text()) if plan.is_file() else None}
    return out


def table(result: dict, facts: dict[str, dict]) -> str:
    """Markdown: per arm, held-out accuracy before -> after with McNemar's p, training clock, and the clock to the
    baseline's final accuracy; then the plan's choice with each prediction."""
    lines = ["| arm | held-out start | end | turned right / wrong | exact McNemar p | training clock (s) | "
             "clock to the baseline's final accuracy (s) |", "|---|---|---|---|---|---|---|"]
    for c in result["configurations"]:
        if "budget" not in c:
            lines.append(f"| {c['name']} | failed | | | | | |")
            continue
        pc = facts[c["name"]]["paired"]
        hit = ((c.get("to_target") or {}).get("final") or {}).get("mean_curve")
        lines.append(f"| {c['name']} | {c['start_accuracy']['mean']:.3f} | {c['final_accuracy']['mean']:.3f} | "
                     + (f"{pc.turned_right} / {pc.turned_wrong} | {pc.mcnemar_p:.2g} | " if pc else "| | ")
                     + f"{c['budget']['wall_s']:.0f} | " + (f"{hit['wall_s']:.0f} |" if hit else "not reached |"))
    for name, f in facts.items():
        plan = f["plan"]
        if plan:
            lines += ["", f"{name}'s plan: **{plan['choice']}**: {plan['reason']}", "",
                      "| candidate | effective ratio | informative groups a step | predicted training clock (s) | "
                      "vs GRPO |", "|---|---|---|---|---|"]
            for pr in plan["predictions"]:
                lines.append(f"| {pr['name']} | {pr['effective_ratio']:.2f} | {pr['signal']:.2f} | "
                             f"{pr['train_s']:.0f} | {pr['clock']:.2f}x |")
    checks = result.get("plan_check") or []
    if checks:
        lines += ["", "| arm | composition | effective ratio predicted / measured | clock vs the baseline predicted / "
                  "measured |", "|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['arm']} | {c['composition']} | {c['predicted_ratio']:.2f} / "
                         f"{c['measured_ratio']:.2f} | {c['predicted_clock']:.2f} / {c['measured_clock']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path, note: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, c in enumerate(result["configurations"]):
        if "curve" not in c:
            continue
        cur = c["curve"]
        ax.plot(cur["wall_s"], cur["mean"], marker="o", label=c["name"], **line_style(i, c["name"]))
    tgt = (result.get("targets") or {}).get("final")
    if tgt is not None:
        ax.axhline(tgt, color="grey", ls=":", lw=1, label=f"{result['baseline']}'s final accuracy")
    ax.set_xlabel("training clock (s; evaluation and setup excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    ax.set_title("SmolLM2-135M-Instruct on 2 CPU cores" + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="the bench report folder (results.json)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "real-model.png"))
    ap.add_argument("--note", default="", help="a line under the title, e.g. \"measured under load\"")
    a = ap.parse_args()
    report = Path(a.report)
    result = json.loads((report / "results.json").read_text())
    fig = plot(result, Path(a.out), a.note)
    md = table(result, arm_facts(result))
    (report / "real_model.md").write_text(md)
    print(md)
    meta = result["meta"]
    tracker = MlflowTracker(meta["tracking_uri"], "rlsift", report / "mlflow-real-model",
                            run_id=meta["mlflow_parent_run"], background=False)
    tracker.log_artifact(fig)
    tracker.log_artifact(report / "real_model.md")
    tracker.flush()
    print(f"figure {fig}; logged to MLflow run {meta['mlflow_parent_run']} ({meta['tracking_uri']})")


if __name__ == "__main__":
    main()
