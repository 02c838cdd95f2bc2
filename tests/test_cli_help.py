"""What ``--help`` says: every command and argument explained, examples that run (``ledger sql``), figures that agree
with the README's; and a bad SQL query is one line, not a traceback."""

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "rlsift"):
    """(``rlsift ledger sql``, its parser) for every command under ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subparsers(sub, f"{prefix} {name}")


def test_every_command_and_argument_has_help_text():
    """``ingest``'s options, ``sync``'s arguments and ``deploy`` had none."""
    from flows.cli import parser

    bare = []
    for name, sub in _subparsers(parser()):
        if not (sub.description or "").strip():
            bare.append(f"{name}: no description")
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip():
                bare.append(f"{name}: {'/'.join(action.option_strings) or action.dest}")
    assert not bare, bare


def test_bench_quick_says_the_readmes_minutes():
    from flows.cli import parser

    (_, bench), = [(n, s) for n, s in _subparsers(parser()) if n == "rlsift bench"]
    quick = next(a for a in bench._actions if "--quick" in a.option_strings).help
    said = re.search(r"about (\d+) minutes", quick)
    readme = re.search(r"^rlsift bench --quick .*\(about (\d+) minutes\)$", (ROOT / "README.md").read_text(), re.M)
    assert said and readme and said.group(1) == readme.group(1), (quick, readme)


@pytest.fixture
def ledger_root(tmp_path):
    """A run root whose ledger holds a run with two stages."""
    from tasks.records.ledger import Ledger, StageRow

    with Ledger(tmp_path / "ledger.duckdb") as led:
        led.start_run("r1", {}, None)
        for stage, s in (("ingest", 0.4), ("train", 12.5), ("prepare", 2.0)):
            led.add_stage("r1", StageRow(stage=stage, wall_s=s, device="cpu", device_hours=s / 3600, cost=0.0))
    return tmp_path


def test_the_ledger_sql_example_runs_on_a_ledger(ledger_root, capsys):
    """The example in ``rlsift ledger sql --help`` ("select stage and wall_s from the stages table" was not SQL),
    pasted: each stage's wall time."""
    from flows.cli import main

    with pytest.raises(SystemExit):
        main(["ledger", "sql", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    example = re.search(r'(--sql "[^"]+")', shown).group(1)
    assert main(["ledger", "sql", "--root", str(ledger_root), *shlex.split(example), "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out) == [{"run_id": "r1", "stage": "train", "wall_s": 12.5},
                                                   {"run_id": "r1", "stage": "prepare", "wall_s": 2.0},
                                                   {"run_id": "r1", "stage": "ingest", "wall_s": 0.4}]


@pytest.mark.parametrize("sql, says", [
    ("select stage and wall_s from the stages table", "Parser Error: syntax error at or near"),
    ("SELECT * FROM stagez", 'Catalog Error: Table with name stagez does not exist! Did you mean "stages"?'),
    ("SELECT wall FROM stages", 'Binder Error: Referenced column "wall" not found in FROM clause!'),
    ("DELETE FROM stages", "read-only"),
])
def test_a_sql_error_is_one_line_naming_the_problem(ledger_root, capsys, sql, says):
    from flows.cli import main

    assert main(["ledger", "sql", "--root", str(ledger_root), "--sql", sql]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("rlsift ledger sql: ") and says in err, err
