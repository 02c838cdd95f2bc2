"""Every config file loads and validates; bad keys and values are errors that name the key."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import Config, ConfigError, load_config

CONF = Path(__file__).resolve().parents[1] / "conf"
FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent.name != "data")
DATA = sorted((CONF / "data").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_config_file_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.model_config["frozen"]


@pytest.mark.parametrize("path", DATA, ids=lambda p: p.stem)
def test_every_data_group_validates(path, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    cfg = load_config(None, [f"data={path.stem}"])
    assert cfg.data.sources, path


def test_presets_switch_what_their_names_say():
    get = lambda name: load_config(CONF / "presets" / f"{name}.yaml")  # noqa: E731
    assert get("grpo").select.method == "uniform" and not get("grpo").pods.enabled
    assert get("dots").select.method == "dots" and not get("dots").replay.enabled
    assert get("dots_rr").replay.enabled and get("pods").pods.enabled
    assert get("gain").gain.enabled and get("scalingrl").curriculum.enabled
    a = get("all")
    assert (a.select.method, a.pods.enabled, a.replay.enabled, a.curriculum.enabled, a.gain.enabled) == \
        ("dots", True, True, True, True)


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "train.lr=3e-4", "replay.enabled=true", "data.sources=[]"])
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-4 and cfg.replay.enabled and cfg.data.sources == ()


@pytest.mark.parametrize("override, expect", [
    ("train.stepz=3", "train.stepz: unknown key; allowed keys: steps"),
    ("trian.steps=3", "trian: unknown key; allowed keys: seed, paths"),
    ("train.steps=-1", "train.steps: Input should be greater than or equal to 0"),
    ("select.method=best", "select.method: Input should be 'uniform' or 'dots'"),
    ("model.hidden=100", "hidden/heads must be an integer >= 32"),
    ("train.steps", "expected key=value"),
])
def test_bad_config_names_the_key(override, expect):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert expect in str(err.value)


def test_frozen():
    cfg = load_config(None)
    with pytest.raises(ValidationError):
        cfg.train.steps = 3  # type: ignore[misc]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_flat_params_cover_every_leaf():
    flat = load_config(None).flat()
    assert flat["train.steps"] == 150 and flat["select.predictor.hidden"] == 64
    assert all(not isinstance(v, dict) for v in flat.values())
