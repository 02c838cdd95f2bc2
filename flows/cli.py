"""The ``rlsift`` command line: run, ingest, bench, ledger, deploy, sync. Its arguments (:func:`parser`), the
process's environment and the terminal's logging, and :func:`main` (the console script), which runs the command
(flows/cli_commands.py: what each does).

``--json`` prints exactly one JSON object on stdout; logs and progress go to stderr (progress bars only on a
terminal). The terminal shows rlsift's own lines and other libraries' errors; their INFO and WARNING lines (MLflow's,
Prefect's, transformers', DeepSpeed's, Python warnings) only with ``-v`` (:func:`setup_logging`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flows.cli_commands import _is_override, cmd_bench, cmd_deploy, cmd_ingest, cmd_plan, cmd_run, cmd_sync, cmd_worker
from flows.ledger_cli import add_ledger_parser

ENV_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "rlsift",  # stage summaries in the Prefect UI's flow-run logs
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",  # rlsift lines outside a flow run stay local
}
#: Other libraries' own handlers, quiet below errors without ``-v`` (a variable already set wins): MLflow's (its
#: "Creating initial MLflow database tables...", system-metrics lines), transformers', the temporary Prefect server's
#: (its process writes to this terminal). The worker's flow runs inherit them.
QUIET_ENV = {"MLFLOW_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "PREFECT_SERVER_LOGGING_LEVEL": "ERROR"}
#: The same with ``-v``: each library's INFO lines.
VERBOSE_ENV = {"MLFLOW_LOGGING_LEVEL": "INFO", "TRANSFORMERS_VERBOSITY": "info", "PREFECT_LOGGING_LEVEL": "INFO"}
#: rlsift's own loggers (``rlsift.*`` and the modules of its packages): all their lines reach the terminal.
OWN_LOGGERS = ("rlsift", "tasks", "flows", "rlcore", "__main__")


def _env(verbose: bool = False) -> None:
    """Process-wide defaults (a variable already set wins)."""
    for k, v in {**ENV_DEFAULTS, **(VERBOSE_ENV if verbose else QUIET_ENV)}.items():
        os.environ.setdefault(k, v)


class OwnLines(logging.Filter):
    """On the terminal's handler without ``-v``: rlsift's own lines at any level, another library's only from ERROR
    up (its INFO and WARNING lines stay off a successful run's terminal; the Prefect UI's handlers, on the loggers
    themselves, still get them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] in OWN_LOGGERS


def setup_logging(verbose: bool, as_json: bool) -> None:
    """The terminal's log lines (stderr): ``HH:MM:SS logger message``; rlsift's INFO lines and up, other libraries'
    errors (:class:`OwnLines`); with ``verbose``, every library's INFO lines too. Python warnings become log lines
    (``py.warnings``: another library's). ``as_json``: warnings and errors only (a run's log file still gets it
    all)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.captureWarnings(True)
    for noisy in ("httpx", "httpcore", "urllib3"):  # a line per HTTP request (Prefect's API) otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not verbose:
            handler.addFilter(OwnLines())
        if as_json:  # the terminal gets warnings and errors; a run's log file still gets it all
            handler.setLevel(logging.WARNING)
    if as_json:
        logging.getLogger().setLevel(logging.WARNING)


VERBOSE_HELP = ("also other libraries' INFO and WARNING lines (MLflow, Prefect, transformers, DeepSpeed, Python "
                "warnings); without it the terminal shows rlsift's lines and other libraries' errors")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlsift", description="Data-efficient RL fine-tuning of language models.")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp, overrides=True):
        sp.add_argument("-c", "--config", help="YAML config (e.g. conf/presets/all.yaml)")
        if overrides:
            sp.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=40")
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    r = sub.add_parser("run", help="the whole pipeline (default config: conf/presets/auto.yaml)")
    common(r)
    r.add_argument("--resume", metavar="RUN_ID", help=(
        "continue a stopped or crashed run from its last checkpoint, with its stored config; give the run's root as "
        "it ran (paths.root=..., or the -c config or RLSIFT_ROOT that set it): the run is looked up under it. It "
        "reports to the Prefect server the run used (kept in the run; PREFECT_API_URL, when set, wins). A stopped "
        "run's message, and `rlsift ledger runs` for a run whose process is gone, print the whole command"))
    r.set_defaults(fn=cmd_run)

    pl = sub.add_parser("plan", help=("measure the pool and what a token costs, predict each composition's clock "
                                      "against plain GRPO and choose (no training)"))
    common(pl)
    pl.set_defaults(fn=cmd_plan)

    i = sub.add_parser("ingest", help="ingestion only", description=(
        "Read data files (or the config's sources) into the ledger of the run root, as a run's ingest does: "
        "accepted rows, exact duplicates dropped, bad rows quarantined with their line numbers. No training."))
    i.add_argument("paths", nargs="*", help=("files or folders (default: the configured sources) and dotted "
                                             "key=value overrides, e.g. paths.root=/data/rlsift-runs"))
    i.add_argument("--format", choices=["gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf"],
                   help="the files' row format (default: guessed from each file's content)")
    i.add_argument("-c", "--config", help="YAML config whose paths.root and data.sources to use")
    i.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override (the same as a positional key=value)")
    i.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    i.set_defaults(fn=cmd_ingest)

    b = sub.add_parser("bench", help="every preset and TRL on the same budget: time to target")
    common(b)
    b.add_argument("--quick", action="store_true", help=("auto, dapo and TRL against plain GRPO, 2 seeds of 30 "
                                                          "steps: about 8 minutes on 2 cores (docs/benchmarks.md)"))
    b.add_argument("--seeds", type=int, default=None, help=("seeds per configuration (default: flows/bench_arms.py "
                                                            "QUICK_SEEDS with --quick, else SEEDS)"))
    b.add_argument("--presets", help=("comma-separated subset of presets, leave-one-out arms (all-dots, ...) "
                                      "or 'ablation' (every preset and leave-one-out arm)"))
    b.add_argument("--no-trl", action="store_true", help="skip TRL's GRPOTrainer control")
    b.add_argument("--jobs", type=int, default=1, help=("configurations side by side, each in its own process "
                                                        "with cores/jobs torch threads (2 on a 2-core machine)"))
    b.set_defaults(fn=cmd_bench)

    add_ledger_parser(sub)

    d = sub.add_parser("deploy", help="register the Prefect deployments with the configured server", description=(
        "Register rlsift's flows (pipeline, retrain, benchmark) as Prefect deployments with the Prefect server of "
        "PREFECT_API_URL, as infra/prefect.yaml describes them; `rlsift worker` then runs what they schedule. "
        "docs/operations.md says more."))
    d.add_argument("--json", action="store_true", help="print the registered deployments as one JSON object")
    d.set_defaults(fn=cmd_deploy)

    w = sub.add_parser("worker", help=("a Prefect process worker (prefect worker start) whose Ctrl-C or SIGTERM "
                                       "first lets its runs in flight end cleanly (cancelled, resumable)"))
    w.add_argument("--pool", default=os.environ.get("RLSIFT_WORK_POOL", "rlsift-process"), help="work pool")
    w.add_argument("--grace", type=float, default=60.0,
                   help="seconds the runs in flight get to end before the worker stops (default 60)")
    w.set_defaults(fn=cmd_worker)

    s = sub.add_parser("sync", help="send a run's tracking outbox after an MLflow outage", description=(
        "Send what a run kept in its outbox while MLflow was unreachable (metrics, the model's registration, the "
        "Description). A run that ended during an outage prints this command with its arguments."))
    s.add_argument("run_dir", help="the run's folder (<paths.root>/runs/<run id>), which holds outbox.jsonl")
    s.add_argument("uri", help="the MLflow tracking URI to send to (a server's URL or sqlite:///...)")
    s.add_argument("mlflow_run_id", help="the MLflow run the outbox belongs to")
    s.set_defaults(fn=cmd_sync)
    for listed in sub._choices_actions:  # `rlsift CMD --help` says at least what `rlsift --help` says of CMD
        sp = sub.choices[listed.dest]
        sp.description = sp.description or f"{listed.help[0].upper()}{listed.help[1:]}."
    for command in sub.choices.values():  # `rlsift run -v` as well as `rlsift -v run`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)  # key=value overrides may also follow options (`--json a=b`)
    if extra and (not hasattr(args, "overrides") or not all(_is_override(e) for e in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd != "worker":  # a worker's flow runs get their environment from the deployments (infra/prefect.yaml)
        _env(args.verbose)
    else:
        for k, v in (VERBOSE_ENV if args.verbose else QUIET_ENV).items():
            os.environ.setdefault(k, v)
    if extra:
        args.overrides = [*args.overrides, *extra]
    setup_logging(args.verbose, getattr(args, "json", False))
    from tasks.records.stopping import sigterm_raises, stop_signal

    try:
        with sigterm_raises():  # SIGTERM ends rlsift as Ctrl-C does: cleanup and exit handlers run
            return args.fn(args)
    except BaseException as err:
        if (sig := stop_signal(err)) is None:
            raise
        return 128 + sig  # the shell's code for a process ended by that signal; no traceback


if __name__ == "__main__":
    sys.exit(main())
