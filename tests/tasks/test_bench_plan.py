"""The benchmark's plan check (tasks/bench/report.py), its plain verdicts (tables.py) and which arms the plan
predicts."""

from types import SimpleNamespace

import pytest

from flows.bench_arms import composition_of, plan_base, preset_overrides
from tasks.bench.report import plan_check
from tasks.bench.tables import plain_markdown, plan_markdown


def test_which_composition_predicts_an_arm():
    assert composition_of("grpo-sync") == "grpo" and composition_of("dots_screen") == "dots_screen"
    assert composition_of("dapo-sync") == "dapo"
    assert composition_of("auto") is None and composition_of("trl") is None and composition_of("all-pods") is None


def test_the_arms_are_predicted_at_the_lag_they_run():
    """Overlapped arms are predicted overlapped (the screen ahead, the rounds started ahead, hidden where the trainer
    is on an accelerator); with a -sync arm besides the baseline every arm is predicted sequentially."""
    from tasks.config.load import load_config, with_overrides
    from tasks.plan.planner import candidate_config, composition

    assert plan_base(["grpo-sync", "auto", "dots_screen"]) == "grpo"
    assert plan_base(["grpo-sync", "dots_screen", "dots_screen-sync"]) == "grpo-sync"
    cfg = load_config(None)
    ahead = {base: composition("s", candidate_config(with_overrides(cfg, preset_overrides(base)),
                                                     "dots_screen_round_ahead"), device="cuda")
             for base in ("grpo", "grpo-sync")}
    assert (ahead["grpo"].screen_ahead, ahead["grpo"].round_ahead) == (True, True)
    assert (ahead["grpo-sync"].screen_ahead, ahead["grpo-sync"].round_ahead) == (False, False)


def row(name, ratio, wall, paired_p=0.5, diff=-0.004, verdict="faster", speedup=2.0):
    return {"name": name, "budget": {"wall_s": 40.0 * wall}, "effective_ratio": {"mean": ratio},
            "wall_vs_baseline": wall,
            "to_target": {"final": {"speedup": speedup}},
            "verdicts": {"final": {"wall_s": {"verdict": verdict}},
                         "final_paired": {"p": paired_p, "diff": diff}}}


PLAN = {"baseline": {"name": "grpo", "effective_ratio": 0.45, "clock": 1.0, "train_s": 32.0},
        "predictions": [{"name": "dapo", "effective_ratio": 1.0, "clock": 2.2, "train_s": 70.4},
                        {"name": "dots_screen", "effective_ratio": 0.7, "clock": 0.4, "train_s": 12.8}]}


def test_plan_check_sets_predictions_beside_measurements():
    result = {"baseline": "grpo-sync", "configurations": [
        row("grpo-sync", 0.40, 1.0), row("dapo", 0.98, 2.5), row("auto", 0.6, 0.5), row("trl", 0.4, 2.3),
        {"name": "broken", "failed_seeds": [0]}]}
    runs = [SimpleNamespace(name="auto", ok=True, summary={"plan": {
        "choice": "dots_screen", "predicted_clock": 0.4, "predicted_effective_ratio": 0.7, "predicted_seconds": s}})
        for s in (19.0, 21.0)]
    got = plan_check(result, PLAN, {"grpo-sync": "grpo", "dapo": "dapo", "auto": None, "trl": None}, runs,
                     "grpo-sync", auto_base="grpo-sync")
    assert [(c["arm"], c["composition"]) for c in got] == [("grpo-sync", "grpo"), ("dapo", "dapo"),
                                                           ("auto", "dots_screen")]
    assert got[1] == {"arm": "dapo", "composition": "dapo", "predicted_ratio": 1.0, "measured_ratio": 0.98,
                      "predicted_clock": 2.2, "measured_clock": 2.5, "clock_against": "grpo-sync",
                      "predicted_s": 70.4, "measured_s": 100.0}
    table = "\n".join(plan_markdown({"plan_check": got}))
    # the ratio's error holds the baseline's too (predicted 32 s, measured 40 s); the seconds' error the arm's alone
    assert "| grpo-sync | grpo | 0.45 | 0.40 | 1.00x | 1.00x | +0% | 32.0 | 40.0 | -20% |" in table
    assert "| dapo | dapo | 1.00 | 0.98 | 2.20x | 2.50x | -12% | 70.4 | 100.0 | -30% |" in table
    # auto: each seed's own plan, the mean of its seconds (19 and 21 s)
    assert "| auto | dots_screen | 0.70 | 0.60 | 0.40x | 0.50x | -20% | 20.0 | 20.0 | +0% |" in table


def test_where_the_plans_baseline_arm_did_not_run_the_clocks_are_against_the_benchmarks_baseline():
    """--quick runs no overlapped `grpo`, the arm the plan's clocks are against: both clocks are then set against
    `grpo-sync` from the seconds (predicted 32 s for it, as the plan's own baseline; 40 s measured), not left blank."""
    result = {"baseline": "grpo-sync", "configurations": [row("grpo-sync", 0.40, 1.0), row("dapo", 0.98, 2.5),
                                                          row("auto", 0.6, 0.5)]}
    runs = [SimpleNamespace(name="auto", ok=True, summary={"plan": {
        "choice": "dots_screen", "predicted_clock": 0.4, "predicted_effective_ratio": 0.7, "predicted_seconds": 16.0}})]
    got = {c["arm"]: c for c in plan_check(result, PLAN, {"grpo-sync": "grpo", "dapo": "dapo", "auto": None},
                                           runs, "grpo", auto_base="grpo")}
    assert {a: (c["predicted_clock"], c["measured_clock"], c["clock_against"]) for a, c in got.items()} == {
        "grpo-sync": (1.0, 1.0, "grpo-sync"), "dapo": (70.4 / 32.0, 2.5, "grpo-sync"),
        "auto": (0.5, 0.5, "grpo-sync")}
    table = "\n".join(plan_markdown({"plan_check": list(got.values())}))
    assert "relative to `grpo-sync` (" in table and "-x" not in table
    assert "| auto | dots_screen | 0.70 | 0.60 | 0.50x | 0.50x | +0% | 16.0 | 20.0 | -20% |" in table


def test_plain_verdicts_say_when_the_figures_cannot_decide():
    result = {"baseline": "grpo-sync", "configurations": [
        row("auto", 0.6, 0.5), row("dapo", 1.0, 2.4, paired_p=0.01, diff=0.02, verdict="slower", speedup=0.4),
        row("one", 0.5, 0.9, verdict=None, speedup=1.25), row("late", 0.5, 1.2, verdict="not reached (1/3 seeds)")]}
    text = "\n".join(plain_markdown(result))
    assert ("`auto` reached `grpo-sync`'s final accuracy at 0.50x its clock (faster) and ended -0.4 points from it "
            "(p = 0.5: these figures cannot tell the accuracies apart).") in text
    assert "`dapo` reached `grpo-sync`'s final accuracy at 2.50x its clock (slower) and ended +2.0 points" in text
    assert "a real difference" in text
    assert "`one` reached `grpo-sync`'s final accuracy at 0.80x its clock (one seed: no interval" in text
    assert "`late` did not reach `grpo-sync`'s final accuracy on every seed (not reached (1/3 seeds))" in text


def test_an_arm_whose_seed_mean_curve_never_gets_there_is_not_said_to_reach_it():
    """One seed of two at the target on each side: the per-seed verdict has no interval, and the arm's seed-mean
    curve (what the clock is read on) ends under it, so the sentence must not say it got there."""
    half = row("auto", 0.7, 0.5, verdict="no interval: 1 of 2 seeds reached it, 1 of 2 of the baseline's",
               speedup=None)
    half["to_target"]["final"]["per_seed"] = {"reached": 1, "seeds": 2}
    text = "\n".join(plain_markdown({"baseline": "grpo-sync", "configurations": [half]}))
    assert ("`auto` did not reach `grpo-sync`'s final accuracy on its seed-mean curve (no interval: 1 of 2 seeds "
            "reached it, 1 of 2 of the baseline's) and ended -0.4 points from it") in text
    assert " reached `grpo-sync`'s final accuracy at" not in text
    # with an interval over seeds that each got there, the count comes with the sentence
    every = row("auto", 0.7, 0.5, verdict="no different", speedup=None)
    every["to_target"]["final"]["per_seed"] = {"reached": 3, "seeds": 3}
    text = "\n".join(plain_markdown({"baseline": "grpo-sync", "configurations": [every]}))
    assert "on its seed-mean curve (no different; 3 of 3 seeds did on their own)" in text


def test_a_sync_arm_is_predicted_one_after_the_other_and_each_clock_against_the_arm_its_baseline_runs():
    """The plan overlaps plain GRPO (its baseline, lag 1): the -sync arm is predicted as the sum of the step's parts,
    and every clock is measured against the overlapped `grpo` arm, the one the plan's baseline predicts."""
    parts = {"generate_s": 0.5, "update_s": 0.2, "forward_s": 0.0, "fixed_s": 0.01, "upfront_s": 0.0}
    plan = {"baseline": {"name": "grpo", "effective_ratio": 0.45, "clock": 1.0, "train_s": 55.0, "step_s": 0.55,
                         **parts}, "predictions": []}
    result = {"baseline": "grpo-sync", "configurations": [row("grpo-sync", 0.40, 1.0), row("grpo", 0.40, 0.8),
                                                          row("auto", 0.6, 0.4)]}
    runs = [SimpleNamespace(name="auto", ok=True, summary={"plan": {
        "choice": "grpo_prescreen", "predicted_clock": 0.5, "predicted_effective_ratio": 0.7,
        "predicted_seconds": 14.0}})]
    got = {c["arm"]: c for c in plan_check(result, plan, {"grpo-sync": "grpo", "grpo": "grpo", "auto": None}, runs,
                                           "grpo", frozenset({"grpo-sync"}))}
    assert got["grpo-sync"]["predicted_s"] == pytest.approx(100 * 0.71)  # 100 steps of the parts' sum
    assert got["grpo-sync"]["predicted_clock"] == pytest.approx(71.0 / 55.0)
    assert got["grpo-sync"]["measured_clock"] == pytest.approx(1.0 / 0.8)
    assert got["grpo"]["predicted_s"] == 55.0 and got["grpo"]["measured_clock"] == pytest.approx(1.0)
    assert got["auto"]["measured_clock"] == pytest.approx(0.4 / 0.8)
