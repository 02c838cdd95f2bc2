"""The shipped warm start (assets/tiny-warmstart, conf/smoke.yaml's policy) is what the warm-start code makes."""

import json
import shutil
from pathlib import Path

import pytest

from tasks.config_load import load_config
from tasks.model import warmstart
from tasks.stages import policy_source

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tiny-warmstart"


def test_shipped_warm_start_matches_the_default_fingerprint(tmp_path, monkeypatch):
    """The embedded default (seed 0) finds the shipped folder as its cache entry without training: the settings,
    data and code it was made with are today's. If this fails, the warm start changed: run the embedded default
    once with ``paths.cache=<dir>`` and copy the new ``<dir>/<fingerprint>/`` folder here."""
    meta = json.loads((ASSET / "meta.json").read_text())
    shutil.copytree(ASSET, tmp_path / meta["fingerprint"])

    def no_training(*_a, **_k):
        raise AssertionError("the shipped warm start is stale: the default config would train a new one")

    monkeypatch.setattr(warmstart, "_train", no_training)
    assert Path(policy_source(load_config(None, [f"paths.cache={tmp_path}"]))) == tmp_path / meta["fingerprint"]


def test_smoke_config_uses_the_shipped_warm_start():
    cfg = load_config(Path(__file__).resolve().parents[1] / "conf" / "smoke.yaml")
    assert Path(cfg.model.path) == Path("assets/tiny-warmstart") and (ASSET / "model.safetensors").is_file()


@pytest.mark.parametrize("level, lo, hi", [(1, 0.9, 1.0), (3, 0.0, 0.05)])
def test_shipped_warm_start_has_the_documented_skills(level, lo, hi):
    """Levels 1 solved, the slip-prone level 3 not (README, "What the embedded default does today")."""
    from tasks.data import arith
    from tasks.model.policy import load_policy

    model, tok = load_policy(ASSET)
    acc = warmstart.greedy_accuracy_by_level(model, tok, arith.generate(0, 400, "test", {level: 1.0}))
    assert lo <= acc[level] <= hi
