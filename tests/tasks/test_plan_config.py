"""What a plan.auto run trains (tasks/plan/planner.py): the choice's keys over the run's own, from its record."""

import pytest

from rlcore.plan import Prediction
from rlcore.step_costs import CallCost, FixedCosts, UnitCosts
from tasks.config import ConfigError
from tasks.config.load import load_config, with_overrides
from tasks.plan.planner import candidate_config, composition, planned_config, reads_upfront
from tasks.plan.record import Plan, costs_from_json


def plan_choosing(name: str) -> Plan:
    p = Prediction(name, effective_ratio=0.5, signal=4, generated=32, generated_tokens=1, updated_tokens=1,
                   forward_tokens=0, step_s=1, upfront_s=5, train_s=15, clock=0.5)
    base = Prediction("grpo", effective_ratio=0.4, signal=4, generated=64, generated_tokens=1, updated_tokens=1,
                      forward_tokens=0, step_s=3, train_s=30, clock=1.0)
    costs = UnitCosts(generate=CallCost.fit([100, 400], [0.5, 0.8]), update=CallCost(0.01, 5e-5),
                      forward=CallCost(0.0, 2e-5), completion_tokens=20, prompt_tokens=10, solution_tokens=15,
                      fixed=FixedCosts(optimizer_s=0.002, step_s=0.03, round_s=0.05, fit_s=0.4), score_s=0.002)
    return Plan(shares={"solved": 0.2, "unsolved": 0.3, "mixed": 0.5}, g=8, costs=costs, baseline=base,
                predictions=(p,), unavailable={}, choice=name, reason=f"{name}: test", overrides=(), upfront_s=12)


def test_the_choice_replaces_the_composition_keys_and_keeps_the_rest(tmp_path):
    cfg = load_config("conf/presets/auto.yaml", ["train.steps=7", "data=balanced"])
    assert cfg.plan.auto and cfg.select.method == "uniform"
    screen = planned_config(cfg, plan_choosing("dots_screen"))
    assert (screen.select.method, screen.select.screen, screen.rollout.n, screen.train.prompts_per_step) == \
        ("dots", 2, 4, 20)
    assert not screen.plan.auto and not screen.adapt.enabled
    assert screen.train.steps == 7 and screen.data == cfg.data  # the run's own keys hold
    dots = planned_config(cfg, plan_choosing("dots"))  # replay: the adaptive composition turns it down in the run
    assert dots.replay.enabled and dots.adapt.enabled
    grpo = planned_config(cfg, plan_choosing("grpo"))
    assert grpo == load_config("conf/presets/grpo.yaml", ["train.steps=7", "data=balanced"])


def test_a_plan_round_trips_and_names_its_choice(tmp_path):
    plan = plan_choosing("dots_n4")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan and plan.chosen.name == "dots_n4"
    md = (tmp_path / "plan.md").read_text()
    assert "**Plan: dots_n4: test**" in md
    assert [r["composition"] for r in plan.rows()] == ["grpo", "dots_n4"]
    # the choice's training clock: its 10 s of steps and its predicted 5 s before them, over GRPO's 30 s; this run:
    # the same steps and the 12 s it spent before them
    clock = plan.clock
    assert (clock.choice, clock.training, clock.with_plan, clock.upfront_s) == \
        ("dots_n4", pytest.approx(15 / 30), pytest.approx((15 - 5 + 12) / 30), 12)
    assert plan.metrics()["plan/predicted_training_clock"] == clock.training
    assert plan.metrics()["plan/predicted_clock_with_plan"] == clock.with_plan
    assert ("This run: dots_n4: training clock predicted 0.50x plain GRPO's (its steps, calibration and scoring); "
            "0.73x with the plan's own cost (12 s before the first step: calibration and plan measured, scoring "
            "predicted).") in md
    # the costs say what a token costs at the probe's two calls (here it falls with the batch) and the fixed costs
    assert "a generated token 5000 us in a call of 100 tokens, 2000 us in one of 400 (falls with the batch)" in md
    assert "optimizer step 2.0 ms, bookkeeping 30.0 ms; a round's: checkpoint 50.0 ms, DOTS's predictor 400 ms" in md
    flat = UnitCosts(**{**plan.costs.__dict__, "generate": CallCost.fit([100, 400], [0.1, 0.41])})
    assert "(flat: within 15% at any batch)" in Plan(**{**plan.__dict__, "costs": flat}).summary()


def test_the_line_shows_this_runs_clock_with_the_plans_cost_once():
    """The choice weighed 0.60x with the 8 s spent by then (its reason says so); the run spent 12 s before its first
    step (the overlap's decision came after the choice): the terminal's line gives this run's 0.73x in that clause,
    once, not the choice's figure and then this run's."""
    from dataclasses import replace

    plan = plan_choosing("dots_n4")
    weighed = replace(plan, reason="dots_n4: predicted 0.50x plain GRPO's training clock, 0.60x with the plan's own "
                                   "8 s with 1.00x its informative contrasts a step")
    line = weighed.line()
    assert line == ("dots_n4: predicted 0.50x plain GRPO's training clock, 0.73x with the plan's own 12 s with 1.00x "
                    "its informative contrasts a step")
    assert line.count("with the plan's own") == 1
    # a reason without the clause gets it added after, as before
    assert plan.line() == "dots_n4: test; 0.73x with the plan's own cost (12 s before the first step)"


def test_a_plan_saved_before_the_calls_were_timed_still_loads():
    old = {"generate_s": 1e-4, "update_s": 5e-5, "forward_s": 0.0, "completion_tokens": 20.0, "prompt_tokens": 10.0,
           "solution_tokens": 15.0}
    costs = costs_from_json(old)
    assert costs.generate == CallCost(0.0, 1e-4) and costs.fixed == FixedCosts() and costs.score_s == 0.0
    base = Prediction("grpo", effective_ratio=0.4, signal=4, generated=64, generated_tokens=1, updated_tokens=1,
                      forward_tokens=0, step_s=2, clock=1.0)
    legacy = Plan(shares={}, g=8, costs=costs, baseline=base, predictions=(), unavailable={}, choice="grpo",
                  reason="grpo", overrides=())
    assert legacy.clock.training == legacy.clock.with_plan == 1.0  # no training clock saved: the choice's own


def test_composition_reads_what_a_config_does():
    cfg = load_config(None)
    c = composition("dots", candidate_config(cfg, "dots"), pool_size=2000)
    assert (c.draw, c.weighting, c.fresh_frac, c.prompts, c.n, c.m) == ("dots", "target", 0.5, 32, 8, 8)
    assert (c.steps, c.round_steps, c.chunk) == (150, 5, 512)
    # K x g fresh reference rollouts and the predictor's fit every round; the calibration and the scores before
    assert c.reference == (32, 8) and c.predictor and c.calibration == (32, 8) and c.scored == 2000
    pods = composition("pods", candidate_config(cfg, "pods"), pool_size=2000)
    assert (pods.n, pods.m, pods.reference, pods.predictor, pods.calibration, pods.scored) == (
        16, 8, (0, 0), False, (0, 0), 0)
    screen = composition("dots_screen", candidate_config(cfg, "dots_screen"))
    assert screen.reference == (0, 0) and screen.predictor  # calibrate.reference=trained: no fresh rollouts
    assert composition("dapo", candidate_config(cfg, "dapo")).dynamic == (2.0, 3)
    vllm = composition("grpo", with_overrides(cfg, ["rollout.engine=vllm"]))
    assert vllm.chunk == 0  # a server takes the draw in one request
    with pytest.raises(ConfigError, match="plan.candidates: nope"):
        candidate_config(cfg, "nope")


def test_the_prescreen_reaches_the_plan_and_the_training_through_its_registration_alone():
    """The seam (tasks/training/techniques.py): select.prescreen's one registration gives the plan a rule whose
    screen pass scores 3 candidates a prompt of the 6 drawn, and the training's selection the same technique as the
    order of its pass; a screen without it scores all 6 and has no order."""
    from rlcore.plan_draw import screened_per_prompt
    from rlcore.selection import Prescreen
    from tasks.training.techniques import screen_order
    cfg = load_config(None)
    pre_cfg = candidate_config(cfg, "grpo_prescreen")
    wide_cfg = with_overrides(pre_cfg, ["select.prescreen=0"])
    pre, wide = composition("grpo_prescreen", pre_cfg), composition("wide", wide_cfg)
    assert pre.screen == wide.screen == 6
    assert (screened_per_prompt(pre), screened_per_prompt(wide)) == (3, 6)
    assert [r.name for r in pre.rules] == ["prescreen"] and wide.rules == ()
    assert screen_order(pre_cfg) == Prescreen(3, pre_cfg.rollout.n, pre_cfg.select.prescreen_half_life)
    assert screen_order(wide_cfg) is None and screen_order(cfg) is None


def test_what_a_run_reads_before_training():
    cfg = load_config(None)
    assert reads_upfront(candidate_config(cfg, "grpo")) == {"score": False, "calibrate": False}
    assert reads_upfront(candidate_config(cfg, "dots")) == {"score": True, "calibrate": True}
    assert reads_upfront(candidate_config(cfg, "gain")) == {"score": True, "calibrate": False}
    assert reads_upfront(load_config("conf/presets/auto.yaml")) == {"score": True, "calibrate": True}


def test_a_cost_the_probe_cannot_trust_is_said_so_never_0_ms():
    """A decode step the fit could not tell from a token's cost, and a timing whose repeats never agreed (the
    probe's ``UnitCosts.untrusted``): the plan's line says so instead of "a decode step 0.0 ms"."""
    plan = plan_choosing("grpo")
    assert plan.costs.generate.step_s == 0.0  # fitted without decode steps
    note = "a generate call of 4 prompts: samples still spread 40% (over the last 2 of 4; stable at 15%)"
    shaky = Plan(**{**plan.__dict__, "costs": UnitCosts(**{**plan.costs.__dict__, "untrusted": (note,)})})
    text = shaky.summary()
    assert " 0.0 ms" not in text and "a decode step's cost not told apart from a token's" in text
    assert text.endswith(f"Estimates the probe cannot trust: {note}") and note in shaky.markdown()
    assert Plan.from_json(shaky.to_json()).costs.untrusted == (note,)
    assert "cannot trust" not in plan.summary()


def predicted(names: tuple[str, ...]):
    """The default config, the pool and the predictions of plain GRPO and of ``names`` (default candidates each) on 8
    reference prompts with the screen's likelihoods (4 of them mixed at g = 8), at 2 s a generated token, 1 s an
    updated one and 0.5 s a screened one."""
    from rlcore.plan import predict
    from rlcore.plan_draw import PoolStats

    pool = PoolStats(successes=(0, 0, 8, 8, 4, 1, 6, 3), g=8, levels=(1,) * 8,
                     screen=(0.01, 0.01, 0.99, 0.99, 0.5, 0.4, 0.95, 0.05))
    costs = UnitCosts(generate=CallCost(0.0, 2.0), update=CallCost(0.0, 1.0), forward=CallCost(0.0, 0.5),
                      completion_tokens=10, prompt_tokens=5, solution_tokens=7)
    cfg = load_config(None)
    assert set(names) <= set(cfg.plan.candidates)
    base, preds = predict([composition(n, candidate_config(cfg, n)) for n in names],
                          composition("grpo", candidate_config(cfg, "grpo")), pool, costs)
    return cfg, pool, base, preds


def test_where_20_screened_prompts_fall_short_of_grpos_signal_the_plan_takes_24_not_plain_grpo():
    """The screened uniform draw on 24 and 28 prompts (conf/bench/grpo_screen_24.yaml, _28; docs/benchmarks.md,
    S36): where the reference set puts grpo_screen's 20 groups of 4 under the floor of plain GRPO's informative
    contrasts a step, the default candidates keep the draw on 24 prompts instead of falling back to plain GRPO."""
    from rlcore.plan_choice import choose
    from rlcore.plan_draw import group_chance

    # plain GRPO (32 x 8): 4 of 8 reference prompts mixed, 16 informative groups of 7 contrasts a step; the screen
    # keeps the 2 of 8 it rates likeliest (pass rates 4/8 and 1/8), each at the chance its calibration gives a
    # group of 4, of 3 contrasts
    names = ("grpo_screen", "grpo_screen_24", "grpo_screen_28")
    cfg, pool, base, preds = predicted(names)
    per_prompt = float(group_chance(composition(names[0], candidate_config(cfg, names[0])), pool)[[4, 5]].mean())
    assert base.signal == pytest.approx(16 * 7) and [p.signal for p in preds] == pytest.approx(
        [20 * per_prompt * 3, 24 * per_prompt * 3, 28 * per_prompt * 3])
    assert 20 * per_prompt * 3 < cfg.plan.min_signal * 16 * 7 <= 24 * per_prompt * 3  # 46.8 < 50.4 <= 56.2
    assert choose(base, preds[:1], cfg.plan.min_signal)[0] is base  # 20 prompts alone, under the floor: plain GRPO
    assert choose(base, preds, cfg.plan.min_signal)[0].name == "grpo_screen_24"
    assert choose(base, preds, 0.4)[0].name == "grpo_screen"  # 0.42x passes a floor of 0.4


def test_the_plan_takes_the_fewest_groups_of_6_that_keep_the_floor():
    """Groups of 6 on 11, 12 and 14 prompts (conf/bench/grpo_prescreen_n6_11.yaml, _n6, _n6_14; docs/benchmarks.md,
    S60): the same draw, so each one's informative contrasts a step and its step grow with its prompts; the plan takes
    11 where they clear the floor and 12 where only those do, so the floor alone decides how few groups a pool
    gets."""
    from rlcore.plan_choice import choose

    _, _, base, preds = predicted(("grpo_prescreen_n6_11", "grpo_prescreen_n6", "grpo_prescreen_n6_14"))
    per_prompt = preds[1].signal / 12
    assert per_prompt > 0 and [p.signal for p in preds] == pytest.approx([11 * per_prompt, 12 * per_prompt,
                                                                          14 * per_prompt])
    assert preds[0].step_s < preds[1].step_s < preds[2].step_s
    at_11, at_12 = preds[0].signal / base.signal, preds[1].signal / base.signal
    assert choose(base, preds, at_11)[0].name == "grpo_prescreen_n6_11"
    assert choose(base, preds, (at_11 + at_12) / 2)[0].name == "grpo_prescreen_n6"  # 11 under it, 12 over
