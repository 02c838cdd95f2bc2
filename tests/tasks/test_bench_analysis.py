"""Tests of the benchmark arithmetic (tasks/bench/analysis.py), its verdicts (comparison.py) and its report
(report.py, tables.py, plots.py) on hand-made curves and metric rows."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.bench.analysis import (
    Curve,
    accuracy_band,
    counted,
    curve_from_metrics,
    first_crossing,
    mean_curve,
    mean_dicts,
    overlap_split,
    reach,
    series_mean,
    speedup,
    spread,
    step_split,
    targets,
    time_to_target,
)


def curve(acc, wall=None, steps=None):
    steps = steps or [5 * i for i in range(len(acc))]
    wall = wall or [10.0 * s for s in steps]
    return Curve(tuple(steps), tuple(float(w) for w in wall), tuple(100.0 * s for s in steps),
                 tuple(w / 3600 for w in wall), tuple(0.1 * w / 3600 for w in wall), tuple(acc))


def test_first_crossing_is_interpolation_free():
    # accuracies at steps 0, 5, 10, 15: 0.2, 0.35, 0.5, 0.45; target 0.4 -> first point >= 0.4 is step 10
    c = curve([0.2, 0.35, 0.5, 0.45])
    assert first_crossing(c, 0.4) == 2
    hit = time_to_target(c, 0.4)
    assert hit["step"] == 10 and hit["wall_s"] == 100.0 and hit["rollouts"] == 1000.0
    assert first_crossing(c, 0.2) == 0  # already there at the start: time 0
    assert time_to_target(c, 0.51) is None


def test_crossing_tolerates_float_rounding_of_means():
    # the target is a seed mean (0.1 + 0.2 + 0.3) / 3 = 0.20000000000000004 > 0.2 in floating point
    target = (0.1 + 0.2 + 0.3) / 3
    assert target > 0.2
    assert first_crossing(curve([0.0, 0.2]), target) == 1


def test_targets_from_mean_curve():
    # seed A: 0.2 0.6 0.5; seed B: 0.2 0.4 0.5 -> mean 0.2 0.5 0.5: final 0.5, best 0.99 * 0.5 = 0.495
    a, b = curve([0.2, 0.6, 0.5]), curve([0.2, 0.4, 0.5])
    t = targets([a, b])
    assert t["final"] == pytest.approx(0.5)
    assert t["best"] == pytest.approx(0.495)
    # best is the best of the MEAN curve (0.5), not of any single seed (0.6)
    assert targets([a])["best"] == pytest.approx(0.99 * 0.6)
    with pytest.raises(ValueError, match="best_frac"):
        targets([a], best_frac=0)


def test_mean_curve_on_common_steps():
    # wall differs by seed: mean of 10 and 30 is 20 at step 5; step 10 only in the first -> dropped
    a = curve([0.0, 0.4, 0.8], wall=[0, 10, 20], steps=[0, 5, 10])
    b = curve([0.2, 0.6], wall=[0, 30], steps=[0, 5])
    m = mean_curve([a, b])
    assert m.steps == (0, 5)
    assert m.accuracy == pytest.approx((0.1, 0.5))
    assert m.wall_s == pytest.approx((0.0, 20.0))
    band = accuracy_band([a, b])
    assert band["lo"] == pytest.approx([0.0, 0.4]) and band["hi"] == pytest.approx([0.2, 0.6])
    with pytest.raises(ValueError, match="no evaluation step"):
        mean_curve([curve([0.1], steps=[1]), curve([0.1], steps=[2])])


def test_reach_and_speedup():
    # baseline reaches 0.5 at step 10 (wall 100); config at step 5 (wall 40): speed-up 2.5
    base = curve([0.2, 0.4, 0.5])
    fast = curve([0.2, 0.5, 0.6], wall=[0, 40, 80])
    slow = curve([0.2, 0.3, 0.4])
    assert speedup(time_to_target(base, 0.5)["wall_s"], time_to_target(fast, 0.5)["wall_s"]) == pytest.approx(2.5)
    assert speedup(100.0, None) is None
    assert speedup(0.0, 0.0) == 1.0 and speedup(5.0, 0.0) == math.inf
    r = reach([fast, slow], 0.5)
    assert r == {"reached": 1, "seeds": 2, "step_mean": 5, "wall_s_mean": 40.0}


def test_spread():
    # 0.4, 0.5, 0.6: mean 0.5, sample std sqrt(((0.1^2) * 2) / 2) = 0.1
    s = spread([0.4, 0.5, 0.6])
    assert s["mean"] == pytest.approx(0.5) and s["std"] == pytest.approx(0.1)
    assert (s["min"], s["max"], s["n"]) == (0.4, 0.6, 3)
    assert spread([0.3])["std"] == 0.0
    assert spread([])["n"] == 0 and math.isnan(spread([])["mean"])


def test_counted_stages():
    assert counted("rollout") and counted("reference") and counted("tracking") and counted("calibrate")
    assert not counted("eval_during") and not counted("eval_start") and not counted("prepare")
    assert not counted("ingest") and not counted("score", skip={"score"})


def rows_fixture():
    # Three steps, eval every 2 steps (row step 1 -> point at step 2), calibrate 2 s + score 1 s upfront.
    # Cumulative stage seconds per row; eval_during and prepare must never count.
    base = {"time/ingest_s": 0.5, "time/prepare_s": 30.0, "time/eval_start_s": 2.0,
            "time/calibrate_s": 2.0, "time/score_s": 1.0}
    return [
        {"step": 0, **base, "time/rollout_s": 1.0, "time/update_s": 2.0, "time/tracking_s": 0.0,
         "time/step_s": 3.0, "rollout/generated": 64.0, "select/reference_rollouts": 32.0,
         "cost/rollout_device_hours": 1.0 / 3600, "cost/update_device_hours": 2.0 / 3600},
        {"step": 1, **base, "time/rollout_s": 2.0, "time/update_s": 4.0, "time/tracking_s": 0.1,
         "time/eval_during_s": 5.0, "time/step_s": 8.0, "rollout/generated": 64.0, "eval/accuracy": 0.25},
        {"step": 2, **base, "time/rollout_s": 3.0, "time/update_s": 6.0, "time/tracking_s": 0.2,
         "time/eval_during_s": 5.0, "time/checkpoint_s": 0.3, "time/step_s": 3.0, "rollout/generated": 64.0},
    ]


def test_curve_from_metrics_hand_worked():
    rows = rows_fixture()
    c = curve_from_metrics(rows, 0.1, upfront_rollouts=16, end_step=3, end_accuracy=0.5)
    assert c.steps == (0, 2, 3)
    assert c.accuracy == (0.1, 0.25, 0.5)
    # step 0: calibrate 2 + score 1 = 3; step 2: 3 + rollout 2 + update 4 + tracking 0.1 = 9.1 (eval 5 left out)
    # step 3: 3 + 3 + 6 + 0.2 + checkpoint 0.3 = 12.5
    assert c.wall_s == pytest.approx((3.0, 9.1, 12.5))
    # rollouts: 16 upfront; + 64 + 32 reference + 64 = 176 at step 2; + 64 = 240 at step 3
    assert c.rollouts == (16.0, 176.0, 240.0)
    # GRPO does not pay for calibrate/score: skip them -> 0, 6.1, 9.5
    g = curve_from_metrics(rows, 0.1, skip={"calibrate", "score"}, end_step=3, end_accuracy=0.5)
    assert g.wall_s == pytest.approx((0.0, 6.1, 9.5))
    # without an end evaluation the curve stops at the last scheduled one
    assert curve_from_metrics(rows, 0.1).steps == (0, 2)
    # these rows log no rollout/tokens (as TRL's do not): no token counts, not zeros that would look fast
    assert c.tokens == ()
    assert curve_from_metrics([{**r, "rollout/tokens": 10.0} for r in rows], 0.1, end_step=3,
                              end_accuracy=0.5).tokens == (0.0, 20.0, 30.0)


def test_curve_device_hours_follow_the_same_stages():
    rows = rows_fixture()
    rows[1]["cost/eval_during_device_hours"] = 99.0  # never counted
    rows[1]["cost/rollout_device_hours"] = 2.0 / 3600
    rows[1]["cost/update_device_hours"] = 4.0 / 3600
    c = curve_from_metrics(rows, 0.0)
    assert c.device_hours[1] == pytest.approx(6.0 / 3600)


def test_step_split_per_step_means():
    # last row (3 steps): rollout 3/3 = 1, update 6/3 = 2, tracking 0.2/3, checkpoint 0.3/3; upfront totals
    s = step_split(rows_fixture())
    assert s["rollout"] == pytest.approx(1.0) and s["update"] == pytest.approx(2.0)
    assert s["checkpoint"] == pytest.approx(0.1) and s["reference"] == 0.0
    assert s["calibrate_total"] == 2.0 and s["score_total"] == 1.0 and s["other"] == 0.0
    assert "score_total" not in step_split(rows_fixture(), skip={"score"})


def test_series_and_dict_means():
    a = [{"step": 0, "k": 0.5}, {"step": 1, "k": 1.0}]
    b = [{"step": 0, "k": 0.0}]
    assert series_mean([a, b], "k") == ([0], [0.25])
    assert mean_dicts([{"x": 1.0, "y": 2.0}, {"x": 3.0}]) == {"x": 2.0, "y": 2.0}


def test_curve_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        curve([0.1, 0.2], steps=[5, 5])
    with pytest.raises(ValueError, match="at least one"):
        Curve((), (), (), (), (), ())


@given(st.lists(st.floats(0, 1), min_size=1, max_size=20), st.floats(0, 1))
def test_crossing_matches_slow_loop(acc, target):
    c = curve(acc)
    i = first_crossing(c, target)
    oracle = next((j for j in range(len(acc)) if acc[j] >= target - 1e-9), None)
    assert i == oracle
    if i is not None:
        assert all(a < target - 1e-9 for a in acc[:i])


def test_compare_times_hand_worked():
    """Baseline 100/110/120 s, arm 40/50/60 s: difference -60, Welch se sqrt(100/3 + 100/3) = 8.165 with 4 degrees
    of freedom (t = 2.776): interval -60 +- 22.67, all below 0 -> faster; ratio 50/110."""
    from tasks.bench.comparison import FASTER, SAME, compare_times

    v = compare_times([100.0, 110.0, 120.0], [40.0, 50.0, 60.0])
    assert v["verdict"] == FASTER and v["diff"] == pytest.approx(-60.0)
    assert v["ci"] == pytest.approx([-82.67, -37.33], abs=0.01) and v["ratio"] == pytest.approx(50 / 110)
    assert compare_times([100.0, 110.0, 120.0], [95.0, 115.0, 125.0])["verdict"] == SAME
    assert compare_times([40.0, 50.0, 60.0], [100.0, 110.0, 120.0])["verdict"] == "slower"
    assert compare_times([1.0, 2.0, 3.0], [None, 1.0, 1.0])["verdict"] == "not reached (2/3 seeds)"
    assert compare_times([5.0], [1.0])["verdict"] == "one seed: no interval"
    assert compare_times([5.0, None], [1.0, 2.0])["verdict"] == "no interval: 2 of 2 seeds reached it, 1 of 2 of " \
        "the baseline's"  # which side lacks the second seed
    assert compare_times([5.0, 5.0], [1.0, 1.0])["ci"] == [-4.0, -4.0]  # no spread: the interval is the point


def test_mcnemar_pooled_hand_worked():
    """Seed 1: 2 turned right, 1 wrong of 4; seed 2: 2 right of 2 -> 4/1 discordant, diff 3/6,
    p = P(X >= 4) + P(X <= 1) for X ~ Bin(5, 1/2) = 12/32."""
    from tasks.bench.comparison import mcnemar_pooled

    r = mcnemar_pooled([([1, 0, 0, 1], [1, 1, 1, 0]), ([0, 0], [1, 1])])
    assert (r["turned_right"], r["turned_wrong"], r["prompts"]) == (4, 1, 6)
    assert r["diff"] == pytest.approx(0.5) and r["p"] == pytest.approx(12 / 32)
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar_pooled([([1], [1, 0])])


def test_verdict_table_comes_first_in_the_report():
    from tasks.bench.report import BenchRun, analyse
    from tasks.bench.tables import markdown

    def run(name, seed, accs, correct):
        rows = [{"step": 5 * i + 4, "eval/accuracy": a, "time/rollout_s": 10.0 * (i + 1),
                 "rollout/generated": 80.0, "rollout/tokens": 800.0} for i, a in enumerate(accs)]
        return BenchRun(name, seed, {"status": "completed", "eval_accuracy_start": 0.2, "steps": 5 * len(accs),
                                     "eval_accuracy_end": accs[-1]}, rows, end_correct=correct, end_prompts=("a", "b"))

    runs = [run("grpo", s, [0.3, 0.4, 0.5], (1, 0)) for s in (0, 1)] + \
           [run("fast", s, [0.5, 0.55, 0.55], (1, 1)) for s in (0, 1)]
    md = markdown(analyse(runs))
    assert md.startswith("What the figures say, against `grpo`:\n\n- `fast` reached `grpo`'s final accuracy at 0.33x "
                         "its clock (faster) and ended +50.0 points from it")
    assert "\nVerdicts against `grpo`" in md
    assert "| fast | (a) final | faster (0.33x) | faster (0.33x) | faster (0.33x) | faster (0.33x) | +0.500 (2/0" in md


def test_step_table_totals_and_ratio_to_trl():
    from tasks.bench.report import BenchRun, analyse
    from tasks.bench.tables import markdown

    def run(name, rollout_s, update_s):  # 4 steps; cumulative seconds 4x the per-step figures at the last row
        rows = [{"step": i, "eval/accuracy": 0.3 + 0.1 * i, "time/rollout_s": rollout_s * (i + 1),
                 "time/update_s": update_s * (i + 1), "rollout/generated": 8.0, "rollout/tokens": 80.0}
                for i in range(4)]
        return BenchRun(name, 0, {"status": "completed", "eval_accuracy_start": 0.2, "steps": 4,
                                  "eval_accuracy_end": 0.6}, rows, end_correct=(1, 0), end_prompts=("a", "b"))

    md = markdown(analyse([run("grpo", 0.5, 0.7), run("trl", 1.0, 1.0)]))
    grpo_line = next(ln for ln in md.splitlines() if ln.startswith("| grpo | 0.000 | 0.000 | 0.500"))
    assert "| 1.200 | 0.60 |" in grpo_line  # 0.5 + 0.7 s a step against TRL's 2.0
    assert "| 2.000 | 1.00 |" in next(ln for ln in md.splitlines() if ln.startswith("| trl | 0.000"))


def test_level_change_hand_worked():
    """Two seeds over prompts of levels 1, 1, 2, 2, 2. Level 1: start 1, 1 in both seeds; end 0, 0 in both -> 4
    turned wrong, none right, p = 2 * (1/2)^4 = 0.125: not significant at 0.05, so "no different" although the
    mean fell from 1 to 0. Level 2: 6 of 6 turned right, p = 2 * (1/2)^6 = 1/32 -> "above start"."""
    from tasks.bench.comparison import ABOVE_START, SAME, level_change

    levels, start, end = (1, 1, 2, 2, 2), (1, 1, 0, 0, 0), (0, 0, 1, 1, 1)
    lv1, lv2 = level_change([(levels, start, end), (levels, start, end)])
    assert (lv1["level"], lv1["prompts"], lv1["start"], lv1["end"]) == (1, 2, 1.0, 0.0)
    assert (lv1["turned_right"], lv1["turned_wrong"], lv1["verdict"]) == (0, 4, SAME)
    assert lv1["p"] == pytest.approx(0.125)
    assert (lv2["turned_right"], lv2["turned_wrong"], lv2["verdict"]) == (6, 0, ABOVE_START)
    assert lv2["p"] == pytest.approx(1 / 32)
    with pytest.raises(ValueError, match="differ in length"):
        level_change([((1, 2), (1, 1), (1,))])


def test_level_change_flags_a_slipped_level_and_orders_levels_none_last():
    from tasks.bench.comparison import BELOW_START, SAME, level_change

    n = 12  # 12 solved prompts of level 1 all turn wrong: p = 2 * (1/2)^12, far below 0.05
    levels, start, end = (None, 3) + (1,) * n, (0, 0) + (1,) * n, (0, 1) + (0,) * n
    cells = level_change([(levels, start, end)])
    assert [c["level"] for c in cells] == [1, 3, None]
    assert cells[0]["verdict"] == BELOW_START and cells[0]["p"] == pytest.approx(2 * 0.5 ** n)
    assert cells[1]["verdict"] == SAME and cells[1]["end"] == 1.0  # one prompt turned right: p = 1


def test_report_reads_levels_from_the_evaluations_and_tables_them(tmp_path):
    from tasks.bench.report import BenchRun, analyse, attach_evals
    from tasks.bench.tables import markdown
    from tasks.evaluation.heldout import EvalCell, EvalResult

    def save(run_dir, phase, correct, levels=(1,) * 8 + (2,) * 2):
        cell = EvalCell(n=len(correct), greedy_acc=sum(correct) / len(correct))
        EvalResult(overall=cell, by_level={}, by_source={}, k=0, prompt_ids=tuple(f"p{i}" for i in range(10)),
                   greedy_correct=tuple(correct), levels=levels).save(run_dir / f"eval_{phase}.json")

    runs = []
    for name, end in (("grpo", (1,) * 8 + (1, 1)), ("slips", (0,) * 8 + (1, 1))):
        d = tmp_path / name
        d.mkdir()
        save(d, "start", (1,) * 8 + (0, 0))
        save(d, "end", end)
        rows = [{"step": 4, "eval/accuracy": sum(end) / 10, "time/rollout_s": 1.0, "rollout/generated": 8.0}]
        run = BenchRun(name, 0, {"status": "completed", "eval_accuracy_start": 0.8, "steps": 5,
                                 "eval_accuracy_end": sum(end) / 10, "run_dir": str(d)}, rows)
        attach_evals(run)
        runs.append(run)
    assert runs[1].levels == (1,) * 8 + (2,) * 2 and runs[1].start_correct == (1,) * 8 + (0, 0)
    md = markdown(analyse(runs))
    assert "| slips | 1 | 8 | 1.000 | 0.000 | -1.000 | 0 / 8 | 0.0078 | below start |" in md
    assert "| grpo | 2 | 2 | 0.000 | 1.000 | +1.000 | 2 / 0 | 0.5 | no different |" in md
    assert "Levels significantly below their start: `slips`: level 1." in md


def test_report_leaves_levels_out_of_evaluations_without_them(tmp_path):
    """Evaluations written before levels were recorded: no per-level table, the rest of the report as before."""
    from tasks.bench.report import BenchRun, analyse, attach_evals
    from tasks.bench.tables import markdown
    from tasks.evaluation.heldout import EvalCell, EvalResult

    cell = EvalCell(n=2, greedy_acc=0.5)
    for phase in ("start", "end"):
        EvalResult(overall=cell, by_level={}, by_source={}, k=0, prompt_ids=("a", "b"),
                   greedy_correct=(1, 0)).save(tmp_path / f"eval_{phase}.json")
    run = BenchRun("grpo", 0, {"status": "completed", "eval_accuracy_start": 0.5, "steps": 5,
                               "eval_accuracy_end": 0.5, "run_dir": str(tmp_path)},
                   [{"step": 4, "eval/accuracy": 0.5, "time/rollout_s": 1.0, "rollout/generated": 8.0}])
    attach_evals(run)
    assert run.end_correct == (1, 0) and run.levels == ()
    assert "Per level" not in markdown(analyse([run]))


def test_every_configuration_gets_its_own_colour_in_the_curves(tmp_path, monkeypatch):
    """The full ablation plots every preset, every leave-one-out arm and TRL; matplotlib's default cycle would
    repeat colours after 10."""
    import matplotlib.pyplot as plt

    from flows.bench_arms import ablation
    from tasks.bench import plots

    curve = {"wall_s": [0, 1], "rollouts": [0, 8], "steps": [0, 1], "mean": [0.2, 0.3], "lo": [0.2, 0.3],
             "hi": [0.2, 0.3]}
    names = [*ablation(), "trl"]
    result = {"targets": {"final": 0.3}, "configurations": [{"name": n, "seeds": [0], "curve": curve} for n in names]}
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its lines
    plots.plot_curves(result, tmp_path / "curves.png")
    lines = [ln for ln in figures[0].axes[0].get_lines() if ln.get_label() in names]
    assert len({ln.get_color() for ln in lines}) == len(names)
    assert [ln.get_linestyle() for ln in lines if ln.get_label() == "trl"] == ["--"]
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_write_report_writes_every_file_and_plots_the_completed_runs_ratio(tmp_path, monkeypatch):
    """The effective-ratio plot has one line per configuration with a completed run (a failed run is left out),
    at the seed mean of each step's ratio."""
    import matplotlib.pyplot as plt

    from tasks.bench.report import BenchRun, analyse, write_report

    def run(name, seed, ratios, status="completed"):
        rows = [{"step": i, "eval/accuracy": 0.3, "time/rollout_s": 1.0 + i, "rollout/generated": 8.0,
                 "train/effective_ratio": r} for i, r in enumerate(ratios)]
        return BenchRun(name, seed, {"status": status, "eval_accuracy_start": 0.2, "steps": len(ratios),
                                     "eval_accuracy_end": 0.3}, rows)

    runs = [run("grpo", 0, [0.2, 0.4]), run("grpo", 1, [0.4, 0.6]), run("dots", 0, [0.5, 0.5]),
            run("broken", 0, [0.9, 0.9], status="failed")]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figures to look at their lines
    files = write_report(tmp_path, runs, analyse(runs), {"grpo": [{"round": 0, "level": 1, "pred_success": None}]},
                         {"seeds": 2})
    assert [f.name for f in files] == ["results.md", "results.json", "accuracy_curves.png", "effective_ratio.png",
                                       "selected_difficulty.png"]
    assert all(f.stat().st_size > 0 for f in files)
    lines = {ln.get_label(): ln for ln in figures[1].axes[0].get_lines()}
    assert set(lines) == {"grpo", "dots"}
    assert list(lines["grpo"].get_xdata()) == [1, 2]
    assert list(lines["grpo"].get_ydata()) == pytest.approx([0.3, 0.5])  # seed means; too few steps to smooth
    assert (tmp_path / "results.md").read_text().startswith("# rlsift benchmark\n\n- seeds: 2\n")


def test_overlap_split_is_the_step_against_the_slower_side_hand_worked():
    """Two overlapped steps (the evaluation step, the step after it, whose generator waited for the evaluation, and
    a sequential run's rows are left out): limit = mean of max(draw, update) = (0.5 + 0.4) / 2, step / limit =
    0.55 / 0.45."""
    rows = [{"step": 0, "time/step_s": 0.6, "overlap/draw_s": 0.5, "overlap/update_s": 0.3,
             "overlap/trainer_idle_s": 0.2, "overlap/generator_idle_s": 0.0},
            {"step": 1, "time/step_s": 0.5, "overlap/draw_s": 0.2, "overlap/update_s": 0.4,
             "overlap/trainer_idle_s": 0.0, "overlap/generator_idle_s": 0.1},
            {"step": 2, "time/step_s": 9.0, "overlap/draw_s": 0.2, "overlap/update_s": 0.4, "eval/accuracy": 0.5,
             "overlap/trainer_idle_s": 0.0, "overlap/generator_idle_s": 0.1},
            {"step": 3, "time/step_s": 0.6, "overlap/draw_s": 0.2, "overlap/update_s": 0.4,
             "overlap/trainer_idle_s": 0.0, "overlap/generator_idle_s": 4.0},
            {"step": 4, "time/step_s": 0.7}]
    out = overlap_split(rows)
    assert out["limit"] == pytest.approx(0.45) and out["step"] == pytest.approx(0.55)
    assert out["step_vs_limit"] == pytest.approx(0.55 / 0.45)
    assert out["draw"] == pytest.approx(0.35) and out["update"] == pytest.approx(0.35)
    assert out["trainer_idle"] == pytest.approx(0.1) and out["generator_idle"] == pytest.approx(0.05)
    assert overlap_split([{"step": 0, "time/step_s": 0.7}]) == {}


def test_rollouts_per_informative_group_hand_worked_and_against_the_baseline():
    """GRPO: 256 rollouts a step for 0.4 x 32 = 12.8 informative groups (20 each); waves: 60 rollouts for 0.9 x 12
    = 10.8 (5.56 each, 0.28x GRPO's); TRL logs neither and is left out."""
    from tasks.bench.analysis import rollouts_per_informative
    from tasks.bench.report import BenchRun, analyse
    from tasks.bench.tables import markdown

    def run(name, generated, ratio, groups):
        rows = [{"step": i, "eval/accuracy": 0.3 + 0.1 * i, "time/rollout_s": 1.0 * (i + 1),
                 "rollout/generated": generated, "rollout/tokens": 10 * generated, "train/effective_ratio": ratio,
                 "train/groups": groups} for i in range(2)]
        return BenchRun(name, 0, {"status": "completed", "eval_accuracy_start": 0.2, "steps": 2,
                                  "eval_accuracy_end": 0.4}, rows, end_correct=(1, 0), end_prompts=("a", "b"))

    assert rollouts_per_informative(run("grpo", 256.0, 0.4, 32.0).rows) == pytest.approx(20.0)
    assert rollouts_per_informative([{"step": 0, "eval/accuracy": 0.1}]) is None
    result = analyse([run("grpo", 256.0, 0.4, 32.0), run("waves", 60.0, 0.9, 12.0)])
    waves = next(r for r in result["configurations"] if r["name"] == "waves")
    assert waves["rollouts_per_informative_vs_baseline"] == pytest.approx(60 / 10.8 / 20)
    assert "| waves | 5.56 | 0.28 | 0.90 |" in markdown(result)
