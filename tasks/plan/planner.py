"""The plan's measurements and its record: the pool's pass rates, the timed probe (tasks/plan/probe.py), the
candidates read from their configs, and what the run then trains (rlcore/plan.py has the prediction).

The pool is measured by the calibrate stage's reference rollouts (K prompts x g rollouts, done anyway), each
reference prompt weighted by the share of the pool its level holds over its share of the reference set (the set is
stratified by level), and, where every prompt has a worked solution, by the screen's likelihood of each reference
prompt's solution (one forward pass each).

The plan also records the overlap's lag for the config its chosen candidate trains (``Plan.overlap``, decided by
tasks/overlap/lag.py ``decide_lag`` with the chosen candidate's predicted step); a run without the plan decides it
in its own stage (tasks/stages.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlcore.overlap_lag import LagChoice
from rlcore.plan import Composition, PoolStats, Prediction, predict, without_rule
from rlcore.plan_choice import RunClock, choose, out_of_reach, run_clock
from rlcore.seeding import derive_seed
from rlcore.step_costs import CallCost, UnitCosts
from tasks.calibration.record import Calibration
from tasks.config import Config, ConfigError
from tasks.config.load import preset_overrides, with_overrides
from tasks.data.prompts import PromptRecord
from tasks.overlap.concurrent import SamplerHandover
from tasks.overlap.lag import decide_lag, lag_from_json, lag_to_json
from tasks.plan.probe import ProbeInputs, probe_costs
from tasks.policy import Policy
from tasks.records.files import write_json
from tasks.records.progress import pulse
from tasks.selection.screen import policy_likelihood
from tasks.training.techniques import step_rules

log = logging.getLogger("rlsift.plan")


def reads_upfront(cfg: Config) -> dict[str, bool]:
    """Whether a run of ``cfg`` reads what the score and calibrate stages measure before training: DOTS
    (embeddings, labels), ScalingRL (CoT complexity, measured difficulty) and GAIN-RL (angle) do, and ``plan.auto``
    (the plan reads the calibration, and its choice is not known beforehand); plain GRPO and PODS do not. The
    pipeline runs both stages always; the benchmark's clock counts them only where they are read."""
    dots, cc = cfg.select.method == "dots", cfg.curriculum.enabled
    return {"score": dots or cc or cfg.gain.enabled or cfg.plan.auto, "calibrate": dots or cc or cfg.plan.auto}


def composition(name: str, cfg: Config, pool_size: int = 0) -> Composition:
    """What ``cfg`` does a step and before its first, as rlcore.plan predicts it (``pool_size``: prompts the score
    stage embeds)."""
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
        rules=step_rules(cfg, pool_size), screen_ahead=sc.screen > 1 and sc.screen_ahead and sampler_apart(cfg),
        round_ahead=sc.round_ahead and sampler_apart(cfg) and not (dots and cal.reference == "fresh"))


def sampler_apart(cfg: Config) -> bool:
    """Whether a run of ``cfg`` generates apart from its trainer (tasks/overlap/concurrent.py ``Sampler.apart``), as
    far as its config says before training: a server, or lag 1. ``overlap.lag=auto`` counts as apart: on a CPU whose
    cores fit both sides it is lag 1, and on a shared device the overlap's probe decides after the plan (lag 0 there
    makes the plan's screen the cheaper by the pass it hides)."""
    return cfg.rollout.engine != "hf" or cfg.overlap.lag != 0


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
        likelihood = policy_likelihood(policy, temperature=cfg.rollout.temperature,
                                       max_new_tokens=cfg.rollout.max_new_tokens,
                                       micro_batch_tokens=cfg.train.micro_batch_tokens, device=device)
        screen = tuple(float(q) for q in likelihood(refs))
    levels = [r.level for r in refs]
    in_pool, in_refs = Counter(r.level for r in pool), Counter(levels)
    return PoolStats(successes=tuple(int(round(float(s) * g)) for s in calibration.success), g=g,
                     levels=tuple(levels), screen=screen,
                     weights=tuple(in_pool[lv] / len(pool) / in_refs[lv] for lv in levels))


def probe_records(pool: list[PromptRecord], calibration: Calibration, cfg: Config) -> list[PromptRecord]:
    """The probes' prompts: the first ``plan.probe_prompts`` reference prompts."""
    return calibration.first(pool, cfg.plan.probe_prompts)


@dataclass(frozen=True)
class Plan:
    """What the plan measured, predicted and chose; saved as the run's ``plan.json``.

    ``shares``: the pool's solved / unsolved / mixed shares at g rollouts; ``costs``: the probe's;
    ``baseline``: plain GRPO's prediction; ``predictions``: each candidate's; ``unavailable``: candidates left
    out and why; ``choice``, ``reason``: the chosen candidate and why in one line; ``overrides``: its keys;
    ``overlap``: the overlap's lag for the chosen candidate's config, and why (None in a plan saved before it);
    ``upfront_s``: what this run spends before its first step and plain GRPO would not: its calibration and the
    plan (measured) and the scoring of its pool (predicted); ``savings``: for each technique inside a candidate's step
    (rlcore/step_rules.py: the waves, the skip), what it saves on this pool against the candidate without it
    (:func:`saving`); ``out_of_reach``: candidates the probe stopped measuring for once what every step pays was
    timed, and why (tasks/plan/probe.py): their predictions leave out what they alone pay and was not timed, so
    their steps and clocks are lower bounds (their savings say so)."""

    shares: dict[str, float]
    g: int
    costs: UnitCosts
    baseline: Prediction
    predictions: tuple[Prediction, ...]
    unavailable: dict[str, str]
    choice: str
    reason: str
    overrides: tuple[str, ...]
    overlap: LagChoice | None = None
    upfront_s: float = 0.0
    savings: tuple[str, ...] = ()
    out_of_reach: dict[str, str] = field(default_factory=dict)

    @property
    def chosen(self) -> Prediction:
        return next((p for p in self.predictions if p.name == self.choice), self.baseline)

    @property
    def clock(self) -> RunClock:
        """This run's predicted clock over plain GRPO's (rlcore/plan_choice.py :class:`RunClock`): the chosen
        candidate's training clock, and with what the run spends before its first step (``upfront_s``) in place of
        its predicted calibration and scoring. Every place that shows a plan's clock shows this record's
        :meth:`~RunClock.text` or its two figures."""
        return run_clock(self.chosen, self.baseline, self.upfront_s)

    def metrics(self) -> dict[str, float]:
        """``plan/*``: one value each, at step 0."""
        c, base, fx = self.costs, self.baseline, self.costs.fixed
        return {"plan/pool_solved": self.shares["solved"], "plan/pool_unsolved": self.shares["unsolved"],
                "plan/pool_mixed": self.shares["mixed"],
                "plan/generate_us_per_token": 1e6 * base.generate_s / max(base.generated_tokens, 1.0),
                "plan/update_us_per_token": 1e6 * c.update.per_token(base.updated_tokens),
                "plan/optimizer_ms": 1e3 * fx.optimizer_s, "plan/bookkeeping_ms": 1e3 * fx.step_s,
                "plan/checkpoint_ms": 1e3 * fx.round_s, "plan/predictor_fit_ms": 1e3 * fx.fit_s,
                "plan/upfront_s": self.upfront_s, "plan/predicted_training_clock": self.clock.training,
                "plan/predicted_clock_with_plan": self.clock.with_plan,
                "plan/predicted_effective_ratio": self.chosen.effective_ratio} | self._overlap_metrics()

    def tags(self) -> dict[str, str]:
        """The MLflow run's ``rlsift.plan.*`` tags: the choice, why, and the clock's text (:attr:`clock`)."""
        return {"rlsift.plan.choice": self.choice, "rlsift.plan.reason": self.reason,
                "rlsift.plan.clock": self.clock.text()}

    def _overlap_metrics(self) -> dict[str, float]:
        o = self.overlap
        if o is None:
            return {}
        return {"plan/overlap_lag": float(o.lag)} | ({} if o.probe is None else {
            "plan/overlap_at_once_ratio": o.probe.ratio, "plan/overlap_sequential_s": o.probe.sequential_s})

    def rows(self) -> list[dict[str, Any]]:
        """One row per prediction (the baseline first) for tables: the Prefect artifact, ``rlsift plan``."""
        out = []
        for p in (self.baseline, *self.predictions):
            if p.name == self.baseline.name and p is not self.baseline:
                continue
            chosen = ("yes" if p.name == self.choice else
                      f"out of reach ({self.out_of_reach[p.name]}): its figures are lower bounds"
                      if p.name in self.out_of_reach
                      else "")
            out.append({"composition": p.name, "chosen": chosen,
                        "effective_ratio": round(p.effective_ratio, 3),
                        "informative_groups": round(p.signal, 1), "vs_grpo_signal": round(
                            p.signal / self.baseline.signal, 2) if self.baseline.signal else None,
                        "generated_rollouts": round(p.generated, 1),
                        "rollouts_per_informative": round(p.generated / p.signal, 2) if p.signal else None,
                        "step_s": round(p.step_s, 3),
                        "fixed_s": round(p.fixed_s, 3), "upfront_s": round(p.upfront_s, 2),
                        "clock_vs_grpo": round(p.clock, 3)})
        out += [{"composition": name, "chosen": f"left out: {why}"} for name, why in self.unavailable.items()]
        return out

    def summary(self) -> str:
        """The pool and the costs in one line, and the estimates the probe cannot trust, where there are any
        (``UnitCosts.untrusted``). A cost the probe could not measure is said so, never shown as 0.0 ms."""
        c, s, fx = self.costs, self.shares, self.costs.fixed
        step = (f"a decode step {_ms(c.generate.step_s)} whatever its rows" if c.generate.step_s > 0 else
                "a decode step's cost not told apart from a token's")
        out = (f"pool at g={self.g}: {s['mixed']:.0%} mixed, {s['solved']:.0%} solved, {s['unsolved']:.0%} "
               f"unsolved; a generated token {_per_token(c.generate)}, {step}; an updated one {_per_token(c.update)}; "
               f"a step's fixed costs: optimizer step {_ms(fx.optimizer_s)}, bookkeeping {_ms(fx.step_s)}; a "
               f"round's: checkpoint {_ms(fx.round_s)}, DOTS's predictor {_ms(fx.fit_s)}; "
               f"{c.completion_tokens:.0f} completion and {c.prompt_tokens:.0f} prompt tokens a rollout")
        if c.untrusted:
            out += f". Estimates the probe cannot trust: {'; '.join(c.untrusted)}"
        return out

    def line(self) -> str:
        """The choice, why and its predicted clock in one line (what the terminal shows), each figure once: the
        reason of a chosen candidate states its training clock (and, when the choice weighed it, the clock with the
        plan's own cost: else that is added); the baseline's says why nothing else was chosen, and gets its clock
        added."""
        clock = self.clock
        if self.choice == self.baseline.name:
            return f"{self.reason}; {clock.text().removeprefix(f'{self.choice}: ')}"
        if f"{clock.with_plan:.2f}x" in self.reason:
            return self.reason
        return (f"{self.reason}; {clock.with_plan:.2f}x with the plan's own cost ({clock.upfront_s:.0f} s before the "
                "first step)")

    def text(self) -> str:
        """The plan for a terminal (``rlsift plan``): :meth:`line`, the pool and the costs, the overlap, and the
        predictions as a plain table with aligned columns (:meth:`markdown` is the same for files and MLflow)."""
        rows = self.rows()
        cols = [k for k in rows[0] if any(r.get(k) is not None for r in rows)]
        cells = [cols] + [["" if r.get(k) is None else str(r[k]) for k in cols] for r in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
        return "\n".join([f"plan: {self.line()}", self.summary(),
                          *([f"overlap: {self.overlap.reason}"] if self.overlap is not None else []), "", *table])

    def markdown(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        run = f"This run: {self.clock.text()}."
        lines = [f"**Plan: {self.reason}**", "", self.summary(), "", run, "",
                 *([f"**Overlap: {self.overlap.reason}**", ""] if self.overlap is not None else []),
                 *[f"**{line}**" for line in self.savings], *([""] if self.savings else []),
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k in cols) + " |" for r in rows]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"shares": self.shares, "g": self.g, "costs": asdict(self.costs), "baseline": asdict(self.baseline),
                "predictions": [asdict(p) for p in self.predictions], "unavailable": self.unavailable,
                "choice": self.choice, "reason": self.reason, "overrides": list(self.overrides),
                "overlap": None if self.overlap is None else lag_to_json(self.overlap), "upfront_s": self.upfront_s,
                "savings": list(self.savings), "out_of_reach": self.out_of_reach}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(shares=d["shares"], g=d["g"], costs=costs_from_json(d["costs"]),
                   baseline=Prediction(**d["baseline"]), predictions=tuple(Prediction(**p) for p in d["predictions"]),
                   unavailable=d["unavailable"], choice=d["choice"], reason=d["reason"],
                   overrides=tuple(d["overrides"]),
                   overlap=lag_from_json(d["overlap"]) if d.get("overlap") is not None else None,
                   upfront_s=d.get("upfront_s", 0.0), savings=tuple(d.get("savings", ())),
                   out_of_reach=d.get("out_of_reach", {}))

    def save(self, path: Path) -> Path:
        write_json(path, self.to_json())
        (path.parent / "plan.md").write_text(self.markdown())
        return path

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))


def costs_from_json(d: dict[str, Any]) -> UnitCosts:
    """``UnitCosts`` of a ``plan.json``; one saved before the probe timed calls of several sizes (seconds a token,
    ``generate_s``, ``update_s``, ``forward_s``) reads as lines through 0 with no fixed costs."""
    if "generate" in d:
        return UnitCosts.from_dict(d)
    return UnitCosts(generate=CallCost(0.0, d["generate_s"]), update=CallCost(0.0, d["update_s"]),
                     forward=CallCost(0.0, d["forward_s"]), completion_tokens=d["completion_tokens"],
                     prompt_tokens=d["prompt_tokens"], solution_tokens=d.get("solution_tokens", 0.0))


def _per_token(cost: CallCost) -> str:
    """What a token costs at the probe's smallest and largest calls, and whether that falls with the batch."""
    if len(cost.tokens) < 2:
        return f"{1e6 * cost.token_s:.0f} us"
    calls = sorted(zip(cost.tokens, cost.steps or (0.0,) * len(cost.tokens), strict=True))
    (lo, lo_steps), (hi, hi_steps) = calls[0], calls[-1]
    small, large = cost.per_token(lo, lo_steps), cost.per_token(hi, hi_steps)
    trend = ("falls with the batch" if large < (1 - FLAT) * small else
             f"flat: within {FLAT:.0%} at any batch")
    return f"{1e6 * small:.0f} us in a call of {lo:.0f} tokens, {1e6 * large:.0f} us in one of {hi:.0f} ({trend})"


def _ms(seconds: float) -> str:
    """``seconds`` in milliseconds with the digits a small one needs (``-`` for a cost not measured: 0)."""
    if seconds <= 0:
        return "-"
    ms = 1e3 * seconds
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3g} ms"


#: A token's cost that moves less than this between the probe's smallest and largest calls is called flat.
FLAT = 0.15


def make_plan(cfg: Config, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
              device: torch.device | str = "cpu", candidates: tuple[str, ...] | None = None, spent_s: float = 0.0,
              scratch: Path | None = None, handover: SamplerHandover | None = None) -> Plan:
    """Measure the pool and the costs (tasks/plan/probe.py), predict every candidate (``plan.candidates``
    unless given) against ``plan.baseline`` and choose one whose predicted clock earns back what this run spent
    before its first step (rlcore/plan_choice.py ``choose``). ``spent_s``: the seconds the run spent on its calibration
    (on this run's clock with the plan's own); ``scratch``: where the probe writes its scratch files;
    ``handover``: where the overlap probe keeps its generator process for the training
    (tasks/overlap/lag.py ``decide_lag``)."""
    with pulse("plan", log) as say:  # a line per probe and candidate, and one every few seconds in a long probe
        return _make_plan(cfg, policy, pool, calibration, device, candidates, spent_s, scratch, handover, say)


def _make_plan(cfg: Config, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
               device: torch.device | str, candidates: tuple[str, ...] | None, spent_s: float, scratch: Path | None,
               handover: SamplerHandover | None, say: Callable[[str], None]) -> Plan:
    t0 = time.perf_counter()
    pc = cfg.plan
    say(f"the pool's pass rates from the calibration's {len(calibration.indices)} reference prompts" + (
        ", the screen's likelihood of their solutions" if all(r.solution for r in pool) else ""))
    stats = pool_stats(policy, pool, calibration, cfg, device)
    refs = probe_records(pool, calibration, cfg)
    comps, configs, unavailable = [], {}, {}
    for name in dict.fromkeys(candidates or pc.candidates):
        configs[name] = candidate_config(cfg, name)
        c = composition(name, configs[name], len(pool))
        if c.screen > 1 and stats.screen is None:
            unavailable[name] = "the screen needs a worked solution for every prompt"
            continue
        comps.append(c)
    base = composition(pc.baseline, candidate_config(cfg, pc.baseline), len(pool))
    out: dict[str, str] = {}  # candidates out of reach once what every step pays is timed, and why

    def live(step_costs: UnitCosts) -> list[Composition]:
        """The baseline and the candidates still in reach (rlcore/plan_choice.py ``out_of_reach``): predicted with
        the costs only some candidates pay at 0, against the baseline, which pays none of them."""
        if not pc.prune or base.screen > 1 or base.predictor or base.scored:
            return [base, *comps]
        lower_base, lower = predict(comps, base, stats, step_costs)
        spent = spent_s + time.perf_counter() - t0
        out.update((c.name, why) for c, p in zip(comps, lower, strict=True) if c.name != base.name
                   and (why := out_of_reach(p, lower_base, pc.min_signal, spent)) is not None)
        if out:
            say(f"probe: {', '.join(out)} out of reach (each predicted with what it alone pays at 0), so not probed "
                "further")
        return [base, *(c for c in comps if c.name not in out)]

    dots = {c.name: configs[c.name] for c in comps if c.predictor}
    costs = probe_costs(policy, cfg, ProbeInputs(records=refs, pool=pool, calibration=calibration,
                                                 comps=[base, *comps], stats=stats, dots=dots, scratch=scratch,
                                                 live=live),
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
    so_far = spent_s + time.perf_counter() - t0 + len(pool) * costs.score_s  # before the first step, without the lag
    best, reason = choose(baseline, predictions, pc.min_signal, so_far)
    chosen = candidate_config(cfg, best.name)
    say(f"chose {best.name}; the overlap's lag for it" + (
        " (the draw and the update timed alone and at once where that pays)" if chosen.overlap.lag == "auto" else ""))
    overlap = decide_lag(chosen, policy, refs, device, handover=handover,
                         expected=(best.generate_s + best.forward_s, best.update_s + best.fixed_s))
    upfront = spent_s + time.perf_counter() - t0 + len(pool) * costs.score_s
    return Plan(shares=stats.shares, g=stats.g, costs=costs, baseline=baseline, predictions=tuple(predictions),
                unavailable=unavailable, choice=best.name, reason=reason,
                overrides=tuple(preset_overrides(best.name)), overlap=overlap, upfront_s=upfront, savings=savings,
                out_of_reach=out)


def saving(technique: str, with_it: Prediction, without: Prediction) -> str:
    """One line: what ``technique`` saves a candidate on this pool against the same candidate without it
    (rlcore/plan.py ``without_rule``): rollouts a step and per informative group, the effective ratio, the step.
    E.g. ``waves on dots_screen_waves: 88 rollouts a step for 13.8 informative groups (6.3 a group, effective ratio
    1.00) against 80 for 14.6 (5.5, 0.73) without; its step 0.412 s against 0.380 s (+8%)``."""
    def per(p: Prediction) -> str:
        return f"{p.generated / p.signal:.1f}" if p.signal else "-"

    return (f"{technique} on {with_it.name}: {with_it.generated:.0f} rollouts a step for {with_it.signal:.1f} "
            f"informative groups ({per(with_it)} a group, effective ratio {with_it.effective_ratio:.2f}) against "
            f"{without.generated:.0f} for {without.signal:.1f} ({per(without)}, {without.effective_ratio:.2f}) "
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
