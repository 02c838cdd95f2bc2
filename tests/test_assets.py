"""The shipped warm start (assets/tiny-warmstart, conf/smoke.yaml's policy) is what the warm-start code makes."""

import json
from pathlib import Path

import pytest

from tasks.config.load import default_config, load_config
from tasks.model import warmstart
from tasks.model.source import policy_source

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny-warmstart"


class WouldTrain(Exception):
    """Raised where the warm start would start training (building the model is its first step)."""


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*_a, **_k):
        raise WouldTrain

    monkeypatch.setattr(warmstart, "build_tiny_model", refuse)


def test_the_default_run_starts_from_the_shipped_warm_start(tmp_path, no_training):
    """`rlsift run`'s config (an empty cache) resolves to assets/tiny-warmstart without training: the settings, data
    and code the asset's meta.json records are today's. If this fails, the warm start changed: run the embedded
    default once with ``paths.cache=<dir>`` and copy the new ``<dir>/<fingerprint>/`` folder here."""
    cfg = load_config(default_config(), [f"paths.root={tmp_path}", f"paths.cache={tmp_path / 'cache'}"])
    try:
        assert Path(policy_source(cfg)) == ASSET
    except WouldTrain:
        pytest.fail("the default run would train its warm start: the shipped one is not used, or is stale")
    assert warmstart.shipped(json.loads((ASSET / "meta.json").read_text())["fingerprint"]) == ASSET


def test_a_machines_first_run_draws_no_warm_start_record(tmp_path, no_training, monkeypatch):
    """The asset keeps the hash of its recipe's records (``sft-data/<key>.json``), so a run with an empty cache finds
    the shipped warm start without drawing the 76,800 records (4.5 s); the kept hash is the records' own. If this
    fails, tasks/data/arith.py or tasks/model/warmstart_data.py changed (the key) or the records did: with the first
    test passing, write the file again: ``python -c "from tasks.config.load import default_config, load_config;
    from tasks.model import warmstart_data; from tasks.model.source import warmstart_recipe;
    warmstart_data.keep(warmstart_recipe(load_config(default_config(), [])), 'assets/tiny-warmstart')"``."""
    import sys

    from tasks.model import warmstart_data
    from tasks.model.source import warmstart_recipe

    cfg = load_config(default_config(), [f"paths.root={tmp_path}", f"paths.cache={tmp_path / 'cache'}"])
    recipe = warmstart_recipe(cfg)
    shipped = sorted((ASSET / "sft-data").glob("*.json"))
    assert len(shipped) == 1, "the asset keeps one recipe's hash"
    kept = json.loads(shipped[0].read_text())
    if kept["python"] != list(sys.version_info[:2]):
        pytest.skip(f"the kept hash is keyed by Python {kept['python']} (random's draws), not this one")
    assert shipped[0] == warmstart_data.kept_file(ASSET, recipe), "the kept hash is not under today's key"
    assert kept["data_hash"] == warmstart_data.data_hash(recipe.records())

    def no_draw(*_a, **_k):
        raise AssertionError("records drawn where the asset keeps their hash")

    monkeypatch.setattr(warmstart_data, "sft_records", no_draw)
    assert Path(policy_source(cfg)) == ASSET
    assert not (tmp_path / "cache" / "sft-data").exists()  # nothing written: the shipped hash read in place


@pytest.mark.parametrize("override", ["seed=1", "model.warmstart.steps=1"])
def test_another_warm_start_is_trained_not_the_shipped_one(tmp_path, no_training, override):
    """Another seed or recipe has another fingerprint: it trains (and caches) its own warm start."""
    cfg = load_config(default_config(), [f"paths.root={tmp_path}", override])
    with pytest.raises(WouldTrain):
        policy_source(cfg)
    assert warmstart.shipped("0" * 16) is None


def test_smoke_config_uses_the_shipped_warm_start():
    cfg = load_config(Path(__file__).resolve().parents[1] / "conf" / "smoke.yaml")
    assert Path(cfg.model.path) == ASSET and (ASSET / "model.safetensors").is_file()  # relative to the file


@pytest.mark.parametrize("level, lo, hi", [(1, 0.9, 1.0), (3, 0.0, 0.05)])
def test_shipped_warm_start_has_the_documented_skills(level, lo, hi):
    """Levels 1 solved, the slip-prone level 3 not (README, "What the embedded default does today")."""
    from tasks.data import arith
    from tasks.model.loading import load_policy

    model, tok = load_policy(ASSET)
    acc = warmstart.greedy_accuracy_by_level(model, tok, arith.generate(0, 400, "test", {level: 1.0}))
    assert lo <= acc[level] <= hi
