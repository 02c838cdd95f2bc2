"""The plan's measurements: the pool's pass rates, the timed probe (tasks/plan/probe.py), the candidates read from
their configs, and what the run then trains (rlcore/plan.py has the prediction, tasks/plan/record.py the record).

The pool is measured by the calibrate stage's reference rollouts (K prompts x g rollouts, done anyway), each
reference prompt weighted by the share of the pool its level holds over its share of the reference set (the set is
stratified by level), and, where every prompt has a worked solution, by the screen's likelihood of each reference
prompt's solution (one forward pass each).

The plan also records the overlap's lag for the config its chosen candidate trains (``Plan.overlap``, decided by
tasks/overlap/lag.py ``decide_lag`` with the chosen candidate's predicted step); a run without the plan decides it
in its own stage (tasks/stages.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from rlcore.plan import Prediction, predict, without_rule
from rlcore.plan_choice import choose, dominated, out_of_reach
from rlcore.plan_draw import Composition, PoolStats
from rlcore.seeding import derive_seed
from rlcore.step_costs import UnitCosts
from tasks.calibration.record import Calibration
from tasks.config import Config, ConfigError
from tasks.config.load import preset_overrides, with_overrides
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import HFEngine
from tasks.model.shared_prefix import attends_with_sdpa
from tasks.overlap.concurrent import SamplerHandover, thread_split
from tasks.overlap.lag import decide_lag, lag_without_probe
from tasks.plan.probe import ProbeInputs, probe_costs
from tasks.plan.probe_cache import ProbeMemo, probe_key
from tasks.plan.record import Plan
from tasks.policy import Policy
from tasks.records.progress import pulse
from tasks.selection.screen import in_sampler, screen_likelihood
from tasks.training.techniques import step_rules
from tasks.update.policy_update import wants_shared_prefix

log = logging.getLogger("rlsift.plan")


def reads_upfront(cfg: Config) -> dict[str, bool]:
    """Whether a run of ``cfg`` reads what the score and calibrate stages measure before training: DOTS
    (embeddings, labels), ScalingRL (CoT complexity, measured difficulty) and GAIN-RL (angle) do, and ``plan.auto``
    (the plan reads the calibration, and its choice is not known beforehand); plain GRPO and PODS do not. The
    pipeline calibrates always and scores only where a run reads the scores (a ``plan.auto`` run: where its choice
    does, tasks/stages.py ``score_stage``); the benchmark's clock counts either only where it is read."""
    dots, cc = cfg.select.method == "dots", cfg.curriculum.enabled
    return {"score": dots or cc or cfg.gain.enabled or cfg.plan.auto, "calibrate": dots or cc or cfg.plan.auto}


def composition(name: str, cfg: Config, pool_size: int = 0, device: torch.device | str = "cpu",
                sdpa: bool = False, overlap: bool = False) -> Composition:
    """What ``cfg`` does a step and before its first, as rlcore.plan predicts it (``pool_size``: prompts the score
    stage embeds; ``device``: the update's; ``sdpa``: the policy attends with SDPA, so ``train.shared_prefix`` may
    compute each group's prompt once, tasks/update/policy_update.py ``uses_shared_prefix``; ``overlap``: it trains
    with lag 1, :func:`overlaps`)."""
    sc, tc, rc, cal = cfg.select, cfg.train, cfg.rollout, cfg.calibrate
    dots = sc.method == "dots"
    reads = reads_upfront(cfg)
    return Composition(
        name=name, prompts=tc.prompts_per_step, n=rc.n, m=cfg.kept_per_prompt, draw=sc.method,
        weighting=sc.weighting, alpha=sc.alpha, tau=sc.tau, screen=sc.screen,
        fresh_frac=cfg.replay.fresh_frac if cfg.replay.enabled else 1.0,
        dynamic=(cfg.dynamic.oversample, cfg.dynamic.max_rounds) if cfg.dynamic.enabled else None,
        skip_silent=tc.skip_zero_advantage and tc.kl_coef == 0, steps=tc.steps, round_steps=tc.round_steps,
        chunk=rc.chunk if rc.engine == "hf" else 0,
        reference=(cal.k, cal.g) if dots and cal.reference == "fresh" else (0, 0), predictor=dots,
        calibration=(cal.k, cal.g) if reads["calibrate"] else (0, 0), scored=pool_size if reads["score"] else 0,
        rules=step_rules(cfg, pool_size),
        screen_ahead=sc.screen > 1 and sc.screen_ahead and (overlap or hides(cfg, device)),
        round_ahead=sc.round_ahead and hides(cfg, device) and not (dots and cal.reference == "fresh"),
        shared_prefix=sdpa and wants_shared_prefix(tc.shared_prefix, device, cfg.gain.enabled), overlap=overlap,
        screen_in_sampler=overlap and sc.screen > 1 and rc.engine == "hf" and in_sampler(sc.screen_process, device))


def overlaps(cfg: Config, policy: Policy, device: torch.device | str) -> bool:
    """Whether a run of ``cfg`` trains with lag 1 as far as is known before the plan's choice (tasks/overlap/lag.py
    ``lag_without_probe``; on a device the sampler and the trainer share, ``auto`` is probed after the choice, and
    the plan predicts lag 0)."""
    known = lag_without_probe(cfg, policy, device)
    return known is not None and known.lag == 1


def split_threads(cfg: Config, policy: Policy, device: torch.device | str) -> tuple[int, int] | None:
    """(generator, trainer) threads where a lag-1 run of ``cfg`` splits a CPU's cores between the sampler and the
    trainer (tasks/overlap/concurrent.py ``thread_split``), else None."""
    if torch.device(device).type != "cpu" or not isinstance(policy.engine, HFEngine):
        return None
    return thread_split(torch.get_num_threads(), cfg.overlap.generator_threads)


def hides(cfg: Config, device: torch.device | str) -> bool:
    """Whether work of the trainer's process run beside a generate call (the screen's look-ahead, a round's start
    ahead) costs a step only what outlasts the call, as rlcore.plan counts it: the call runs apart from the trainer
    (tasks/overlap/concurrent.py ``Sampler.apart``) and on other hardware than that work. A server; or the in-process
    sampler at lag 1 (``overlap.lag=auto`` counts: on a shared device the overlap's probe decides after the plan)
    beside a trainer on an accelerator. On a CPU the generator's threads and the trainer's share its cores, so the
    work costs its own time: measured (`grpo_prescreen` one after the other on 2 cores, docs/algorithms.md 9.2), a
    step of 0.228 s, against 0.226 s predicted with the screen's pass counted and 0.178 s with it hidden. Where the
    plan knows the candidate overlaps (lag 1), the look-ahead waits for the update it runs beside and runs on the
    trainer's side, hardware aside (:func:`composition` runs the screen ahead there; rlcore/plan.py counts it)."""
    if cfg.rollout.engine != "hf":
        return True
    return cfg.overlap.lag != 0 and torch.device(device).type != "cpu"


def candidate_config(cfg: Config, name: str) -> Config:
    """``cfg`` with the candidate's keys (its preset or benchmark-arm file) and the plan off: what a run trains."""
    try:
        return with_overrides(cfg, [*preset_overrides(name), "plan.auto=false"])
    except ConfigError as err:
        raise ConfigError(f"plan.candidates: {name}: {err}") from None


def pool_stats(policy: Policy, pool: list[PromptRecord], calibration: Calibration, cfg: Config,
               device: torch.device | str = "cpu") -> PoolStats:
    """The reference set's successes and levels, the pool share each reference prompt stands for (its level's
    share of the pool over the level's count in the set), and the screen's likelihoods where every prompt has a
    solution."""
    g = cfg.calibrate.g
    refs = [pool[i] for i in calibration.indices]
    screen = None
    if all(r.solution for r in pool):
        likelihood = screen_likelihood(policy, cfg, device)
        screen = tuple(float(q) for q in likelihood(refs))
    levels = [r.level for r in refs]
    in_pool, in_refs = Counter(r.level for r in pool), Counter(levels)
    return PoolStats(successes=tuple(int(round(float(s) * g)) for s in calibration.success), g=g,
                     levels=tuple(levels), screen=screen,
                     weights=tuple(in_pool[lv] / len(pool) / in_refs[lv] for lv in levels))


def probe_records(pool: list[PromptRecord], calibration: Calibration, cfg: Config) -> list[PromptRecord]:
    """The probes' prompts: the first ``plan.probe_prompts`` reference prompts."""
    return calibration.first(pool, cfg.plan.probe_prompts)


def make_plan(cfg: Config, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
              device: torch.device | str = "cpu", candidates: tuple[str, ...] | None = None, spent_s: float = 0.0,
              scratch: Path | None = None, handover: SamplerHandover | None = None, kept: Path | None = None) -> Plan:
    """Measure the pool and the costs (tasks/plan/probe.py), predict every candidate (``plan.candidates``
    unless given) against ``plan.baseline`` and choose the cheapest from here on among those the probe measured in
    full (rlcore/plan_choice.py ``choose``; not those out of reach, ``out_of_reach``). ``spent_s``: the seconds the
    run spent on its calibration (on this run's clock with the plan's own); ``scratch``: where the probe writes its
    scratch files; ``handover``: where the overlap probe keeps its generator process for the training
    (tasks/overlap/lag.py ``decide_lag``); ``kept``: the folder of the probe's kept timings (tasks/plan/probe_cache.py;
    None: every part timed, nothing kept)."""
    with pulse("plan", log) as say:  # a line per probe and candidate, and one every few seconds in a long probe
        return _make_plan(cfg, policy, pool, calibration, device, candidates, spent_s, scratch, handover, kept, say)


def _make_plan(cfg: Config, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
               device: torch.device | str, candidates: tuple[str, ...] | None, spent_s: float, scratch: Path | None,
               handover: SamplerHandover | None, kept: Path | None, say: Callable[[str], None]) -> Plan:
    t0 = time.perf_counter()
    pc = cfg.plan
    say(f"the pool's pass rates from the calibration's {len(calibration.indices)} reference prompts" + (
        ", the screen's likelihood of their solutions" if all(r.solution for r in pool) else ""))
    stats = pool_stats(policy, pool, calibration, cfg, device)
    refs = probe_records(pool, calibration, cfg)
    comps, configs, unavailable = [], {}, {}
    sdpa = attends_with_sdpa(policy.model)
    for name in dict.fromkeys(candidates or pc.candidates):
        configs[name] = candidate_config(cfg, name)
        c = composition(name, configs[name], len(pool), device, sdpa, overlaps(configs[name], policy, device))
        if c.screen > 1 and stats.screen is None:
            unavailable[name] = "the screen needs a worked solution for every prompt"
            continue
        comps.append(c)
    base_cfg = candidate_config(cfg, pc.baseline)
    base = composition(pc.baseline, base_cfg, len(pool), device, sdpa, overlaps(base_cfg, policy, device))
    out: dict[str, str] = {}  # candidates the probe stopped measuring (out of reach, or dominated), and why

    def live(step_costs: UnitCosts, unmeasured: Callable[[Composition], bool]) -> list[Composition]:
        """The baseline and the candidates still in reach: predicted with the costs not yet timed at 0 (those of the
        candidates ``unmeasured`` says still pay some), against the baseline, which pays none of them; out of reach
        alone (rlcore/plan_choice.py ``out_of_reach``), or beaten by a candidate predicted in full (``dominated``)."""
        if not pc.prune or unmeasured(base):
            return [base, *comps]
        lower_base, lower = predict(list(map(one_after_the_other, comps)), one_after_the_other(base), stats,
                                    step_costs)  # the work the choice compares
        spent = spent_s + time.perf_counter() - t0
        before = set(out)
        out.update((c.name, why) for c, p in zip(comps, lower, strict=True) if c.name not in out
                   and c.name != base.name and (why := out_of_reach(p, lower_base, pc.min_signal, spent)) is not None)
        exact = [p for c, p in zip(comps, lower, strict=True) if c.name not in out and not unmeasured(c)]
        out.update((c.name, why) for c, p in zip(comps, lower, strict=True) if c.name not in out
                   and unmeasured(c) and (why := dominated(p, exact, lower_base, pc.min_signal)) is not None)
        if new := [name for name in out if name not in before]:
            say(f"probe: {', '.join(new)} out of reach (each predicted with what it alone pays at 0), so not probed "
                "further")
        return [base, *(c for c in comps if c.name not in out)]

    dots = {c.name: configs[c.name] for c in comps if c.predictor}
    memo = ProbeMemo.open(kept, probe_key(cfg, policy, device), pc.reuse_probe_hours)
    costs = probe_costs(policy, cfg, ProbeInputs(records=refs, pool=pool, calibration=calibration,
                                                 comps=[base, *comps], stats=stats, dots=dots, scratch=scratch,
                                                 live=live, memo=memo, split=split_threads(cfg, policy, device),
                                                 handover=handover),
                        derive_seed(cfg.seed, "plan-probe"), device, say)
    baseline, predictions = predict(comps, base, stats, costs)
    savings = tuple(saving(rule.name, p, predict([without_rule(c, rule.name)], base, stats, costs)[1][0])
                    + (" (out of reach: steps without what it alone pays, not timed)" if c.name in out else "")
                    for c, p in zip(comps, predictions, strict=True) for rule in c.rules)
    for p in (baseline, *(p for p in predictions if p.name != baseline.name)):  # the baseline once
        say(f"candidate {p.name}: effective ratio {p.effective_ratio:.2f}, training clock (its steps and what it "
            f"pays before them) predicted at {p.clock:.2f}x {baseline.name}'s")
    for name, why in unavailable.items():
        say(f"candidate {name}: left out ({why})")
    so_far = spent_s + time.perf_counter() - t0  # before the first step, without the lag and the pool's scoring
    work_base, work = predict(list(map(one_after_the_other, comps)), one_after_the_other(base), stats, costs)
    best, reason = choose(baseline, [p for p in predictions if p.name not in out], pc.min_signal, so_far,
                          work=(work_base, [p for p in work if p.name not in out]))
    chosen = candidate_config(cfg, best.name)
    say(f"chose {best.name}; the overlap's lag for it" + (
        " (the draw and the update timed alone and at once where that pays)" if chosen.overlap.lag == "auto" else ""))
    overlap = decide_lag(chosen, policy, refs, device, handover=handover,
                         expected=(best.generate_s + best.forward_s, best.update_s + best.ahead_s + best.fixed_s))
    upfront = spent_s + time.perf_counter() - t0
    return Plan(shares=stats.shares, g=stats.g, costs=costs, baseline=baseline, predictions=tuple(predictions),
                unavailable=unavailable, choice=best.name, reason=reason,
                overrides=tuple(preset_overrides(best.name)), overlap=overlap, upfront_s=upfront, savings=savings,
                out_of_reach=out, reused=tuple(memo.reused))


def one_after_the_other(c: Composition) -> Composition:
    """``c`` predicted with its draw and update one after the other: the step's work, which the choice compares.
    The overlap packs that work differently by candidate on split cores, and a choice by the overlapped step took
    DOTS's candidates on `balanced`, whose signal the plan predicts high there: -1.2 points against GRPO, p =
    0.0009, where the choice by work keeps GRPO's accuracy (docs/benchmarks.md, "Every idea tried", row "The plan
    ranks the candidates by their overlapped step"). The screen's pass a lag-1 step runs ahead is the trainer's work
    after the update (rlcore/plan.py), so it is counted in full here, not as hidden beside the generate call (a
    choice that counted it hidden took `grpo_screen`, 80 candidates scored a step, over `grpo_prescreen_18`'s 54:
    64.1 s against 47.4-54.7 s for the seeds that took `grpo_prescreen`, S55)."""
    return replace(c, overlap=False, screen_ahead=c.screen_ahead and not c.overlap, screen_in_sampler=False)


def saving(technique: str, with_it: Prediction, without: Prediction) -> str:
    """One line: what ``technique`` saves a candidate on this pool against the same candidate without it
    (rlcore/plan.py ``without_rule``): rollouts a step and per informative group, the effective ratio, the step.
    E.g. ``waves on dots_screen_waves: 88 rollouts a step for 13.8 informative groups (6.3 a group, effective ratio
    1.00) against 80 for 14.6 (5.5, 0.73) without; its step 0.412 s against 0.380 s (+8%)``."""
    def per(p: Prediction) -> str:
        return f"{p.generated / p.informative:.1f}" if p.informative else "-"

    return (f"{technique} on {with_it.name}: {with_it.generated:.0f} rollouts a step for {with_it.informative:.1f} "
            f"informative groups ({per(with_it)} a group, effective ratio {with_it.effective_ratio:.2f}) against "
            f"{without.generated:.0f} for {without.informative:.1f} ({per(without)}, {without.effective_ratio:.2f}) "
            f"without; its step {with_it.step_s:.3f} s against {without.step_s:.3f} s "
            f"({with_it.step_s / without.step_s - 1:+.0%})")


def planned_config(cfg: Config, plan: Plan) -> Config:
    """The config a ``plan.auto`` run trains: its own with the chosen candidate's keys, and, where the choice
    runs PODS or replay, the adaptive composition (rlcore/adaptive_composition.py), which turns them down during
    the run as the fresh groups' measured informativeness rises."""
    chosen = candidate_config(cfg, plan.choice)
    if chosen.pods.enabled or chosen.replay.enabled:
        chosen = with_overrides(chosen, ["adapt.enabled=true"])
    return chosen
