"""The benchmark report's Markdown (``results.md``): the verdicts in plain words, then the verdict, results, cost,
per-level, step-time, overlap and plan tables, from the aggregates :func:`tasks.bench.report.analyse` returns."""

from __future__ import annotations

import math

from tasks.bench import analysis as ba
from tasks.bench import comparison as bc


def _f(x, fmt: str = ".3f", none: str = "-") -> str:
    """A table cell's number: ``none`` for None or NaN, ``inf`` for infinity, else ``format(x, fmt)``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def _x(x) -> str:
    """A clock ratio's cell: ``0.52x``, or ``-`` where there is none."""
    cell = _f(x, ".2f")
    return cell if cell == "-" else f"{cell}x"


def plain_markdown(result: dict) -> list[str]:
    """One sentence per arm: its clock to the baseline's final accuracy and its final accuracy against the
    baseline's, each said to be decided or not by the figures (Welch interval over seeds; paired McNemar). The
    clock is read on the arm's seed-mean curve: where that curve never gets there, the sentence says so and how many
    seeds did on their own, whatever the per-seed verdict."""
    rows = [r for r in result["configurations"] if r.get("verdicts")]
    if not rows:
        return []
    base = result["baseline"]
    lines = [f"What the figures say, against `{base}`:", ""]
    for r in rows:
        clock = r["verdicts"]["final"]["wall_s"]
        target = (r.get("to_target") or {}).get("final") or {}
        speedup, seeds = target.get("speedup"), target.get("per_seed")
        verdict = clock["verdict"] or "one seed: no interval, so the clock is not decided"
        if verdict.startswith("not reached"):
            when = f"did not reach `{base}`'s final accuracy on every seed ({verdict})"
        elif not speedup:
            counted = verdict.startswith("no interval:")  # the verdict gives the seeds that got there already
            alone = f"; {seeds['reached']} of {seeds['seeds']} seeds did on their own" if seeds and not counted else ""
            when = f"did not reach `{base}`'s final accuracy on its seed-mean curve ({verdict}{alone})"
        else:
            when = f"reached `{base}`'s final accuracy at {1 / speedup:.2f}x its clock ({verdict})"
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
                         " | ".join(cell(v[m]) for m in bc.MEASURES) + f" | {paired if key == 'final' else ''} |")
    return lines + [""]


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
    lines += informative_markdown(result)
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


def informative_markdown(result: dict) -> list[str]:
    """Rollouts generated per informative group trained (seed mean over each run's steps), and against the
    baseline's on the same seeds: what a rollout buys (per-prompt budgets, selection and the skip all lower it)."""
    rows = [r for r in result["configurations"]
            if math.isfinite((r.get("rollouts_per_informative") or {}).get("mean", math.nan))]
    if not rows:
        return []
    lines = ["", f"Rollouts generated per informative group trained (seed mean), against `{result['baseline']}`'s:",
             "", "| configuration | rollouts per informative group | vs baseline | effective ratio |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {_f(r['rollouts_per_informative']['mean'], '.2f')} | "
                     f"{_f(r.get('rollouts_per_informative_vs_baseline'), '.2f')} | "
                     f"{_f(r['effective_ratio']['mean'], '.2f')} |")
    return lines


def level_markdown(result: dict) -> list[str]:
    """Per configuration and difficulty level: greedy accuracy at the start and the end (seed means), the prompts
    that turned right and wrong pooled over seeds, the exact McNemar p and the verdict (``bc.level_change``)."""
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
    below = {r["name"]: [c["level"] for c in r["levels"] if c["verdict"] == bc.BELOW_START] for r in rows}
    slipped = "; ".join(f"`{n}`: level {', '.join(map(str, lv))}" for n, lv in below.items() if lv)
    return lines + ["", f"Levels significantly below their start: {slipped or 'none'}."]


def overlap_markdown(result: dict) -> list[str]:
    """The overlapped arms' step against the overlap's limit (the slower of draw and update, both measured in the
    overlapped run; tasks/bench/analysis.py ``overlap_split``)."""
    rows = [r for r in result["configurations"] if r.get("overlap")]
    if not rows:
        return []
    lines = ["", "Overlapped arms (steps without an evaluation or one just before, seed mean, seconds): the step "
             "against its limit, the slower of the next step's draw and this step's update, and each side's idle "
             "time:", "",
             "| configuration | step | draw | update | limit | step / limit | trainer idle | generator idle |",
             "|" + "---|" * 8]
    for r in rows:
        o = r["overlap"]
        lines.append(f"| {r['name']} | " + " | ".join(_f(o.get(k), ".3f") for k in (
            "step", "draw", "update", "limit")) + f" | {_f(o.get('step_vs_limit'), '.2f')} | "
            f"{_f(o.get('trainer_idle'), '.3f')} | {_f(o.get('generator_idle'), '.3f')} |")
    return lines


def plan_markdown(result: dict) -> list[str]:
    """The plan's predictions against the measurements (:func:`plan_check`)."""
    rows = result.get("plan_check")
    if not rows:
        return []
    against = sorted({f"`{c['clock_against']}`" for c in rows if c.get("clock_against")})
    lines = ["", "The plan's predictions (`rlsift plan` on this pool, before any arm ran) against the measurements: "
             "effective-group ratio (seed mean over steps) and training clock at the budget, relative to "
             f"{' or '.join(against) or 'the baseline'} (the arm the plan's clock is against where it ran, else "
             "the benchmark's baseline by the seconds predicted for both) and in seconds (seed mean).", "",
             "| arm | predicted as | ratio predicted | ratio measured "
             "| clock predicted | clock measured | clock error | seconds predicted | seconds measured | "
             "seconds error |", "|" + "---|" * 10]

    def error(predicted: float | None, measured: float | None) -> str:
        return f"{predicted / measured - 1:+.0%}" if predicted is not None and measured else "-"

    for c in rows:
        lines.append(f"| {c['arm']} | {c['composition']} | {_f(c['predicted_ratio'], '.2f')} | "
                     f"{_f(c['measured_ratio'], '.2f')} | {_x(c['predicted_clock'])} | "
                     f"{_x(c['measured_clock'])} | {error(c['predicted_clock'], c['measured_clock'])} | "
                     f"{_f(c.get('predicted_s'), '.1f')} | {_f(c.get('measured_s'), '.1f')} | "
                     f"{error(c.get('predicted_s'), c.get('measured_s'))} |")
    return lines
