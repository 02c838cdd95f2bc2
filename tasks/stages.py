"""The pipeline's stages as Prefect tasks: thin wrappers that time, cost, record and call the plain code.

Tasks take the in-process :class:`~tasks.run.Run` and policy objects, so they use ``NO_CACHE`` (stack.md
§2: models and connections cannot be hashed) and no retries: a stage reruns from the run's checkpoint via
``rlsift run --resume``, never silently from scratch.
"""

from __future__ import annotations

import json
import logging

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import arith, ingest, plots, score
from tasks.evaluate import evaluate, flat_metrics, table_rows
from tasks.policy import load_policy
from tasks.records import PromptRecord
from tasks.rollout import HFEngine, derive_seed
from tasks.run import Run, resolve_dtype, show_progress, write_json
from tasks.train import Policy, rollout_rewards, train
from tasks.warmstart import warm_start

log = logging.getLogger("rlsift")
stage = task(cache_policy=NO_CACHE, persist_result=False)

#: Warm-start data: worked solutions over all levels, from a seed the RL pool never uses.
WARMSTART_SEED = 10_000


@stage(name="ingest")
def ingest_stage(run: Run) -> ingest.IngestResult:
    with run.meter.stage("ingest"):
        result = ingest.ingest(run.ledger, run.run_id, list(run.cfg.data.sources))
        ingest.split_holdout(result, run.cfg.data.test_from_train, run.cfg.seed)
    if not result.train:
        raise ValueError("no training prompts after ingest: check data.sources and the quarantine table")
    t = result.totals
    run.log_metrics({"ingest/rows": t["rows"], "ingest/accepted": t["accepted"], "ingest/duplicates": t["duplicates"],
                     "ingest/quarantined": t["quarantined"], "ingest/train": len(result.train),
                     "ingest/test": len(result.test)}, 0)
    run.log_stage_cost("ingest")
    log.info("ingest: %s", json.dumps(result.summary()["sources"]))
    return result


@stage(name="prepare-policy")
def prepare_stage(run: Run) -> Policy:
    cfg, mc = run.cfg, run.cfg.model
    with run.meter.stage("prepare"):
        if mc.path:
            path = mc.path
        else:
            cache = run.cfg.paths.cache or str(run.root / "cache")
            sft = arith.generate(WARMSTART_SEED + cfg.seed, max(mc.warmstart.steps, 1) * 4, "train", "uniform",
                                 unique=False)
            path = warm_start(sft, cache, hidden=mc.hidden, layers=mc.layers, heads=mc.heads,
                              steps=mc.warmstart.steps, batch_size=mc.warmstart.batch_size, lr=mc.warmstart.lr,
                              seed=cfg.seed, progress=show_progress())
        model, tok = load_policy(path, dtype=resolve_dtype(mc.dtype, run.device), device=run.device)
    rc = cfg.rollout
    if rc.engine == "vllm":
        from tasks.vllm_engine import VLLMEngine
        engine = VLLMEngine(rc.vllm_url, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature,
                            top_p=rc.top_p, top_k=rc.top_k)
    else:
        engine = HFEngine(model, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                          top_k=rc.top_k, chunk=rc.chunk, device=run.device)
    run.info["policy_path"] = str(path)
    run.tracker.set_tags({"rlsift.policy_path": str(path)})
    run.log_stage_cost("prepare")
    n_params = sum(p.numel() for p in model.parameters())
    run.log_metrics({"model/params": n_params}, 0)
    return Policy(model=model, tokenizer=tok, engine=engine,
                  system_prompt=mc.system_prompt if getattr(tok, "chat_template", None) else None)


@stage(name="calibrate")
def calibrate_stage(run: Run, policy: Policy, pool: list[PromptRecord]) -> dict:
    """K reference prompts stratified by level, G rollouts each with the current policy."""
    cfg = run.cfg
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "calibrate"))
    strata: dict = {}
    for i in torch.randperm(len(pool), generator=gen).tolist():
        strata.setdefault(pool[i].level, []).append(i)
    picked, k = [], min(cfg.calibrate.k, len(pool))
    while len(picked) < k:  # round-robin over levels
        for lv in sorted(strata, key=lambda x: (x is None, x)):
            if strata[lv] and len(picked) < k:
                picked.append(strata[lv].pop())
    with run.meter.stage("calibrate"):
        _, rewards = rollout_rewards(policy, [pool[i] for i in picked], cfg.calibrate.g,
                                     derive_seed(cfg.seed, "calibrate-roll"))
    rates = rewards.mean(1)
    run.ledger.add_rows("reference", run.run_id, [
        {"round": -1, "step": -1, "prompt_id": pool[i].id, "n": cfg.calibrate.g, "successes": int(rewards[j].sum()),
         "success_rate": float(rates[j]), "predicted": None} for j, i in enumerate(picked)])
    eff = ((rates > 0) & (rates < 1)).float().mean()
    metrics = {"calibrate/success_mean": float(rates.mean()), "calibrate/effective": float(eff),
               "calibrate/solved": float((rates == 1).float().mean()), "calibrate/unsolved": float((rates == 0).float().mean())}
    run.log_metrics(metrics, 0)
    run.log_stage_cost("calibrate")
    return {"indices": picked, "success": rates, **metrics}


@stage(name="score")
def score_stage(run: Run, policy: Policy, pool: list[PromptRecord]) -> dict:
    with run.meter.stage("score"):
        feats = score.score(policy, pool, inter_weight=run.cfg.gain.inter_weight, batch_size=run.cfg.eval.batch_size,
                            device=run.device, progress=show_progress())
    score.save(feats, run.dir / "features.pt")
    if not run.ledger.query("SELECT 1 FROM features WHERE run_id = ? LIMIT 1", [run.run_id]):
        run.ledger.add_rows("features", run.run_id, score.ledger_rows(feats))
    corr = torch.corrcoef(torch.stack([feats["angle"], feats["prompt_tokens"].float()]))[0, 1]
    run.log_metrics({"gain/angle_mean": float(feats["angle"].mean()), "gain/angle_length_corr": float(corr)}, 0)
    run.log_stage_cost("score")
    return feats


@stage(name="train")
def train_stage(run: Run, policy: Policy, pool: list[PromptRecord], features: dict, test: list[PromptRecord],
                calibration: dict) -> dict:
    ec = run.cfg.eval
    during = test[: ec.limit] if ec.limit else test

    def eval_during(step: int) -> dict:
        res = evaluate(policy, during, samples=0, seed=run.cfg.seed)
        run.ledger.add_rows("evals", run.run_id, table_rows(res, "during", step))
        return flat_metrics(res)

    summary = train(run, policy, pool, features, calibration, evaluate_fn=eval_during)
    run.log_stage_cost("train", summary["steps"])
    return summary


@stage(name="evaluate")
def evaluate_stage(run: Run, policy: Policy, test: list[PromptRecord], phase: str, step: int) -> dict:
    ec = run.cfg.eval
    records = test[: ec.limit] if ec.limit else test
    done = run.ledger.query("SELECT 1 FROM evals WHERE run_id = ? AND phase = ? LIMIT 1", [run.run_id, phase])
    if done and phase == "start":  # a resumed run keeps its starting evaluation
        cached = run.dir / "eval_start.json"
        if cached.exists():
            return json.loads(cached.read_text())
    with run.meter.stage(f"eval_{phase}"):
        result = evaluate(policy, records, samples=ec.samples, seed=run.cfg.seed)
    write_json(run.dir / f"eval_{phase}.json", result)
    run.ledger.add_rows("evals", run.run_id, table_rows(result, phase, step))
    run.log_metrics(flat_metrics(result, f"eval_{phase}") | flat_metrics(result), step)
    run.tracker.log_artifact(run.dir / f"eval_{phase}.json")
    run.log_stage_cost(f"eval_{phase}", step)
    return result


@stage(name="report")
def report_stage(run: Run, policy: Policy, start: dict, end: dict, summary: dict) -> dict:
    """Plots, the eval table, the final model (registered in MLflow)."""
    from tasks.policy import save_policy

    files = plots.training_curves(run.dir / "metrics.jsonl", run.dir / "training_curves.png")
    files += plots.eval_levels(start, end, run.dir / "eval_by_level.png")
    table = plots.eval_table(start, end)
    (run.dir / "eval_table.md").write_text(table)
    for f in [*files, run.dir / "eval_table.md"]:
        run.tracker.log_artifact(f)
    final = save_policy(policy.model, policy.tokenizer, run.dir / "final_model")
    version = None
    if run.cfg.tracking.register_model:
        version = run.tracker.register_model(final, run.cfg.tracking.model_name, {
            "rlsift.run_id": run.run_id, "parent_version": run.info.get("parent_version", ""),
            "data_fingerprint": run.info.get("data_fingerprint", ""), "steps": str(summary.get("steps"))})
    return {"model_path": str(final), "model_version": version, "table": table}
