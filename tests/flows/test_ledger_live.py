"""The ledger answers while a run writes it: `rlsift ledger runs` and `ledger why` mid-training (issue 41)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.conftest import ROOT, cli_env


def _trained_a_step(root: Path) -> bool:
    """Whether a run under ``root`` has finished a training step (its metrics line follows the step's ledger rows)."""
    return any('"train/reward_mean"' in f.read_text() for f in root.glob("runs/*/metrics.jsonl"))


@pytest.mark.slow
def test_the_ledger_answers_mid_training(tmp_path, capsys):
    """A run keeps training while another process lists it as running and explains a selection. Slow: a real run
    with its Prefect server, about a minute on 2 cores; tests/tasks/test_ledger.py checks the locking fast."""
    from flows.cli import main

    root, log = tmp_path / "root", tmp_path / "run.log"
    with log.open("w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", "-c", "tests/fixtures/tiny.yaml", f"paths.root={root}",
             "model.path=assets/tiny-warmstart", "train.steps=1000", "eval.every=0", "eval.samples=0",
             "calibrate.k=4"], cwd=ROOT, env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)  # its own process group: the kill below ends its Prefect server too
    try:
        deadline = time.monotonic() + 300
        while not _trained_a_step(root):
            assert run.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no training step within 300 s"
            time.sleep(0.5)

        assert main(["ledger", "runs", "--root", str(root), "--json"]) == 0
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["status"] == "running"
        assert main(["ledger", "sql", "--root", str(root), "--json", "--sql",
                     "SELECT prompt_id FROM selections LIMIT 1"]) == 0
        (picked,) = json.loads(capsys.readouterr().out)
        assert main(["ledger", "why", "--root", str(root), "--run", listed["run"], "--prompt",
                     picked["prompt_id"]]) == 0
        out = capsys.readouterr().out
        assert "selector" in out and "uniform" in out
        assert main(["ledger", "runs", "--root", str(root)]) == 0  # the table, too
        assert listed["run"] in capsys.readouterr().out
        assert run.poll() is None, "the run ended before the questions: they were not asked mid-training"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
