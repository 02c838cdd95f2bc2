"""The plan's probe: what the work of a step costs on this device, timed before training (docs/algorithms.md 9.1).

rlcore/plan.py predicts each candidate's clock from these measurements (:class:`rlcore.step_costs.UnitCosts`):

- **Generation at the candidates' batch sizes** (tasks/plan/probe_generation.py): a call as small as the smallest
  first call a candidate makes and one as large as the baseline's largest (a step's draw, DOTS's reference
  rollouts, each cut at ``rollout.chunk``), or the calibration's call as the large one; ``CallCost.fit`` splits the
  two timings into a decode step's cost (a call decodes until its longest completion ends) and a token's. Larger
  calls (DAPO's, PODS's) are predicted on that line, not timed: the probe spends its time at the sizes of the steps
  the plan may choose.
  The same calls give the completion and prompt tokens of a rollout of each level's prompts (a draw that favours
  some levels has their lengths, and its calls their longest).
- **The update** at the smallest batch a candidate updates and the baseline's (its predicted informative groups'
  rows, ``rlcore.plan.update_rows``; larger ones are predicted on the line through the two), as the training step
  runs it: the run's ``policy_update`` through an updater of the probe's own at learning rate 0 (AdamW then leaves
  the weights exactly as they are) on the generated rollouts with rewards that alternate 1, 0, ... so that every
  row is computed. The optimizer step (gradient clipping and AdamW over the trainable parameters) is timed alone,
  with a gradient on every trainable parameter as after a step's backward passes (given before each timed call,
  untimed: under bf16-mixed the update's own step has moved its gradients into the float32 masters and freed them),
  and taken out of each timing; then a round's checkpoint of the weights and that optimizer's state is written to a
  scratch folder, once (tasks/plan/timing.py ``ONCE``).
- **The overlap's split** (where a candidate trains with lag 1 and the sampler and the trainer split a CPU's
  threads, ``ProbeInputs.split``): a generate call of half the baseline's prompts (tasks/plan/probe_split.py
  ``split_prompts``) and the small update on all threads here, then the call in a generator process and the update
  on the trainer's threads at once: the longer one once, the other repeated beside it (tasks/plan/probe_split.py
  ``at_once``; rlcore/plan.py ``overlapped_step`` reads the two paces).
- **The screen's teacher-forced pass** (tasks/plan/probe_screen.py; where a candidate screens) at its candidates'
  count and half of it.
- **A step's bookkeeping**: the draw over the pool, a step's selection and group rows held and written to a scratch
  ledger once a round as the run writes them (tasks/records/ledger/, the same code), and a step's metrics line to a
  scratch outbox and ``metrics.jsonl``; a round's, over its steps.
- **Scoring and DOTS's predictor**, where a candidate reads the scores: one batch of the pool scored (the
  reference prompts first; a run scores its pool only for a choice that reads the scores, tasks/stages.py
  ``score_stage``, and the plan counts it before such a choice's first step), and, where a candidate draws with
  it, DOTS's predictor (tasks/selection/dots.py ``dots_predictor``)
  labelled with the calibration's pass rates on their embeddings, fitted for ``select.predictor.fit_steps`` and
  asked for the pool's predictions, as a round does.

**Kept for the next plan** (tasks/plan/probe_cache.py, ``plan.reuse_probe_hours``): each part's timings are kept
on the machine for the next plan with the same model shape and settings, which reuses each part timed at sizes that
span its own and times the rest (the lengths still come from its own calibration rollouts).

Every timing is repeated until it holds still (tasks/plan/timing.py: the median of the last few samples once they
agree, a cap on samples and seconds); one that never agrees, and a decode step's cost that the two generate calls
cannot tell from a token's, are listed in ``UnitCosts.untrusted``, logged, and shown with the plan (never a 0.0 ms).

**Only for a candidate in reach.** Generation, the update, the optimizer step, the checkpoint and the bookkeeping
are what every step pays, the baseline's too; the screen's pass and DOTS's predictor only some candidates'. Once
the first are timed, the plan may name the candidates still in reach (``ProbeInputs.live``; rlcore/plan_choice.py
``out_of_reach``: predicted with the rest at 0, a lower bound, they could still be chosen, and their saving
could still repay what the planning has cost), and the rest is timed for those only, or not at all
(docs/algorithms.md 9.1: the real model's screen pass took 22 s of a 112 s probe, for candidates that could not
win). After the screen's pass it asks again, before the scoring and the predictor: a candidate that a rival now
predicted in full beats even with those at 0 (``dominated``) gets neither timed.

Deviations: the probe times the single-process update without activation checkpointing (sharded backends and
``train.gradient_checkpointing`` change it); the predictor is timed with the first DOTS candidate's settings; the
calibration's call, where it is the large one, is timed once, not until stable.
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rlcore.advantages import group_advantages
from rlcore.plan import call_rows, draw_calls, update_rows
from rlcore.plan_draw import Composition, PoolStats
from rlcore.step_costs import CallCost, FixedCosts, UnitCosts
from rlcore.types import RolloutGroup
from tasks.calibration.record import Calibration
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.overlap.concurrent import SamplerHandover
from tasks.plan.probe_bookkeeping import probe_bookkeeping
from tasks.plan.probe_cache import ProbeMemo
from tasks.plan.probe_generation import calibration_call, call_lengths, cycle_records, probe_generation
from tasks.plan.probe_screen import probe_screen, screen_counts, solution_lengths
from tasks.plan.probe_split import probe_split, split_prompts
from tasks.plan.timing import CHEAP, COSTLY, ONCE, Timing, Untrusted, time_until_stable
from tasks.policy import Policy
from tasks.records.files import atomic_write
from tasks.selection.dots import dots_predictor
from tasks.selection.features import compute_features
from tasks.update.distributed import optimizer_step
from tasks.update.policy_update import LocalUpdater
from tasks.update.precision import resolve_precision
from tasks.update.updater import LossSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeInputs:
    """What the probe reads: ``records`` (the probe's prompts, cycled where a call needs more), ``pool`` and its
    ``calibration`` (scoring and the predictor), ``comps`` (the baseline first, then the candidates: their call
    sizes and what they read) and ``stats`` (their batch sizes), ``dots`` (the configs of the candidates that draw
    with DOTS, by name: the first one still in reach has its predictor timed), ``scratch`` (a folder for the
    scratch ledger and checkpoint; None: the system's temporary folder) and ``live`` (given the costs timed so far,
    the rest at 0, and which candidates still have costs to time, the candidates still in reach, the baseline first;
    None: every candidate). ``live`` is asked twice: once the costs every step pays are timed, and again after the
    screen's pass, before the scoring and DOTS's predictor. ``split``: (generator, trainer) threads where a candidate
    that overlaps (``Composition.overlap``) splits a CPU's cores, so the probe times each side's slowdown on its
    share; None: no split. ``handover``: where the split's generator process is kept for the training (a lag-1 run
    then samples from it rather than starting its own); None: the probe stops it."""

    records: list[PromptRecord]
    pool: list[PromptRecord]
    calibration: Calibration
    comps: list[Composition]
    stats: PoolStats
    dots: dict[str, Config] = field(default_factory=dict)
    scratch: Path | None = None
    live: Callable[[UnitCosts, Callable[[Composition], bool]], list[Composition]] | None = None
    memo: ProbeMemo = field(default_factory=ProbeMemo)
    split: tuple[int, int] | None = None
    handover: SamplerHandover | None = None


def probe_costs(policy: Policy, cfg: Config, inputs: ProbeInputs, seed: int, device: torch.device | str = "cpu",
                say: Callable[[str], None] = lambda part: None) -> UnitCosts:
    """The unit and fixed costs of a step (module docstring), timed with ``cfg``'s rollouts and update; each part
    ``inputs.memo`` keeps from an earlier probe reused instead (tasks/plan/probe_cache.py), and each part timed
    kept in it. ``say`` hears each probe as it starts (tasks/records/progress.py: the plan's progress lines)."""
    rc, memo = cfg.rollout, inputs.memo
    untrusted = Untrusted()
    records = inputs.records
    part = _Parts(memo, untrusted, say)
    sizes = _generation_sizes(inputs.comps, rc.n, inputs.stats)
    drawn = calibration_call(inputs.calibration.draw, 0, rc.chunk if rc.engine == "hf" else 0)
    if drawn is not None and (kept := part.reuse("generate", sizes)) is not None:
        generate, batches, draws = kept["generate"], [drawn[0]], [drawn[1]]  # lengths from this run's rollouts
    else:
        generate, batches, draws = part.timed("generate", sizes, lambda: probe_generation(
            policy, rc, records, inputs.calibration.draw, sizes, seed, untrusted, say), lambda out: {
            "generate": out[0]})
    (completion, prompt), by_level, lengths = call_lengths([(b, g) for b, (g, _, _) in zip(batches, draws,
                                                                                          strict=True)])
    groups = [g for gen, _, _ in draws for g in probe_groups(gen)]
    update_sizes = _update_sizes(inputs.comps, inputs.stats, rc.n, len(groups))
    if (kept := part.reuse("update", update_sizes)) is None:
        say(f"probe: the update of {update_sizes[0]} and {update_sizes[1]} groups, the optimizer step, a round's "
            "checkpoint")
        kept = part.timed("update", update_sizes, lambda: dict(zip(("update", "optimizer_s", "round_s"), _probe_update(
            policy, groups, update_sizes, cfg, device, inputs.scratch, untrusted), strict=True)))
    update, optimizer_s, round_s = kept["update"], kept["optimizer_s"], kept["round_s"]
    pool_sizes = (len(inputs.pool), len(inputs.pool))
    split = None
    if inputs.split is not None and any(c.overlap for c in inputs.comps):
        prompts = split_prompts(sizes)
        if (kept := part.reuse("split", (prompts, prompts))) is None:
            say(f"probe: a generate call of {prompts} prompts and an update of {update_sizes[0]} groups on "
                f"{inputs.split[0]} and {inputs.split[1]} of {torch.get_num_threads()} threads (the overlap's split)")
            kept = part.timed("split", (prompts, prompts), lambda: {"split": probe_split(
                policy, cfg, cycle_records(records, prompts), groups[:update_sizes[0]], _updater(policy, cfg, device),
                inputs.split, seed, untrusted, inputs.handover)})
        split = kept["split"]
    if (kept := part.reuse("bookkeeping", pool_sizes)) is None:
        say("probe: a step's bookkeeping (its ledger rows and metrics line)")
        kept = part.timed("bookkeeping", pool_sizes, lambda: {"step_s": probe_bookkeeping(
            records, cfg, len(inputs.pool), inputs.scratch, untrusted)})
    costs = UnitCosts(generate=generate, update=update, forward=CallCost(0.0, 0.0), completion_tokens=completion,
                      prompt_tokens=prompt, fixed=FixedCosts(optimizer_s=optimizer_s, step_s=kept["step_s"],
                                                             round_s=round_s),
                      levels=by_level, completion_lengths=lengths, split=split, untrusted=tuple(untrusted))
    comps = inputs.comps if inputs.live is None else inputs.live(costs, unmeasured_before_screen)
    counts = screen_counts(comps)
    screen_sizes = (min(counts, default=0), max(counts, default=0))
    solutions = solution_lengths(policy, records)
    if not counts or not solutions:
        forward = CallCost(0.0, 0.0)
    elif (kept := part.reuse("screen", screen_sizes)) is not None:
        forward = kept["forward"]
    else:
        say("probe: the screen's teacher-forced pass")
        forward = part.timed("screen", screen_sizes, lambda: {"forward": probe_screen(
            policy, records, solutions, cfg, counts, device, untrusted)})["forward"]
    solution_tokens = statistics.fmean(solutions) if solutions else 0.0
    if inputs.live is not None and any(unmeasured_after_screen(c) for c in comps):
        comps = inputs.live(replace(costs, forward=forward, solution_tokens=solution_tokens), unmeasured_after_screen)
    dots = next((inputs.dots[c.name] for c in comps if c.name in inputs.dots), None)
    score_s = fit_s = 0.0
    if any(c.scored for c in comps):  # a run scores its pool only for a choice that reads the scores
        score_s, fit_s = _scoring(policy, cfg, inputs, dots, seed, device, untrusted, part, say)
    memo.save()
    for note in untrusted:
        log.warning("plan probe: an estimate it cannot trust: %s", note)
    return replace(costs, forward=forward, solution_tokens=solution_tokens, fixed=replace(costs.fixed, fit_s=fit_s),
                   score_s=score_s, untrusted=tuple(untrusted))


class _Parts:
    """The probe's parts through ``memo`` (tasks/plan/probe_cache.py): :meth:`reuse` a kept one (its notes join
    ``untrusted``), or :meth:`timed`, which keeps it with the notes its timing added."""

    def __init__(self, memo: ProbeMemo, untrusted: Untrusted, say: Callable[[str], None]):
        self.memo, self.untrusted, self.say = memo, untrusted, say

    def reuse(self, name: str, sizes: tuple[int, int]) -> dict | None:
        kept = self.memo.reuse(name, sizes)
        if kept is None:
            return None
        self.say(f"probe: {name}: kept from {time.time() - kept.at:.0f} s ago at {kept.sizes[0]}-{kept.sizes[1]}, "
                 f"not timed again ({self.memo.path})")
        self.untrusted.extend(kept.notes)
        return kept.values

    def timed(self, name: str, sizes: tuple[int, int], work: Callable[[], object],
              values: Callable[[object], dict] = lambda out: out) -> object:
        """``work()``'s result; ``values(result)`` kept as the part."""
        before = len(self.untrusted)
        out = work()
        self.memo.keep(name, sizes, values(out), tuple(self.untrusted[before:]))
        return out


def _scoring(policy: Policy, cfg: Config, inputs: ProbeInputs, dots: Config | None, seed: int,
             device: torch.device | str, untrusted: Untrusted, part: _Parts,
             say: Callable[[str], None]) -> tuple[float, float]:
    """Seconds to score one pool prompt and DOTS's predictor a round (0 where ``dots`` is None), each kept or
    timed (:func:`_probe_scoring`)."""
    batch = max(cfg.eval.batch_size, len(inputs.calibration.indices))
    pool = (len(inputs.pool), len(inputs.pool))
    if part.memo.serves("scoring", (batch, batch)) and (dots is None or part.memo.serves("predictor", pool)):
        score_s = part.reuse("scoring", (batch, batch))["score_s"]
        return score_s, part.reuse("predictor", pool)["fit_s"] if dots is not None else 0.0
    say("probe: scoring a batch of the pool" + (", DOTS's predictor" if dots is not None else ""))
    score_s, fit_s = part.timed("scoring", (batch, batch), lambda: _probe_scoring(
        policy, cfg, inputs, dots, seed, device, untrusted), lambda out: {"score_s": out[0]})
    if dots is not None:
        part.memo.keep("predictor", pool, {"fit_s": fit_s}, ())
    return score_s, fit_s


def unmeasured_after_screen(c: Composition) -> bool:
    """Whether ``c`` pays a cost the probe times after the screen's pass: the pool's scoring, DOTS's predictor."""
    return c.predictor or c.scored > 0


def unmeasured_before_screen(c: Composition) -> bool:
    """Whether ``c`` pays a cost the probe times after the costs every step pays: the screen's pass, and those of
    :func:`unmeasured_after_screen`."""
    return c.screen > 1 or unmeasured_after_screen(c)


def _generation_sizes(comps: Sequence[Composition], n: int, stats: PoolStats) -> tuple[int, int]:
    """Prompts (of n rollouts) of the probe's two generate calls: as many rollouts as the smallest first call a
    candidate makes (each call of a step's draw, rlcore.plan.draw_calls, and DOTS's reference rollouts) and as the
    baseline's (``comps[0]``) largest, the small one a quarter of the large one where they are the same. Larger
    calls (DAPO's, PODS's) are predicted on the line through the two, not timed."""

    def firsts(c: Composition) -> list[int]:
        return [rows for prompts, each in (*draw_calls(c, stats), c.reference)
                for rows in call_rows(prompts, each, c.chunk)[:1]]

    large = max(1, round(max(firsts(comps[0])) / n))
    return _span(round(min(r for c in comps for r in firsts(c)) / n), large)


def _update_sizes(comps: Sequence[Composition], stats: PoolStats, n: int, available: int) -> tuple[int, int]:
    """Groups (of n rows) of the probe's two updates: as many rows as the smallest update a candidate is predicted
    to make and as the baseline's (``comps[0]``), at most ``available`` groups; the small one a quarter of the large
    one where they are the same. Larger updates (DAPO's full batches, PODS's, replay's) are predicted on the line
    through the two, as larger generate calls are (:func:`_generation_sizes`)."""
    large = min(available, max(1, round(update_rows(comps[0], stats) / n)))
    return _span(round(min(update_rows(c, stats) for c in comps) / n), large)


def _span(small: int, large: int) -> tuple[int, int]:
    """The probe's two sizes: ``small`` (at least 1, at most ``large``) and ``large``, or a quarter of ``large`` and
    ``large`` where they would be the same."""
    small = max(1, min(large, small))
    return (small if small < large else max(1, large // 4)), large


def probe_groups(gen: Generation) -> list[RolloutGroup]:
    """``gen``'s rollouts as one group a prompt with rewards 1, 0, 1, ...: every group informative, so the update
    computes every row (the probe times the work; the rewards it trains on are not the task's)."""
    n = gen.n
    rewards = torch.tensor([float(j % 2 == 0) for j in range(n)])
    adv = group_advantages(rewards.unsqueeze(0), scale_by_std=False)[0]
    return [RolloutGroup(prompt_id=f"probe-{i}", prompt_ids=p, completion_ids=gen.completion_ids[i * n:(i + 1) * n],
                         completion_mask=gen.completion_mask[i * n:(i + 1) * n], rewards=rewards, advantages=adv,
                         behaviour_logp=torch.zeros(0), success_rate=float(rewards.mean()), n_generated=n, step=0,
                         sampler_logp=gen.logprobs[i * n:(i + 1) * n])
            for i, p in enumerate(gen.prompt_ids)]


def _probe_update(policy: Policy, groups: list[RolloutGroup], sizes: tuple[int, int], cfg: Config,
                  device: torch.device | str, scratch: Path | None,
                  untrusted: Untrusted) -> tuple[CallCost, float, float]:
    """The update's passes as a :class:`CallCost` (an update of the first ``sizes`` of ``groups``, each timed less
    the optimizer step), the optimizer step and a round's checkpoint, in seconds (module docstring)."""
    tc, model = cfg.train, policy.model
    was_training = model.training
    updater = _updater(policy, cfg, device)
    try:
        def update(gs: list[RolloutGroup]) -> tuple[float, float]:
            seconds, result = untrusted.timed(lambda: updater.step(gs), COSTLY, f"an update of {len(gs)} groups")
            return result.metrics["train/update_tokens"], seconds

        updater.step(groups[:1])  # warm-up: the first backward allocates, the first AdamW step makes its state
        points = [update(groups[:k]) for k in sizes]
        timing = time_optimizer_step(model, updater.optimizer, policy.trainable_parameters(), tc.grad_clip)
        untrusted.note(timing)
        optimizer_s = timing.seconds
        with tempfile.TemporaryDirectory(prefix="rlsift-probe-", dir=scratch) as tmp:
            state = {"model": policy.checkpoint_state(), "optimizer": updater.state_dict()}
            round_s = untrusted.timed(lambda: atomic_write(Path(tmp) / "checkpoint.pt", lambda f: torch.save(
                state, f)), ONCE, "a round's checkpoint")[0]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    passes = CallCost.fit([t for t, _ in points], [max(s - optimizer_s, 0.0) for _, s in points])
    return passes, optimizer_s, round_s


def _updater(policy: Policy, cfg: Config, device: torch.device | str) -> LocalUpdater:
    """An updater of the probe's own, as the run's step (its loss, precision, reference pass), at learning rate 0."""
    tc, model = cfg.train, policy.model
    return LocalUpdater(model, LossSettings.from_config(cfg, policy.tokenizer.pad_token_id),
                        params=policy.trainable_parameters(), lr=0.0, betas=tc.betas, eps=tc.adam_eps,
                        weight_decay=tc.weight_decay, device=device,
                        ref_model=model if tc.kl_coef > 0 else None,  # a reference pass costs a policy pass
                        precision=resolve_precision(cfg.model.precision, torch.device(device)))


def time_optimizer_step(model: torch.nn.Module, optimizer, params, grad_clip: float,
                        clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Seconds of one optimizer step (:func:`tasks.update.distributed.optimizer_step`: clipping and AdamW) with a
    gradient on each of ``params`` that needs one, as after a step's backward passes: given before each timed call,
    untimed, in the parameter's own dtype (bf16-mixed's step then moves it into the float32 master as a real step
    does, and frees it). Repeated until stable on ``clock`` (tasks/plan/timing.py)."""
    params = [p for p in params if p.requires_grad]

    def gradients() -> None:
        for p in params:
            p.grad = torch.full_like(p, 1e-4)

    try:
        return time_until_stable(lambda: optimizer_step(model, optimizer, grad_clip), CHEAP, "the optimizer step",
                                 clock=clock, before=gradients)[0]
    finally:
        for p in params:
            p.grad = None


def _probe_scoring(policy: Policy, cfg: Config, inputs: ProbeInputs, dots: Config | None, seed: int,
                   device: torch.device | str, untrusted: Untrusted) -> tuple[float, float]:
    """Seconds to score one pool prompt and DOTS's predictor a round, with ``dots``'s settings (0 where None):
    module docstring."""
    pool, cal = inputs.pool, inputs.calibration
    refs = list(cal.indices)
    taken = set(refs)
    batch = (refs + [i for i in range(len(pool)) if i not in taken])[:max(cfg.eval.batch_size, len(refs))]
    seconds, feats = untrusted.timed(lambda: compute_features(policy, [pool[i] for i in batch],
                                                              inter_weight=cfg.gain.inter_weight,
                                                              batch_size=cfg.eval.batch_size, device=device),
                                     COSTLY, f"scoring {len(batch)} prompts")
    score_s = seconds / len(batch)
    if dots is None:
        return score_s, 0.0
    sc = dots.select
    predictor = dots_predictor(dots, feats.emb.shape[1], linear_recalibration=sc.predictor.linear_recalibration)
    emb = feats.emb.float()
    ref_emb, labels = emb[: len(refs)], cal.success.float()
    for s in range(math.ceil(predictor.min_labels / len(refs))):  # as many labels as a round past the first has
        predictor.observe(ref_emb, labels, s)
    fit_s = untrusted.timed(lambda: predictor.fit(sc.predictor.fit_steps, torch.Generator().manual_seed(seed)),
                            COSTLY, "DOTS's predictor's fit")[0]
    predict_s = untrusted.timed(lambda: predictor.predict(emb, ref_emb, labels), CHEAP, "DOTS's predictions")[0]
    return score_s, fit_s + predict_s * len(pool) / len(batch)
