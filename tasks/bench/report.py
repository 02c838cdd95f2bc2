"""Benchmark report: runs' metric files -> curves and aggregates (tasks/bench/analysis.py) -> table and plots.

Input is one :class:`BenchRun` per configuration and seed (our pipeline runs and the TRL control, which
writes the same ``metrics.jsonl`` format). Output, in the report folder:

- ``results.md`` / ``results.json``: the verdict table, the results table (accuracy, time to both targets with
  speed-ups, effective-group ratio), cost against plain GRPO, each level's end against its start (paired over
  the held-out prompts), the step-time split, and everything behind them;
- ``accuracy_curves.png``: held-out accuracy against wall-clock, rollouts and steps, seed mean with a
  min-max band per configuration and the two targets;
- ``effective_ratio.png``: share of trained groups with unequal rewards, per step (seed mean);
- ``selected_difficulty.png``: the level mix of the selected prompts per round (pooled over seeds) with the
  mean predicted success where a predictor ran (the ledger's ``selections`` table).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tasks.bench import analysis as ba  # noqa: E402
from tasks.evaluation.heldout import EvalResult  # noqa: E402


@dataclass
class BenchRun:
    """One configuration and seed: its summary, metric rows and what its clock leaves out."""

    name: str
    seed: int
    summary: dict
    rows: list[dict] = field(default_factory=list)
    skip: tuple[str, ...] = ()
    upfront_rollouts: float = 0.0
    end_correct: tuple[int, ...] = ()  # the final evaluation's 0/1 greedy correctness per held-out prompt
    end_prompts: tuple[str, ...] = ()  # ... and the prompt ids, in the same order
    start_correct: tuple[int, ...] = ()  # the starting policy's, on the same prompts in the same order
    levels: tuple[int | None, ...] = ()  # ... and each prompt's difficulty level

    @property
    def ok(self) -> bool:
        return self.summary.get("status") == "completed" and self.summary.get("eval_accuracy_start") is not None

    def curve(self) -> ba.Curve:
        steps = int(self.summary.get("steps") or 0)
        return ba.curve_from_metrics(self.rows, self.summary["eval_accuracy_start"], skip=self.skip,
                                     upfront_rollouts=self.upfront_rollouts, end_step=steps,
                                     end_accuracy=self.summary.get("eval_accuracy_end"))


def read_eval(run_dir: str | Path, phase: str) -> EvalResult | None:
    """A run's ``eval_<phase>.json`` (``start`` or ``end``), or None when it has none."""
    path = Path(run_dir) / f"eval_{phase}.json"
    return EvalResult.load(path) if path.exists() else None


def attach_evals(run: BenchRun) -> None:
    """Fill the run's per-prompt fields from its start and end evaluations (``summary["run_dir"]``); the start
    and the levels only when both evaluations cover the same prompts in the same order."""
    start, end = (read_eval(run.summary["run_dir"], phase) for phase in ("start", "end"))
    if end is None:
        return
    run.end_correct, run.end_prompts = end.greedy_correct, end.prompt_ids
    if start is not None and start.prompt_ids == end.prompt_ids and end.levels:
        run.start_correct, run.levels = start.greedy_correct, end.levels


def read_rows(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def analyse(runs: list[BenchRun], baseline: str = "grpo", best_frac: float = 0.99) -> dict:
    """Per-configuration aggregates over seeds, with time to target against the baseline's mean curve."""
    by_name: dict[str, list[BenchRun]] = defaultdict(list)
    for r in runs:
        by_name[r.name].append(r)
    curves = {n: [r.curve() for r in rs if r.ok] for n, rs in by_name.items()}
    tgt = ba.targets(curves[baseline], best_frac) if curves.get(baseline) else None
    base_mean = ba.mean_curve(curves[baseline]) if curves.get(baseline) else None
    base_hit = {k: ba.time_to_target(base_mean, v) for k, v in tgt.items()} if tgt else {}
    out = []
    for name, rs in by_name.items():
        ok = [r for r in rs if r.ok]
        row: dict = {"name": name, "seeds": [r.seed for r in ok], "failed_seeds": [r.seed for r in rs if not r.ok],
                     "runs": [{"seed": r.seed, "run_id": r.summary.get("run_id"), "status": r.summary.get("status"),
                               "mlflow_run_id": r.summary.get("mlflow_run_id"), "run_dir": r.summary.get("run_dir"),
                               "error": r.summary.get("error")} for r in rs]}
        if not ok:
            out.append(row)
            continue
        cs, m = curves[name], ba.mean_curve(curves[name])
        row |= {
            "start_accuracy": ba.spread([c.accuracy[0] for c in cs]),
            "final_accuracy": ba.spread([c.accuracy[-1] for c in cs]),
            "best_accuracy": max(m.accuracy),
            "budget": m.point(len(m.steps) - 1),
            "effective_ratio": ba.spread([ba.spread([x.get("train/effective_ratio") for x in r.rows])["mean"]
                                          for r in ok]),
            "step_split": ba.mean_dicts([ba.step_split(r.rows, r.skip) for r in ok]),
            "overlap": ba.mean_dicts([ba.overlap_split(r.rows) for r in ok]),
            "curve": ba.accuracy_band(cs),
            "seed_curves": [{"seed": r.seed, **asdict(c)} for r, c in zip(ok, cs, strict=True)],
            "run_usd_total": ba.spread([r.summary.get("cost_usd") for r in ok])["mean"],
            "skipped_stages": list(ok[0].skip),
        }
        with_levels = [r for r in ok if r.levels]
        if with_levels:
            row["levels"] = ba.level_change([(r.levels, r.start_correct, r.end_correct) for r in with_levels])
        if tgt:
            row["to_target"] = {}
            for key, value in tgt.items():
                hit = ba.time_to_target(m, value)
                base_s = base_hit[key]["wall_s"] if base_hit.get(key) else None
                row["to_target"][key] = {
                    "target": value, "mean_curve": hit, "per_seed": ba.reach(cs, value),
                    "speedup": ba.speedup(base_s, hit["wall_s"] if hit else None)}
        out.append(row)
    if tgt:
        for row in out:
            if "budget" in row and row["name"] != baseline:
                ok_base = [r for r in by_name[baseline] if r.ok]
                ok_arm = [r for r in by_name[row["name"]] if r.ok]
                row["verdicts"] = verdicts(curves[baseline], curves[row["name"]], tgt, ok_base, ok_arm)
    base = next((r for r in out if r["name"] == baseline and "budget" in r), None)
    for r in out:
        if base and "budget" in r:
            r["usd_vs_baseline"] = _ratio(r["budget"]["usd"], base["budget"]["usd"])
            r["wall_vs_baseline"] = _ratio(r["budget"]["wall_s"], base["budget"]["wall_s"])
            t = (r.get("to_target") or {}).get("final", {}).get("mean_curve")
            bt = (base.get("to_target") or {}).get("final", {}).get("mean_curve")
            r["usd_to_target_vs_baseline"] = _ratio(t["usd"], bt["usd"]) if t and bt else None
    return {"baseline": baseline, "best_frac": best_frac, "targets": tgt, "configurations": out}


def verdicts(base_curves: list[ba.Curve], arm_curves: list[ba.Curve], tgt: dict[str, float],
             base_runs: list[BenchRun], arm_runs: list[BenchRun]) -> dict:
    """An arm against the baseline: time to each target in every measure (``ba.compare_times``), and the
    final-accuracy difference paired prompt by prompt over the seeds both ran (``ba.mcnemar_pooled``)."""
    unlogged = {"verdict": "not logged", "ratio": None, "ci": None}
    out: dict = {key: {m: unlogged if m == "tokens" and not all(c.tokens for c in base_curves + arm_curves) else
                       ba.compare_times(ba.seed_times(base_curves, value, m), ba.seed_times(arm_curves, value, m))
                       for m in ba.MEASURES} for key, value in tgt.items()}
    by_seed = {r.seed: r for r in base_runs if r.end_correct}
    pairs = [(by_seed[r.seed].end_correct, r.end_correct) for r in arm_runs
             if r.end_correct and r.seed in by_seed and by_seed[r.seed].end_prompts == r.end_prompts]
    out["final_paired"] = ba.mcnemar_pooled(pairs) if pairs else None
    return out


def plan_check(result: dict, plan: dict, compositions: dict[str, str | None], runs: list[BenchRun]) -> list[dict]:
    """The plan's predictions (``Plan.to_json`` of ``rlsift plan`` on the benchmark's pool) against each arm's
    measured effective ratio and clock at the budget, both relative to the baseline. ``compositions``: arm ->
    the candidate that predicts it; an ``auto`` arm is predicted by its own plan's choice (each seed's mean)."""
    by_name = {p["name"]: p for p in [plan["baseline"], *plan["predictions"]]}
    out = []
    for r in result["configurations"]:
        if "budget" not in r:
            continue
        pred = by_name.get(compositions.get(r["name"]) or "")
        if r["name"] == "auto" or r["name"].startswith("auto-"):
            chosen = [x.summary["plan"] for x in runs if x.name == r["name"] and x.ok and x.summary.get("plan")]
            if chosen:
                pred = {"name": ",".join(sorted({c["choice"] for c in chosen})),
                        "clock": statistics.fmean(c.get("predicted_clock_with_plan", c.get("predicted_clock"))
                                                  for c in chosen),
                        "effective_ratio": statistics.fmean(c["predicted_effective_ratio"] for c in chosen)}
        if pred is None:
            continue
        out.append({"arm": r["name"], "composition": pred["name"], "predicted_ratio": pred["effective_ratio"],
                    "measured_ratio": r["effective_ratio"]["mean"], "predicted_clock": pred["clock"],
                    "measured_clock": r.get("wall_vs_baseline")})
    return out


def plan_markdown(result: dict) -> list[str]:
    """The plan's predictions against the measurements (:func:`plan_check`)."""
    rows = result.get("plan_check")
    if not rows:
        return []
    lines = ["", "The plan's predictions (`rlsift plan` on this pool, before any arm ran) against the measurements: "
             "effective-group ratio (seed mean over steps) and training clock at the budget relative to the "
             "baseline.", "", "| arm | predicted as | ratio predicted | ratio measured | clock predicted "
             "| clock measured | clock error |", "|" + "---|" * 7]
    for c in rows:
        err = (c["predicted_clock"] / c["measured_clock"] - 1) if c["measured_clock"] else None
        lines.append(f"| {c['arm']} | {c['composition']} | {_f(c['predicted_ratio'], '.2f')} | "
                     f"{_f(c['measured_ratio'], '.2f')} | {_f(c['predicted_clock'], '.2f')}x | "
                     f"{_f(c['measured_clock'], '.2f')}x | {'-' if err is None else f'{err:+.0%}'} |")
    return lines


def plain_markdown(result: dict) -> list[str]:
    """One sentence per arm: its clock to the baseline's final accuracy and its final accuracy against the
    baseline's, each said to be decided or not by the figures (Welch interval over seeds; paired McNemar)."""
    rows = [r for r in result["configurations"] if r.get("verdicts")]
    if not rows:
        return []
    lines = [f"What the figures say, against `{result['baseline']}`:", ""]
    for r in rows:
        clock = r["verdicts"]["final"]["wall_s"]
        speedup = ((r.get("to_target") or {}).get("final") or {}).get("speedup")
        verdict = clock["verdict"] or "one seed: no interval, so the clock is not decided"
        if verdict.startswith("not reached"):
            when = f"did not reach its final accuracy on every seed ({verdict})"
        else:
            at = f" at {1 / speedup:.2f}x its clock" if speedup else ""
            when = f"reached its final accuracy{at} ({verdict})"
        fp = r["verdicts"].get("final_paired")
        if fp is None:
            acc = "no paired accuracy"
        elif fp["p"] < 0.05:
            acc = f"ended {100 * fp['diff']:+.1f} points from it (p = {fp['p']:.2g}: a real difference)"
        else:
            acc = (f"ended {100 * fp['diff']:+.1f} points from it (p = {fp['p']:.2g}: these figures cannot tell "
                   "the accuracies apart)")
        lines.append(f"- `{r['name']}` {when} and {acc}.")
    return [*lines, ""]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _f(x, fmt: str = ".3f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def verdict_markdown(result: dict) -> list[str]:
    """The verdict table: each arm against the baseline, per target, one word per measure."""
    rows = [r for r in result["configurations"] if r.get("verdicts")]
    if not rows:
        return []
    lines = [f"Verdicts against `{result['baseline']}`: time to each target (arm / baseline, seed means; "
             "95% Welch interval of the difference decides faster / no different / slower), and the final "
             "accuracy difference paired prompt by prompt over the seeds (exact McNemar p).", "",
             "| arm | target | steps | rollouts | tokens | wall-clock | final acc. diff (right/wrong, p) |",
             "|" + "---|" * 7]

    def cell(v: dict) -> str:
        ratio = f" ({v['ratio']:.2f}x)" if v.get("ratio") is not None else ""
        return f"{v['verdict']}{ratio}"

    for r in rows:
        fp = r["verdicts"].get("final_paired")
        paired = (f"{fp['diff']:+.3f} ({fp['turned_right']}/{fp['turned_wrong']}, p={fp['p']:.2g})"
                  if fp else "-")
        for key in (k for k in r["verdicts"] if k != "final_paired"):
            v = r["verdicts"][key]
            lines.append(f"| {r['name']} | ({'a' if key == 'final' else 'b'}) {key} | " +
                         " | ".join(cell(v[m]) for m in ba.MEASURES) + f" | {paired if key == 'final' else ''} |")
    return lines + [""]


def level_markdown(result: dict) -> list[str]:
    """Per configuration and difficulty level: greedy accuracy at the start and the end (seed means), the prompts
    that turned right and wrong pooled over seeds, the exact McNemar p and the verdict (``ba.level_change``)."""
    rows = [r for r in result["configurations"] if r.get("levels")]
    if not rows:
        return []
    lines = ["", "Per level, the end against the start (held-out greedy accuracy, seed means; prompts that turned "
             "right / wrong pooled over seeds; exact McNemar p; below / above start at p < 0.05 per level):", "",
             "| configuration | level | prompts | start | end | change | right / wrong | p | verdict |",
             "|" + "---|" * 9]
    for r in rows:
        for c in r["levels"]:
            lines.append(f"| {r['name']} | {'-' if c['level'] is None else c['level']} | {c['prompts']} | "
                         f"{c['start']:.3f} | {c['end']:.3f} | {c['end'] - c['start']:+.3f} | "
                         f"{c['turned_right']} / {c['turned_wrong']} | {c['p']:.2g} | {c['verdict']} |")
    below = {r["name"]: [c["level"] for c in r["levels"] if c["verdict"] == ba.BELOW_START] for r in rows}
    slipped = "; ".join(f"`{n}`: level {', '.join(map(str, lv))}" for n, lv in below.items() if lv)
    return lines + ["", f"Levels significantly below their start: {slipped or 'none'}."]


def markdown(result: dict) -> str:
    """The verdict table, the results table, the step-time split and the cost table, in Markdown."""
    tgt = result["targets"] or {}
    lines = [*plain_markdown(result), *verdict_markdown(result),
             f"Targets from `{result['baseline']}` (seed-mean curve): (a) final accuracy "
             f"{_f(tgt.get('final'))}, (b) {result['best_frac']:.0%} of its best = {_f(tgt.get('best'))}. "
             "Time = training wall-clock without evaluation or setup; speed-up = baseline time / time.", "",
             "| configuration | seeds | start acc | final acc (mean ± std) | best (mean curve) | effective ratio "
             "| (a) time s [step] | (a) speed-up | (a) seeds reached | (a) rollouts | (b) time s [step] "
             "| (b) speed-up | (b) seeds reached |",
             "|" + "---|" * 13]
    for r in result["configurations"]:
        if "budget" not in r:
            lines.append(f"| {r['name']} | 0 (failed: {r['failed_seeds']}) |" + " - |" * 11)
            continue
        cells = [r["name"], str(len(r["seeds"])), _f(r["start_accuracy"]["mean"]),
                 f"{_f(r['final_accuracy']['mean'])} ± {_f(r['final_accuracy']['std'])}", _f(r["best_accuracy"]),
                 _f(r["effective_ratio"]["mean"], ".2f")]
        for key in ("final", "best"):
            t = (r.get("to_target") or {}).get(key)
            hit = t["mean_curve"] if t else None
            cells.append(f"{_f(hit['wall_s'], '.1f')} [{hit['step']}]" if hit else "not reached")
            cells.append(_f(t["speedup"], ".2f") + "x" if t and t["speedup"] is not None else "-")
            cells.append(f"{t['per_seed']['reached']}/{t['per_seed']['seeds']}" if t else "-")
            if key == "final":
                cells.append(_f(hit["rollouts"], ".0f") if hit else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Cost over the whole budget (training clock, seed mean) and to target (a); the last column is "
              "the runs' own total (every stage, with setup and evaluation):", "",
              "| configuration | steps | wall s | rollouts | device hours | USD | USD vs baseline "
              "| USD to (a) vs baseline | USD run total |", "|" + "---|" * 9]
    for r in result["configurations"]:
        if "budget" not in r:
            continue
        b = r["budget"]
        lines.append(f"| {r['name']} | {b['step']} | {_f(b['wall_s'], '.1f')} | {_f(b['rollouts'], '.0f')} | "
                     f"{_f(b['device_hours'], '.5f')} | {_f(b['usd'], '.6f')} | "
                     f"{_f(r.get('usd_vs_baseline'), '.2f')} | "
                     f"{_f(r.get('usd_to_target_vs_baseline'), '.2f')} | {_f(r.get('run_usd_total'), '.6f')} |")
    lines += level_markdown(result)
    parts = [*ba.STEP_STAGES, "other"]
    step_s = {r["name"]: sum(r["step_split"].get(p) or 0.0 for p in parts) for r in result["configurations"]
              if "budget" in r}
    trl = step_s.get("trl")
    lines += ["", "Seconds per step by phase (seed mean), the step's total and its ratio to TRL's, and one-off "
              "scoring/calibration seconds:", "",
              "| configuration | " + " | ".join(parts) + " | step | vs trl | score (once) | calibrate (once) |",
              "|" + "---|" * (len(parts) + 5)]
    for r in result["configurations"]:
        if "budget" not in r:
            continue
        s = r["step_split"]
        lines.append(f"| {r['name']} | " + " | ".join(_f(s.get(p), ".3f") for p in parts) +
                     f" | {step_s[r['name']]:.3f} | {_f(step_s[r['name']] / trl if trl else None, '.2f')}"
                     f" | {_f(s.get('score_total'), '.1f', 'not used')}"
                     f" | {_f(s.get('calibrate_total'), '.1f', 'not used')} |")
    lines += overlap_markdown(result)
    lines += plan_markdown(result)
    return "\n".join(lines) + "\n"


def overlap_markdown(result: dict) -> list[str]:
    """The overlapped arms' step against the overlap's limit (the slower of draw and update, both measured in the
    overlapped run; tasks/bench/analysis.py ``overlap_split``)."""
    rows = [r for r in result["configurations"] if r.get("overlap")]
    if not rows:
        return []
    lines = ["", "Overlapped arms (steps without an evaluation, seed mean, seconds): the step against its limit, the "
             "slower of the next step's draw and this step's update, and each side's idle time:", "",
             "| configuration | step | draw | update | limit | step / limit | trainer idle | generator idle |",
             "|" + "---|" * 8]
    for r in rows:
        o = r["overlap"]
        lines.append(f"| {r['name']} | " + " | ".join(_f(o.get(k), ".3f") for k in (
            "step", "draw", "update", "limit")) + f" | {_f(o.get('step_vs_limit'), '.2f')} | "
            f"{_f(o.get('trainer_idle'), '.3f')} | {_f(o.get('generator_idle'), '.3f')} |")
    return lines


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


def plot_effective(runs: list[BenchRun], out: Path) -> Path:
    """Effective-group ratio per step, seed mean, smoothed over a few steps."""
    fig, ax = plt.subplots(figsize=(8, 4))
    by_name: dict[str, list[list[dict]]] = defaultdict(list)
    for r in runs:
        if r.ok:
            by_name[r.name].append(r.rows)
    for k, (name, rows) in enumerate(by_name.items()):
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


def write_report(report_dir: Path, runs: list[BenchRun], result: dict, selections: dict[str, list[dict]],
                 meta: dict) -> list[Path]:
    """Write the table (md + json) and the three plots; returns the files."""
    report_dir.mkdir(parents=True, exist_ok=True)
    files = [plot_curves(result, report_dir / "accuracy_curves.png"),
             plot_effective(runs, report_dir / "effective_ratio.png"),
             plot_difficulty(selections, report_dir / "selected_difficulty.png")]
    md = "# rlsift benchmark\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n" + markdown(result)
    (report_dir / "results.md").write_text(md)
    (report_dir / "results.json").write_text(json.dumps({"meta": meta, **result}, indent=2, default=str))
    return [report_dir / "results.md", report_dir / "results.json", *files]
