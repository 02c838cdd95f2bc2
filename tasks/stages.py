"""The pipeline's stages as Prefect tasks: thin wrappers that time, cost, record and call the plain code.

Tasks take the in-process :class:`~tasks.run.Run` and policy objects, so they use ``NO_CACHE`` (models
and connections cannot be hashed) and no retries: a stage reruns from the run's checkpoint via
``rlsift run --resume``, never silently from scratch.

Resume-safe: a resumed run (``rlsift run --resume``) reuses what its stages already produced instead of
redoing and re-recording it: the ingested prompt lists (``ingest.json``; the prompts come back from the
ledger), the calibration (``calibrate.json``), the features (``features.pt``) and the starting
evaluation (``eval_start.json``). Only the policy is prepared again. A redone final evaluation replaces
its ledger rows. Training continues from its checkpoint (tasks/training/checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from rlcore.overlap_lag import LagChoice
from rlcore.seeding import derive_seed
from tasks.calibration.record import Calibration, CalibrationDraw
from tasks.calibration.reference import rollout_rewards, stratified_reference
from tasks.data import ingest
from tasks.data.prompts import PromptRecord
from tasks.evaluation.heldout import EvalResult, evaluate, flat_metrics, table_rows
from tasks.evaluation.report import eval_by_level, eval_levels, eval_table
from tasks.generation.rollout import HFEngine, end_of_turn_ids
from tasks.model.loading import load_policy
from tasks.model.lora import apply_lora
from tasks.model.source import policy_source
from tasks.overlap.lag import decide_lag, lag_from_json, lag_to_json
from tasks.plan.artifact import plan_table
from tasks.plan.planner import make_plan, probe_records, reads_upfront
from tasks.plan.record import Plan
from tasks.policy import Policy
from tasks.records import artifacts, plots
from tasks.records.files import write_json
from tasks.records.label import run_label
from tasks.records.ledger import ReferenceRow
from tasks.records.progress import pulse
from tasks.report.registration import (
    champion_tags,
    refusal,
    registration,
    version_description,
    version_tags,
)
from tasks.run import Run
from tasks.selection.features import Features, compute_features, static_features
from tasks.training.entry import training
from tasks.training.step_records import TRAIN_PHASES, HeldoutEval, TrainSummary

log = logging.getLogger("rlsift")
stage = task(cache_policy=NO_CACHE, persist_result=False)

def stage_done(run: Run, name: str, step: int = 0, parts: tuple[str, ...] | None = None,
               metrics: bool = True) -> None:
    """A stage ended: its cost in the ledger, MLflow and the log (``Run.log_stage_cost``, same arguments), and the
    run's cost table so far as the flow run's ``time-by-stage`` artifact (tasks/records/artifacts.py)."""
    run.log_stage_cost(name, step, parts=parts, metrics=metrics)
    artifacts.stage_costs(title(run), run.cost_table())


def title(run: Run) -> str:
    """How the Prefect artifacts name the run (its id and MLflow name)."""
    return artifacts.title(run.run_id, run.tracker.name)


@stage(name="ingest")
def ingest_stage(run: Run, only_new: bool = False) -> ingest.IngestResult:
    """Sources -> ledger. ``only_new``: train only on prompts the ledger did not know (the retrain flow)."""
    cache = run.dir / "ingest.json"
    if cache.exists():
        return _reuse_ingest(run, cache)
    with run.meter.stage("ingest"):
        result = ingest.ingest(run.ledger, run.run_id, list(run.cfg.data.sources))
        ingest.split_holdout(result, run.cfg.data.test_from_train, run.cfg.seed)
    if only_new:
        result.train = [r for r in result.train if r.id in result.new_ids]
    elif not result.train:
        raise ValueError("no training prompts after ingest: check data.sources and the quarantine table")
    t = result.totals
    run.log_metrics({"ingest/rows": t["rows"], "ingest/accepted": t["accepted"], "ingest/duplicates": t["duplicates"],
                     "ingest/quarantined": t["quarantined"], "ingest/new": t["new"],
                     "ingest/train": len(result.train), "ingest/test": len(result.test)}, 0)
    write_json(cache, {"train": [r.id for r in result.train], "test": [r.id for r in result.test],
                       "new_ids": sorted(result.new_ids), "sources": result.sources})
    stage_done(run, "ingest")
    log.info("ingest: %s", json.dumps(result.summary()["sources"]))
    return result


def _reuse_ingest(run: Run, cache) -> ingest.IngestResult:
    data = json.loads(cache.read_text())
    train, test = run.ledger.prompts(ids=data["train"]), run.ledger.prompts(ids=data["test"])
    if len(train) != len(data["train"]) or len(test) != len(data["test"]):
        raise RuntimeError(f"{cache} names prompts the ledger {run.ledger.path} does not have")
    log.info("ingest: reusing this run's ingest (%d train, %d test prompts)", len(train), len(test))
    return ingest.IngestResult(train=train, test=test, new_ids=set(data["new_ids"]), sources=data["sources"])


@stage(name="prepare-policy")
def prepare_stage(run: Run) -> Policy:
    cfg, mc = run.cfg, run.cfg.model
    precision = run.precision
    log.info("precision %s (model.precision=%s): passes and sampler in %s, trained weights and AdamW state in %s",
             precision.name, mc.precision, str(precision.compute).removeprefix("torch."),
             str(precision.master).removeprefix("torch."))
    with run.meter.stage("prepare"):
        path = policy_source(cfg)
        model, tok = load_policy(path, dtype=precision.compute, device=run.device)
        if mc.lora.enabled:
            model = apply_lora(model, mc.lora, derive_seed(cfg.seed, "lora"))
    rc = cfg.rollout
    if rc.engine == "vllm":  # one or more vLLM servers (docs/scale-out.md)
        from tasks.generation.server_pool import ServerPool
        engine = ServerPool.from_config(rc, tok, end_of_turn_ids(model, tok), lora=mc.lora.enabled)
        engine.sync_weights(model, tok, run.dir / "vllm_weights")  # the servers sample from exactly this policy
    else:
        engine = HFEngine.from_config(model, tok, rc, run.device)
    policy = Policy(model=model, tokenizer=tok, engine=engine,
                    system_prompt=mc.system_prompt if getattr(tok, "chat_template", None) else None)
    run.info = replace(run.info, policy_path=str(path))
    stage_done(run, "prepare", metrics=not run.resumed)
    if not run.resumed:
        run.tracker.set_tags({"rlsift.policy_path": str(path)})
        run.tracker.log_params({"precision": precision.name})  # model.precision resolved (auto: by the device)
        run.log_metrics({"model/params": sum(p.numel() for p in model.parameters()),
                         "model/trainable_params": sum(p.numel() for p in policy.trainable_parameters())}, 0)
    return policy


@stage(name="calibrate")
def calibrate_stage(run: Run, policy: Policy, pool: list[PromptRecord]) -> Calibration:
    """K reference prompts stratified by level, G rollouts each with the current policy."""
    cfg = run.cfg
    cache = run.dir / "calibrate.json"
    if cache.exists():
        return Calibration.load(cache)
    picked = stratified_reference(pool, cfg.calibrate.k, derive_seed(cfg.seed, "calibrate"))
    records = tuple(pool[i] for i in picked)
    with run.meter.stage("calibrate"), pulse("calibrate", log) as say:  # a line every 10 s while it runs
        say(f"{len(picked)} reference prompts x {cfg.calibrate.g} rollouts")
        t0 = time.perf_counter()
        gen, rewards = rollout_rewards(policy, list(records), cfg.calibrate.g, derive_seed(cfg.seed, "calibrate-roll"))
        seconds = time.perf_counter() - t0
    calibration = Calibration(indices=tuple(picked), success=rewards.mean(1),
                              draw=CalibrationDraw(records, gen, seconds))  # the plan's probe reads it
    rates = calibration.success
    run.ledger.add_reference(run.run_id, [
        ReferenceRow(round=-1, step=-1, prompt_id=pool[i].id, n=cfg.calibrate.g, successes=int(rewards[j].sum()),
                     success_rate=float(rates[j]), predicted=None) for j, i in enumerate(picked)])
    run.log_metrics(calibration.metrics, 0)
    calibration.save(cache)
    stage_done(run, "calibrate")
    return calibration


@stage(name="plan")
def plan_stage(run: Run, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
               candidates: tuple[str, ...] | None = None) -> Plan:
    """The plan (tasks/plan/planner.py): the pool's measured pass rates, a timed probe, each candidate's predicted
    effective ratio and clock against plain GRPO, and the choice (an ``auto`` run is renamed after it,
    :func:`name_the_choice`). A resumed run reuses its ``plan.json``."""
    cache = run.dir / "plan.json"
    if cache.exists():
        result = Plan.load(cache)
        name_the_choice(run, result)
        plan_table(title(run), result)
        return result
    with run.meter.stage("plan"):
        result = make_plan(run.cfg, policy, pool, calibration, device=run.device, candidates=candidates,
                           spent_s=run.meter.seconds.get("calibrate", 0.0), scratch=run.dir, handover=run.handover,
                           kept=run.cfg.paths.cache_dir / "plan-probe")
    result.save(cache)
    run.log_metrics(result.metrics(), 0)
    run.tracker.set_tags(result.tags())
    for f in (cache, run.dir / "plan.md"):
        run.tracker.log_artifact(f)
    log.info("plan: %s", result.summary())
    log.info("plan: %s", result.line())
    name_the_choice(run, result)
    plan_table(title(run), result)
    stage_done(run, "plan")
    return result


def name_the_choice(run: Run, plan: Plan) -> None:
    """An ``auto`` run is named after what it trains: ``auto bundled:default s0`` becomes ``auto→dots_screen
    bundled:default s0`` (also inside a retrain's name); a name the caller chose (a benchmark arm's) stays."""
    before, after = run_label(run.cfg), run_label(run.cfg, plan.choice)
    name = run.tracker.name
    if name and before in name and before != after:
        run.tracker.rename(name.replace(before, after))


@stage(name="overlap")
def overlap_stage(run: Run, policy: Policy, pool: list[PromptRecord], calibration: Calibration,
                  plan: Plan | None = None) -> LagChoice:
    """The overlap's lag for the training stage (tasks/overlap/lag.py ``decide_lag``): the plan's where it ran,
    else decided here (``overlap.lag=auto`` on a shared device: a probe on the reference prompts where it pays for
    itself, whose generator process the training then samples from). Recorded as the MLflow tags
    ``rlsift.overlap.*`` and the run's ``overlap.json``, which a resumed run reuses."""
    cache = run.dir / "overlap.json"
    if cache.exists():
        return lag_from_json(json.loads(cache.read_text()))
    if plan is not None and plan.overlap is not None:
        choice = plan.overlap
    else:
        with run.meter.stage("overlap"):
            choice = decide_lag(run.cfg, policy, probe_records(pool, calibration, run.cfg), run.device,
                                handover=run.handover)  # a lag-1 probe's process is the training's
        if choice.basis in ("probe", "cost"):
            run.log_stage_cost("overlap")
    write_json(cache, lag_to_json(choice))
    probe = {} if choice.probe is None else {f"rlsift.overlap.{k}": f"{v:.4g}" for k, v in (
        ("draw_s", choice.probe.draw_s), ("update_s", choice.probe.update_s),
        ("at_once_s", choice.probe.at_once_s), ("at_once_ratio", choice.probe.ratio))}
    run.tracker.set_tags({"rlsift.overlap.lag": str(choice.lag), "rlsift.overlap.basis": choice.basis,
                          "rlsift.overlap.reason": choice.reason} | probe)
    log.info("overlap: %s", choice.reason)
    return choice


@stage(name="score")
def score_stage(run: Run, policy: Policy, pool: list[PromptRecord]) -> Features:
    """The pool's features (tasks/selection/features.py): scored with a forward pass where the run's techniques
    read them (tasks/plan/planner.py ``reads_upfront``: DOTS, ScalingRL, GAIN-RL), else the tokenizer's alone."""
    saved = run.dir / "features.pt"
    if saved.exists():
        feats = Features.load(saved)
        if feats.ids == [r.id for r in pool]:
            return feats
    if not reads_upfront(run.cfg)["score"]:
        log.info("score: not run (%d prompts): this run's techniques read no embedding or angle", len(pool))
        return static_features(policy, pool)
    with run.meter.stage("score"):
        feats = compute_features(policy, pool, inter_weight=run.cfg.gain.inter_weight,
                                 batch_size=run.cfg.eval.batch_size, device=run.device, progress=True)
    feats.save(saved)
    if not run.ledger.has_features(run.run_id):
        run.ledger.add_features(run.run_id, feats.ledger_rows())
    corr = torch.corrcoef(torch.stack([feats.angle, feats.prompt_tokens.float()]))[0, 1]
    run.log_metrics({"gain/angle_mean": float(feats.angle.mean()), "gain/angle_length_corr": float(corr)}, 0)
    stage_done(run, "score")
    return feats


@stage(name="round", task_run_name="round-{index}")
def round_task(index: int, body: Callable[[], None]) -> None:
    """Training round ``index``'s steps as a task run of the train stage's, so the flow-run graph shows the rounds;
    its log ends with the round's selection summary (``tasks.training.rounds.RoundLog``)."""
    body()


def run_round(index: int, body: Callable[[], None]) -> None:
    """How the train stage runs round ``index`` (``body``: its steps): :func:`round_task` in a Prefect transaction
    that commits as the round ends. A task run nested in another is, by Prefect's default (a lazy commit), part of
    its parent's transaction, committed only when the parent's is: a run stopped in round 2 would roll back the
    train stage's transaction and with it rounds 0 and 1, which Prefect then shows as ``RolledBack``, though their
    checkpoints are kept and a resume skips them. Committed at their end, finished rounds stay ``Completed``; only
    the round the stop interrupted shows how it ended."""
    from prefect.transactions import CommitMode, transaction

    with transaction(commit_mode=CommitMode.EAGER):
        round_task(index, body)


@stage(name="train")
def train_stage(run: Run, policy: Policy, pool: list[PromptRecord], features: Features, test: list[PromptRecord],
                calibration: Calibration, lag: LagChoice) -> TrainSummary:
    """Training (tasks/training/loop.py ``Trainer``, built by tasks/training/entry.py), each round a task run of its
    own (:func:`run_round`), with a greedy held-out evaluation every ``eval.every`` steps (:func:`eval_during`)."""
    evaluate_fn = partial(eval_during, run, policy, test)
    with training(run, policy, pool, features, lag, calibration, evaluate=evaluate_fn) as trainer:
        for round_ in trainer.rounds():
            run_round(round_.index, partial(trainer.play_round, round_))
        summary = trainer.finish()
    stage_done(run, "train", summary.steps, parts=TRAIN_PHASES)
    return summary


def eval_during(run: Run, policy: Policy, test: list[PromptRecord], step: int) -> HeldoutEval:
    """The in-training held-out evaluation after ``step`` updates: greedy on the first ``eval.limit`` test prompts,
    its rows in the ledger (phase ``during``)."""
    ec = run.cfg.eval
    res = evaluate(policy, test[: ec.limit] if ec.limit else test, samples=0, seed=run.cfg.seed)
    run.ledger.add_evals(run.run_id, table_rows(res, "during", step))
    return HeldoutEval(accuracy=res.overall.greedy_acc, metrics=flat_metrics(res))


@stage(name="evaluate", task_run_name="evaluate-{phase}")  # evaluate-start, evaluate-end
def evaluate_stage(run: Run, policy: Policy, test: list[PromptRecord], phase: str, step: int) -> EvalResult:
    """Held-out evaluation ``phase`` (``start`` before training, ``end`` after it) at ``step``; its accuracy by level
    (with the start's, after training) becomes the flow run's ``eval-by-level`` artifact."""
    ec = run.cfg.eval
    records = test[: ec.limit] if ec.limit else test
    cached = run.dir / f"eval_{phase}.json"
    if phase == "start" and cached.exists():  # a resumed run keeps its starting evaluation
        result = EvalResult.load(cached)
        publish_eval(run, phase, result)
        return result
    with run.meter.stage(f"eval_{phase}"), pulse(f"eval_{phase}", log) as say:  # a line every 10 s while it runs
        say(f"{len(records)} held-out prompts, greedy" + (f" and {ec.samples} samples each" if ec.samples else ""))
        result = evaluate(policy, records, samples=ec.samples, seed=run.cfg.seed)
    run.ledger.replace_evals(run.run_id, phase, table_rows(result, phase, step))
    result.save(cached)
    run.log_metrics(flat_metrics(result, f"eval_{phase}") | flat_metrics(result), step)
    run.tracker.log_artifact(cached)
    publish_eval(run, phase, result)
    stage_done(run, f"eval_{phase}", step)
    return result


def publish_eval(run: Run, phase: str, result: EvalResult) -> None:
    """The ``eval-by-level`` artifact: the start alone, then the start (``eval_start.json``) beside the end."""
    start = run.dir / "eval_start.json"
    if phase == "start":
        eval_by_level(title(run), result, None)
    elif start.exists():
        eval_by_level(title(run), EvalResult.load(start), result)


@dataclass(frozen=True)
class Report:
    """What the report stage leaves: the final model's folder, its registered version (None when not
    registered), the Markdown eval table and, for a LoRA run, its adapter folder (else None)."""

    model_path: str
    model_version: str | None
    table: str
    adapter_path: str | None = None


@stage(name="report")
def report_stage(run: Run, policy: Policy, start: EvalResult, end: EvalResult, summary: TrainSummary) -> Report:
    """Plots, the eval table, the final model (registered in MLflow with a description and its held-out accuracy)
    and, for a LoRA run, its adapter folder (``final_adapter``: logged, and registered with the version).
    Timed as stage ``report`` (registering the model is most of it)."""
    with run.meter.stage("report"):
        files = plots.training_curves(run.dir / "metrics.jsonl", run.dir / "training_curves.png",
                                      heldout=((0, start.overall.greedy_acc),
                                               (summary.steps, end.overall.greedy_acc)))
        files += eval_levels(start, end, run.dir / "eval_by_level.png")
        table = eval_table(start, end)
        (run.dir / "eval_table.md").write_text(table)
        for f in [*files, run.dir / "eval_table.md"]:
            run.tracker.log_artifact(f)
        final = policy.save(run.dir / "final_model")
        adapter = None
        if policy.has_adapters:  # beside the merged model: the adapter PEFT loads over the base and vLLM serves
            adapter = policy.save_adapter(run.dir / "final_adapter", run.info.policy_path)
            run.tracker.log_artifact(adapter)
        version = None
        tc = run.cfg.tracking
        why = refusal(start.overall.greedy_acc, end.overall.greedy_acc, tc.register_tolerance)
        if tc.register_model and why:
            log.warning("run %s: not registered: %s", run.run_id, why)
            run.tracker.set_tags({"rlsift.not_registered": why})
        elif tc.register_model:
            tags = version_tags(run, end, summary) | champion_tags(run, start, end, summary)  # candidate or champion
            version = run.tracker.register_model(final, tc.model_name, tags,
                                                 version_description(run, start, end, summary), adapter=adapter)
    log.info("report: held-out accuracy %.3f -> %.3f after %d steps; %s", start.overall.greedy_acc,
             end.overall.greedy_acc, summary.steps, registration(tc.model_name, tc.register_model, version, why))
    stage_done(run, "report", summary.steps)
    return Report(model_path=str(final), model_version=version, table=table,
                  adapter_path=str(adapter) if adapter is not None else None)
