"""The training stage's entry: :func:`training` builds a :class:`~tasks.training.loop.Trainer` with its parts (the
overlap's lag where the caller has not decided it, the run's updater, the sampler) and closes them after;
:func:`train` plays every round in place.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from rlcore.overlap_lag import LagChoice
from tasks.calibration.record import Calibration
from tasks.data.prompts import PromptRecord
from tasks.overlap.concurrent import open_sampler
from tasks.overlap.lag import decide_lag
from tasks.policy import Policy
from tasks.run import Run
from tasks.selection.features import Features
from tasks.training.loop import Trainer
from tasks.training.step_records import EvaluateFn, TrainSummary
from tasks.update.backend import build_updater, share_generation

log = logging.getLogger("rlsift.train")


@contextmanager
def training(run: Run, policy: Policy, pool: list[PromptRecord], features: Features, lag: LagChoice,
             calibration: Calibration | None = None, evaluate: EvaluateFn | None = None) -> Iterator[Trainer]:
    """The training stage's :class:`Trainer` (or a resumed one), with its updater and sampler, closed after.

    ``lag``: the overlap decided before training (the pipeline's overlap stage; :func:`decided_lag` outside it):
    with lag 1 the next step's draw runs while this step updates (tasks/overlap/concurrent.py). ``evaluate`` runs
    every ``eval.every`` steps (0: never); its accuracy goes to ``Selector.set_heldout_accuracy``, which
    ScalingRL's scheduler reads at the next round start. A failing or stopped run does not wait for the draw in
    flight.
    """
    cfg = run.cfg
    # one process, or sharded over the torchrun ranks (then `model` stays rank 0's full copy, updated in place)
    longest = int(features.prompt_tokens.max()) if len(features.ids) else None  # the memory check counts it
    updater = build_updater(cfg, policy, device=run.device, precision=run.precision, prompt_tokens=longest)
    shared = share_generation(cfg, policy, updater, lag.lag)  # sharded: every rank decodes its share
    if shared is not None:
        log.info("rollouts: %s", shared)
    sampling = open_sampler(policy, lag.lag, threads=cfg.overlap.generator_threads,  # the probe's, where kept
                            needs_copy=cfg.select.screen > 1, on_temp_dir=run.note_temp, handover=run.handover)
    try:
        trainer = Trainer(run, policy, sampling, updater, pool, features, calibration, evaluate)
        try:
            with frozen_heap():
                yield trainer
        except BaseException:
            sampling.close(now=True)
            try:  # a failed run's steps stay in the ledger to be read (a resume drops those past its checkpoint)
                trainer.recorder.flush()
            except Exception as err:  # the failure's own error is the one raised
                log.warning("the ledger rows of the steps since the last checkpoint were not written: %s", err)
            raise
        finally:
            trainer.overlap.close()
    finally:
        sampling.close()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive before training left out of the garbage collector's passes during it (``gc.freeze``),
    given back after (``gc.unfreeze``: a cycle among them is collected then). A full pass scans every tracked object,
    and a run's imports and setup leave hundreds of thousands (torch, transformers, MLflow, Prefect): on 2 cores one
    took 0.46-0.61 s, holding the GIL, so it stopped the trainer, the draw thread and the tracking threads at once,
    at any step (two such in four 100-step runs; docs/performance.md); a pass now scans what training made.
    Training frees its step objects by reference counting, so the heap it freezes does not grow. A heap its caller
    froze already stays as the caller left it (``gc.unfreeze`` would give back every frozen object, the caller's
    too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def decided_lag(run: Run, policy: Policy, pool: list[PromptRecord], calibration: Calibration | None) -> LagChoice:
    """The overlap's lag where no overlap stage decided it (tasks/overlap/lag.py ``decide_lag``), probing on the
    plan's probe prompts (the first ``plan.probe_prompts`` reference prompts) or the pool's first ones."""
    cfg = run.cfg
    lag = decide_lag(cfg, policy, calibration.first(pool, cfg.plan.probe_prompts) if calibration is not None
                     else pool[: cfg.plan.probe_prompts], run.device, handover=run.handover)
    log.info("overlap: %s", lag.reason)
    return lag


def train(run: Run, policy: Policy, pool: list[PromptRecord], features: Features,
          calibration: Calibration | None = None, evaluate: EvaluateFn | None = None,
          lag: LagChoice | None = None) -> TrainSummary:
    """Run (or resume) the training stage in place, every round in turn (:func:`training`'s arguments; ``lag``
    None: :func:`decided_lag`); the pipeline's train stage plays the rounds itself, each a Prefect task run."""
    lag = lag if lag is not None else decided_lag(run, policy, pool, calibration)
    with training(run, policy, pool, features, lag, calibration, evaluate) as trainer:
        for round_ in trainer.rounds():
            trainer.play_round(round_)
        return trainer.finish()
