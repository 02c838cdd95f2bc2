"""The commands rlsift prints for a person to paste (a stopped run's resume, ``rlsift sync`` after an MLflow outage,
``mlflow ui`` on a local store, the next step of a message): each starts with the full path of the program in this
Python's environment, so that it runs as printed from any folder, in a shell that never activated the venv.

Every such command is made by :func:`command` (tests/test_printed_commands.py finds each call in the code and runs
the printed command's ``--help`` from another folder with a bare ``PATH``). Light on purpose (stdlib only): the
ledger's command line and the config checks print commands before any heavy import.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def program(name: str) -> str:
    """The full path of the program ``name`` (``rlsift``, ``mlflow``, ``prefect``) that this Python's environment
    installed (next to ``sys.executable``, the venv's own ``bin/`` by its path, links kept), else ``name``."""
    here = Path(os.path.abspath(sys.executable)).with_name(name)
    return str(here) if here.is_file() else name


def launcher() -> list[str]:
    """How this process was started, as the start of a command that runs rlsift the same way from any folder:
    ``/abs/.venv/bin/rlsift`` when it runs the ``rlsift`` script (by its absolute path, not the one the shell's
    ``PATH`` may find: a venv that was never activated has none; symbolic links kept, a venv's own), ``/abs/python -m
    flows.cli`` when Python ran the module, else (a Prefect worker's flow run, a test, a script) the ``rlsift`` script
    of this Python's environment (:func:`program`), or this Python running the module where it has none."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "flows.cli":
        return [sys.executable, "-m", "flows.cli"]
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name == "rlsift" and Path(script).is_file():
        return [os.path.abspath(script)]
    found = program("rlsift")
    return [found] if found != "rlsift" else [sys.executable, "-m", "flows.cli"]


def command(*args: str | os.PathLike, tool: str = "rlsift") -> str:
    """A command line to print, quoted for a POSIX shell: ``tool`` (``rlsift`` as :func:`launcher` says, any other
    by :func:`program`'s full path) and ``args``, e.g. ``command("sync", run_dir, uri, run_id)``."""
    start = launcher() if tool == "rlsift" else [program(tool)]
    return shlex.join([*start, *(str(a) for a in args)])
