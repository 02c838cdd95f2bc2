"""``rlsift ledger runs|why|round|sql``: answers from the ledger (tasks/records/ledger/), light on purpose.

It imports the config, duckdb and rich only (no torch, Prefect or MLflow), so it answers in about a second, also
while a run writes the ledger (it then reads a snapshot). flows/cli.py builds its subcommands and calls
:func:`cmd_ledger`.
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_ledger(args) -> int:
    """``rlsift ledger runs|why|round|sql``: light on purpose (the config, duckdb and rich; no torch, Prefect or
    MLflow), so it answers in about a second, also while a run writes the ledger (it then reads a snapshot)."""
    from pathlib import Path

    from tasks.config import ConfigError
    from tasks.config.load import load_config
    from tasks.records.ledger import Ledger, QueryError

    try:
        root = Path(args.root or load_config(args.config, args.overrides).paths.root)
    except ConfigError as err:
        print(f"rlsift ledger {args.what}: {err}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    empty, error, note = "(no rows)", None, None  # error: an answer about no run or no prompt at all (exit 1)
    if not (root / "ledger.duckdb").is_file():
        print(f"rlsift ledger {args.what}: no ledger at {root / 'ledger.duckdb'}: no run has used the root {root} "
              "(give the run's root: --root or paths.root=...)", file=sys.stderr)
        if args.json:
            sys.stdout.write("[]\n")
        return 1
    with Ledger(root / "ledger.duckdb", read_only=True) as ledger:
        if args.what in ("why", "round") and ledger.run_status(args.run) is None:
            error = _unknown_run(args.run, ledger.run_ids(), ledger.path)
        elif args.what == "runs":
            rows = [_run_row(r, root) for r in ledger.runs()]
            note = "\n".join(f"run {r['run']} {r['status']}: `{r['resume']}` finishes it"
                             for r in rows if r["status"] == RESUMABLE[0]) or None
        elif args.what == "why":
            rows = ledger.why(args.run, args.prompt, args.step)
            if not rows:
                known = ledger.prompts_like(args.prompt)
                if not known:
                    error = f"no prompt id starts with {args.prompt!r} in {ledger.path}"
                else:
                    empty = (f"prompt {known[0]['prompt_id']} (level {known[0]['level']}, {known[0]['split']}) was "
                             f"never selected in run {args.run}" +
                             (f" at step {args.step}" if args.step is not None else ""))
        elif args.what == "round":
            rows = ledger.round_selection(args.run, args.round)
            empty, note = _round_state(args.run, args.round, ledger.progress(args.run), bool(rows))
        else:
            try:
                rows = ledger.ask(args.sql)
            except QueryError as err:
                print(f"rlsift ledger sql: {err}", file=sys.stderr)
                return 2
    if args.json:
        sys.stdout.write(json.dumps(rows, default=str) + "\n")
    elif rows:
        _print_table(rows, drop=("question",) if args.what == "round" else ("resume",))
    elif error is None:
        print(empty)
    if note is not None:
        print(note, file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)
        return 1
    return 0


def _round_state(run_id: str, round_: int, progress: dict, any_rows: bool) -> tuple[str, str | None]:
    """``ledger round``: (what to say when the round has no rows, a note for a round that has some but is not
    committed yet, else None). A round is committed once the run has written its last step (its checkpoint follows
    at once); mid-round, or before the round, it is not committed yet; past the run's last round, there is none."""
    from tasks.config import ConfigError
    from tasks.config.load import validate

    try:
        train = validate(progress["config"]).train
    except ConfigError:  # a run of an older config schema: no figures to tell the cases apart
        return f"no selections in round {round_} of run {run_id}", None
    rounds = -(-train.steps // train.round_steps)
    first, last = round_ * train.round_steps, min((round_ + 1) * train.round_steps, train.steps) - 1
    status, done = progress["status"], progress["last_step"]
    if round_ < 0 or round_ >= rounds:
        return f"run {run_id} has no round {round_}: it trains rounds 0-{rounds - 1} ({train.steps} steps)", None
    if status == "completed" or (done is not None and done >= last):
        return f"no selections in round {round_} of run {run_id}", None
    where = (f"the run ({status}) has not trained a step yet" if done is None else
             f"the run ({status}) has written steps up to {done} of 0-{train.steps - 1}")
    pending = f"round {round_} of run {run_id} (steps {first}-{last}) is not committed yet: {where}"
    return pending, pending if any_rows else None


def _unknown_run(run_id: str, known: list[str], path, shown: int = 10) -> str:
    """The error for a run id the ledger does not have, with the newest ``shown`` of the runs it has."""
    if not known:
        return f"no run {run_id!r} in {path}: it has no runs yet"
    from tasks.records.commands import command

    more = (f" and {len(known) - shown} older (`{command('ledger', 'runs', '--root', path.parent)}` lists them)"
            if len(known) > shown else "")
    return f"no run {run_id!r} in {path}; its runs, newest first: {', '.join(known[:shown])}{more}"


#: The statuses of a run that ``rlsift run --resume`` continues (``stopped``: its process is gone, tasks/records/ledger
#: ``STOPPED``; a literal here: the command line imports this module before it needs duckdb).
RESUMABLE = ("stopped", "cancelled", "failed")


def _run_row(r: dict, root) -> dict:
    """``rlsift ledger runs``: what a user compares, one row per run; ``resume``: the command that finishes a
    stopped, cancelled or failed run (the table leaves it out and prints a stopped run's below it)."""
    from tasks.config import ConfigError
    from tasks.config.load import validate
    from tasks.records.label import run_label
    from tasks.records.resume import resume_command

    cfg, s = (json.loads(v) if isinstance(v, str) else (v or {}) for v in (r["config"], r["summary"]))
    try:
        what = run_label(validate(cfg), (s.get("plan") or {}).get("choice"))  # an auto run: what it trained
    except ConfigError:  # a run of an older config schema
        what = "?"
    acc = (f"{s['eval_accuracy_start']:.3f} -> {s['eval_accuracy_end']:.3f}"
           if s.get("eval_accuracy_end") is not None else None)
    return {"run": r["run_id"], "status": r["status"], "started": str(r["started_at"])[:16], "what": what,
            "steps": s.get("steps"), "accuracy": acc, "usd": None if s.get("cost_usd") is None else
            round(s["cost_usd"], 4), "version": s.get("model_version"), "parent": s.get("parent_version") or None,
            "resume": resume_command(r["run_id"], root) if r["status"] in RESUMABLE else None}


def _print_table(rows: list[dict], drop: tuple[str, ...] = ()) -> None:
    """Rows as a table, leaving out the columns that are empty in every row (signals not in use), floats to
    three decimals (:func:`_cell`)."""
    from rich.console import Console
    from rich.table import Table

    cols = [k for k in rows[0] if k not in drop and any(r.get(k) is not None for r in rows)]
    table = Table(*cols, box=None, pad_edge=False)
    for r in rows:
        table.add_row(*(_cell(r.get(k)) for k in cols))
    Console(width=200, soft_wrap=True).print(table)


def _cell(v) -> str:
    """A table cell: floats to three decimals (``0.823``), or three significant digits below 0.1 (``0.00781``)
    so a small weight does not print as 0; the ``--json`` output keeps full precision."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if v == 0 or abs(v) >= 0.1 or v != v else f"{v:.3g}"
    return str(v)


#: ``rlsift ledger sql``'s example (tests/test_cli_help.py runs it on a ledger).
SQL_EXAMPLE = ("--sql \"SELECT run_id, stage, round(sum(wall_s), 1) AS wall_s FROM stages GROUP BY ALL "
               "ORDER BY run_id, wall_s DESC\"")


def add_ledger_parser(sub) -> None:
    """``rlsift ledger`` and its commands, on the CLI's subparsers ``sub``."""
    led = sub.add_parser("ledger", help="questions about runs (answers also while a run writes the ledger)",
                         description=("Questions about runs, answered from the ledger of a run root (the config's "
                                      "paths.root, or --root). `rlsift ledger COMMAND --help` says more."))
    asks = led.add_subparsers(dest="what", required=True, metavar="COMMAND")

    def ask(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        a = asks.add_parser(name, help=summary, description=description)
        a.add_argument("--root", help="run root (default: paths.root of the config)")
        a.add_argument("-c", "--config", help="the config whose paths.root to read (default: the embedded one)")
        a.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. paths.root=/data/rlsift-runs")
        a.add_argument("--json", action="store_true", help="print the rows as one JSON list on stdout")
        a.set_defaults(fn=cmd_ledger)
        return a

    ask("runs", "every run: status, what it trained, steps, accuracy, cost, model version",
        "One row per run of the root, oldest first: status, start, what it trained, steps, held-out greedy "
        "accuracy before -> after, money, registered model version and its parent.")
    why = ask("why", "why a prompt was chosen: each selection with its signals and its group's outcome",
              "Every selection of a prompt in a run (or at one step) with the signals that chose it (DOTS's "
              "predicted success, GAIN-RL's angle and rank, ScalingRL's DES, the screen) and its rollout group's "
              "outcome; columns of signals no selection used are left out.")
    why.add_argument("--run", required=True, help="run id")
    why.add_argument("--prompt", required=True, help="prompt id (or its prefix)")
    why.add_argument("--step", type=int, help="only this training step")
    rnd = ask("round", "a round's selections, heaviest first within each step",
              "The selections of one round of a run (train.round_steps steps), heaviest first within each step. "
              "Mid-run it says when the round is not committed yet (the run has not written all its steps).")
    rnd.add_argument("--run", required=True, help="run id")
    rnd.add_argument("--round", required=True, type=int, help="round number (from 0)")
    sql = ask("sql", "a read-only SQL query over the ledger's tables",
              "A read-only SQL query (duckdb) over the ledger's tables: runs, prompts, quarantine, ingests, "
              "reference, features, selections, groups, skipped_updates, stages, evals.")
    sql.add_argument("--sql", required=True,
                     help=f"the query (duckdb's SQL), e.g. each stage's wall time: {SQL_EXAMPLE}")
