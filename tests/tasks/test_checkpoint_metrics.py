"""No window loses step metrics: a kill after a checkpoint's ``latest`` pointer is written but before its held
metrics reach the tracker's outbox is made good by the resume, with the original timestamps (the training stage's
recorder, tasks/training/recorder.py, writes the checkpoint with them and sends them)."""

import pytest
import torch

from tasks.config.load import validate
from tasks.records.cost import CostMeter
from tasks.records.ledger import Ledger
from tasks.run import Run
from tasks.training import checkpoint
from tasks.training.recorder import Recorder as StepRecorder
from tests.policies import policy_of


class Recorder:
    """A tracker that keeps what it is given (the outbox's view)."""

    def __init__(self):
        self.sent: list[tuple[dict, int, int]] = []

    def log_metrics(self, metrics, step, ts=None):
        self.sent.append((dict(metrics), step, ts))


class State:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _run(tmp_path, ledger) -> Run:
    return Run(cfg=validate({}), run_id="r1", root=tmp_path, dir=tmp_path / "runs" / "r1", ledger=ledger,
               tracker=Recorder(), meter=CostMeter(prices={"cpu": 0.0}, device="cpu", devices=1),
               device=torch.device("cpu"), tracking_uri="none")


class Killed(BaseException):
    pass


def save(run: Run, step: int, model: torch.nn.Module) -> None:
    """A checkpoint at ``step`` as the training stage writes it: with the held metrics it covers, then their send."""
    StepRecorder(run).checkpoint(step, lambda held: checkpoint.save(run, step, policy_of(model), State(), {}, None,
                                                                    held=held))


def test_a_kill_between_the_pointer_and_the_send_loses_no_metrics(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    with Ledger(tmp_path / "ledger.duckdb") as led:
        run = _run(tmp_path, led)
        run.defer_metrics(0)
        for step in range(4):
            run.log_metrics({"train/reward_mean": step / 10}, step)
        sent_before = list(run.tracker.sent)

        def killed(step, held=None):  # the process dies right after the `latest` pointer was replaced
            raise Killed

        monkeypatch.setattr(run, "commit_metrics", killed)
        with pytest.raises(Killed):
            save(run, 4, model)
        assert checkpoint.latest(run) is not None and run.tracker.sent == sent_before == []
        held = run.held_metrics(2**62)

        resumed = _run(tmp_path, led)  # a new process: nothing in memory
        got = checkpoint.restore(resumed, policy_of(model), State(), State(), None)
        assert got.step == 4 and resumed.tracker.sent == []  # restoring sends nothing: the recorder does
        StepRecorder(resumed).resume(got.step, got.held)
    assert resumed.tracker.sent == held  # every step 0..3, with the timestamps they were first logged with
    assert [s for _, s, _ in resumed.tracker.sent] == [0, 1, 2, 3]


def test_a_normal_checkpoint_sends_each_step_once(tmp_path):
    with Ledger(tmp_path / "ledger.duckdb") as led:
        run = _run(tmp_path, led)
        run.defer_metrics(0)
        run.log_metrics({"x": 1.0}, 0)
        run.log_metrics({"x": 2.0}, 1)
        save(run, 1, torch.nn.Linear(2, 2))
        assert [s for _, s, _ in run.tracker.sent] == [0]
        assert [s for _, s, _ in run.held_metrics(2**62)] == [1]
