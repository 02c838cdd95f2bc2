"""tasks/update/skip_guard.py: a skipped update is said where users look (ledger, metrics, progress bar), and a run
whose updates are skipped train.max_skipped_steps steps in a row stops, naming the cause and the site."""

import json
from contextlib import nullcontext

import pytest

from tasks.records.ledger import Ledger
from tasks.update.nan_locator import SkippedUpdate, inject_nan
from tasks.update.policy_update import LocalUpdater
from tasks.update.skip_guard import SkipGuard, SkippedStepsError, skipped_rows
from tests.tasks.test_train import PRESETS, SMALL, make_policy


def test_the_guard_counts_skipped_steps_in_a_row_and_stops_after_k():
    skip = SkippedUpdate(0, "gradient", "norm nan", note="site not here")
    guard = SkipGuard(2, minibatches=2)
    assert guard.observe(0, {"train/skipped_updates": 0.0}, ()) == {"train/skipped_in_row": 0.0}
    assert guard.observe(1, {"train/skipped_updates": 1.0}, (skip,)) == {"train/skipped_in_row": 0.0}  # 1 of 2
    assert guard.observe(2, {"train/skipped_updates": 2.0}, (skip, skip)) == {"train/skipped_in_row": 1.0}
    assert guard.postfix() == {"skipped": "1/2"} and not guard.stuck
    guard.check()  # one in a row: goes on
    assert guard.observe(3, {}, ()) == {"train/skipped_in_row": 0.0} and guard.postfix() == {}  # a good step
    guard.observe(4, {"train/skipped_updates": 2.0}, (skip, skip))
    guard.observe(5, {"train/skipped_updates": 2.0}, ())  # a backend that reports only the count
    assert guard.stuck
    with pytest.raises(SkippedStepsError, match=r"2 steps in a row \(steps 4-5; train.max_skipped_steps=2\)"):
        guard.check()
    never = SkipGuard(0, 1)  # 0: never stops
    assert not never.stuck and never.postfix() == {}


def test_each_skipped_minibatch_is_a_ledger_row(tmp_path):
    """A described skip is a row with its cause and site; one the update only counted is an ``unknown`` row."""
    skip = SkippedUpdate(0, "gradient", "norm nan", note="site not here")
    with Ledger(tmp_path / "ledger.duckdb") as ledger:
        ledger.add_skipped_updates("r", 1, skipped_rows({"train/skipped_updates": 1.0}, (skip,)))
        ledger.add_skipped_updates("r", 5, skipped_rows({"train/skipped_updates": 2.0}, ()))
        assert skipped_rows({"train/skipped_updates": 0.0}, ()) == []
        rows = ledger.skipped_updates("r")
    assert [(r["step"], r["minibatch"], r["cause"]) for r in rows] == [
        (1, 0, "gradient"), (5, -1, "unknown"), (5, -1, "unknown")]
    assert rows[0]["site"] == "site not here" and rows[0]["detail"] == "norm nan"


def test_a_run_records_a_single_skipped_step_and_stops_after_k_in_a_row(smoke_cfg, monkeypatch):
    """The loop with the real updater, whose update on chosen steps gets a NaN in the gradient reaching layer 1's
    attention (a backward-only NaN): step 1 alone is skipped (recorded, counted, the run goes on), steps 3 and 4
    in a row stop the run at train.max_skipped_steps=2 with the error naming the cause, the site and the steps."""
    from tasks.data import arith
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training.entry import train

    monkeypatch.setattr("tasks.calibration.reference.batch_rewards",
                        lambda records, completions, workers=1: [float(len(c) % 2 == 0) for c in completions])
    real, calls, bad = LocalUpdater.step, {"n": 0}, {1, 3, 4}

    def step(self, groups):
        i = calls["n"]
        calls["n"] += 1
        with inject_nan(self.model, "model.layers.1.self_attn.q_proj", position=1, phase="backward") \
                if i in bad else nullcontext():
            return real(self, groups)

    monkeypatch.setattr(LocalUpdater, "step", step)
    cfg = smoke_cfg(*SMALL, "train.steps=6", "train.max_skipped_steps=2", path=PRESETS.format("grpo"))
    pool = arith.generate(0, 40, "train", "default")
    policy = make_policy()
    run = open_run(cfg, track=False)
    try:
        with pytest.raises(SkippedStepsError) as err:
            train(run, policy, pool, compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu"))
        rows = run.ledger.skipped_updates(run.run_id)
        checkpointed = (run.checkpoint_dir / "latest").read_text().split()[0]
        logged = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        run.close("failed", {})
    message = str(err.value)
    assert "2 steps in a row (steps 3-4; train.max_skipped_steps=2)" in message
    assert "non-finite gradient (norm nan)" in message and "backward of model.layers.1.self_attn" in message
    assert [(r["step"], r["cause"]) for r in rows] == [(1, "gradient"), (3, "gradient"), (4, "gradient")]
    assert all("backward of model.layers.1.self_attn" in r["site"] for r in rows)
    by_step = {m["step"]: m for m in logged}
    assert sorted(by_step) == [0, 1, 2, 3, 4]  # step 2 trained after the single skip; step 5 never ran
    assert [by_step[s]["train/skipped_updates"] for s in range(5)] == [0, 1, 0, 1, 1]
    assert [by_step[s]["train/skipped_in_row"] for s in range(5)] == [0, 1, 0, 1, 2]
    assert "train/grad_norm" in by_step[2] and "train/grad_norm" not in by_step[1]
    # the stop checkpoints first (round ends are 2 and 4): the skipped steps' metrics reach MLflow with it
    assert checkpointed == "step-000005.pt"
