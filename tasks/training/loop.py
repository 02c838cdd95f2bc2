"""The training stage: rounds of GRPO steps with selection, PODS down-sampling and rollout replay.

One step (verl-style, every phase timed so the timing metrics read as a table of contents), a method of
:class:`Trainer` each::

    draw     round start (every mu steps): reference rollouts -> predictor, curriculum and window updates;
             select B_fresh prompts, generate n rollouts each, verify, keep m of n (PODS), advantages
             (tasks/training/draw.py; n and B_fresh from the adaptive composition's plan; with per-prompt rollout
             budgets in two waves, tasks/training/waves.py)
    update   mix in B - B_fresh replayed groups (rlcore.replay_buffer); a clipped policy-gradient step at the
             step's lr (the run's Updater, tasks/update/updater.py), which returns the fresh groups'
             behaviour log-probs; overlapped (lag 1), the next step's draw runs beside it, launched here or,
             where nothing in between reads what a draw does, right after the previous step's observe
    observe  admit fresh groups with 0 < success < 1 (from all n) to the buffer; label the predictor
    record   ledger rows for every selection and group, metrics (tasks/training/recorder.py)
    every eval.every steps: held-out evaluation, whose accuracy feeds the selector (ScalingRL's rho)
    step end: metrics line, checkpoint at round ends (tasks/training/checkpoint.py)

The caller plays the rounds (:meth:`Trainer.rounds`, :meth:`Trainer.play_round`; in the pipeline each a Prefect
task run ``round-<r>``, tasks/stages.py); each ends with the round's selection summary (:class:`RoundLog`).
tasks/training/entry.py builds the trainer with its updater and sampler. With every technique off this is plain GRPO
with uniform prompt selection.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import groupby

import torch

from rlcore.adaptive_composition import AdaptiveComposition, CompositionPlan
from rlcore.advantages import effective_mask
from rlcore.replay_buffer import ReplayBuffer, mix_counts
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.calibration.record import Calibration
from tasks.calibration.reference import policy_measure
from tasks.data.prompts import PromptRecord
from tasks.overlap.concurrent import Overlap, Sampler
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.records.progress import progress_bar
from tasks.records.throughput import FlopModel, peak
from tasks.run import Run
from tasks.selection.features import Features
from tasks.selection.screen import in_sampler, screen_likelihood
from tasks.selection.selector import Selector
from tasks.training import checkpoint
from tasks.training.draw import DRAW_PHASES, CarriedRollouts, StepDraw, use_sampler_behaviour
from tasks.training.recorder import Recorder, throughput
from tasks.training.rounds import RoundLog
from tasks.training.step_records import (
    TRAIN_PHASES,
    DrawState,
    EvaluateFn,
    HeldoutEval,
    Round,
    StepUpdate,
    TrainSummary,
)
from tasks.training.techniques import prompt_filters, screen_order, step_draw
from tasks.update.skip_guard import SkipGuard, skipped_rows
from tasks.update.updater import Updater, scheduled_lr

log = logging.getLogger("rlsift.train")

class Trainer:
    """The training stage's steps, one phase a method: :meth:`draw` (round start, selection, rollouts),
    :meth:`update`, :meth:`observe` (replay buffer, selector, adaptive composition), :meth:`record` (ledger rows and
    metrics, through the run's :class:`~tasks.training.recorder.Recorder`), the held-out evaluation
    (:meth:`heldout`) and the step's end (:meth:`end_step`: metrics line, progress bar, checkpoint).

    The caller drives it: :meth:`rounds` lists what is left to play, :meth:`play_round` plays one (the pipeline's
    train stage wraps each in a Prefect task run, tasks/stages.py), :meth:`finish` ends training. Built from the
    latest checkpoint when there is one (tasks/training/checkpoint.py); :func:`tasks.training.entry.training` builds
    it with its updater and sampler.
    """

    def __init__(self, run: Run, policy: Policy, sampling: Sampler, updater: Updater,
                 pool: list[PromptRecord], features: Features, calibration: Calibration | None = None,
                 evaluate: EvaluateFn | None = None):
        cfg = run.cfg
        self.run, self.cfg, self.policy, self.sampling, self.updater = run, cfg, policy, sampling, updater
        self.pool, self.evaluate = pool, evaluate
        self.sampler = sampling.policy  # what the rollouts and the likelihood screen read
        process = sampling.process if in_sampler(cfg.select.screen_process, run.device) else None
        likelihood = screen_likelihood(self.sampler, cfg, run.device, process) if cfg.select.screen > 1 else None
        self.selector = Selector(cfg, pool, features, likelihood, filters=prompt_filters(cfg, len(pool)),
                                 screen_order=screen_order(cfg), apart=sampling.apart,
                                 ahead_after_draw=process is not None)
        self.draw_fresh = step_draw(cfg)  # sample_fresh, or a registered technique's (tasks/training/techniques.py)
        if calibration is not None:
            self.selector.seed_labels(calibration)
        self.buffer = ReplayBuffer(cfg.replay.capacity, max_age=cfg.replay.max_age) if cfg.replay.enabled else None
        ad = cfg.adapt
        self.composer = AdaptiveComposition(ad.low, ad.high, ad.momentum) if ad.enabled else None
        resume = checkpoint.restore(run, policy, updater, self.selector, self.buffer, self.composer)
        self.recorder = Recorder(run)
        self.recorder.resume(resume.step, resume.held)
        self.start: int = resume.step
        #: the next step's draw, made beside this step's update (lag 1) or restored from the checkpoint
        self.pending: StepDraw | None = resume.draw
        #: what the latest draw left for the next one to complete (``waves.carry``), restored with the checkpoint
        self.carry: CarriedRollouts | None = resume.carry
        if self.start:
            log.info("resuming at step %d%s", self.start,
                     " with its rollouts restored" if self.pending is not None else "")
        self.measure = policy_measure(self.sampler)
        self.sampler_behaviour = use_sampler_behaviour(cfg, sampling.lag)
        self.shape = FlopModel.of(policy.model)
        self.machine = peak(run.meter.device, run.device, next(policy.model.parameters()).dtype)
        if not self.start:
            run.tracker.set_tags({"rlsift.peak_flops_source": self.machine.source})
        self.bar = progress_bar(total=cfg.train.steps, initial=self.start, desc="train", unit="step")
        self.bar_acc = ""  # held-out greedy accuracy of the last in-training evaluation (eval.every)
        self.summary = TrainSummary(steps=self.start)
        self.overlap = Overlap()
        #: skipped updates: recorded, shown, and the run stopped after ``train.max_skipped_steps`` in a row
        self.guard = SkipGuard(cfg.train.max_skipped_steps, cfg.train.minibatches)
        #: the draw state a checkpoint saves where a draw was launched ahead before it (:meth:`launch_ahead`)
        self.before_draw: DrawState | None = None
        if sampling.overlapped and self.start < cfg.train.steps and self.pending is None:
            run.meter.add("weight_sync", sampling.sync(run.dir / "vllm_weights"))

    # ---- the stage's view ------------------------------------------------------------------------------------
    def rounds(self) -> list[Round]:
        """The rounds left to play, in order (a resume mid-round: the rest of that round first)."""
        rs = self.cfg.train.round_steps
        return [Round(r, tuple(steps)) for r, steps in groupby(range(self.start, self.cfg.train.steps),
                                                               key=lambda s: s // rs)]

    def play_round(self, round_: Round) -> RoundLog:
        """This process's steps of ``round_``, then its summary line (logged and returned)."""
        tally = RoundLog(round_.index, list(round_.steps))
        for step in round_.steps:
            self.play_step(round_.index, step, tally)
        log.info("%s", tally.line())
        return tally

    def finish(self) -> TrainSummary:
        """After the last round: the rollout engine gets the final weights (the final evaluation samples with
        them) and, under LoRA, the policy its adapters' float32 masters; returns what training did, with the
        overlap's totals when overlapped."""
        self.overlap.close()
        self.bar.close()
        sync_rollout_weights(self.run, self.policy)
        if self.policy.has_adapters:  # the adapter folder is saved from the float32 masters (Policy.save_adapter)
            self.policy.adapter_masters = self.updater.master_weights()
        if self.sampling.overlapped:
            self.summary = replace(self.summary, overlap=self.recorder.overlap_totals())
            log.info("overlap over %d steps: %s", self.summary.steps,
                     ", ".join(f"{k} {v:.1f}" for k, v in self.summary.overlap.items()))
        return self.summary

    # ---- one step, phase by phase --------------------------------------------------------------------------
    def play_step(self, round_: int, step: int, tally: RoundLog) -> None:
        """One training step: draw (or take the draw made ahead), update, observe, record, evaluate, end."""
        t0 = time.perf_counter()
        sd = self.pending if self.pending is not None else self.draw(step, step, self.run.meter)  # lag 0, or first
        if sd.step != step:  # a checkpoint's draw belongs to the step it was saved before
            raise RuntimeError(f"the rollouts drawn for step {sd.step} reached step {step}")
        self.pending = None
        upd = self.update(sd)
        metrics = self.observe(sd, upd) | self.guard.observe(step, upd.stats, upd.skipped)
        self.launch_ahead(step)
        eff = effective(upd.batch)
        metrics |= self.record(round_, sd, upd, eff)
        held = self.heldout(step)
        if held is not None:
            metrics |= held.metrics
        metrics["time/step_s"] = time.perf_counter() - t0
        self.end_step(step, sd, upd, eff, metrics, held, tally)

    def draw(self, step: int, version: int, meter: CostMeter,
             after_update: Callable[[], None] | None = None) -> StepDraw:
        """Everything before the update that does not need this step's update: round start, selection, rollouts
        (``version``: the updates the sampling weights have had; ``meter``: where the phases are timed;
        ``after_update``: where the draw runs beside an update, returns once it has ended: the selection's look-ahead
        waits for it, tasks/overlap/concurrent.py)."""
        cfg, tc, buffer = self.cfg, self.cfg.train, self.buffer
        round_, metrics = step // tc.round_steps, {}
        if not self.sampling.overlapped and (step % tc.round_steps == 0 or step == self.start):
            sync_rollout_weights(self.run, self.policy)  # vLLM, sequential: the round's starting weights sample
        if step % tc.round_steps == 0:
            with meter.stage("reference"):
                metrics |= self.selector.begin_round(round_, step, self.measure)
        if buffer is not None:
            buffer.prune(step)  # drop groups past replay.max_age so the mix counts only replayable ones
        delta = cfg.replay.fresh_frac if buffer is not None else 1.0
        plan = self.composer.plan(cfg.rollout.n, cfg.kept_per_prompt, delta) if self.composer is not None \
            else CompositionPlan(rollouts=cfg.rollout.n, fresh_frac=delta, level=0.0)
        n_fresh, n_replay = (mix_counts(tc.prompts_per_step, plan.fresh_frac, len(buffer))
                             if buffer is not None and round_ > 0 else (tc.prompts_per_step, 0))
        before = dict(meter.seconds)
        fs = self.draw_fresh(self.run, self.sampler, self.selector, self.pool, n_fresh, step, plan.rollouts,
                             meter=meter, sampler_behaviour=self.sampler_behaviour, version=version,
                             carry=self.carry, after_update=after_update)
        self.carry = fs.carry  # draws are made one after another, so the next one reads it
        phases = {k: meter.seconds.get(k, 0.0) - before.get(k, 0.0) for k in DRAW_PHASES}
        return StepDraw(step=step, fresh=fs, plan=plan, n_replay=n_replay, version=version, metrics=metrics,
                        references=tuple(self.selector.take_references()), phases=phases)

    def draw_ahead(self, step: int, after_update: Callable[[], None]) -> StepDraw:
        """Step ``step``'s draw from the weights before step ``step - 1``'s update (lag 1), beside that update
        (``after_update`` returns once it has ended), on a meter of its own."""
        return self.draw(step, step - 1, CostMeter(prices={}, device="cpu", devices=1), after_update)

    def update(self, sd: StepDraw) -> StepUpdate:
        """The replayed groups joined to the fresh ones, one update at the step's lr; with lag 1 the next step's
        draw runs beside it (collected into :attr:`pending`)."""
        run, step, buffer = self.run, sd.step, self.buffer
        with run.meter.stage("selection"):
            n_replay = min(sd.n_replay, len(buffer)) if buffer is not None else 0
            replayed = buffer.sample(n_replay, step, torch.Generator().manual_seed(
                derive_seed(self.cfg.seed, step, "replay"))) if n_replay else []
        batch = sd.fresh.groups + replayed
        if self.sampling.overlapped and step + 1 < self.cfg.train.steps and not self.overlap.in_flight:
            self.launch(step + 1)  # step + 1 drawn from these weights (unless launched ahead, :meth:`launch_ahead`)
        lr = scheduled_lr(self.cfg, step)
        self.updater.set_lr(lr)
        with run.meter.stage("update"):
            t_upd = time.perf_counter()
            try:
                result = self.updater.step(batch)
            finally:
                self.overlap.update_ended()  # the draw in flight runs its look-ahead now, on the trainer's cores
            upd_s = time.perf_counter() - t_upd
        timing = None
        if self.overlap.in_flight:
            with run.meter.stage("rollout"):  # the trainer's wait for the next step's rollouts
                self.pending, timing = self.overlap.collect()
        fresh = result.with_behaviour(batch)[:len(sd.fresh.groups)]
        return StepUpdate(fresh=fresh, batch=batch, replayed=n_replay, lr=lr, stats=result.metrics, seconds=upd_s,
                          timing=timing, skipped=result.skipped)

    def launch(self, step: int) -> None:
        """Step ``step``'s draw in the background, from the trainer's weights now (lag 1)."""
        with self.run.meter.stage("weight_sync"):
            self.sampling.sync(self.run.dir / "vllm_weights")
        self.overlap.launch(partial(self.draw_ahead, step))

    def launch_ahead(self, step: int) -> None:
        """Once step ``step`` is observed, step ``step + 2``'s draw launched beside its records and the end of the
        step, rather than at step ``step + 1``'s update, where the generator would wait for them: from the same
        weights (after update ``step``) with the same selection (observed up to ``step``), so the run is the same,
        and the trainer's records no longer leave the generator idle (docs/algorithms.md 8.3). Not where anything
        between here and that update reads or writes what a draw does: a held-out evaluation (it samples with the
        engine, and a round start reads its accuracy), Rollout Replay's buffer (the records read it, a draw prunes
        it), the last two steps. At a step that ends with a checkpoint, what the draw changes (the selector, what it
        carries) is copied first, and the checkpoint saves that copy (:class:`DrawState`): a resume draws step
        ``step + 2`` again from it."""
        nxt = step + 1
        if (not self.sampling.overlapped or self.pending is None or self.overlap.in_flight or self.buffer is not None
                or nxt + 1 >= self.cfg.train.steps or self.evaluates(step)):
            return
        if self.checkpoints(step):
            with self.run.meter.stage("checkpoint"):
                self.before_draw = self.draw_state()
        self.launch(nxt + 1)

    def draw_state(self) -> DrawState:
        """What a draw changes of the state a checkpoint saves, copied as it is now: the selector's (through pickle:
        0.7 ms for the default pool's, against 14 ms for ``copy.deepcopy``), the carried rollouts (a draw replaces
        them rather than changing them)."""
        return DrawState(selector=pickle.loads(pickle.dumps(self.selector.state_dict(), protocol=5)),
                         carry=self.carry)

    def evaluates(self, step: int) -> bool:
        """Whether a held-out evaluation follows step ``step``'s update (every ``eval.every`` steps)."""
        every = self.cfg.eval.every
        return self.evaluate is not None and bool(every) and (step + 1) % every == 0

    def checkpoints(self, step: int) -> bool:
        """Whether step ``step`` ends with a checkpoint: a round's end, every ``train.checkpoint_every`` steps, the
        last step, and a run the skip guard stops."""
        tc = self.cfg.train
        return ((step + 1) % tc.round_steps == 0 or bool(tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0)
                or step + 1 == tc.steps or self.guard.stuck)

    def observe(self, sd: StepDraw, upd: StepUpdate) -> dict[str, float]:
        """What the step taught the selection: informative fresh groups to the replay buffer, the rewards to the
        selector (DOTS labels, ScalingRL, GAIN-RL) and to the adaptive composition; returns the round start's
        metrics and theirs."""
        fs, metrics = sd.fresh, dict(sd.metrics)
        with self.run.meter.stage("selection"):
            if self.buffer is not None:
                for g in upd.fresh:
                    self.buffer.admit(g)
            metrics |= self.selector.observe(sd.step, fs.idx, fs.rewards, fs.reward_mean,
                                             upd.stats.get("gain/angle_online"))
            if self.composer is not None:
                self.composer.observe(torch.stack(fs.rewards), self.cfg.kept_per_prompt)  # the plan this step ran
                metrics |= sd.plan.metrics() | {"adapt/informative": self.composer.informative}
        return metrics

    def record(self, round_: int, sd: StepDraw, upd: StepUpdate, eff: torch.Tensor) -> dict[str, float]:
        """The step's ledger rows; returns its training metrics (``eff``: [groups trained] 1.0 where a group's
        rewards were unequal)."""
        meter, fs, step = self.run.meter, sd.fresh, sd.step
        with meter.stage("tracking"):
            self.recorder.rows(round_, step, sd.references, fs.rows, upd.batch,
                               skipped_rows(upd.stats, upd.skipped))
            metrics = upd.stats | fs.stats
            metrics |= {
                "train/reward_mean": fs.reward_mean,
                "train/lr": upd.lr,
                "train/effective_ratio": float(eff.mean()),
                "train/effective_ratio_fresh": float(eff[:len(fs.groups)].mean()),
                "train/groups": float(len(upd.batch)),
                "train/level_mean": float(sum(r.level or 0 for r in fs.records) / len(fs.records)),
                "train/policy_lag": float(step - sd.version),
                "rollout/generated": float(fs.generated),
                "rollout/tokens": float(fs.tokens),
                "rollout/tokens_per_s": fs.tokens / max(fs.gen_s, 1e-9),
                "rollout/length_mean": fs.tokens / fs.generated,
            } | throughput(self.shape, self.machine, fs, upd.stats, upd.seconds) | {
                "time/reference_share": meter.wall_seconds("reference") / max(meter.wall_seconds(TRAIN_PHASES), 1e-9)}
            if upd.timing is not None:  # this update overlapped the next step's draw
                metrics |= {"overlap/update_s": upd.seconds} | upd.timing.metrics() | {
                    f"overlap/draw_{k}_s": v for k, v in self.pending.phases.items()}
            if self.buffer is not None:
                metrics |= self.buffer.stats(step) | {"replay/fresh": float(len(fs.groups)),
                                                      "replay/replayed": float(upd.replayed)}
        return metrics

    def heldout(self, step: int) -> HeldoutEval | None:
        """Every ``eval.every`` steps: the held-out evaluation after step ``step``'s update, whose accuracy the
        selector reads at the next round start (before the step's checkpoint, so a resume keeps it)."""
        if not self.evaluates(step):
            return None
        sync_rollout_weights(self.run, self.policy)  # a server evaluates the weights after this update
        with self.run.meter.stage("eval_during"):
            held = self.evaluate(step + 1)
        self.selector.set_heldout_accuracy(held.accuracy)
        return held

    def end_step(self, step: int, sd: StepDraw, upd: StepUpdate, eff: torch.Tensor, metrics: dict[str, float],
                 held: HeldoutEval | None, tally: RoundLog) -> None:
        """The step's metrics line (with the cost meter's totals), progress bar and round tally; a checkpoint at a
        round's end, every ``train.checkpoint_every`` steps and after the last."""
        run = self.run
        metrics |= run.meter.metrics() | (run.meter.memory.take() if run.meter.memory is not None else {})
        with run.meter.stage("tracking"):
            self.recorder.metrics(step, metrics)
        self.summary = TrainSummary(steps=step + 1, last=metrics)
        if "eval/accuracy" in metrics:
            self.bar_acc = f"{metrics['eval/accuracy']:.2f}"
        self.bar.update(1)
        timing = upd.timing
        idle = {"idle": f"{timing.trainer_idle_s:.2f}/{timing.generator_idle_s:.2f}"} if timing else {}
        self.bar.set_postfix(reward=f"{sd.fresh.reward_mean:.2f}", eff=f"{float(eff.mean()):.2f}",
                             s=f"{metrics['time/step_s']:.1f}", **({"acc": self.bar_acc} if self.bar_acc else {}),
                             **idle, **self.guard.postfix())
        tally.add(sd.fresh.records, sd.fresh.rows, eff, upd.replayed,
                  (upd.seconds, timing) if timing is not None else None, sd.fresh.rewards,
                  None if held is None else held.accuracy)
        if self.checkpoints(step):
            with run.meter.stage("tracking"):
                self.recorder.flush()  # the ledger rows the checkpoint covers, written before it
            with run.meter.stage("checkpoint"):
                state = self.before_draw or DrawState(selector=self.selector.state_dict(), carry=self.carry)
                self.before_draw = None
                self.recorder.checkpoint(step + 1, lambda held: checkpoint.save(
                    run, step + 1, self.policy, self.updater, state.selector, self.buffer, self.composer,
                    draw=self.pending, carry=state.carry, held=held))
        self.guard.check()  # train.max_skipped_steps in a row: stop, naming the cause


def effective(batch: list[RolloutGroup]) -> torch.Tensor:
    """[groups] 1.0 where a group's kept rewards are unequal (it carries a gradient), else 0.0."""
    kept = torch.stack([g.rewards for g in batch]) if len({g.size for g in batch}) == 1 else None
    return effective_mask(kept).float() if kept is not None else torch.tensor(
        [float(g.rewards.max() > g.rewards.min()) for g in batch])


def sync_rollout_weights(run: Run, policy: Policy) -> None:
    """Bring the rollout engine up to date with the policy's weights (``RolloutEngine.sync_weights``: nothing to do
    for the in-process HF engine, an export and reload for the vLLM server, tasks/generation/vllm_engine.py)."""
    run.meter.add("weight_sync", policy.engine.sync_weights(policy.model, policy.tokenizer, run.dir / "vllm_weights"))

