"""The ``benchmark`` flow: every preset and TRL's GRPOTrainer on the same model, task, reward and budget.

For each seed: the presets in order (``grpo-sync``, plain GRPO with generation then update, first: it is
the baseline and supplies the warm-started model every other configuration then loads), then the TRL control
on the same model and data. Every
configuration is one nested MLflow run under a parent ``bench-<timestamp>`` run; the report (results
table in Markdown and JSON, plots) goes to ``<paths.root>/reports/bench-<timestamp>/`` and to the parent
run. The arithmetic of time to target is in tasks/bench/analysis.py, the report in tasks/bench/report.py,
the control in tasks/bench/trl_control.py; docs/benchmarks.md explains the conventions and the commands.

The arms, the benchmark's defaults and the config of one run (which settings win over which) are in
flows/bench_arms.py. Here: the TRL control, the lanes that run the arms side by side in worker processes
(``--jobs``), and the flow that runs them all and writes the report.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.bench_arms import (
    BASELINE,
    PRESETS,
    QUICK_PRESETS,
    QUICK_SEEDS,
    SEEDS,
    SYNC,
    ablation,
    composition_of,
    configuration,
    plan_arms,
    plan_base,
)
from flows.pipeline import run_pipeline
from tasks.bench import report as bench_report
from tasks.bench.report import BenchRun
from tasks.config import Config, ConfigError
from tasks.config.load import load_config
from tasks.model.source import policy_source
from tasks.plan.planner import reads_upfront
from tasks.records.cost import describe_machine
from tasks.records.ledger import Ledger
from tasks.records.tracking import MlflowTracker, default_uri, run_info
from tasks.run import RunInfo

log = logging.getLogger("rlsift.bench")


def clock_skips(cfg: Config) -> tuple[str, ...]:
    """Upfront stages a configuration does not use, left off its clock: the pipeline always calibrates (and scores
    the pool where the run reads the scores), but only some configurations read them (tasks/plan/planner.py
    ``reads_upfront``, which the plan's prediction of each clock reads too)."""
    return tuple(s for s, used in reads_upfront(cfg).items() if not used)


def policy_path_of(summary: dict) -> str:
    """The folder of the model a run started from (summary, the run's info.json, or its MLflow tag)."""
    if summary.get("policy_path"):
        return summary["policy_path"]
    info = Path(summary["run_dir"]) / "info.json"
    if info.is_file() and RunInfo.load(info).policy_path:
        return RunInfo.load(info).policy_path
    return run_info(summary["tracking_uri"], summary["mlflow_run_id"])["tags"]["rlsift.policy_path"]


def control_data(cfg: Config, reference: dict | None) -> tuple[list, list]:
    """The train and held-out prompts of a finished run of ours, in its order (its ingest.json + the ledger);
    without one, the same ingest code on ``cfg``'s sources, nothing written."""
    from tasks.data.ingest import ingest, split_holdout

    saved = Path(reference["run_dir"]) / "ingest.json" if reference else None
    if saved is not None and saved.is_file():
        ids = json.loads(saved.read_text())
        with Ledger(reference["ledger"], read_only=True) as led:
            return led.prompts(ids=ids["train"]), led.prompts(ids=ids["test"])
    with Ledger(":memory:") as led:  # same ingest code, nothing written
        data = ingest(led, "trl-control", list(cfg.data.sources))
    split_holdout(data, cfg.data.test_from_train, cfg.seed)
    return data.train, data.test


@task(name="trl-control", cache_policy=NO_CACHE, persist_result=False)
def trl_stage(cfg: Config, reference: dict | None, run_dir: Path, tracker) -> dict:
    from tasks.bench.trl_control import run_trl_control

    train, test = control_data(cfg, reference)
    return run_trl_control(cfg, cfg.model.path or policy_path_of(reference), train, test, run_dir, tracker)


def run_control(cfg: Config, reference: dict | None, run_dir: Path, uri: str, parent_run_id: str) -> dict:
    """TRL's GRPOTrainer on ``cfg`` (plain GRPO's settings) as one nested MLflow run."""
    tracker = MlflowTracker(uri, cfg.tracking.experiment, run_dir, run_name=f"trl-s{cfg.seed}",
                            parent_run_id=parent_run_id)
    status = "FAILED"
    try:
        out = trl_stage(cfg, reference, run_dir, tracker)
        status = "FINISHED"
        return out
    finally:
        tracker.finish(status)


@dataclass(frozen=True)
class BenchJob:
    """One configuration x seed of a benchmark, as a lane process receives it."""

    name: str
    seed: int
    config: str | None
    overrides: tuple[str, ...]
    quick: bool
    policy_path: str
    parent_run_id: str
    uri: str
    root: str
    stamp: str
    threads: int

    def settings(self, lane: int) -> Config:
        """This job's config in lane ``lane``: the lane's own ledger root (DuckDB admits one writing process
        per file), the shared warm-start cache and MLflow store, and ``threads`` torch threads."""
        shared = load_config(self.config, list(self.overrides))
        lane_keys = [f"paths.root={json.dumps(str(Path(self.root) / 'lanes' / str(lane)))}",
                     f"paths.cache={json.dumps(shared.paths.cache or str(Path(self.root) / 'cache'))}",
                     f"tracking.uri={json.dumps(self.uri)}"]
        preset = BASELINE if self.name == "trl" else self.name
        return configuration(self.config, [f"model.threads={self.threads}", *self.overrides, *lane_keys], preset,
                             self.seed, self.quick, self.policy_path)


_LANE: int | None = None


def _take_lane(lanes) -> None:
    """Pool initializer: the worker process takes a lane number for the rest of its life."""
    global _LANE
    _LANE = lanes.get()


@flow(name="benchmark-run", log_prints=True)
def lane_run(job: BenchJob) -> dict:
    """One benchmark run in a lane process (``rlsift bench --jobs N``)."""
    cfg = job.settings(_LANE or 0)
    if job.name == "trl":
        run_dir = Path(job.root) / "runs" / f"trl-{job.stamp}-s{job.seed}"
        return run_control(cfg, None, run_dir, job.uri, job.parent_run_id)
    return run_pipeline(cfg, parent_run_id=job.parent_run_id, run_name=f"{job.name}-s{job.seed}").to_dict()


def _lane_job(job: BenchJob) -> dict:
    t0 = time.perf_counter()
    try:
        return lane_run(job)
    except Exception as err:  # noqa: BLE001 -- reported by _run_one in the parent, the other runs go on
        return {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                "lane_wall_s": time.perf_counter() - t0}


def run_lanes(jobs: list[BenchJob], n: int) -> list[dict]:
    """``jobs`` on ``n`` worker processes, in order (each worker takes the next job when it is free, so arms
    listed side by side run side by side); their Prefect runs go to this flow's API server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        api = str(client.api_url)
    ctx = multiprocessing.get_context("spawn")
    lanes = ctx.Queue()
    for k in range(n):
        lanes.put(k)
    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api  # inherited by the workers as they start
    try:
        # not multiprocessing.Pool: its workers are daemonic and may not start the overlap's generator process
        with ProcessPoolExecutor(n, mp_context=ctx, initializer=_take_lane, initargs=(lanes,)) as pool:
            return list(pool.map(_lane_job, jobs, chunksize=1))
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


def _run_one(name: str, seed: int, cfg: Config, fn) -> BenchRun:
    t0 = time.perf_counter()
    try:
        summary = fn()
    except Exception as err:  # noqa: BLE001 -- one failed configuration must not lose the others
        log.error("bench %s seed %d failed: %s\n%s", name, seed, err, traceback.format_exc())
        summary = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    if summary.get("traceback"):  # a lane process's failure
        log.error("bench %s seed %d failed: %s\n%s", name, seed, summary["error"], summary["traceback"])
    log.info("bench %s seed %d: %s in %.0f s", name, seed, summary.get("status"), time.perf_counter() - t0)
    run = BenchRun(name, seed, summary, skip=clock_skips(cfg) if name != "trl" else ("score", "calibrate"))
    if run.ok:
        run.rows = bench_report.read_rows(summary["run_dir"])
        bench_report.attach_evals(run)
        if name != "trl" and "calibrate" not in run.skip:
            run.upfront_rollouts = float(min(cfg.calibrate.k, summary.get("ingest", {}).get("train") or cfg.calibrate.k)
                                         * cfg.calibrate.g)
    return run


def selections(runs: list[BenchRun]) -> dict[str, list[dict]]:
    """Selected prompts' round, level and predicted success per configuration (pooled over seeds), read
    from each run's ledger."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        if r.ok and r.name != "trl" and r.summary.get("ledger"):
            with Ledger(r.summary["ledger"], read_only=True) as led:
                out.setdefault(r.name, []).extend(led.selected_levels(r.summary["run_id"]))
    return out


@flow(name="benchmark", log_prints=True)
def benchmark(config: str | None = None, overrides: list[str] | None = None, quick: bool = False,
              seeds: int | None = None, presets: list[str] | None = None, trl: bool = True, jobs: int = 1) -> dict:
    """Every preset (and TRL) x seeds on one budget; returns the results (``table``: Markdown) and paths.

    ``jobs`` > 1 runs that many configurations side by side, each in its own process with an equal share of
    the cores as torch threads, in the order seed by seed, arm by arm (so that neighbouring arms see the same
    load). Each process keeps its own ledger under ``<paths.root>/lanes/<k>``; MLflow runs nest as usual.
    """
    overrides = list(overrides or [])
    asked = [p.strip() for p in presets or (QUICK_PRESETS if quick else PRESETS) if p.strip()]
    asked = [n for p in asked for n in (ablation() if p == "ablation" else (p,))]
    names = list(dict.fromkeys([BASELINE, *asked]))  # baseline first
    if seeds is not None and seeds < 1:
        raise ConfigError(f"seeds must be at least 1, got {seeds}")
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    n_seeds = seeds or (QUICK_SEEDS if quick else SEEDS)
    base_seed = load_config(config, overrides).seed
    first = configuration(config, overrides, BASELINE, base_seed, quick, None)  # validates before any work
    for name in names:
        configuration(config, overrides, name, base_seed, quick, None)
    root = Path(first.paths.root).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report_dir = root / "reports" / f"bench-{stamp}"
    report_dir.mkdir(parents=True, exist_ok=True)
    uri = first.tracking.uri or default_uri(root)
    parent = MlflowTracker(uri, first.tracking.experiment, root / "runs" / f"bench-{stamp}", run_name=f"bench-{stamp}")
    parent.log_params({"bench.presets": ",".join(names), "bench.seeds": n_seeds, "bench.quick": quick,
                       "bench.trl": trl, "bench.config": config, "bench.overrides": " ".join(overrides),
                       **{k: v for k, v in first.flat().items() if k.startswith(("train.", "rollout.", "eval."))}})
    parent.set_tags({"rlsift.kind": "benchmark"})
    log.info("benchmark on %s", describe_machine())  # clocks differ about 2.5x between 2-core machines
    t0 = time.perf_counter()
    policy_path = policy_source(first)  # the warm start every arm starts from, made once, before any clock
    plan = plan_arms(config, overrides, names, base_seed, quick, policy_path)
    order = [(name, base_seed + i) for i in range(n_seeds) for name in (*names, *(("trl",) if trl else ()))]
    configs = {(name, seed): configuration(config, overrides, BASELINE if name == "trl" else name, seed, quick,
                                           policy_path) for name, seed in order}
    if jobs > 1:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        log.info("benchmark: %d runs on %d lanes, %d torch thread(s) each", len(order), jobs, threads)
        done = run_lanes([BenchJob(name, seed, config, tuple(overrides), quick, policy_path, parent.run_id, uri,
                                   str(root), stamp, threads) for name, seed in order], jobs)
        runs = [_run_one(name, seed, configs[name, seed], lambda out=out: out)
                for (name, seed), out in zip(order, done, strict=True)]
    else:
        runs = _run_in_turn(order, configs, root, stamp, uri, parent.run_id)
    result = bench_report.analyse(runs, baseline=BASELINE)
    if plan is not None:
        result["plan_check"] = bench_report.plan_check(
            result, plan, {name: composition_of(name) for name in names}, runs, plan_base(names),
            frozenset(n for n in names if n.endswith(SYNC)))
    sel = selections(runs)
    meta = {"command": "rlsift bench" + (" --quick" if quick else "") + (f" --jobs {jobs}" if jobs > 1 else "") +
            (f" --seeds {seeds}" if seeds else "") + (f" --presets {','.join(presets)}" if presets else "") +
            (" --no-trl" if not trl else "") + (f" -c {config}" if config else "") +
            "".join(f" {o}" for o in overrides), "presets": ", ".join(names), "seeds": n_seeds, "trl": trl,
            "steps": first.train.steps, "prompts_per_step": first.train.prompts_per_step,
            "rollouts_per_prompt": "rollout.n of each preset", "eval_every": first.eval.every,
            "eval_prompts": first.eval.limit or "all", "policy_path": policy_path, "jobs": jobs,
            "benchmark_wall_s": round(time.perf_counter() - t0, 1), "mlflow_parent_run": parent.run_id,
            "tracking_uri": uri, "machine": describe_machine()}
    files = bench_report.write_report(report_dir, runs, result, sel, meta)
    for f in files:
        parent.log_artifact(f)
    _log_outcomes(parent, result)
    failed = [f"{r.name}-s{r.seed}" for r in runs if not r.ok]
    parent.finish("FAILED" if failed else "FINISHED")
    table = (report_dir / "results.md").read_text()
    get_run_logger().info("benchmark %s: %d runs (%d failed) in %.0f s; report %s", stamp, len(runs), len(failed),
                          time.perf_counter() - t0, report_dir)
    return {"table": table, "report_dir": str(report_dir), "mlflow_run_id": parent.run_id, "tracking_uri": uri,
            "failed": failed, "files": [str(f) for f in files], "wall_s": time.perf_counter() - t0,
            "runs": [{"name": r.name, "seed": r.seed, "status": r.summary.get("status"),
                      "run_id": r.summary.get("run_id"), "mlflow_run_id": r.summary.get("mlflow_run_id")}
                     for r in runs],
            "targets": result["targets"]}


def _run_in_turn(order: list[tuple[str, int]], configs: dict, root: Path, stamp: str, uri: str,
                 parent_run_id: str) -> list:
    """Each (arm, seed) of ``order`` in this process, one after the other; TRL's control of a seed gets the
    baseline's summary of that seed (its accuracy target)."""
    runs = []
    for name, seed in order:
        cfg = configs[name, seed]
        if name == "trl":
            reference = next((r.summary for r in runs if r.name == BASELINE and r.seed == seed and r.ok), None)
            fn = lambda cfg=cfg, ref=reference, seed=seed: run_control(  # noqa: E731
                cfg, ref, root / "runs" / f"trl-{stamp}-s{seed}", uri, parent_run_id)
        else:
            fn = lambda cfg=cfg, name=name, seed=seed: run_pipeline(  # noqa: E731
                cfg, parent_run_id=parent_run_id, run_name=f"{name}-s{seed}").to_dict()
        runs.append(_run_one(name, seed, cfg, fn))
    return runs


def _log_outcomes(parent: MlflowTracker, result: dict) -> None:
    """Each configuration's final accuracy, effective-group ratio and speed-ups to its targets, as the parent
    MLflow run's metrics."""
    for r in result["configurations"]:
        if "budget" in r:
            parent.log_metrics({f"bench/{r['name']}/final_accuracy": r["final_accuracy"]["mean"],
                                f"bench/{r['name']}/effective_ratio": r["effective_ratio"]["mean"]}, 0)
            for key, t in (r.get("to_target") or {}).items():
                if t["speedup"] is not None:
                    parent.log_metrics({f"bench/{r['name']}/speedup_{key}": t["speedup"]}, 0)
