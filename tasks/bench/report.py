"""Benchmark report: runs' metric files -> curves and aggregates (tasks/bench/analysis.py) -> table and plots.

Input is one :class:`BenchRun` per configuration and seed (our pipeline runs and the TRL control, which
writes the same ``metrics.jsonl`` format). Output, in the report folder:

- ``results.md`` / ``results.json``: the verdict table, the results table (accuracy, time to both targets with
  speed-ups, effective-group ratio), cost against plain GRPO, each level's end against its start (paired over
  the held-out prompts), the step-time split, and everything behind them (the tables: :mod:`tasks.bench.tables`);
- ``accuracy_curves.png``: held-out accuracy against wall-clock, rollouts and steps, seed mean with a
  min-max band per configuration and the two targets;
- ``effective_ratio.png``: share of trained groups with unequal rewards, per step (seed mean);
- ``selected_difficulty.png``: the level mix of the selected prompts per round (pooled over seeds) with the
  mean predicted success where a predictor ran (the ledger's ``selections`` table). The plots:
  :mod:`tasks.bench.plots`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.bench import analysis as ba
from tasks.bench import comparison as bc
from tasks.bench.plots import plot_curves, plot_difficulty, plot_effective
from tasks.bench.tables import markdown
from tasks.evaluation.heldout import EvalResult


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
            "rollouts_per_informative": ba.spread([ba.rollouts_per_informative(r.rows) for r in ok]),
            "step_split": ba.mean_dicts([ba.step_split(r.rows, r.skip) for r in ok]),
            "overlap": ba.mean_dicts([ba.overlap_split(r.rows) for r in ok]),
            "curve": ba.accuracy_band(cs),
            "seed_curves": [{"seed": r.seed, **asdict(c)} for r, c in zip(ok, cs, strict=True)],
            "run_usd_total": ba.spread([r.summary.get("cost_usd") for r in ok])["mean"],
            "skipped_stages": list(ok[0].skip),
        }
        with_levels = [r for r in ok if r.levels]
        if with_levels:
            row["levels"] = bc.level_change([(r.levels, r.start_correct, r.end_correct) for r in with_levels])
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
            per, base_per = r["rollouts_per_informative"]["mean"], base["rollouts_per_informative"]["mean"]
            r["rollouts_per_informative_vs_baseline"] = (_ratio(per, base_per) if math.isfinite(per)
                                                         and math.isfinite(base_per) else None)
            t = (r.get("to_target") or {}).get("final", {}).get("mean_curve")
            bt = (base.get("to_target") or {}).get("final", {}).get("mean_curve")
            r["usd_to_target_vs_baseline"] = _ratio(t["usd"], bt["usd"]) if t and bt else None
    return {"baseline": baseline, "best_frac": best_frac, "targets": tgt, "configurations": out}


def verdicts(base_curves: list[ba.Curve], arm_curves: list[ba.Curve], tgt: dict[str, float],
             base_runs: list[BenchRun], arm_runs: list[BenchRun]) -> dict:
    """An arm against the baseline: time to each target in every measure (``bc.compare_times``), and the
    final-accuracy difference paired prompt by prompt over the seeds both ran (``bc.mcnemar_pooled``)."""
    unlogged = {"verdict": "not logged", "ratio": None, "ci": None}
    out: dict = {key: {m: unlogged if m == "tokens" and not all(c.tokens for c in base_curves + arm_curves) else
                       bc.compare_times(bc.seed_times(base_curves, value, m), bc.seed_times(arm_curves, value, m))
                       for m in bc.MEASURES} for key, value in tgt.items()}
    by_seed = {r.seed: r for r in base_runs if r.end_correct}
    pairs = [(by_seed[r.seed].end_correct, r.end_correct) for r in arm_runs
             if r.end_correct and r.seed in by_seed and by_seed[r.seed].end_prompts == r.end_prompts]
    out["final_paired"] = bc.mcnemar_pooled(pairs) if pairs else None
    return out


def plan_check(result: dict, plan: dict, compositions: dict[str, str | None], runs: list[BenchRun],
               base_arm: str, sequential: frozenset[str] = frozenset(), auto_base: str = "grpo") -> list[dict]:
    """The plan's predictions (``Plan.to_json`` of ``rlsift plan`` on the benchmark's pool) against each arm's
    measured effective ratio and clock at the budget, relative to the arm the plan's baseline runs as (``base_arm``;
    ``auto_base`` for an ``auto`` arm's own plan: plain GRPO as its config overlaps it) and in seconds (the seed
    mean). ``compositions``: arm -> the candidate that predicts it; the arms in ``sequential`` run it one after the
    other (``-sync``), predicted as the sum of its parts where the plan overlapped it (rlcore/plan.py); an ``auto``
    arm is predicted by its own plan's choice (each seed's mean; a plan of an earlier version, without its seconds,
    gives none)."""
    by_name = {p["name"]: p for p in [plan["baseline"], *plan["predictions"]]}
    walls = {r["name"]: r["budget"]["wall_s"] for r in result["configurations"] if "budget" in r}
    out, unmeasured = [], []
    for r in result["configurations"]:
        if "budget" not in r:
            continue
        pred = by_name.get(compositions.get(r["name"]) or "")
        against = base_arm
        if pred is not None and r["name"] in sequential:
            pred = one_after_the_other(pred, plan)
        if r["name"] == "auto" or r["name"].startswith("auto-"):
            against = auto_base
            chosen = [x.summary["plan"] for x in runs if x.name == r["name"] and x.ok and x.summary.get("plan")]
            if chosen:
                pred = {"name": ",".join(sorted({c["choice"] for c in chosen})),
                        "clock": statistics.fmean(c.get("predicted_clock_with_plan", c.get("predicted_clock"))
                                                  for c in chosen),
                        "effective_ratio": statistics.fmean(c["predicted_effective_ratio"] for c in chosen),
                        "train_s": statistics.fmean(c["predicted_seconds"] for c in chosen)
                        if all("predicted_seconds" in c for c in chosen) else None}
        if pred is None:
            continue
        base = walls.get(against)
        out.append({"arm": r["name"], "composition": pred["name"], "predicted_ratio": pred["effective_ratio"],
                    "measured_ratio": r["effective_ratio"]["mean"], "predicted_clock": pred["clock"],
                    "measured_clock": _ratio(r["budget"]["wall_s"], base) if base else None, "clock_against": against,
                    "predicted_s": pred.get("train_s"), "measured_s": r["budget"].get("wall_s")})
        if not base:
            unmeasured.append(out[-1])
    # the arm a clock is predicted against did not run (--quick runs no overlapped `grpo`): both clocks against the
    # benchmark's baseline instead, from the seconds predicted for each arm and for the baseline
    ref = next((c for c in out if c["arm"] == result["baseline"] and c["predicted_s"] and c["measured_s"]), None)
    for c in unmeasured:
        if ref is not None and c["predicted_s"] is not None:
            c |= {"predicted_clock": c["predicted_s"] / ref["predicted_s"],
                  "measured_clock": _ratio(c["measured_s"], ref["measured_s"]), "clock_against": ref["arm"]}
    return out


def one_after_the_other(pred: dict, plan: dict) -> dict:
    """A prediction of ``plan`` (``Plan.to_json``) for its composition run one after the other: a step the sum of its
    parts, its clock against the plan's baseline as predicted."""
    steps = (pred["train_s"] - pred["upfront_s"]) / pred["step_s"] if pred["step_s"] else 0.0
    step_s = pred["generate_s"] + pred["update_s"] + pred["forward_s"] + pred["fixed_s"]
    train_s = pred["upfront_s"] + steps * step_s
    base = plan["baseline"]["train_s"]
    return pred | {"step_s": step_s, "train_s": train_s, "clock": train_s / base if base else pred["clock"]}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def write_report(report_dir: Path, runs: list[BenchRun], result: dict, selections: dict[str, list[dict]],
                 meta: dict) -> list[Path]:
    """Write the table (md + json) and the three plots; returns the files."""
    report_dir.mkdir(parents=True, exist_ok=True)
    rows_by_name: dict[str, list[list[dict]]] = defaultdict(list)
    for r in runs:
        if r.ok:
            rows_by_name[r.name].append(r.rows)
    files = [plot_curves(result, report_dir / "accuracy_curves.png"),
             plot_effective(rows_by_name, report_dir / "effective_ratio.png"),
             plot_difficulty(selections, report_dir / "selected_difficulty.png")]
    md = "# rlsift benchmark\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n" + markdown(result)
    (report_dir / "results.md").write_text(md)
    (report_dir / "results.json").write_text(json.dumps({"meta": meta, **result}, indent=2, default=str))
    return [report_dir / "results.md", report_dir / "results.json", *files]
