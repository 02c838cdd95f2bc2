"""The training stage: rounds of GRPO steps with selection, PODS down-sampling and rollout replay.

One step (verl-style, every phase timed so the timing metrics read as a table of contents)::

    round start (every mu steps): reference rollouts -> predictor, curriculum and window updates
    select B_fresh prompts                               (tasks/selection/selector.py: ScalingRL -> GAIN-RL -> DOTS,
                                                          then the likelihood screen, tasks/selection/screen.py)
    generate n rollouts each, verify rewards             (tasks/calibration/reference.py; n and B_fresh from the
                                                          adaptive composition's plan, rlcore.adaptive_composition)
    keep m of n per prompt, advantages on the kept m      (rlcore.downsample, rlcore.advantages)
    mix in B - B_fresh replayed groups                    (rlcore.replay_buffer)
    clipped policy-gradient step at the step's lr         (the run's Updater, tasks/update/policy_update.py)
    admit fresh groups with 0 < success < 1 (from all n) to the buffer; label the predictor
    ledger rows for every selection and group; metrics; checkpoint at round ends
    every eval.every steps: held-out evaluation, whose accuracy feeds the selector (ScalingRL's rho)

A round's steps run in one call of the caller's ``run_round`` (in the pipeline a Prefect task run ``round-<r>``,
tasks/stages.py), which ends with the round's selection summary (:class:`RoundLog`). With every technique off this
is plain GRPO with uniform prompt selection.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import groupby

import torch

from rlcore.adaptive_composition import AdaptiveComposition, CompositionPlan
from rlcore.advantages import effective_mask, group_advantages, solved_anchor
from rlcore.downsample import downsample
from rlcore.dynamic_sampling import BatchFiller
from rlcore.overlap_lag import LagChoice
from rlcore.replay_buffer import ReplayBuffer, mix_counts
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.records.ledger import GroupRow, ReferenceRow, SelectionRow
from tasks.records.throughput import ModelShape, Peak, peak, rates
from tasks.records.progress import progress_bar
from tasks.run import Run
from tasks.training import checkpoint
from tasks.calibration.record import Calibration
from tasks.overlap.concurrent import Overlap, Sampler, open_sampler
from tasks.plan.planner import decide_lag, probe_records
from tasks.calibration.reference import policy_measure, rollout_rewards
from tasks.training.rounds import RoundLog, RoundRunner, run_plainly
from tasks.selection.features import Features
from tasks.selection.screen import policy_likelihood
from tasks.selection.selector import Selector
from tasks.update.backend import build_updater, share_generation
from tasks.update.policy_update import scheduled_lr
from tasks.update.skip_guard import SkipGuard

log = logging.getLogger("rlsift.train")

#: The cost meter's names for the phases of the training stage (their sum is the stage's wall time).
TRAIN_PHASES = ("reference", "selection", "rollout", "update", "tracking", "eval_during", "checkpoint", "weight_sync")
#: The phases of a step's draw (``StepDraw.phases``; overlapped, its ``overlap/draw_<phase>_s`` metrics).
DRAW_PHASES = ("reference", "selection", "rollout")


@dataclass(frozen=True)
class HeldoutEval:
    """One in-training held-out evaluation (``eval.every``): greedy accuracy in [0, 1] and the metrics to log."""

    accuracy: float
    metrics: dict[str, float]


#: ``step -> HeldoutEval``: evaluates the current policy after ``step`` updates (tasks/stages.py ``train_stage``).
EvaluateFn = Callable[[int], HeldoutEval]


def make_groups(gen: Generation, rewards: torch.Tensor, records: list[PromptRecord], step: int, *, m: int | None,
                rule: str, scale_std: bool, generator: torch.Generator, negative_weight: float, anchor: float,
                sampler_behaviour: bool = False, version: int | None = None) -> tuple[list[RolloutGroup], dict]:
    """PODS down-sampling (when m is set) and group-relative advantages on the kept rollouts; ``anchor``: the
    solved-skill guard's advantage for groups whose kept rollouts all succeed (``rlcore.advantages.solved_anchor``).

    Every group carries its rollouts' sampler log-probs; ``sampler_behaviour`` makes them its behaviour policy mu
    (``train.behaviour``), otherwise the update's pi_old is. ``version``: the sampling weights' update count."""
    b, n = rewards.shape
    if m is None:
        keep, stats = torch.arange(n).expand(b, n), {}
    else:
        keep, stats = downsample(rewards, m, rule=rule, generator=generator)
    kept_r = rewards.gather(1, keep)  # [B, G]
    adv = group_advantages(kept_r, scale_by_std=scale_std)  # [B, G]
    if negative_weight != 1.0:
        adv = torch.where(adv < 0, adv * negative_weight, adv)
    adv = solved_anchor(kept_r, adv, anchor)
    groups = []
    for i, rec in enumerate(records):
        rows = i * n + keep[i]
        sampler = gen.logprobs[rows]
        groups.append(RolloutGroup(
            prompt_id=rec.id, prompt_ids=gen.prompt_ids[i], completion_ids=gen.completion_ids[rows],
            completion_mask=gen.completion_mask[rows], rewards=kept_r[i], advantages=adv[i],
            behaviour_logp=sampler if sampler_behaviour else torch.zeros(0), success_rate=float(rewards[i].mean()),
            n_generated=n, step=step, sampler_logp=sampler, policy_version=version))
    return groups, stats


@dataclass(frozen=True)
class FreshBatch:
    """One step's freshly generated groups.

    Attributes:
        groups: the groups that enter the update (all of them, or with dynamic sampling the informative ones).
        idx: pool indices of every prompt selected this step (every generation round), in draw order.
        rows: a ledger row per selected prompt.
        records: the selected prompts.
        rewards: [len(idx), n] rewards of every generated rollout (labels for the predictor).
        generated: rollouts generated (discarded ones included); tokens: their completion tokens;
            prompt_tokens: their prompts' tokens (a prompt counted once per rollout).
        gen_s: wall seconds in generation and verification.
        stats: PODS and dynamic-sampling metrics, and the rollout engine's own (``RolloutEngine.metrics``).
    """

    groups: list[RolloutGroup]
    idx: list[int]
    rows: list[SelectionRow]
    records: list[PromptRecord]
    rewards: torch.Tensor
    generated: int
    tokens: int
    prompt_tokens: int
    gen_s: float
    stats: dict[str, float]


def sample_fresh(run: Run, policy: Policy, selector: Selector, pool: list[PromptRecord], k: int,
                 step: int, n: int, *, meter: CostMeter | None = None, sampler_behaviour: bool = False,
                 version: int | None = None) -> FreshBatch:
    """Select k prompts, generate n rollouts each (``rollout.n``, or the adaptive composition's plan), verify,
    down-sample (PODS) and build groups.

    With ``dynamic.enabled`` (DAPO's dynamic sampling, rlcore/dynamic_sampling.py) further rounds select and
    generate until k informative groups are found or ``dynamic.max_rounds`` is reached; every round's
    rollouts count. Round 0 draws with the seeds of a step without dynamic sampling.

    ``meter``: where the phases are timed (default ``run.meter``; an overlapped draw keeps its own);
    ``sampler_behaviour`` and ``version``: :func:`make_groups`'.
    """
    cfg, tc = run.cfg, run.cfg.train
    meter = meter if meter is not None else run.meter
    ds = cfg.dynamic
    filler = BatchFiller(k, ds.oversample, ds.max_rounds) if ds.enabled else None
    idx_all, rows_all, records_all, rewards_all, pods_all = [], [], [], [], []
    generated = tokens = prompt_tokens = 0
    gen_s = 0.0
    groups: list[RolloutGroup] = []
    attempt = 0

    def seed(purpose: str) -> int:  # round 0 keeps the seeds of a step without dynamic sampling
        return derive_seed(cfg.seed, step, purpose, *((attempt,) if attempt else ()))

    while True:
        want = filler.request() if filler is not None else k
        with meter.stage("selection"):
            idx, rows = selector.choose(want, step, attempt)
        records = [pool[i] for i in idx]
        with meter.stage("rollout"):
            t_gen = time.perf_counter()
            gen, rewards = rollout_rewards(policy, records, n, seed("train"))
            gen_s += time.perf_counter() - t_gen
        gen_rng = torch.Generator().manual_seed(seed("pods"))
        with meter.stage("selection"):
            groups, pods_stats = make_groups(gen, rewards, records, step,
                                             m=cfg.pods.m if cfg.pods.enabled else None, rule=cfg.pods.rule,
                                             scale_std=tc.scale_std, generator=gen_rng,
                                             negative_weight=tc.negative_weight, anchor=cfg.guard.anchor,
                                             sampler_behaviour=sampler_behaviour, version=version)
        idx_all += idx
        rows_all += rows
        records_all += records
        rewards_all.append(rewards)
        pods_all.append((len(records), pods_stats))
        generated += gen.completion_ids.shape[0]
        tokens += gen.tokens
        prompt_tokens += n * sum(int(p.numel()) for p in gen.prompt_ids)
        attempt += 1
        if filler is None:
            break
        filler.add(groups)
        if filler.done:
            groups = filler.batch()
            break
    total = sum(b for b, _ in pods_all)
    stats = {key: sum(b * st[key] for b, st in pods_all) / total for key in pods_all[0][1]}
    if filler is not None:
        stats |= filler.metrics()
    stats |= policy.engine.metrics()  # a pool's live servers, the generator process's peak memory
    return FreshBatch(groups=groups, idx=idx_all, rows=rows_all, records=records_all,
                      rewards=torch.cat(rewards_all), generated=generated, tokens=tokens, prompt_tokens=prompt_tokens,
                      gen_s=gen_s, stats=stats)


@dataclass(frozen=True)
class StepDraw:
    """What one step's sampling hands its update: drawn in the step itself (``overlap.lag`` 0) or, one step ahead,
    while the previous update ran (lag 1; then kept in the checkpoint until trained).

    Attributes:
        step: the step these rollouts are for.
        fresh: the freshly generated groups.
        plan: the adaptive composition's plan (rollouts a prompt, fresh share) the draw followed.
        n_replay: replayed groups to add at the update.
        version: updates the sampling weights had received (``step`` on-policy, ``step - 1`` with lag 1).
        metrics: the round start's metrics (reference rollouts, predictor, curriculum, window) when the step
            starts a round.
        references: the round start's reference rows for the ledger.
        phases: seconds of the draw's phases (reference, selection, rollout).
    """

    step: int
    fresh: FreshBatch
    plan: CompositionPlan
    n_replay: int
    version: int
    metrics: dict[str, float]
    references: tuple[ReferenceRow, ...]
    phases: dict[str, float]


@dataclass(frozen=True)
class TrainSummary:
    """What the training stage did: ``steps`` done in all (a resumed run counts the crashed run's too), the
    ``last`` step's metrics (empty when no step ran in this process) and, overlapped, the ``overlap`` totals over
    every step (seconds: ``update_s``, ``draw_s``, ``overlap_s``, ``trainer_idle_s``, ``generator_idle_s``)."""

    steps: int
    last: dict[str, float] = field(default_factory=dict)
    overlap: dict[str, float] = field(default_factory=dict)


def use_sampler_behaviour(cfg, lag: int) -> bool:
    """``train.behaviour``: whether fresh groups' mu is the sampler's log-probs (auto: whenever the sampler is not
    the trainer's own module at the step's start: ``lag`` 1, or an engine outside this process)."""
    if cfg.train.behaviour != "auto":
        return cfg.train.behaviour == "sampler"
    return lag > 0 or cfg.rollout.engine != "hf"


def train(run: Run, policy: Policy, pool: list[PromptRecord], features: Features,
          calibration: Calibration | None = None, evaluate_fn: EvaluateFn | None = None,
          run_round: RoundRunner = run_plainly, lag: LagChoice | None = None) -> TrainSummary:
    """Run (or resume) the training stage.

    ``evaluate_fn`` runs every ``eval.every`` steps (0: never); its accuracy goes to
    ``Selector.set_heldout_accuracy``, which ScalingRL's scheduler reads at the next round start. With
    ``lag`` 1 the next step's draw runs while this step updates (tasks/overlap/concurrent.py); ``lag``: the overlap
    decided before training (the pipeline's overlap stage), or None to decide it here
    (tasks/plan/planner.py ``decide_lag``, probing on the reference prompts or the pool's first ones).
    ``run_round`` runs each round's steps (a resume mid-round: the rest of that round), whose :class:`RoundLog`
    line ends them.
    """
    cfg = run.cfg
    if lag is None:
        lag = decide_lag(cfg, policy, probe_records(pool, calibration, cfg) if calibration is not None
                         else pool[: cfg.plan.probe_prompts], run.device, handover=run.handover)
        log.info("overlap: %s", lag.reason)
    # one process, or sharded over the torchrun ranks (then `model` stays rank 0's full copy, updated in place)
    updater = build_updater(cfg, policy, device=run.device)
    shared = share_generation(cfg, policy, updater, lag.lag)  # sharded: every rank decodes its share
    if shared is not None:
        log.info("rollouts: %s", shared)
    sampling = open_sampler(policy, lag.lag, threads=cfg.overlap.generator_threads,  # the probe's, where kept
                               needs_copy=cfg.select.screen > 1, on_temp_dir=run.note_temp, handover=run.handover)
    try:
        return _train(run, policy, sampling, updater, pool, features, calibration, evaluate_fn, run_round)
    finally:
        sampling.close()


def _train(run: Run, policy: Policy, sampling: Sampler, updater, pool: list[PromptRecord], features: Features,
           calibration: Calibration | None, evaluate_fn: EvaluateFn | None, run_round: RoundRunner) -> TrainSummary:
    cfg, tc = run.cfg, run.cfg.train
    model = policy.model
    sampler = sampling.policy  # what the rollouts and the likelihood screen read
    likelihood = policy_likelihood(sampler, temperature=cfg.rollout.temperature,
                                   max_new_tokens=cfg.rollout.max_new_tokens, micro_batch_tokens=tc.micro_batch_tokens,
                                   device=run.device) if cfg.select.screen > 1 else None
    selector = Selector(cfg, pool, features, likelihood)
    if calibration is not None:
        selector.seed_labels(calibration)
    buffer = ReplayBuffer(cfg.replay.capacity, max_age=cfg.replay.max_age) if cfg.replay.enabled else None
    ad = cfg.adapt
    composer = AdaptiveComposition(ad.low, ad.high, ad.momentum) if ad.enabled else None
    resume = checkpoint.restore(run, policy, updater, selector, buffer, composer)
    start, pending = resume.step, resume.draw
    if start:
        run.ledger.truncate_after(run.run_id, start - 1)
        log.info("resuming at step %d%s", start, " with its rollouts restored" if pending is not None else "")
    measure = policy_measure(sampler)
    sampler_behaviour = use_sampler_behaviour(cfg, sampling.lag)
    shape = ModelShape.of(model)
    machine = peak(run.meter.device, run.device, next(model.parameters()).dtype)
    if not start:
        run.tracker.set_tags({"rlsift.peak_flops_source": machine.source})

    def draw(step: int, version: int, meter) -> StepDraw:
        """Everything before the update that does not need this step's update: round start, selection, rollouts."""
        round_, metrics = step // tc.round_steps, {}
        if not sampling.overlapped and (step % tc.round_steps == 0 or step == start):
            sync_rollout_weights(run, policy)  # vLLM, sequential: the server samples with the round's starting weights
        if step % tc.round_steps == 0:
            with meter.stage("reference"):
                metrics |= selector.begin_round(round_, step, measure)
        if buffer is not None:
            buffer.prune(step)  # drop groups past replay.max_age so the mix counts only replayable ones
        delta = cfg.replay.fresh_frac if buffer is not None else 1.0
        plan = composer.plan(cfg.rollout.n, cfg.kept_per_prompt, delta) if composer is not None \
            else CompositionPlan(rollouts=cfg.rollout.n, fresh_frac=delta, level=0.0)
        n_fresh, n_replay = (mix_counts(tc.prompts_per_step, plan.fresh_frac, len(buffer))
                             if buffer is not None and round_ > 0 else (tc.prompts_per_step, 0))
        before = dict(meter.seconds)
        fs = sample_fresh(run, sampler, selector, pool, n_fresh, step, plan.rollouts, meter=meter,
                          sampler_behaviour=sampler_behaviour, version=version)
        phases = {k: meter.seconds.get(k, 0.0) - before.get(k, 0.0) for k in DRAW_PHASES}
        return StepDraw(step=step, fresh=fs, plan=plan, n_replay=n_replay, version=version, metrics=metrics,
                        references=tuple(selector.take_references()), phases=phases)

    metrics_file = run.dir / "metrics.jsonl"
    if metrics_file.exists():  # a resumed run drops what the crashed one logged past its checkpoint
        kept = [ln for ln in metrics_file.read_text().splitlines() if _step_of(ln) < start]
        metrics_file.write_text("".join(ln + "\n" for ln in kept))
    bar = progress_bar(total=tc.steps, initial=start, desc="train", unit="step")
    bar_acc = ""  # held-out greedy accuracy of the last in-training evaluation (eval.every)
    summary = TrainSummary(steps=start)
    overlap = Overlap()
    guard = SkipGuard(tc.max_skipped_steps, tc.minibatches, run.ledger, run.run_id)  # skipped updates: said, bounded

    def play_round(round_: int, steps: list[int]) -> None:
        """This process's ``steps`` of round ``round_`` (all of them, or a resumed round's rest), then its summary."""
        nonlocal pending, summary, bar_acc
        tally = RoundLog(round_, steps)
        for step in steps:
            t0 = time.perf_counter()
            sd = pending if pending is not None else draw(step, step, run.meter)  # lag 0, or the first step
            if sd.step != step:  # a checkpoint's draw belongs to the step it was saved before
                raise RuntimeError(f"the rollouts drawn for step {sd.step} reached step {step}")
            pending, timing = None, None
            fs = sd.fresh
            idx, rows, records, rewards, fresh = fs.idx, fs.rows, fs.records, fs.rewards, fs.groups
            metrics = dict(sd.metrics)
            with run.meter.stage("selection"):
                n_replay = min(sd.n_replay, len(buffer)) if buffer is not None else 0
                replayed = buffer.sample(n_replay, step, torch.Generator().manual_seed(
                    derive_seed(cfg.seed, step, "replay"))) if n_replay else []
            batch = fresh + replayed
            if sampling.overlapped and step + 1 < tc.steps:  # draw step + 1 from these weights during the update
                with run.meter.stage("weight_sync"):
                    sampling.sync(run.dir / "vllm_weights")
                overlap.launch(lambda s=step + 1: draw(s, s - 1, CostMeter(prices={}, device="cpu", devices=1)))
            lr = scheduled_lr(cfg, step)
            updater.set_lr(lr)
            with run.meter.stage("update"):
                t_upd = time.perf_counter()
                stats = updater.step(batch)
                upd_s = time.perf_counter() - t_upd
            if overlap.in_flight:
                with run.meter.stage("rollout"):  # the trainer's wait for the next step's rollouts
                    pending, timing = overlap.collect()
            with run.meter.stage("selection"):
                if buffer is not None:
                    for g in fresh:
                        buffer.admit(g)
                accuracy = float(rewards.mean())
                metrics |= selector.observe(step, idx, rewards, accuracy, stats.get("gain/angle_online"))
                if composer is not None:
                    composer.observe(rewards, cfg.kept_per_prompt)  # the plan this step ran, r with this step in it
                    metrics |= sd.plan.metrics() | {"adapt/informative": composer.informative}
            kept = torch.stack([g.rewards for g in batch]) if len({g.size for g in batch}) == 1 else None
            eff = effective_mask(kept).float() if kept is not None else torch.tensor(
                [float(g.rewards.max() > g.rewards.min()) for g in batch])
            with run.meter.stage("tracking"):
                if sd.references:
                    run.ledger.add_reference(run.run_id, list(sd.references))
                run.ledger.add_selections(run.run_id, round_, step, rows)
                run.ledger.add_groups(run.run_id, step, [GroupRow(
                    prompt_id=g.prompt_id, n=g.n_generated, successes=int(round(g.success_rate * g.n_generated)),
                    mean_reward=g.success_rate, kept=g.size, kept_mean_reward=float(g.rewards.mean()),
                    replayed=g.replayed_from is not None,
                    from_step=g.replayed_from if g.replayed_from is not None else step,
                    policy_version=g.policy_version,
                    lag=None if g.policy_version is None else step - g.policy_version) for g in batch])
                metrics |= stats | fs.stats | guard.observe(step, stats, updater.skipped())
                metrics |= {
                    "train/reward_mean": accuracy,
                    "train/lr": lr,
                    "train/effective_ratio": float(eff.mean()),
                    "train/effective_ratio_fresh": float(eff[:len(fresh)].mean()),
                    "train/groups": float(len(batch)),
                    "train/level_mean": float(sum(r.level or 0 for r in records) / len(records)),
                    "train/policy_lag": float(step - sd.version),
                    "rollout/generated": float(fs.generated),
                    "rollout/tokens": float(fs.tokens),
                    "rollout/tokens_per_s": fs.tokens / max(fs.gen_s, 1e-9),
                    "rollout/length_mean": fs.tokens / fs.generated,
                } | throughput(shape, machine, fs, stats, upd_s) | {
                    "time/reference_share": run.meter.wall_seconds("reference") / max(run.meter.wall_seconds(
                        TRAIN_PHASES), 1e-9)}
                if timing is not None:  # this update overlapped the next step's draw
                    metrics |= {"overlap/update_s": upd_s} | timing.metrics() | {
                        f"overlap/draw_{k}_s": v for k, v in pending.phases.items()}
                if buffer is not None:
                    metrics |= buffer.stats(step) | {"replay/fresh": float(len(fresh)),
                                                     "replay/replayed": float(n_replay)}
            held = None
            if evaluate_fn is not None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                sync_rollout_weights(run, policy)  # a server evaluates the weights after this update
                with run.meter.stage("eval_during"):
                    held = evaluate_fn(step + 1)
                metrics |= held.metrics
                selector.set_heldout_accuracy(held.accuracy)  # before the checkpoint below, so a resume keeps it
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics |= run.meter.metrics() | (run.meter.memory.take() if run.meter.memory is not None else {})
            with run.meter.stage("tracking"):
                run.log_metrics(metrics, step)
                with open(metrics_file, "a") as f:
                    f.write(json.dumps({"step": step, **metrics}) + "\n")
            summary = TrainSummary(steps=step + 1, last=metrics)
            if "eval/accuracy" in metrics:
                bar_acc = f"{metrics['eval/accuracy']:.2f}"
            bar.update(1)
            idle = {"idle": f"{timing.trainer_idle_s:.2f}/{timing.generator_idle_s:.2f}"} if timing else {}
            bar.set_postfix(reward=f"{accuracy:.2f}", eff=f"{float(eff.mean()):.2f}",
                            s=f"{metrics['time/step_s']:.1f}", **({"acc": bar_acc} if bar_acc else {}), **idle,
                            **guard.postfix())
            tally.add(fs.records, fs.rows, eff, len(replayed), (upd_s, timing) if timing is not None else None,
                      rewards, None if held is None else held.accuracy)
            if (step + 1) % tc.round_steps == 0 or (tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0) \
                    or step + 1 == tc.steps or guard.stuck:
                with run.meter.stage("checkpoint"):
                    checkpoint.save(run, step + 1, policy, updater, selector, buffer, composer, draw=pending)
            guard.check()  # train.max_skipped_steps in a row: stop, naming the cause
        log.info("%s", tally.line())

    try:
        if sampling.overlapped and start < tc.steps and pending is None:
            run.meter.add("weight_sync", sampling.sync(run.dir / "vllm_weights"))
        for round_, steps in groupby(range(start, tc.steps), key=lambda s: s // tc.round_steps):
            run_round(round_, partial(play_round, round_, list(steps)))
    except BaseException:
        sampling.close(now=True)  # a failing or stopped run does not wait for the draw in flight
        raise
    finally:
        overlap.close()
    bar.close()
    sync_rollout_weights(run, policy)  # the final evaluation samples with the final weights
    if sampling.overlapped:
        summary = replace(summary, overlap=overlap_totals(metrics_file))
        log.info("overlap over %d steps: %s", summary.steps, ", ".join(f"{k} {v:.1f}" for k, v in
                                                                       summary.overlap.items()))
    return summary


def overlap_totals(metrics_file) -> dict[str, float]:
    """The run's overlap seconds summed over every step in ``metrics.jsonl`` (a resumed run's earlier steps too)."""
    keys = ("update_s", "draw_s", "overlap_s", "trainer_idle_s", "generator_idle_s")
    totals = dict.fromkeys(keys, 0.0)
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for k in keys:
            totals[k] += row.get(f"overlap/{k}", 0.0)
    return totals


def throughput(shape: ModelShape, machine: Peak, fs: FreshBatch, upd_stats: dict[str, float],
               upd_s: float) -> dict[str, float]:
    """Tokens per second and MFU (tasks/records/throughput.py) of this step's rollout and update phases.

    The rollout phase's FLOPs are forward passes over every generated rollout's prompt and completion (the prompt
    is prefilled once per rollout, as ``generate`` does with ``num_return_sequences``), its time includes the
    verifiers; the update's are forward + backward over the real tokens of the rows it computed
    (``upd_stats``: the updater's ``train/update_tokens`` and ``train/update_rows``; rows of groups without a
    gradient are not computed, ``train.skip_zero_advantage``; the reference and pi_old passes of
    ``train.kl_coef`` / ``train.minibatches`` are not counted).
    """
    upd_tps, upd_mfu = rates(shape, machine, tokens=int(upd_stats["train/update_tokens"]),
                             sequences=int(upd_stats["train/update_rows"]), seconds=upd_s, backward=True)
    gen_tps, gen_mfu = rates(shape, machine, tokens=fs.prompt_tokens + fs.tokens, sequences=fs.generated,
                             seconds=fs.gen_s, backward=False)
    return {"perf/update_tokens_per_s": upd_tps, "perf/update_mfu": upd_mfu, "perf/rollout_tokens_per_s": gen_tps,
            "perf/rollout_mfu": gen_mfu, "perf/peak_tflops": machine.flops / 1e12}


def sync_rollout_weights(run: Run, policy: Policy) -> None:
    """Bring the rollout engine up to date with the policy's weights (``RolloutEngine.sync_weights``: nothing to do
    for the in-process HF engine, an export and reload for the vLLM server, tasks/generation/vllm_engine.py)."""
    run.meter.add("weight_sync", policy.engine.sync_weights(policy.model, policy.tokenizer, run.dir / "vllm_weights"))


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; a line torn by a kill counts as past every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")
