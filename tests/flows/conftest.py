"""Fixtures for the flow tests: a temporary Prefect API, and a small arithmetic task with a policy that has
learned part of it, so real verifiers give mixed rewards (real gradients, a non-empty replay buffer,
informative PODS choices); helpers to run ``rlsift`` in subprocesses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prefect_harness():
    """A temporary Prefect API (fresh SQLite) for the flow tests of one module."""
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def easy_task(tmp_path_factory):
    """(data folder with easy_train.jsonl / easy_test.jsonl, folder of a policy fine-tuned on the train half).

    Level 1-2 problems of the bundled task; the tiny policy is warm-started on the 40 train problems' worked
    solutions for 400 steps (about 10-20 s on one core), which gets most of them right when sampled: groups of
    4 rollouts are now and then mixed (completions need up to 27 tokens: allow 32 new tokens).
    """
    import torch

    from tasks.data import arith
    from tasks.model.warmstart import warm_start

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("easy")
    records = {}
    for split, n in (("train", 40), ("test", 8)):
        records[split] = arith.generate(0, n, split, {1: 0.5, 2: 0.5})
        with open(folder / f"easy_{split}.jsonl", "w") as f:
            for r in records[split]:
                f.write(json.dumps({"question": r.question, "answer": r.answer, "solution": r.solution,
                                    "level": r.level}) + "\n")
    model = warm_start(records["train"], folder / "cache", hidden=64, layers=2, heads=2, steps=400, batch_size=16,
                       lr=3e-3, seed=0, progress=False)
    return folder, model


def easy_overrides(folder: Path, model: Path) -> list[str]:
    return [f"model.path={model}",
            f"data.sources=[{{kind: file, path: {folder / 'easy_train.jsonl'}, reward: arith}}, "
            f"{{kind: file, path: {folder / 'easy_test.jsonl'}, reward: arith}}]"]


def cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for ``rlsift`` subprocesses: offline, one thread, Prefect state in ``tmp``, CI mode."""
    env = dict(os.environ)
    env.update({"PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CI": "true", "PYTHONUNBUFFERED": "1"})
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


def rlsift(*args: str, env: dict[str, str], timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)
