"""The plan's probe (tasks/plan/probe.py) on a tiny policy: it times generation at two batch sizes, the update,
and the fixed costs of a step and a round, leaves the weights and its scratch folder as they were, and only a
candidate that draws with DOTS's predictor pays its fit."""

import re
from dataclasses import replace

import pytest
import torch

from rlcore.plan import draw_calls, predict, update_rows
from rlcore.plan_draw import PoolStats
from tasks.calibration.record import Calibration
from tasks.calibration.reference import stratified_reference
from tasks.config.load import load_config, with_overrides
from tasks.data.arith import generate
from tasks.plan.planner import candidate_config, composition, pool_stats
from tasks.plan.probe import ProbeInputs, _generation_sizes, _update_sizes, probe_costs, probe_groups
from tests.conftest import SMOKE
from tests.tasks.test_overlap_choice import tiny_policy


@pytest.fixture(scope="module")
def setting():
    cfg = load_config(SMOKE, ["eval.batch_size=32"])
    pool = generate(0, 48, "train", "default")
    refs = stratified_reference(pool, cfg.calibrate.k, 0)
    calibration = Calibration(indices=tuple(refs), success=torch.tensor([0.0, 0.25, 0.5, 1.0] * 2))
    return cfg, pool, calibration


def test_the_probe_times_each_cost_and_only_dots_pays_the_predictor_fit(setting, tmp_path):
    cfg, pool, calibration = setting
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    grpo = composition("grpo", candidate_config(cfg, "grpo"), len(pool))
    dots = composition("dots_n4", candidate_config(cfg, "dots_n4"), len(pool))
    records = [pool[i] for i in calibration.indices[:4]]
    stats = pool_stats(policy, pool, calibration, cfg)
    costs = probe_costs(policy, cfg, ProbeInputs(records=records, pool=pool, calibration=calibration,
                                                 comps=[grpo, dots], stats=stats,
                                                 dots={"dots_n4": candidate_config(cfg, "dots_n4")}, scratch=tmp_path),
                        seed=0)
    fx = costs.fixed
    assert fx.optimizer_s > 0 and fx.step_s > 0 and fx.round_s > 0 and fx.fit_s > 0 and costs.score_s > 0
    # generation at the smallest first call a candidate makes and the baseline's (GRPO's); the update at the
    # smallest batch a candidate is predicted to update and the baseline's
    assert len(costs.generate.tokens) == 2 and costs.generate.tokens[0] < costs.generate.tokens[1]
    assert len(costs.update.tokens) == 2 and costs.update.tokens[0] < costs.update.tokens[1]
    assert costs.generate.time(1000) > 0 and costs.update.time(1000) > 0
    assert costs.completion_tokens > 0 and costs.prompt_tokens > 0 and costs.solution_tokens > 0
    # each level's lengths from the same calls: what a draw that favours some levels generates and updates
    assert [lv for lv, _, _ in costs.levels] == list(dict.fromkeys(r.level for r in records))
    assert all(c > 0 and p > 0 for _, c, p in costs.levels)
    # and every rollout's completion length by level, and each call's decode steps (its longest completion)
    assert [lv for lv, _ in costs.completion_lengths] == [lv for lv, _, _ in costs.levels]
    assert sum(sum(xs) for _, xs in costs.completion_lengths) == sum(costs.generate.tokens)
    assert len(costs.generate.steps) == 2 and all(0 < d <= cfg.rollout.max_new_tokens for d in costs.generate.steps)
    assert costs.forward.tokens == ()  # no candidate screens: no screen pass timed
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())  # learning rate 0
    assert all(p.grad is None for p in policy.model.parameters())
    assert list(tmp_path.iterdir()) == []  # the scratch ledger and checkpoint are gone
    # the fixed costs in each candidate's clock: the fit only where the predictor is; started ahead
    # (select.round_ahead, lag auto, the reference trained), what of it outlasts the round's last generate call
    base, (fit,) = predict([dots], grpo, stats, costs)
    per_round = cfg.train.round_steps
    assert base.fixed_s == pytest.approx(fx.optimizer_s + fx.step_s + fx.round_s / per_round)
    assert not dots.round_ahead and fit.fixed_s == pytest.approx(base.fixed_s + fx.fit_s / per_round)
    ahead = composition("dots_n4", candidate_config(with_overrides(cfg, ["select.round_ahead=true"]), "dots_n4"),
                        len(pool), "cuda")  # hidden beside the call where the trainer is on an accelerator
    _, (hidden,) = predict([ahead], grpo, stats, costs)
    assert ahead.round_ahead and hidden.fixed_s == pytest.approx(
        base.fixed_s + max(0.0, fx.fit_s - hidden.generate_s) / per_round)
    assert base.upfront_s == 0 and fit.upfront_s > len(pool) * costs.score_s  # calibration and scores


def test_a_probe_without_dots_times_neither_the_predictor_nor_the_scoring(setting, tmp_path):
    """No candidate reads the score stage's embeddings or angles (plain GRPO, DAPO): a run of any of them scores no
    pool (tasks/stages.py ``score_stage``), so the probe times neither the scoring nor DOTS's predictor; with
    ScalingRL's curriculum among them it times the scoring, not the predictor."""
    cfg, pool, calibration = setting
    policy = tiny_policy()

    def costs_of(*names):
        comps = [composition(n, candidate_config(cfg, n), len(pool)) for n in names]
        return probe_costs(policy, cfg, ProbeInputs(records=[pool[i] for i in calibration.indices[:4]], pool=pool,
                                                    calibration=calibration, comps=comps,
                                                    stats=pool_stats(policy, pool, calibration, cfg),
                                                    scratch=tmp_path), seed=0)

    costs = costs_of("grpo", "dapo")
    assert costs.fixed.fit_s == 0.0 and costs.score_s == 0.0 and costs.fixed.optimizer_s > 0
    costs = costs_of("grpo", "scalingrl")
    assert costs.fixed.fit_s == 0.0 and costs.score_s > 0


def test_the_probes_batch_sizes_come_from_the_candidates():
    cfg = load_config(None)
    comps = [composition(n, candidate_config(cfg, n), 2000) for n in ("grpo", "dots_screen", "pods", "dapo")]
    stats = PoolStats(successes=(0, 4, 4, 8), g=8, levels=(1, 2, 3, 4), screen=(0.0, 0.5, 0.5, 1.0))
    # dots_screen draws 20 prompts x 4 = 80 rollouts and GRPO, the baseline, 32 x 8; PODS's 32 x 16 and DAPO's
    # 64 x 8 = 512 (the engine's chunk), and the calibrate stage's call, are predicted on the line, not timed
    assert draw_calls(comps[3], stats)[0] == (64, 8) and draw_calls(comps[2], stats)[0] == (32, 16)
    assert _generation_sizes(comps, 8, stats) == (10, 32)
    assert _generation_sizes(comps[:1], 8, stats) == (8, 32)  # GRPO alone: 32 x 8, and a quarter of it
    # waves as the baseline: a first call of 30 candidates x 2 rollouts, a second of the completed ones' 2 each (at
    # most 20); its calibration's 32 x 8 is not timed
    waves = composition("dots_screen_waves", candidate_config(cfg, "dots_screen_waves"), 2000)
    (first, second) = draw_calls(waves, stats)
    assert first == (30, 2) and second[1] == 2 and 1 <= second[0] <= 20
    assert _generation_sizes([waves], 8, stats) == (round(second[0] * 2 / 8) or 1, round(30 * 2 / 8))
    # carried: one call a step of the 30 x 2 first rollouts and the last step's completions
    carried = composition("carried", candidate_config(cfg, "dots_screen_waves_carry"), 2000)
    (call,) = draw_calls(carried, stats)
    assert call[1] == 1 and abs(call[0] - (60 + 2 * second[0])) <= 1  # each rounded from the expected count
    assert _generation_sizes([carried], 8, stats) == (round(call[0] / 8) // 4, round(call[0] / 8))  # one size


def test_the_screened_uniform_draw_pays_neither_the_scoring_nor_the_predictor():
    """grpo_screen is the screen without DOTS: the plan charges it the screen's pass over its 4 x 20 candidates and
    nothing DOTS pays (the pool's embeddings before training, a predictor fit a round), where dots_screen pays both."""
    cfg = load_config(None)
    uniform, dots = (composition(n, candidate_config(cfg, n), 2000) for n in ("grpo_screen", "dots_screen"))
    assert (uniform.draw, uniform.screen, uniform.prompts, uniform.n) == ("uniform", 4, 20, 4)
    assert (uniform.predictor, uniform.scored, uniform.reference) == (False, 0, (0, 0))
    assert (dots.draw, dots.screen, dots.predictor, dots.scored) == ("dots", 2, True, 2000)
    assert "grpo_screen" in cfg.plan.candidates


def test_the_plan_hides_the_screen_beside_the_generate_call_only_on_other_hardware():
    """A candidate with the screen runs it ahead where select.screen_ahead is on and the sampler is apart from the
    trainer (a server, lag 1, or lag auto); the plan counts only what outlasts the generate call where the two run on
    different hardware: a server, or a trainer on an accelerator. On a CPU they share the cores, so the pass costs
    its own time (S40: a sequential step of 0.228 s measured, 0.226 s predicted so, 0.178 s with it hidden). Never
    at lag 0 with the in-process engine, nor with the option off, nor without a screen. A candidate the plan knows
    to overlap (lag 1) runs it ahead on a CPU too: after the update it runs beside, on the trainer's side
    (rlcore/plan.py, tests/rlcore/test_plan.py)."""
    cfg = load_config(None)

    def ahead(c, device="cuda", overlap=False):
        return composition("s", c, device=device, overlap=overlap).screen_ahead

    lags = {lag: ahead(candidate_config(with_overrides(cfg, [f"overlap.lag={lag}"]), "dots_screen"))
            for lag in ("auto", 0, 1)}
    assert lags == {"auto": True, 0: False, 1: True}
    assert not ahead(candidate_config(cfg, "dots_screen"), "cpu")
    assert not ahead(candidate_config(with_overrides(cfg, ["overlap.lag=1"]), "dots_screen"), "cpu")
    assert ahead(candidate_config(with_overrides(cfg, ["overlap.lag=1"]), "dots_screen"), "cpu", overlap=True)
    assert not ahead(candidate_config(cfg, "dots_screen_inline"), "cpu", overlap=True)
    assert not ahead(candidate_config(cfg, "dots_screen_inline")) and not ahead(candidate_config(cfg, "grpo"))
    server = with_overrides(cfg, ["overlap.lag=0", "rollout.engine=vllm"])
    assert ahead(candidate_config(server, "dots_screen"), "cpu") and ahead(candidate_config(server, "dots_screen"))


def test_the_choice_counts_a_lag1_screen_run_ahead_as_work_and_a_servers_as_hidden():
    """The choice compares each candidate's work one after the other (tasks/plan/planner.py ``one_after_the_other``).
    A lag-1 step's screen run ahead is the trainer's work after the update, so it is counted in full there, as a
    screen scored inline is; beside a server's generate call (lag 0) it stays hidden."""
    from tasks.plan.planner import one_after_the_other

    cfg = load_config(None)
    lag1 = composition("s", candidate_config(with_overrides(cfg, ["overlap.lag=1"]), "grpo_screen"), device="cpu",
                       overlap=True)
    assert lag1.screen_ahead and not one_after_the_other(lag1).screen_ahead
    assert not one_after_the_other(lag1).overlap
    server = composition("s", candidate_config(with_overrides(cfg, ["overlap.lag=0", "rollout.engine=vllm"]),
                                               "grpo_screen"), device="cpu")
    assert server.screen_ahead and one_after_the_other(server).screen_ahead


def test_the_plan_starts_rounds_ahead_where_a_run_would():
    """A candidate's rounds start ahead, hidden beside the generate call, where select.round_ahead is on, the
    sampler is apart on other hardware (as the screen's pass, the test above) and a round's start takes no reference
    rollouts (DOTS with calibrate.reference=trained, or no DOTS)."""
    cfg = load_config(None)
    ahead = {lag: composition("s", candidate_config(with_overrides(cfg, [f"overlap.lag={lag}"]),
                                                    "dots_screen_round_ahead"), device="cuda").round_ahead
             for lag in ("auto", 0, 1)}
    assert ahead == {"auto": True, 0: False, 1: True}
    assert not composition("s", candidate_config(cfg, "dots_screen_round_ahead"), device="cpu").round_ahead
    assert not composition("s", candidate_config(cfg, "dots_screen"), device="cuda").round_ahead, "off by default"
    on = with_overrides(cfg, ["select.round_ahead=true"])
    assert not composition("d", candidate_config(on, "dots"), device="cuda").round_ahead, "fresh reference rollouts"


def test_the_probes_sizes_span_the_candidates_up_to_the_baselines():
    """The probe times the smallest call and update a candidate makes and the baseline's (the first); DAPO's larger
    ones are predicted on the line through the two, not timed."""
    cfg = load_config(None)
    comps = [composition(n, candidate_config(cfg, n)) for n in ("grpo", "dots_screen", "dapo")]
    stats = PoolStats(successes=(0, 4, 4, 8), g=8, levels=(1, 2, 3, 4), screen=(0.0, 0.5, 0.5, 1.0))
    # GRPO: half of 32 groups of 8 informative, 128 rows; dots_screen: nearly all of its 20 groups of 4, about 78
    # rows; DAPO: a full batch of 32 x 8 = 256 rows (nearly: three rounds of yield 1/2 leave a few missing)
    assert round(update_rows(comps[2], stats) / 8) == 32
    small, large = _update_sizes(comps, stats, 8, available=100)
    assert small == round(update_rows(comps[1], stats) / 8) and large == round(update_rows(comps[0], stats) / 8) == 16
    assert _update_sizes(comps, stats, 8, available=12) == (min(12, small), 12)  # no more than the probe drew
    assert _update_sizes(comps[:1], stats, 8, available=100) == (4, 16)  # one size: a quarter of it too


def test_the_probes_groups_are_all_informative():
    policy = tiny_policy()
    gen = policy.engine.generate(policy.prompts(generate(0, 3, "train", "default")), n=4, seed=0)
    groups = probe_groups(gen)
    assert len(groups) == 3 and all(g.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] for g in groups)
    assert all(g.advantages.abs().min() > 0 and g.completion_ids.shape[0] == 4 for g in groups)


def test_the_plan_says_what_it_measures_as_it_goes(setting, tmp_path, caplog):
    """A line as each probe starts and one per candidate (the plan ran 147 s without a line on a loaded machine);
    tests/tasks/test_progress.py checks the lines of a probe that runs long."""
    import logging

    from tasks.plan.planner import make_plan

    cfg, pool, calibration = setting
    cfg = with_overrides(cfg, ["plan.prune=false"])  # every probe, whatever the candidates' reach
    with caplog.at_level(logging.INFO, logger="rlsift"):
        plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("grpo_n4", "dots_n4"), scratch=tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlsift.plan"]
    assert lines[0].startswith("plan: the pool's pass rates from the calibration's 8 reference prompts"), lines
    for probe in ("generation, calls of", "the update of", "scoring a batch of the pool, DOTS's predictor",
                  "a step's bookkeeping"):
        assert sum(line.startswith(f"plan: probe: {probe}") for line in lines) == 1, (probe, lines)
    for name in ("grpo", "grpo_n4", "dots_n4"):
        assert sum(line.startswith(f"plan: candidate {name}: effective ratio ") for line in lines) == 1, lines
    assert lines[-1].startswith(f"plan: chose {plan.choice}; the overlap's lag for it"), lines


def test_the_probes_optimizer_step_under_bf16_mixed_takes_a_real_steps_time():
    """Under bf16-mixed the update's own step moves its gradients into the float32 masters and frees them, so the
    probe once timed an empty step (0.9 ms against 1,055 ms on a GPU). It now gives every trainable parameter a
    gradient before each timed step: its time is within a factor of two of an optimizer step timed right after a
    real backward pass (the empty step was over 1,000 times off). Not tighter: the probe's gradients are warm in the
    cache where a backward pass's are not, which made it 0.72x on one CI machine and 0.9-1.1x on others. Both on the
    process's CPU time with one thread (a shared machine's load moves wall time by several times; the probe's clock
    is injected for it), the fastest of each after a warm-up step."""
    import functools
    import time

    from tasks.model.loading import build_tiny_model
    from tasks.plan.probe import time_optimizer_step
    from tasks.update.distributed import optimizer_step
    from tasks.update.precision import build_optimizer, resolve_precision

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_tiny_model(hidden=256, layers=4, heads=4, seed=0, vocab_size=512).to(torch.bfloat16)
        precision = resolve_precision("bf16-mixed", "cpu")
        assert precision.mixed
        optimizer = build_optimizer(model.parameters(), functools.partial(torch.optim.AdamW, lr=0.0), precision)
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

        def backward():
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()

        backward()
        optimizer_step(model, optimizer, 1.0)  # warm-up: AdamW makes its state
        measured, probed = [], []
        for _ in range(4):
            for _ in range(3):
                backward()
                t0 = time.process_time()
                optimizer_step(model, optimizer, 1.0)
                measured.append(time.process_time() - t0)
            probed += time_optimizer_step(model, optimizer, list(model.parameters()), 1.0,
                                          clock=time.process_time).samples
    finally:
        torch.set_num_threads(threads)
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient behind
    assert 0.5 < min(probed) / min(measured) < 2.0, (measured, probed)


def test_the_probe_stops_measuring_for_a_candidate_out_of_reach(setting, tmp_path):
    """``plan.prune``: once generation, the update and the fixed costs every step pays are timed, a candidate that
    could not be chosen with the rest at 0 is not probed further. PODS (32 prompts x 16 rollouts) never has a
    cheaper step than GRPO (32 x 8): with it the only other candidate, the screen's pass and DOTS's predictor are
    timed for no one; its row says why, and a saved plan keeps it. ``dots_screen``, in reach, gets both timed."""
    from tasks.plan.planner import make_plan
    from tasks.plan.record import Plan

    cfg, pool, calibration = setting
    plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("pods",), scratch=tmp_path)
    assert plan.choice == "grpo" and list(plan.out_of_reach) == ["pods"]
    assert plan.out_of_reach["pods"].startswith("its step at least ")
    assert plan.costs.forward.tokens == () and plan.costs.fixed.fit_s == 0
    assert plan.costs.score_s == 0  # nothing in reach reads the scores: the run will not score its pool
    assert next(r for r in plan.rows() if r["composition"] == "pods")["chosen"].startswith("out of reach")
    assert Plan.from_json(plan.to_json()).out_of_reach == plan.out_of_reach
    # dots_screen (the screen, the scores, the predictor) in reach: GRPO at 64 x 8, dots_screen at 20 x 4, any signal,
    # steps enough to earn back the plan
    cfg = with_overrides(cfg, ["train.prompts_per_step=64", "plan.min_signal=0", "train.steps=1000"])
    plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("pods", "dots_screen"), scratch=tmp_path)
    assert "dots_screen" not in plan.out_of_reach, plan.out_of_reach
    assert len(plan.costs.forward.tokens) > 0 and plan.costs.score_s > 0 and plan.costs.fixed.fit_s > 0
    # one step: dots_screen's cheaper step, with what it alone pays at 0, cannot repay the planning so far; it is not
    # probed further, and its lower bound is not offered to the choice, though its step is cheaper than GRPO's
    cfg = with_overrides(cfg, ["train.steps=1"])
    plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("dots_screen",), scratch=tmp_path)
    assert plan.out_of_reach["dots_screen"].endswith("spent before its first step"), plan.out_of_reach
    dots_screen = next(p for p in plan.predictions if p.name == "dots_screen")
    assert dots_screen.step_s < plan.baseline.step_s and plan.choice == "grpo", plan.reason


def test_the_probe_does_not_score_for_a_candidate_a_measured_one_beats(setting, tmp_path):
    """After the screen's pass, ``grpo_prescreen`` is predicted in full; ``dots_screen_waves`` (DOTS's draw, waves of
    rollouts) still lacks the pool's scoring and its predictor, but its steps alone, with those at 0, already cost
    far more than ``grpo_prescreen``'s (rlcore/plan_choice.py ``dominated``): neither is timed, its row says why,
    and ``grpo_prescreen`` is chosen. Without the rival the scoring and the predictor are timed for it."""
    from tasks.plan.planner import make_plan

    cfg, pool, calibration = setting
    # GRPO at 128 x 8: both candidates' steps far below its (about half and a third of it on the tiny policy)
    cfg = with_overrides(cfg, ["train.prompts_per_step=128", "plan.min_signal=0", "train.steps=1000"])
    plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("grpo_prescreen", "dots_screen_waves"),
                     scratch=tmp_path)
    assert plan.choice == "grpo_prescreen", plan.reason
    assert re.fullmatch(r"at least [\d.]+ s from here on against grpo_prescreen's [\d.]+ s, measured in full",
                        plan.out_of_reach["dots_screen_waves"]), plan.out_of_reach
    assert len(plan.costs.forward.tokens) > 0  # the screen's pass was timed for both
    assert plan.costs.score_s == 0 and plan.costs.fixed.fit_s == 0
    plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("dots_screen_waves",), scratch=tmp_path)
    assert "dots_screen_waves" not in plan.out_of_reach
    assert plan.costs.score_s > 0 and plan.costs.fixed.fit_s > 0


def test_the_calibrations_rollouts_are_the_probes_largest_generate_call(setting, tmp_path, monkeypatch):
    """Where the calibrate stage drew its rollouts in this process (``Calibration.draw``) in calls at least as
    large as the baseline's and took at least ``RETIME_BELOW_S``, the probe times only the small call and takes the
    calibration's as its largest: its tokens, seconds and decode steps (each engine call to its longest
    completion) as they were, one generate call fewer, and its rollouts for the lengths by level and the update's
    groups. Without the draw (a loaded calibration), with a draw smaller than the baseline's call, or with one no
    cheaper a token than the small call (a cold first call, a busy moment: the fit cannot then tell a decode step's
    cost from a token's), the probe times the large call itself; and, without a warm-up, where the calibration's
    call was quicker than ``RETIME_BELOW_S`` (its one sample a first call, dearer than the call again)."""
    from tasks.calibration.record import CalibrationDraw
    from tasks.calibration.reference import rollout_rewards
    from tasks.plan import probe_generation

    monkeypatch.setattr(probe_generation, "RETIME_BELOW_S", 0.0)  # first the reuse, however quick the draw

    cfg, pool, calibration = setting
    cfg = with_overrides(cfg, ["rollout.chunk=16"])  # the calibration's 8 x 4 rollouts in two calls of 16
    policy = tiny_policy()
    grpo = composition("grpo", candidate_config(cfg, "grpo"), len(pool))
    records = [pool[i] for i in calibration.indices]
    gen, _ = rollout_rewards(policy, records, cfg.calibrate.g, 5)
    stats = pool_stats(policy, pool, calibration, cfg)
    calls = []
    engine_generate = policy.engine.generate

    def counted(prompts, n, seed, *args, **kw):
        calls.append(len(prompts) * n)
        return engine_generate(prompts, n, seed, *args, **kw)

    policy.engine.generate = counted

    def probe(draw):
        calls.clear()
        inputs = ProbeInputs(records=records[:4], pool=pool, calibration=Calibration(
            calibration.indices, calibration.success, draw), comps=[grpo], stats=stats, scratch=tmp_path)
        return probe_costs(policy, cfg, inputs, seed=0), list(calls)

    small, large = _generation_sizes([grpo], cfg.rollout.n, stats)
    assert large * cfg.rollout.n <= 16  # the calibration's calls are at least the baseline's
    quick = 1e-4  # seconds: cheaper a token than any timed call of this model
    costs, made = probe(CalibrationDraw(tuple(records), gen, quick))
    assert set(made) == {small * cfg.rollout.n}  # only the small call, repeated until stable; no warm-up
    lengths = gen.completion_mask.sum(1)
    assert costs.generate.tokens[-1] == gen.tokens and costs.generate.seconds[-1] == quick
    assert costs.generate.steps[-1] == int(lengths[:16].max()) + int(lengths[16:].max())
    assert [lv for lv, _, _ in costs.levels] == list(dict.fromkeys(r.level for r in records))  # every level's
    timed, made = probe(None)
    assert set(made) == {cfg.rollout.n, small * cfg.rollout.n, large * cfg.rollout.n}  # warm-up, small, large
    assert len(timed.generate.tokens) == 2 and timed.generate.seconds[-1] != quick
    slow, made = probe(CalibrationDraw(tuple(records), gen, 1.25))  # 4 ms a token: far slower than the small call
    assert set(made) == {small * cfg.rollout.n, large * cfg.rollout.n} and 1.25 not in slow.generate.seconds
    few = CalibrationDraw(tuple(records[:1]), rollout_rewards(policy, records[:1], 2, 5)[0], 1.25)
    _, made = probe(few)  # 2 rollouts: smaller than the baseline's call
    assert large * cfg.rollout.n in made
    monkeypatch.undo()  # RETIME_BELOW_S as shipped: the same draw, quicker than it, is timed again, warm
    assert probe_generation.RETIME_BELOW_S > 0.5
    again, made = probe(CalibrationDraw(tuple(records), gen, 0.5))
    assert set(made) == {small * cfg.rollout.n, large * cfg.rollout.n}  # no warm-up: the calibration warmed it
    assert len(again.generate.tokens) == 2 and 0.5 not in again.generate.seconds


def test_the_probe_times_each_sides_share_of_the_threads_only_where_a_candidate_overlaps(setting, tmp_path,
                                                                                        monkeypatch):
    """Where a candidate trains with lag 1 on a CPU whose threads it splits (ProbeInputs.split), the probe times a
    generate call of half the baseline's prompts in a generator process and the small update on the trainer's
    threads, each beside the other, against both on all threads here, and puts the paces in UnitCosts.split; the
    process's thread count is left as it was, the weights too, and no generator process is left running. No
    candidate overlapping, or no split: nothing timed."""
    import multiprocessing

    cfg, pool, calibration = setting
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    records = [pool[i] for i in calibration.indices[:4]]
    stats = pool_stats(policy, pool, calibration, cfg)
    grpo = composition("grpo", candidate_config(cfg, "grpo"), len(pool))
    threads = torch.get_num_threads()
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda k: seen.append(k) or real(k))

    def probe(comps, split):
        return probe_costs(policy, cfg, ProbeInputs(records=records, pool=pool, calibration=calibration, comps=comps,
                                                    stats=stats, scratch=tmp_path, split=split), seed=0)

    from tasks.plan import probe as probe_module
    from tasks.plan.probe_split import split_prompts

    calls = []
    real_split = probe_module.probe_split
    monkeypatch.setattr(probe_module, "probe_split", lambda p, c, batch, *a, **kw: calls.append(len(batch)) or
                        real_split(p, c, batch, *a, **kw))
    assert probe([grpo], (1, 1)).split is None and probe([replace(grpo, overlap=True)], None).split is None
    assert seen == [] and calls == []
    comps = [grpo, replace(grpo, name="over", overlap=True)]
    split = probe(comps, (1, 1)).split
    # its generate call: half the baseline's prompts (the pace grows with the call), not the smallest call
    assert calls == [split_prompts(_generation_sizes(comps, cfg.rollout.n, stats))]
    assert split is not None and split.threads == (1, 1)
    assert split.generate > 0 and split.passes > 0
    assert seen and seen[-1] == threads and torch.get_num_threads() == threads  # the trainer's share, then all
    assert not [p for p in multiprocessing.active_children() if p.name == "rlsift-generator"]
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())


def test_the_splits_generator_process_is_kept_for_the_training_that_fits_it(setting, tmp_path):
    """With a handover, the split's generator process is kept rather than stopped: the process gets its threads
    back for the stages before the training, and a lag-1 training of the same policy samples from that process
    (with the trainer's share of the threads) instead of starting another; closing it leaves none."""
    import multiprocessing

    from tasks.calibration.reference import rollout_rewards
    from tasks.overlap.concurrent import SamplerHandover, open_sampler, thread_split

    cfg, pool, calibration = setting
    policy = tiny_policy()
    records = [pool[i] for i in calibration.indices[:4]]
    grpo = composition("grpo", candidate_config(cfg, "grpo"), len(pool))
    threads = torch.get_num_threads()
    handover = SamplerHandover()
    inputs = ProbeInputs(records=records, pool=pool, calibration=calibration, stats=pool_stats(
        policy, pool, calibration, cfg), comps=[grpo, replace(grpo, name="over", overlap=True)], scratch=tmp_path,
        split=(1, 1), handover=handover)
    assert probe_costs(policy, cfg, inputs, seed=0).split is not None

    def generators():
        return [p for p in multiprocessing.active_children() if p.name == "rlsift-generator"]

    kept = handover.kept
    assert kept is not None and kept.process.alive and len(generators()) == 1
    assert torch.get_num_threads() == threads
    sampling = open_sampler(policy, 1, threads=cfg.overlap.generator_threads, handover=handover)
    try:
        assert sampling is kept and handover.kept is None
        assert torch.get_num_threads() == thread_split(threads, cfg.overlap.generator_threads)[1]  # the trainer's
        gen, rewards = rollout_rewards(sampling.policy, records[:1], 2, 0)  # drawn in the kept process
        assert rewards.shape == (1, 2) and gen.completion_ids.shape[0] == 2 and len(generators()) == 1
    finally:
        sampling.close()
    assert torch.get_num_threads() == threads and not generators()


def test_a_candidate_is_predicted_at_the_lag_it_will_train_with(monkeypatch):
    """overlap.lag as set; auto: 1 where the sampler and the trainer run apart, else left to the overlap's probe
    after the choice, and predicted at lag 0."""
    from tasks.overlap import lag as lag_module
    from tasks.plan.planner import overlaps

    cfg, policy = load_config(SMOKE), tiny_policy()
    assert not overlaps(with_overrides(cfg, ["overlap.lag=0"]), policy, "cpu")
    assert overlaps(with_overrides(cfg, ["overlap.lag=1"]), policy, "cpu")
    auto = with_overrides(cfg, ["overlap.lag=auto"])
    monkeypatch.setattr(lag_module, "separate_devices", lambda *a: "CPU cores for each")
    assert overlaps(auto, policy, "cpu")
    monkeypatch.setattr(lag_module, "separate_devices", lambda *a: None)
    assert not overlaps(auto, policy, "cpu")
