"""Every command rlsift prints runs as printed, from any folder, for a user who never activated the venv.

The commands rlsift prints for pasting (a stopped run's resume, ``rlsift sync`` after an MLflow outage, ``mlflow ui``
on a local store, the hints of its messages) are all made by tasks/records/commands.py ``command``. This test finds
every call of it in the code (so a new printed command is tested without being listed here), prints each as the code
would, with ``--help`` in place of its arguments, and runs that in a bash with a bare ``PATH`` in a folder of its
own.
It also finds any other command written into a message by hand (a back-quoted ``rlsift ...``): ``rlsift sync`` was
printed bare and failed with exit 127 for a user of ``.venv/bin/rlsift``.
"""

import ast
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tasks.records.commands import command, program

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("flows", "tasks") for p in (ROOT / folder).rglob("*.py"))


def _calls() -> dict[tuple[str, ...], list[str]]:
    """(program, subcommand words...) -> where the code prints such a command: every ``command(...)`` call, its
    leading literal arguments up to the first option or value that is not a literal."""
    found: dict[tuple[str, ...], list[str]] = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "command"):
                continue
            words = []
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)) or arg.value.startswith("-"):
                    break
                words.append(arg.value)
            tool = next((k.value.value for k in node.keywords if k.arg == "tool"), "rlsift")
            found.setdefault((tool, *words), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


CALLS = _calls()


def test_the_commands_rlsift_prints_are_found():
    """The collection works: the resume, ``rlsift sync``, ``mlflow ui`` and the messages' ledger hints are among
    them."""
    assert {("rlsift", "run"), ("rlsift", "sync"), ("mlflow", "ui"), ("rlsift", "ledger", "runs"),
            ("rlsift", "ledger", "sql")} <= set(CALLS), CALLS


@pytest.mark.parametrize("words", sorted(CALLS), ids=" ".join)
def test_each_printed_command_runs_from_another_folder_without_the_venv_on_the_path(words, tmp_path):
    tool, *sub = words
    printed = command(*sub, "--help", tool=tool)
    first = shlex.split(printed)[0]
    assert os.path.isabs(first) and Path(first).parent == Path(os.path.abspath(program("python"))).parent, printed
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}  # this checkout's code
    p = subprocess.run(["bash", "-c", printed], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "usage:" in p.stdout.lower(), (printed, CALLS[words], p.stdout[-1000:],
                                                                p.stderr[-2000:])


#: Back-quoted commands in messages that name a command rather than give one to paste: who sent an outbox
#: (the MLflow Description: "sent by `rlsift sync`"), what a run was (`rlsift plan`, no training), what ran.
NAMES = {("tasks/records/tracking/tracker.py", "`rlsift sync`"), ("flows/pipeline.py", "`rlsift plan`"),
         ("flows/deploy.py", "`prefect deploy`"), ("tasks/bench/tables.py", "`rlsift plan`")}


def test_no_message_writes_a_command_by_hand():
    """Outside docstrings and ``--help`` and config descriptions, a back-quoted ``rlsift``/``mlflow``/``prefect``
    command in a string is one :func:`tasks.records.commands.command` did not make: it would be printed bare."""
    bare = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        skip = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                    isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))  # a docstring
            if isinstance(node, ast.keyword) and node.arg in ("help", "description"):
                skip.update(id(n) for n in ast.walk(node.value))  # argparse's help, a config field's description
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                for hit in re.findall(r"`(?:rlsift|mlflow|prefect) [^`]*`", node.value):
                    if (str(path.relative_to(ROOT)), hit) not in NAMES:
                        bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {hit}")
    assert not bare, bare
