"""The probe's kept timings (tasks/plan/probe_cache.py): a second plan on the same machine, model shape and settings
reuses each part whose sizes the kept one spans and times nothing of it again; other sizes, another key, an old
part, ``plan.reuse_probe_hours=0`` or an unreadable file are timed afresh."""

import dataclasses
import json
import logging
import time

import pytest
import torch

from rlcore.step_costs import CallCost
from tasks.calibration.record import Calibration, CalibrationDraw
from tasks.calibration.reference import rollout_rewards
from tasks.config.load import with_overrides
from tasks.model.loading import build_tiny_model
from tasks.plan import probe as probe_module
from tasks.plan import probe_cache
from tasks.plan.planner import make_plan
from tasks.plan.probe_cache import COVER, KeptPart, ProbeMemo, probe_key
from tests.tasks.test_overlap_choice import tiny_policy
from tests.tasks.test_plan_probe import setting  # noqa: F401 (a fixture)

CANDIDATES = ("grpo_n4", "grpo_screen")


def test_a_kept_part_serves_sizes_within_cover_at_each_end():
    part = KeptPart(sizes=(4, 32), values={"step_s": 0.01})
    assert part.serves((4, 32)) and part.serves((8, 16))  # inside
    assert COVER == 2.0
    assert part.serves((2, 64)) and not part.serves((1, 32)) and not part.serves((4, 65))  # 2x at each end
    line = CallCost.fit([100, 400], [0.01, 0.03], steps=[10, 20])
    kept = KeptPart(sizes=(1, 2), values={"generate": line, "step_s": 0.5}, notes=("a note",), at=12.0)
    assert KeptPart.from_json(json.loads(json.dumps(kept.to_json()))) == kept


def test_the_memo_keeps_reuses_and_ages(tmp_path):
    memo = ProbeMemo.open(tmp_path, "k", max_age_h=1.0)
    assert memo.reuse("bookkeeping", (10, 10)) is None  # nothing kept yet
    memo.keep("bookkeeping", (10, 10), {"step_s": 0.004}, ("n",))
    memo.keep("update", (2, 8), {"update": CallCost(0.0, 1e-4), "optimizer_s": 0.001, "round_s": 0.02}, ())
    memo.save()
    again = ProbeMemo.open(tmp_path, "k", max_age_h=1.0)
    assert again.serves("update", (2, 8)) and again.reused == []  # asking is not reusing
    assert again.reuse("bookkeeping", (10, 10)).values == {"step_s": 0.004}
    assert again.reuse("update", (2, 20)) is None  # beyond what was timed
    assert again.reused == ["bookkeeping"]
    assert ProbeMemo.open(tmp_path, "other", 1.0).reuse("bookkeeping", (10, 10)) is None  # another key
    data = json.loads((tmp_path / "k.json").read_text())
    data["parts"]["bookkeeping"]["at"] = time.time() - 7200  # two hours old
    (tmp_path / "k.json").write_text(json.dumps(data))
    assert ProbeMemo.open(tmp_path, "k", 1.0).reuse("bookkeeping", (10, 10)) is None
    off = ProbeMemo.open(tmp_path, "k", 0.0)  # plan.reuse_probe_hours=0: nothing read, nothing written
    assert off.path is None and off.reuse("update", (2, 8)) is None
    off.keep("screen", (1, 2), {"forward": CallCost(0.0, 1e-5)}, ())
    off.save()
    assert "screen" not in json.loads((tmp_path / "k.json").read_text())["parts"]


def test_an_unreadable_kept_file_is_timed_over_and_replaced(tmp_path, caplog):
    (tmp_path / "k.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        memo = ProbeMemo.open(tmp_path, "k", 1.0)
    assert memo.parts == {} and "cannot be read" in caplog.text
    memo.keep("bookkeeping", (10, 10), {"step_s": 0.004}, ())
    memo.save()
    assert ProbeMemo.open(tmp_path, "k", 1.0).reuse("bookkeeping", (10, 10)) is not None


def test_the_key_names_the_machine_the_model_and_the_settings_not_the_seed(setting):  # noqa: F811
    cfg, _, _ = setting
    policy = tiny_policy()
    key = probe_key(cfg, policy, "cpu")
    assert probe_key(with_overrides(cfg, ["seed=7", "train.steps=999", "plan.min_signal=0.5"]), policy, "cpu") == key
    assert probe_key(with_overrides(cfg, ["rollout.max_new_tokens=17"]), policy, "cpu") != key
    deeper = build_tiny_model(hidden=64, layers=3, heads=2, tokenizer=policy.tokenizer, seed=0)
    assert probe_key(cfg, dataclasses.replace(policy, model=deeper), "cpu") != key  # another shape: a layer more
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert probe_key(cfg, policy, "cpu") != key  # another machine, as the probe times it
    finally:
        torch.set_num_threads(threads)


def test_the_key_changes_with_what_the_parts_time(setting, monkeypatch):  # noqa: F811
    """A version whose probe times other work (``TIMINGS`` raised) reuses no timing an older one kept."""
    cfg, _, _ = setting
    policy = tiny_policy()
    key = probe_key(cfg, policy, "cpu")
    monkeypatch.setattr("tasks.plan.probe_cache.TIMINGS", probe_cache.TIMINGS + 1)
    assert probe_key(cfg, policy, "cpu") != key


def drawn(policy, pool, calibration, g):
    """``calibration`` with its rollouts drawn in this process, as the calibrate stage leaves it: the plan's
    completion lengths come from them where generation is kept."""
    records = [pool[i] for i in calibration.indices]
    t0 = time.perf_counter()
    gen, rewards = rollout_rewards(policy, records, g, 0)
    return Calibration(indices=calibration.indices, success=rewards.mean(1),
                       draw=CalibrationDraw(tuple(records), gen, time.perf_counter() - t0))


def test_a_second_plan_reuses_every_part_and_times_none(setting, tmp_path, monkeypatch):  # noqa: F811
    cfg, pool, calibration = setting
    cfg = with_overrides(cfg, ["plan.prune=false"])
    policy = tiny_policy()
    calibration = drawn(policy, pool, calibration, cfg.calibrate.g)
    first = make_plan(cfg, policy, pool, calibration, candidates=CANDIDATES, scratch=tmp_path,
                      kept=tmp_path / "kept")
    assert first.reused == ()
    (kept_file,) = (tmp_path / "kept").iterdir()
    # the overlap's split of the cores where this machine has one for the candidates' lag 1 (tasks/plan/planner.py)
    parts = ["generate", "update", *(["split"] if first.costs.split is not None else []), "bookkeeping", "screen"]
    assert set(json.loads(kept_file.read_text())["parts"]) == set(parts)

    def timed_again(*args, **kwargs):
        raise AssertionError("a kept part was timed again")

    for name in ("probe_generation", "_probe_update", "probe_split", "probe_bookkeeping", "probe_screen"):
        monkeypatch.setattr(probe_module, name, timed_again)
    second = make_plan(cfg, policy, pool, calibration, candidates=CANDIDATES, scratch=tmp_path,
                       kept=tmp_path / "kept")
    assert set(second.reused) == set(parts)
    a, b = first.costs, second.costs
    assert (b.generate, b.update, b.forward, b.fixed, b.split) == (a.generate, a.update, a.forward, a.fixed, a.split)
    assert b.completion_tokens > 0 and b.levels  # the lengths: this run's own rollouts
    assert f"not timed again: {', '.join(parts)}" in second.summary()
    assert second.choice == first.choice


def test_what_the_kept_parts_do_not_span_is_timed(setting, tmp_path, monkeypatch):  # noqa: F811
    """A plan whose candidates update more groups than the kept update spans (or screen, where the kept probe did
    not) times those parts and keeps them; the rest it reuses. Without this run's rollouts (a calibration loaded,
    not drawn) generation is timed, for its lengths."""
    cfg, pool, calibration = setting
    cfg = with_overrides(cfg, ["plan.prune=false"])  # the screen timed, whatever grpo_screen's reach
    policy = tiny_policy()
    undrawn = calibration
    calibration = drawn(policy, pool, calibration, cfg.calibrate.g)
    make_plan(cfg, policy, pool, calibration, candidates=("grpo_n4",), scratch=tmp_path, kept=tmp_path / "kept")
    (kept_file,) = (tmp_path / "kept").iterdir()
    data = json.loads(kept_file.read_text())
    assert "screen" not in data["parts"]  # no candidate screened
    data["parts"]["update"]["sizes"] = [100, 100]  # as if the kept probe had updated 100 groups only
    kept_file.write_text(json.dumps(data))
    calls = []
    real = probe_module._probe_update
    monkeypatch.setattr(probe_module, "_probe_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan = make_plan(cfg, policy, pool, calibration, candidates=("grpo_n4", "grpo_screen"), scratch=tmp_path,
                     kept=tmp_path / "kept")
    split = {"split"} if plan.costs.split is not None else set()  # a lag-1 split of this machine's cores
    assert calls == [1] and set(plan.reused) == {"generate", "bookkeeping"} | split
    parts = json.loads(kept_file.read_text())["parts"]
    assert parts["update"]["sizes"] != [100, 100] and "screen" in parts
    plan = make_plan(cfg, policy, pool, undrawn, candidates=("grpo_n4",), scratch=tmp_path, kept=tmp_path / "kept")
    assert "generate" not in plan.reused and "bookkeeping" in plan.reused


@pytest.mark.parametrize("hours", [0.0])
def test_reuse_off_times_everything_and_keeps_nothing(setting, tmp_path, hours):  # noqa: F811
    cfg, pool, calibration = setting
    cfg = with_overrides(cfg, [f"plan.reuse_probe_hours={hours}"])
    for _ in range(2):
        plan = make_plan(cfg, tiny_policy(), pool, calibration, candidates=("grpo_n4",), scratch=tmp_path,
                         kept=tmp_path / "kept")
        assert plan.reused == ()
    assert not (tmp_path / "kept").exists()
