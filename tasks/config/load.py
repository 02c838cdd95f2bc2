"""Loading a :class:`~tasks.config.Config`: YAML files (with ``base:`` chains), config groups, dotted
``key=value`` overrides and the environment, validated with errors that name the dotted key and what is allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.config import Config, ConfigError
from tasks.config.model import is_gguf_name


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=40")
    key, raw = item.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key {key!r}")
    return key.split("."), yaml.safe_load(raw) if raw else ""


def _set(tree: dict, keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k, {}), dict):
            raise ConfigError(f"{'.'.join(keys)}: {k!r} is a value, not a section")
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _allowed(model: type[BaseModel], loc: tuple) -> str:
    """The allowed keys or values at a location, for error messages."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        options = getattr(ann, "__args__", (ann,))
        cls = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), ann)
    fields = getattr(cls, "model_fields", None)
    return f"; allowed keys: {', '.join(fields)}" if fields else ""


#: Keys that were renamed: old dotted key -> (new key, what changed).
RENAMED = {"train.bucket_tokens": ("train.micro_batch_tokens", "its budget now bounds each forward and backward "
                                   "pass of the update, so its memory")}


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden" and key in RENAMED:
            new, why = RENAMED[key]
            lines.append(f"{key}: renamed {new} ({why}); give the same value there")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_allowed(Config, loc)}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


#: Environment variables that set a config key (see :func:`load_config`).
ENV_KEYS = {"RLSIFT_ROOT": ["paths", "root"], "RLSIFT_TRACKING_URI": ["tracking", "uri"]}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (optional), apply dotted overrides, validate.

    A YAML file may name another to start from with a top-level ``base: other.yaml`` (relative to itself).
    The environment variables :data:`ENV_KEYS` (``RLSIFT_ROOT``, ``RLSIFT_TRACKING_URI``), when set and not
    empty, set their keys over the file and under the overrides: one rule for every command, script and
    deployment, so an installation says once where it keeps its root and its MLflow server.

    Relative paths (:data:`PATH_KEYS`): one written in a config file is relative to that file (also in a file reached
    through ``base:`` or a config group), and is made absolute here; one given on the command line or in the
    environment stays relative until :func:`resolve_paths` anchors it to the folder the command runs in.
    """
    return validate(_compose(path, overrides)[0])


def path_origins(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """Where each path of :func:`load_config` (``path``, ``overrides``) was set, by dotted key (``model.path``,
    ``data.sources[0].path``): the config file, ``the command line`` or the environment variable; the keys left at
    their default are absent. For error messages (tasks/preflight.py)."""
    return _compose(path, overrides)[1]


def _compose(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    """The config tree of ``load_config`` before validation, and the origin of each of its paths."""
    tree: dict = {}
    origins: dict[str, str] = {}
    if path is not None:
        tree, origins = _read_yaml(Path(path))
    for var, keys in ENV_KEYS.items():
        if os.environ.get(var):
            _set(tree, keys, os.environ[var])
            origins[".".join(keys)] = var
    for item in overrides:
        keys, value = parse_override(item)
        group = conf_dir() / keys[0] / f"{value}.yaml" if len(keys) == 1 and isinstance(value, str) else None
        if group is not None and group.is_file():  # a config group: data=gsm8k -> conf/data/gsm8k.yaml
            section, found = _read_yaml(group, section=keys[0])
            tree[keys[0]] = section[keys[0]]
            origins = _replace_origins(origins, keys[0], found)
            continue
        if group is not None and keys[0] in Config.model_fields and (conf_dir() / keys[0]).is_dir():
            folder = os.path.abspath(conf_dir() / keys[0])
            known = sorted(p.stem for p in Path(folder).glob("*.yaml"))
            raise ConfigError(f"{item}: no config group {value!r} in {folder}; the groups: {', '.join(known)} (or "
                              f"set the section's keys, e.g. {keys[0]}.KEY=VALUE)")
        _set(tree, keys, value)
        origins = _replace_origins(origins, ".".join(keys), {k: "the command line" for k in _path_items(tree)
                                                             if _under(k, ".".join(keys))})
    return tree, origins


#: The config keys that name a file or folder; ``data.sources`` items' ``path`` and a local ``tracking.uri`` too.
PATH_KEYS = (("paths", "root"), ("paths", "cache"), ("model", "path"))


def _under(key: str, prefix: str) -> bool:
    """``key`` is ``prefix`` or inside it (``data.sources[0].path`` is under ``data`` and ``data.sources``)."""
    return key == prefix or key.startswith((prefix + ".", prefix + "["))


def _replace_origins(origins: dict[str, str], prefix: str, new: dict[str, str]) -> dict[str, str]:
    """``origins`` with every key under ``prefix`` (a value set whole: a section or a list) replaced by ``new``."""
    return {**{k: v for k, v in origins.items() if not _under(k, prefix)}, **new}


def _path_items(tree: dict):
    """The dotted key of each path a config tree states (:data:`PATH_KEYS`, ``data.sources[i].path``,
    ``tracking.uri``), as far as its shape goes (a bad shape is the validation's to report)."""
    for section, key in PATH_KEYS:
        node = tree.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
            if (section, key) == ("model", "path") and is_gguf_name(node[key]):
                continue  # a packaged model's name (gguf:smollm2-135m) is no path
            yield f"{section}.{key}"
    data = tree.get("data")
    if isinstance(data, dict) and isinstance(data.get("sources"), list):
        for i, src in enumerate(data["sources"]):
            if isinstance(src, dict) and isinstance(src.get("path"), str) and src["path"]:
                yield f"data.sources[{i}].path"
    node = tree.get("tracking")
    if isinstance(node, dict) and isinstance(node.get("uri"), str) and _local_store(node["uri"]):
        yield "tracking.uri"


def _local_store(uri: str) -> bool:
    """A tracking URI that names a local store (a path, ``sqlite:///``, ``file:``), not a server."""
    return bool(uri) and (uri.startswith(("sqlite:///", "file:")) or "://" not in uri)


def _anchor(tree: dict, folder: Path) -> list[str]:
    """Make the relative paths ``tree`` states absolute against ``folder`` (in place); the keys it states."""
    keys = list(_path_items(tree))
    for key in keys:
        if key == "tracking.uri":
            tree["tracking"]["uri"] = _local_uri(tree["tracking"]["uri"], folder)
        elif key.startswith("data.sources["):
            src = tree["data"]["sources"][int(key[len("data.sources["):].split("]")[0])]
            src["path"] = _absolute(src["path"], folder)
        else:
            section, name = key.split(".")
            tree[section][name] = _absolute(tree[section][name], folder)
    return keys


def _absolute(path: str, folder: str | Path) -> str:
    """``path`` (``~`` expanded) against ``folder`` when relative, normalised (``conf/../assets`` -> ``assets``)."""
    return os.path.normpath(os.path.join(folder, os.path.expanduser(path)))


#: Where named compositions live: the user presets, then the benchmark's arms (experimental variants).
NAMED_FOLDERS = ("presets", "bench")


def named_config(name: str) -> Path:
    """The file of a preset (``conf/presets/<name>.yaml``) or benchmark arm (``conf/bench/<name>.yaml``)."""
    for folder in NAMED_FOLDERS:
        path = conf_dir() / folder / f"{name}.yaml"
        if path.is_file():
            return path
    known = sorted(p.stem for folder in NAMED_FOLDERS for p in (conf_dir() / folder).glob("*.yaml"))
    raise ConfigError(f"unknown preset or benchmark arm {name!r}; allowed: {', '.join(known)}")


def preset_overrides(name: str) -> list[str]:
    """The keys a preset or arm sets itself (with the files it builds on, not ``base.yaml``) as dotted overrides:
    what it changes on top of any run's config (the benchmark's arms, the plan's candidates)."""
    path: Path | None = named_config(name)
    base_file = (conf_dir() / "base.yaml").resolve()
    merged: dict = {}
    while path is not None:
        tree = yaml.safe_load(path.read_text()) or {}
        base = tree.pop("base", None)
        _anchor(tree, Path(os.path.abspath(path)).parent)  # its paths relative to itself, as in load_config
        merged = _merge(tree, merged)
        nxt = (path.parent / base).resolve() if base else None
        path = nxt if nxt is not None and nxt != base_file else None
    return [f"{k}={json.dumps(v)}" for k, v in _flat_items(merged)]


def _flat_items(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _flat_items(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` with dotted ``key=value`` overrides applied, validated."""
    tree = cfg.model_dump(mode="json")
    for item in overrides:
        _set(tree, *parse_override(item))
    return validate(tree)


def default_config() -> str:
    """The config of ``rlsift run`` and the pipeline flow when none is given: the ``auto`` preset (the plan
    chooses the composition). ``load_config(None)`` stays the embedded defaults (plain GRPO)."""
    return str(conf_dir() / "presets" / "auto.yaml")


def conf_dir() -> Path:
    """``conf/`` of the current directory, else the one shipped beside the package."""
    here = Path("conf")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "conf"


def validate(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def _read_yaml(path: Path, section: str | None = None) -> tuple[dict, dict[str, str]]:
    """A config file's tree, with the file it names as ``base:`` under it and its relative paths made absolute
    against its own folder, and the origin of each path (:func:`path_origins`). ``section``: the file is that one
    section (a config group, ``conf/data/*.yaml``); the tree then holds it under its name."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if tree is None:
        raise ConfigError(f"{path}: the config file is empty (for every default, leave out -c)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = tree.pop("base", None)
    if section is not None:
        tree = {section: tree}
    where = os.path.abspath(path)
    own = {k: where for k in _anchor(tree, Path(where).parent)}
    origins: dict[str, str] = {}
    if base:
        below, origins = _read_yaml(path.parent / base, section)
        if isinstance(tree.get("data"), dict) and "sources" in tree["data"]:  # a list is set whole
            origins = _replace_origins(origins, "data.sources", {})
        tree = _merge(below, tree)
    return tree, {**origins, **own}


def resolve_paths(cfg: Config, folder: str | Path) -> Config:
    """``cfg`` with its relative paths resolved against ``folder`` (the folder the run started in): the run root
    (``paths.root``), the warm-start cache (``paths.cache``), the starting model (``model.path``), every file source
    (``data.sources[i].path``) and a tracking URI that names a local store (a plain path, or ``sqlite:///`` with a
    relative file). The run keeps them so (its ``config.json``), and a resume finds the same files from any folder.
    Absolute paths, URLs and unset paths are left as they are."""
    base = Path(folder)

    def absolute(path: str | None) -> str | None:
        return path if not path or Path(path).is_absolute() else str(base / path)

    tree = cfg.model_dump(mode="json")
    tree["paths"]["root"] = absolute(tree["paths"]["root"])
    tree["paths"]["cache"] = absolute(tree["paths"]["cache"])
    if not is_gguf_name(tree["model"]["path"]):  # a packaged model's name is no path
        tree["model"]["path"] = absolute(tree["model"]["path"])
    for source in tree["data"]["sources"]:
        if source["kind"] == "file":
            source["path"] = absolute(source["path"])
    tree["tracking"]["uri"] = _local_uri(tree["tracking"]["uri"], base)
    return validate(tree)


def _local_uri(uri: str | None, base: Path) -> str | None:
    """A tracking URI with a relative local store made absolute (``mlruns`` -> ``/folder/mlruns``,
    ``sqlite:///x.db`` -> ``sqlite:////folder/x.db``); a server's URL or an absolute store as it is."""
    if not uri:
        return uri
    if uri.startswith("sqlite:///") and not uri.removeprefix("sqlite:///").startswith("/"):
        return f"sqlite:///{base / uri.removeprefix('sqlite:///')}"
    if "://" not in uri and not uri.startswith("file:") and not Path(uri).is_absolute():
        return str(base / uri)
    return uri


def to_json(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
