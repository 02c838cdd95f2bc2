"""The plan's measurements and its record: the pool's pass rates, a timed probe of generation and update, the
candidates read from their configs, and what the run then trains (rlcore/plan.py has the prediction).

The pool is measured by the calibrate stage's reference rollouts (K prompts x g rollouts, done anyway) and, where
every prompt has a worked solution, by the screen's likelihood of each reference prompt's solution (one forward
pass each). The probe generates ``rollout.n`` rollouts for ``plan.probe_prompts`` reference prompts, times a
no-grad forward and a forward and backward pass over them (the update's work, without an optimizer step: the
weights do not change) and a teacher-forced pass over prompts and solutions (the screen's work).

The overlap (``overlap.lag``, :func:`decide_lag`): as configured, or for ``auto`` rlcore.plan.choose_lag, from
where the sampler and the trainer run (tasks/training/overlap.py ``separate_devices``) and, where they share a
device, :func:`probe_overlap`: the same draw and update, alone and at once. The plan records the choice for the
config its chosen candidate trains; a run without the plan decides it in its own stage (tasks/stages.py).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore.plan import (
    Composition,
    LagChoice,
    OverlapProbe,
    PoolStats,
    Prediction,
    UnitCosts,
    choose,
    choose_lag,
    predict,
)
from rlcore.seeding import derive_seed
from tasks.config import Config, ConfigError
from tasks.config_load import preset_overrides, with_overrides
from tasks.data.prompts import PromptRecord
from tasks.model.forward import token_logprobs
from tasks.model.policy import Policy
from tasks.model.rollout import Generation
from tasks.records.files import write_json
from tasks.training.calibration import Calibration
from tasks.training.overlap import SamplingPolicy, separate_devices, thread_split
from tasks.training.screen import policy_likelihood


def composition(name: str, cfg: Config) -> Composition:
    """What ``cfg`` does a step, as rlcore.plan predicts it."""
    sc, tc = cfg.select, cfg.train
    dots = sc.method == "dots"
    return Composition(
        name=name, prompts=tc.prompts_per_step, n=cfg.rollout.n, m=cfg.kept_per_prompt, draw=sc.method,
        weighting=sc.weighting, alpha=sc.alpha, tau=sc.tau, screen=sc.screen,
        fresh_frac=cfg.replay.fresh_frac if cfg.replay.enabled else 1.0,
        dynamic=(cfg.dynamic.oversample, cfg.dynamic.max_rounds) if cfg.dynamic.enabled else None,
        reference_rollouts=(cfg.calibrate.k * cfg.calibrate.g / tc.round_steps
                            if dots and cfg.calibrate.reference == "fresh" else 0.0),
        skip_silent=tc.skip_zero_advantage and tc.kl_coef == 0)


def candidate_config(cfg: Config, name: str) -> Config:
    """``cfg`` with the candidate's keys (its preset or benchmark-arm file) and the plan off: what a run trains."""
    try:
        return with_overrides(cfg, [*preset_overrides(name), "plan.auto=false"])
    except ConfigError as err:
        raise ConfigError(f"plan.candidates: {name}: {err}") from None


def pool_stats(policy: Policy, pool: list[PromptRecord], calibration: Calibration, cfg: Config,
               device: torch.device | str = "cpu") -> PoolStats:
    """The reference set's successes and levels, and the screen's likelihoods where every prompt has a solution."""
    g = cfg.calibrate.g
    refs = [pool[i] for i in calibration.indices]
    screen = None
    if all(r.solution for r in pool):
        likelihood = policy_likelihood(policy, temperature=cfg.rollout.temperature,
                                       max_new_tokens=cfg.rollout.max_new_tokens,
                                       micro_batch_tokens=cfg.train.micro_batch_tokens, device=device)
        screen = tuple(float(q) for q in likelihood(refs))
    return PoolStats(successes=tuple(int(round(float(s) * g)) for s in calibration.success), g=g,
                     levels=tuple(r.level for r in refs), screen=screen)


def probe_costs(policy: Policy, records: list[PromptRecord], cfg: Config, seed: int,
                device: torch.device | str = "cpu") -> UnitCosts:
    """Seconds per generated, updated and teacher-forced token, timed on ``records`` (module docstring)."""
    rc, tc = cfg.rollout, cfg.train
    prompts = policy.prompts(records)
    policy.engine.generate(prompts[:1], n=1, seed=seed)  # warm-up: first-call costs are not a token's
    t0 = time.perf_counter()
    gen = policy.engine.generate(prompts, n=rc.n, seed=seed)
    generate_s = time.perf_counter() - t0
    rows = [gen.prompt_ids[i // rc.n] for i in range(gen.completion_ids.shape[0])]
    update = _update_probe(policy, gen, cfg, device)
    update(slice(0, rc.n))  # warm-up: the first backward allocates what later ones reuse
    update_s = update(slice(None))
    prompt_tokens = sum(int(r.numel()) for r in rows)
    updated = prompt_tokens + gen.tokens
    solution_tokens = forward_s = 0.0
    if all(r.solution for r in records):
        tok = policy.tokenizer
        solution_tokens = sum(len(tok(r.solution, add_special_tokens=False)["input_ids"]) + 1 for r in records)
        likelihood = policy_likelihood(policy, temperature=rc.temperature, max_new_tokens=rc.max_new_tokens,
                                       micro_batch_tokens=tc.micro_batch_tokens, device=device)
        t0 = time.perf_counter()
        likelihood(records)
        forward_s = (time.perf_counter() - t0) / max(solution_tokens + prompt_tokens / rc.n, 1)
    return UnitCosts(generate_s=generate_s / max(gen.tokens, 1), update_s=update_s / max(updated, 1),
                     forward_s=forward_s, completion_tokens=gen.tokens / len(rows),
                     prompt_tokens=prompt_tokens / len(rows), solution_tokens=solution_tokens / len(records))


def _update_probe(policy: Policy, gen: Generation, cfg: Config, device: torch.device | str):
    """``rows -> seconds``: the update's work on rows of ``gen`` (a slice): a no-grad forward (pi_old), then a
    forward and backward pass; the gradients are dropped, the weights do not change."""
    rc, tc = cfg.rollout, cfg.train
    prompts = [gen.prompt_ids[i // gen.n] for i in range(gen.completion_ids.shape[0])]
    pad, model = policy.tokenizer.pad_token_id, policy.model

    def update(r: slice) -> float:
        args = (model, prompts[r], gen.completion_ids[r], gen.completion_mask[r], pad, rc.temperature, device)
        t0 = time.perf_counter()
        with torch.no_grad():
            token_logprobs(*args, max_tokens=tc.micro_batch_tokens)
        token_logprobs(*args, max_tokens=tc.micro_batch_tokens).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return update


#: The overlap probe repeats its draw, update and both at once until the time one after the other adds up to this
#: many seconds (a tiny model's step is a tenth of a second, within a loaded machine's noise), at most
#: :data:`OVERLAP_PROBE_REPEATS` times.
OVERLAP_PROBE_S = 2.0
OVERLAP_PROBE_REPEATS = 5


def probe_overlap(policy: Policy, records: list[PromptRecord], cfg: Config, seed: int,
                  device: torch.device | str = "cpu") -> OverlapProbe:
    """One draw (``rollout.n`` rollouts of each of ``records``) and one update over its rows (the plan's probe:
    forward and backward, no optimizer step), timed alone one after the other with every thread (lag 0), then at
    once as a lag-1 run has them: the draw in the generator process (tasks/training/overlap.py ``SamplingPolicy``,
    its own share of the threads, a copy of the weights on the same device), the update here. Each side has had
    its first call before it is timed, the generator process's start is not timed, and the three are repeated in
    turn (:data:`OVERLAP_PROBE_S`) so that each repeat sees the same load; the record holds their medians."""
    rc = cfg.rollout
    prompts = policy.prompts(records)
    policy.engine.generate(prompts[:1], n=rc.n, seed=seed)  # warm-up: first-call costs are not the draw's
    gen = policy.engine.generate(prompts, n=rc.n, seed=seed)
    update = _update_probe(policy, gen, cfg, device)
    update(slice(None))  # warm-up: the update at once runs on the same rows
    total = torch.get_num_threads()
    sampling = SamplingPolicy(policy, 1, threads=cfg.overlap.generator_threads)
    times: list[tuple[float, float, float]] = []  # (draw, update, at once) of each repeat
    try:
        engine = sampling.policy.engine
        engine.generate(prompts[:1], n=rc.n, seed=seed)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsift-probe") as pool:
            while not times or (len(times) < OVERLAP_PROBE_REPEATS
                                and sum(d + u for d, u, _ in times) < OVERLAP_PROBE_S):
                torch.set_num_threads(total)  # alone: every thread, as lag 0 has them
                t0 = time.perf_counter()
                policy.engine.generate(prompts, n=rc.n, seed=seed)
                draw_s = time.perf_counter() - t0
                update_s = update(slice(None))
                torch.set_num_threads(thread_split(total, cfg.overlap.generator_threads)[1])
                t0 = time.perf_counter()
                drawn = pool.submit(engine.generate, prompts, rc.n, seed)
                update(slice(None))
                drawn.result()
                times.append((draw_s, update_s, time.perf_counter() - t0))
    finally:
        sampling.close()
    draw_s, update_s, at_once_s = (statistics.median(t) for t in zip(*times, strict=True))
    return OverlapProbe(draw_s=draw_s, update_s=update_s, at_once_s=at_once_s, repeats=len(times))


def decide_lag(cfg: Config, policy: Policy, records: list[PromptRecord],
               device: torch.device | str = "cpu") -> LagChoice:
    """``overlap.lag`` for training ``cfg``: 0 or 1 as set, or for ``auto`` rlcore.plan.choose_lag from where the
    sampler and the trainer run and, where they share a device, :func:`probe_overlap` on ``records``."""
    oc = cfg.overlap
    if oc.lag != "auto":
        return LagChoice(oc.lag, "config", f"lag {oc.lag}: overlap.lag={oc.lag} in the config")
    separate = separate_devices(policy.engine, device, oc.generator_threads)
    probe = None if separate else probe_overlap(policy, records, cfg, derive_seed(cfg.seed, "overlap-probe"), device)
    return choose_lag(separate, probe, oc.min_gain)


def probe_records(pool: list[PromptRecord], calibration: Calibration, cfg: Config) -> list[PromptRecord]:
    """The probes' prompts: the first ``plan.probe_prompts`` reference prompts."""
    return [pool[i] for i in calibration.indices[: cfg.plan.probe_prompts]]


def lag_to_json(choice: LagChoice) -> dict[str, Any]:
    return asdict(choice)


def lag_from_json(d: dict[str, Any]) -> LagChoice:
    probe = d.get("probe")
    return LagChoice(lag=d["lag"], basis=d["basis"], reason=d["reason"],
                     probe=OverlapProbe(**probe) if probe is not None else None)


@dataclass(frozen=True)
class Plan:
    """What the plan measured, predicted and chose; saved as the run's ``plan.json``.

    ``shares``: the reference set's solved / unsolved / mixed shares at g rollouts; ``costs``: the probe's;
    ``baseline``: plain GRPO's prediction; ``predictions``: each candidate's; ``unavailable``: candidates left
    out and why; ``choice``, ``reason``: the chosen candidate and why in one line; ``overrides``: its keys;
    ``overlap``: the overlap's lag for the chosen candidate's config, and why (None in a plan saved before it)."""

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

    @property
    def chosen(self) -> Prediction:
        return next((p for p in self.predictions if p.name == self.choice), self.baseline)

    def metrics(self) -> dict[str, float]:
        """``plan/*``: one value each, at step 0."""
        c = self.costs
        return {"plan/pool_solved": self.shares["solved"], "plan/pool_unsolved": self.shares["unsolved"],
                "plan/pool_mixed": self.shares["mixed"], "plan/generate_us_per_token": 1e6 * c.generate_s,
                "plan/update_us_per_token": 1e6 * c.update_s, "plan/predicted_clock": self.chosen.clock,
                "plan/predicted_effective_ratio": self.chosen.effective_ratio} | self._overlap_metrics()

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
            out.append({"composition": p.name, "chosen": "yes" if p.name == self.choice else "",
                        "effective_ratio": round(p.effective_ratio, 3),
                        "informative_groups": round(p.signal, 1), "vs_grpo_signal": round(
                            p.signal / self.baseline.signal, 2) if self.baseline.signal else None,
                        "generated_rollouts": round(p.generated, 1), "step_s": round(p.step_s, 3),
                        "clock_vs_grpo": round(p.clock, 3)})
        out += [{"composition": name, "chosen": f"left out: {why}"} for name, why in self.unavailable.items()]
        return out

    def summary(self) -> str:
        """The pool and the costs in one line."""
        c, s = self.costs, self.shares
        ratio = c.generate_s / c.update_s if c.update_s else float("inf")
        return (f"pool at g={self.g}: {s['mixed']:.0%} mixed, {s['solved']:.0%} solved, {s['unsolved']:.0%} unsolved; "
                f"a generated token {1e6 * c.generate_s:.0f} us, an updated one {1e6 * c.update_s:.0f} us "
                f"({ratio:.1f}x); {c.completion_tokens:.0f} completion and {c.prompt_tokens:.0f} prompt tokens a "
                "rollout")

    def markdown(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        lines = [f"**Plan: {self.reason}**", "", self.summary(), "",
                 *([f"**Overlap: {self.overlap.reason}**", ""] if self.overlap is not None else []),
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k in cols) + " |" for r in rows]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"shares": self.shares, "g": self.g, "costs": asdict(self.costs), "baseline": asdict(self.baseline),
                "predictions": [asdict(p) for p in self.predictions], "unavailable": self.unavailable,
                "choice": self.choice, "reason": self.reason, "overrides": list(self.overrides),
                "overlap": None if self.overlap is None else lag_to_json(self.overlap)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(shares=d["shares"], g=d["g"], costs=UnitCosts(**d["costs"]), baseline=Prediction(**d["baseline"]),
                   predictions=tuple(Prediction(**p) for p in d["predictions"]), unavailable=d["unavailable"],
                   choice=d["choice"], reason=d["reason"], overrides=tuple(d["overrides"]),
                   overlap=lag_from_json(d["overlap"]) if d.get("overlap") is not None else None)

    def save(self, path: Path) -> Path:
        write_json(path, self.to_json())
        (path.parent / "plan.md").write_text(self.markdown())
        return path

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))


def make_plan(cfg: Config, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
              device: torch.device | str = "cpu", candidates: tuple[str, ...] | None = None) -> Plan:
    """Measure the pool and the unit costs, predict every candidate (``plan.candidates`` unless given) against
    ``plan.baseline`` and choose."""
    pc = cfg.plan
    stats = pool_stats(policy, pool, calibration, cfg, device)
    refs = probe_records(pool, calibration, cfg)
    costs = probe_costs(policy, refs, cfg, derive_seed(cfg.seed, "plan-probe"), device)
    comps, unavailable = [], {}
    for name in dict.fromkeys(candidates or pc.candidates):
        c = composition(name, candidate_config(cfg, name))
        if c.screen > 1 and stats.screen is None:
            unavailable[name] = "the screen needs a worked solution for every prompt"
            continue
        comps.append(c)
    base = composition(pc.baseline, candidate_config(cfg, pc.baseline))
    baseline, predictions = predict(comps, base, stats, costs)
    best, reason = choose(baseline, predictions, pc.min_signal)
    overlap = decide_lag(candidate_config(cfg, best.name), policy, refs, device)
    return Plan(shares=stats.shares, g=stats.g, costs=costs, baseline=baseline, predictions=tuple(predictions),
                unavailable=unavailable, choice=best.name, reason=reason,
                overrides=tuple(preset_overrides(best.name)), overlap=overlap)


def planned_config(cfg: Config, plan: Plan) -> Config:
    """The config a ``plan.auto`` run trains: its own with the chosen candidate's keys, and, where the choice
    runs PODS or replay, the adaptive composition (rlcore/adaptive_composition.py), which turns them down during
    the run as the fresh groups' measured informativeness rises."""
    chosen = candidate_config(cfg, plan.choice)
    if chosen.pods.enabled or chosen.replay.enabled:
        chosen = with_overrides(chosen, ["adapt.enabled=true"])
    return chosen
