"""What is checked before any work: the config's data files and root (:func:`preflight`) and the run a resume
continues (:func:`resume_config`), once per process for what a run asks (:func:`checked_config`).

Light on purpose: the ``rlsift`` command line runs these before it imports torch, transformers, Prefect or MLflow
(flows/cli_commands.py), so bad input is refused in about a second, not after the seconds those imports and Prefect's
server take. Keep module-level imports to the config, the data readers and the ledger.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.config import Config, ConfigError
from tasks.config.load import ENV_KEYS, load_config, parse_override, path_origins, resolve_paths, validate
from tasks.config.model import is_gguf

#: Config keys a resume may override (they do not change what is computed).
RESUME_MAY_CHANGE = ("paths.", "tracking.uri", "model.threads", "model.device", "rollout.vllm_url",
                     "rollout.vllm_timeout", "rollout.vllm_weight_sync")


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to compute: the YAML file, the dotted overrides, the run it resumes (``rlsift run``'s
    arguments, the ``pipeline`` and ``plan`` flows' parameters), the folder it was asked in (where relative paths
    point) and the environment variables that set config keys (:data:`~tasks.config.load.ENV_KEYS`)."""

    config: str | None
    overrides: tuple[str, ...] = ()
    resume: str | None = None
    folder: str = ""
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def here(cls, config: str | None, overrides=(), resume: str | None = None) -> RunRequest:
        """The request as this process sees it now (its working folder and environment)."""
        return cls(config=config, overrides=tuple(overrides), resume=resume, folder=os.getcwd(),
                   env=tuple((v, os.environ.get(v, "")) for v in ENV_KEYS))


#: The configs this process has checked, by request (:func:`checked_config`).
_CHECKED: dict[RunRequest, Config] = {}


def checked_config(request: RunRequest) -> Config:
    """The config ``request`` runs, loaded, checked (:func:`preflight`) and with its relative paths resolved: a path
    in a config file against that file's folder (tasks/config/load.py ``load_config``), one on the command line or in
    the environment against the folder it was asked in (``resolve_paths``); a resume's is its stored one, absolute
    (:func:`resume_config`). Once a process: the command line checks the request before its heavy imports
    (flows/cli_commands.py), and the flow it then starts gets the same config back without reading the files again.
    Raises :class:`ConfigError`."""
    if request not in _CHECKED:
        if request.resume:
            cfg = resume_config(request.config, list(request.overrides), request.resume, folder=request.folder)
            origins = {k: f"run {request.resume}'s stored config" for k in PATH_CHECKS}
            origins.update({k: v for k, v in path_origins(request.config, list(request.overrides)).items()
                            if v == "the command line" and k.startswith(RESUME_MAY_CHANGE)})
        else:
            cfg = load_config(request.config, list(request.overrides))
            origins = path_origins(request.config, list(request.overrides))
        cfg = resolve_paths(cfg, request.folder)
        preflight(cfg, origins)
        _CHECKED[request] = cfg
    return _CHECKED[request]


#: The paths :func:`preflight` checks (with ``data.sources[i].path``), by dotted key.
PATH_CHECKS = ("paths.root", "paths.cache", "model.path", "tracking.uri")


def _origin(origins: dict[str, str], key: str) -> str:
    """`` (set in FILE, relative to it)``: where a path's value came from, for an error (empty: the default)."""
    got = origins.get(key) or origins.get(key.split("[")[0]) or ""
    if not got:
        return ""
    if got == "the command line":
        return " (given on the command line, relative to the current folder)"
    if got in ENV_KEYS:
        return f" (from {got}, relative to the current folder)"
    if got.startswith("run "):
        return f" (from {got})"
    return f" (set in {got}; a path in a config file is relative to that file)"


def preflight(cfg: Config, origins: dict[str, str] | None = None) -> None:
    """What would fail later, checked before any work, every path of the config included: data files that do not
    exist, are empty or hold no usable row (the ingest's own reader, stopping at the first usable row), a starting
    model that is not a folder, a root, cache or local MLflow store that cannot be written. Raises
    :class:`ConfigError` naming the key, the path and where it was set (``origins``, tasks/config/load.py
    ``path_origins``), in one line."""
    from tasks.data.sources import read_source

    origins = origins or {}
    for i, s in enumerate(cfg.data.sources):
        if s.kind != "file":
            continue
        key = f"data.sources[{i}].path"
        where, told = f"{key}: {s.path}", _origin(origins, key)
        if not Path(s.path).exists():
            raise ConfigError(f"{where} does not exist{told}")
        if Path(s.path).is_file() and Path(s.path).stat().st_size == 0:
            raise ConfigError(f"{where} is empty{told}")
        try:
            records, rejected = read_source(s.path, s.format, split=s.split, fields=s.fields, reward=s.reward,
                                            until_usable=True)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{where}: {err}{told}") from None
        if not records:
            first = f"; the first, line {rejected[0].line}: {rejected[0].reason}" if rejected else ""
            raise ConfigError(f"{where} has no usable row ({len(rejected)} rejected{first}){told}")
    if cfg.model.path is not None and is_gguf(cfg.model.path):  # a GGUF file or a packaged model's name
        from tasks.model.gguf_source import resolve

        try:
            resolve(cfg.model.path)
        except ValueError as err:
            raise ConfigError(f"{err}{_origin(origins, 'model.path')}") from None
    elif cfg.model.path is not None:
        model = Path(cfg.model.path)
        if not model.is_dir():
            raise ConfigError(f"model.path: {model} {'is not a folder' if model.exists() else 'does not exist'}"
                              f"{_origin(origins, 'model.path')}")
        if not (model / "config.json").is_file():
            raise ConfigError(f"model.path: {model} holds no saved model (no config.json)"
                              f"{_origin(origins, 'model.path')}")
    folders = [("paths.root", cfg.paths.root), ("paths.cache", cfg.paths.cache)]
    store = _store_file(cfg.tracking.uri)
    if store is not None:
        folders.append(("tracking.uri", str(store.parent)))
    for key, folder in folders:
        if folder is None:
            continue
        path = Path(folder).resolve()
        here = next(p for p in (path, *path.parents) if p.exists())
        if not here.is_dir() or not os.access(here, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: cannot create or write {path} ({here} is "
                              f"{'not a folder' if not here.is_dir() else 'not writable'}){_origin(origins, key)}")


def _store_file(uri: str | None) -> Path | None:
    """The file or folder of a local MLflow store (``sqlite:///FILE``, ``file:FOLDER``, a plain path); None for a
    server or no URI (the default store under the root)."""
    if not uri:
        return None
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")) if uri.removeprefix("sqlite:///").startswith("/") else None
    if uri.startswith("file:"):
        return Path(uri.removeprefix("file://").removeprefix("file:"))
    return Path(uri) if "://" not in uri else None


def resume_config(config: str | None, overrides: list[str], run_id: str, folder: str | None = None) -> Config:
    """The stored config of run ``run_id``, with the overrides :data:`RESUME_MAY_CHANGE` allows.

    ``config`` and ``overrides`` locate the run root (``paths.root``, relative to ``folder``, default the working
    folder; a stopped run's message prints it: tasks/run.py ``Run.resume_command``). Overrides of any other key that
    differ from the stored value raise :class:`ConfigError`: a resumed run must compute what it started. Relative
    paths in the stored config are read against the folder the run started in (its ``info.json``; a run stores its
    paths resolved, tasks/run.py ``open_run``, so only a config written without them has any).
    """
    from tasks.records.ledger import Ledger

    folder = folder or os.getcwd()
    given = resolve_paths(load_config(config, overrides), folder)
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
    info_file = stored_file.with_name("info.json")
    started_in = (json.loads(info_file.read_text()).get("folder") if info_file.is_file() else None) or folder
    tree = resolve_paths(validate(json.loads(stored_file.read_text())), started_in).model_dump(mode="json")
    stored, wanted = validate(tree).flat(), given.flat()
    for item in overrides:
        keys, _ = parse_override(item)
        dotted = ".".join(keys)
        touched = [k for k in wanted if k == dotted or k.startswith(dotted + ".")]
        if any(k.startswith(RESUME_MAY_CHANGE) or k in RESUME_MAY_CHANGE for k in touched):
            for k in touched:  # the value as the given config resolved it (relative paths: against ``folder``)
                node = tree
                *parents, last = k.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[last] = wanted[k]
            continue
        changed = [k for k in touched if wanted[k] != stored.get(k)]
        if changed:
            raise ConfigError(f"resume {run_id}: {', '.join(changed)} differ from the run's stored config "
                              f"({stored_file}); a resumed run keeps its config (allowed to change: "
                              f"{', '.join(RESUME_MAY_CHANGE)}). Drop the override or start a new run.")
    tree["paths"]["root"] = given.paths.root
    return validate(tree)
