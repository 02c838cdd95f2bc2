"""Shared fixtures. Test tiers: a bare `pytest` runs the fast CPU tier; `-m slow`, `-m gpu`, `-m vllm` the rest."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "tests" / "fixtures" / "tiny.yaml"
#: a default-tier test that hangs fails after this long with its threads' stacks (pytest-timeout), instead of holding
#: CI to its limit; the slowest takes about two minutes on 2 cores. The slow tiers time their own subprocesses.
DEFAULT_TIER_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("slow", "gpu", "vllm", "timeout")):
            item.add_marker(pytest.mark.timeout(DEFAULT_TIER_TIMEOUT_S))


@pytest.fixture
def smoke_cfg(tmp_path):
    """The smoke config with its run root (and warm-start cache) in a temporary folder."""
    from tasks.config.load import load_config

    def make(*overrides: str, path: Path = SMOKE):
        return load_config(path, [f"paths.root={tmp_path / 'root'}", *overrides])

    return make


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and two threads on a busy 2-core machine can be 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
