"""What is checked before any work: the config's data files and root (:func:`preflight`) and the run a resume
continues (:func:`resume_config`).

Light on purpose: the ``rlsift`` command line runs these before it imports torch, transformers, Prefect or MLflow
(flows/cli.py), so bad input is refused in about a second, not after the seconds those imports and Prefect's
server take. Keep module-level imports to the config, the data readers and the ledger.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.config import Config, ConfigError
from tasks.config.load import load_config, parse_override, validate

#: Config keys a resume may override (they do not change what is computed).
RESUME_MAY_CHANGE = ("paths.", "tracking.uri", "model.threads", "model.device", "rollout.vllm_url",
                     "rollout.vllm_timeout")


def preflight(cfg: Config) -> None:
    """What would fail later, checked before any work: data files that do not exist, are empty or hold no
    usable row (the ingest's own reader, stopping at the first usable row), a root that cannot be written.
    Raises :class:`ConfigError` naming the key."""
    from tasks.data.sources import read_source

    for i, s in enumerate(cfg.data.sources):
        if s.kind != "file":
            continue
        where = f"data.sources[{i}].path: {s.path}"
        if not Path(s.path).exists():
            raise ConfigError(f"{where} does not exist")
        if Path(s.path).is_file() and Path(s.path).stat().st_size == 0:
            raise ConfigError(f"{where} is empty")
        try:
            records, rejected = read_source(s.path, s.format, split=s.split, fields=s.fields, reward=s.reward,
                                            until_usable=True)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{where}: {err}") from None
        if not records:
            first = f"; the first, line {rejected[0].line}: {rejected[0].reason}" if rejected else ""
            raise ConfigError(f"{where} has no usable row ({len(rejected)} rejected{first})")
    root = Path(cfg.paths.root).resolve()
    here = next(p for p in (root, *root.parents) if p.exists())
    if not here.is_dir() or not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(f"paths.root: cannot create or write {root} ({here} is "
                          f"{'not a folder' if not here.is_dir() else 'not writable'})")


def resume_config(config: str | None, overrides: list[str], run_id: str) -> Config:
    """The stored config of run ``run_id``, with the overrides :data:`RESUME_MAY_CHANGE` allows.

    ``config`` and ``overrides`` locate the run root (``paths.root``; a stopped run's message prints it:
    tasks/records/stopping.py :func:`~tasks.records.stopping.resume_command`). Overrides of any other key that
    differ from the stored value raise :class:`ConfigError`: a resumed run must compute what it started.
    """
    from tasks.records.ledger import Ledger

    given = load_config(config, overrides)
    stored_file = Path(given.paths.root).resolve() / "runs" / run_id / "config.json"
    if not stored_file.is_file():
        raise ConfigError(f"no run {run_id} under {stored_file.parents[1]}: pass the run's paths.root "
                          "(e.g. -c the config it ran with, or paths.root=...; the message of a stopped run "
                          "prints the whole command)")
    ledger_file = stored_file.parents[2] / "ledger.duckdb"
    if ledger_file.is_file():
        with Ledger(ledger_file, read_only=True) as ledger:
            status = ledger.run_status(run_id)
        if status in ("completed", "skipped"):
            raise ConfigError(f"run {run_id} already {status}: nothing to resume")
    tree = json.loads(stored_file.read_text())
    stored, wanted = validate(tree).flat(), given.flat()
    for item in overrides:
        keys, value = parse_override(item)
        dotted = ".".join(keys)
        touched = [k for k in wanted if k == dotted or k.startswith(dotted + ".")]
        if any(k.startswith(RESUME_MAY_CHANGE) or k in RESUME_MAY_CHANGE for k in touched):
            node = tree
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = value
            continue
        changed = [k for k in touched if wanted[k] != stored.get(k)]
        if changed:
            raise ConfigError(f"resume {run_id}: {', '.join(changed)} differ from the run's stored config "
                              f"({stored_file}); a resumed run keeps its config (allowed to change: "
                              f"{', '.join(RESUME_MAY_CHANGE)}). Drop the override or start a new run.")
    tree.setdefault("paths", {})["root"] = given.paths.root
    return validate(tree)
