"""What each ``rlsift`` command does once its arguments are parsed (flows/cli.py ``parser`` names these ``cmd_*``
and ``main`` calls one): run, plan, ingest, bench, deploy, worker, sync.

Config problems are reported before any work starts (:func:`run_config`), and only then do the commands that need
them load torch, Prefect and MLflow, saying so first (:func:`_start`). ``--json`` prints exactly one JSON object on
stdout. A run that fails says so in one log line (its cause, what is kept and the command that continues it); its
traceback goes to the run's ``run.log``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from flows.cli_text import deploy_text, emit, run_text
from flows.prefect_server import reporting_to, resume_api


def _loading(what: str) -> None:
    """rlsift's first line of a command that imports heavy libraries: what it loads, before it does."""
    logging.getLogger("rlsift").info("loading %s ...", what)


def _accelerator() -> None:
    """DeepSpeed goes on the CPU only where no GPU is (a variable already set wins). Imports torch: for the commands
    that train, once their input is checked."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def _start(flow_module: str, cfg=None) -> None:
    """Before a pipeline command's flow, in the least time (flows/startup.py): rlsift's first line (what it loads), then
    Prefect's temporary server started in a thread while torch, MLflow and ``flow_module`` load here, and the local
    MLflow store of ``cfg`` (its ``tracking.uri``, or the one under ``paths.root``) created meanwhile when new."""
    import importlib

    _loading("torch, Prefect and MLflow")
    from flows.startup import ServerStart, create_local_store

    server = ServerStart()
    _accelerator()
    importlib.import_module(flow_module)
    if cfg is not None:
        from tasks.records.tracking import default_uri

        create_local_store(cfg.tracking.uri or default_uri(cfg.paths.root))
    server.wait()


def _config(args):
    from tasks.config.load import load_config

    return load_config(args.config, args.overrides)


def run_config(args):
    """The config ``rlsift run`` trains, checked before any work and before any heavy import (torch, Prefect,
    MLflow), so bad input is refused in about a second: the file and overrides, a resumed run's stored config
    (looked up under the root they give), the data files and the root (tasks/preflight.py ``checked_config``: the
    pipeline flow this process then starts gets this config back, checked once). Raises
    :class:`~tasks.config.ConfigError`."""
    from tasks.config.load import default_config
    from tasks.preflight import RunRequest, checked_config

    args.config = args.config or default_config()
    return checked_config(RunRequest.here(args.config, args.overrides, getattr(args, "resume", None)))


def cmd_run(args) -> int:
    from tasks.config import ConfigError

    try:
        cfg = run_config(args)
    except ConfigError as err:
        print(f"rlsift run: {err}", file=sys.stderr)
        if args.json:
            sys.stdout.write(json.dumps({"status": "error", "error": str(err)}) + "\n")
        return 2
    api = resume_api(cfg.paths.root, args.resume) if args.resume else None  # the Prefect server the run used
    try:
        with reporting_to(api):
            _start("flows.pipeline", cfg)
            from flows.pipeline import pipeline

            summary = pipeline(config=args.config, overrides=list(args.overrides), resume=args.resume)
    except BaseException as err:
        from tasks.records.stopping import stop_signal, stopping

        if (sig := stop_signal(err)) is None:
            told = getattr(err, "rlsift_summary", None)
            if told is None:  # a failure before the run opened: no run log to keep its traceback
                raise
            if args.json:  # the run's own log line has said why, what is kept and how to continue it
                sys.stdout.write(json.dumps(told, default=str) + "\n")
            return 1
        if args.json:  # the run's own log line has said why and what is kept
            stopped = getattr(stopping(err), "rlsift_summary", None) or {"status": "cancelled",
                                                                          "reason": f"by {sig.name}"}
            sys.stdout.write(json.dumps(stopped, default=str) + "\n")
        return 128 + sig
    emit(summary, args.json, run_text(summary))
    return 0


def cmd_plan(args) -> int:
    from tasks.config import ConfigError

    try:
        cfg = run_config(args)
    except ConfigError as err:
        print(f"rlsift plan: {err}", file=sys.stderr)
        return 2
    _start("flows.pipeline", cfg)
    from flows.pipeline import plan_flow
    from tasks.plan.record import Plan

    out = plan_flow(config=args.config, overrides=list(args.overrides))
    text = Plan.from_json(out["plan"]).text()  # plain for the terminal; plan.md and MLflow keep the Markdown
    emit(out, args.json, f"{text}\n\nrun {out['run_id']}: {out['run_dir']}/plan.json; MLflow run "
          f"{out['mlflow_run_id']}: {out.get('mlflow_ui') or out['tracking_uri']}")
    return 0


def _is_override(item: str) -> bool:
    """``key.sub=value`` (and not a file that happens to contain '=')."""
    import re

    return re.fullmatch(r"[A-Za-z_][\w.]*=.*", item) is not None and not os.path.exists(item)


def cmd_ingest(args) -> int:
    from tasks.config import ConfigError, SourceConfig
    from tasks.data.ingest import ingest
    from tasks.records.ledger import Ledger

    paths = [a for a in args.paths if not _is_override(a)]
    args.overrides = [*args.overrides, *(a for a in args.paths if _is_override(a))]
    try:
        cfg = _config(args)
        sources = ([SourceConfig(kind="file", path=p, format=args.format) for p in paths] if paths
                   else list(cfg.data.sources))
    except (ConfigError, ValueError) as err:
        print(f"rlsift ingest: {err}", file=sys.stderr)
        return 2
    from pathlib import Path

    root = Path(cfg.paths.root)
    with Ledger(root / "ledger.duckdb") as ledger:
        from tasks.records.resume import note_stopped

        note_stopped(ledger, root)
        try:
            result = ingest(ledger, "ingest", sources)
        except FileNotFoundError as err:
            print(f"rlsift ingest: {err}", file=sys.stderr)
            return 2
    s = result.summary()
    out = {k: s[k] for k in ("accepted", "duplicates", "quarantined", "new", "rows", "sources")}
    lines = [f"{name}: {c['rows']} rows, {c['accepted']} accepted ({c['new']} new to the ledger), "
             f"{c['duplicates']} duplicates, {c['quarantined']} quarantined" for name, c in s["sources"].items()]
    emit(out, args.json, "\n".join(lines) + f"\nledger: {root / 'ledger.duckdb'}")
    return 0


def cmd_bench(args) -> int:
    from tasks.config import ConfigError

    try:
        _config(args)
        if args.jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {args.jobs}")
    except ConfigError as err:
        print(f"rlsift bench: {err}", file=sys.stderr)
        return 2
    _start("flows.benchmark")
    from flows.benchmark import benchmark

    result = benchmark(config=args.config, overrides=list(args.overrides), quick=args.quick, seeds=args.seeds,
                       presets=args.presets.split(",") if args.presets else None, trl=not args.no_trl,
                       jobs=args.jobs)
    emit(result, args.json, result.get("table", ""))
    return 0


def cmd_deploy(args) -> int:
    _loading("Prefect")
    from flows.deploy import deploy

    out = deploy()
    if args.json:
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        from tasks.run import launcher

        print(deploy_text(out, launcher()))
    return 0


def cmd_worker(args) -> int:
    logging.getLogger("rlsift").info("starting a Prefect process worker on pool %s (Ctrl-C lets its runs in flight "
                                     "end first)", args.pool)
    _accelerator()  # its flow runs inherit DS_ACCELERATOR: no DeepSpeed warning in their logs
    from flows.worker import serve

    return serve(args.pool, args.grace)


def cmd_sync(args) -> int:
    _loading("MLflow")
    from tasks.records.tracking import sync

    ok = sync(args.run_dir, args.uri, args.mlflow_run_id)
    print("sent" if ok else "MLflow still unreachable; nothing lost, try again later")
    return 0 if ok else 1
