"""``torchrun -m flows.train_dist`` (2 CPU processes) ends where ``rlsift run`` ends (slow: about 2.5 minutes a
backend).

Both runs use ``tests/fixtures/tiny.yaml`` with a 400-step warm start shared through one cache folder, so the policy
solves a few prompts and some steps have non-zero advantages (the 20-step default solves none and the
updates would all be zero), and ``overlap.lag=0`` (``auto`` picks 1 for one process on this CPU and 0 under
scale-out). The sharded run goes through the whole driver protocol: rank 0 runs the pipeline, the other rank
serves the updates and decodes its share of every ``generate`` call (training, reference rollouts, evaluations:
tasks/generation/rank_shared.py), weights come back to rank 0 after every step, checkpoints gather the optimizer
state. Its ledger (groups, selections, reference rollouts, evaluations) equals the one-process run's, and its final
weights are within 1e-5 (measured 7e-8 under DDP before every rank generated).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.records.ledger import Ledger
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["-c", "tests/fixtures/tiny.yaml", "model.warmstart.steps=400", "tracking.register_model=false",
          "overlap.lag=0"]
#: The ledger's tables and their order for the comparison.
TABLES = (("groups", "step, prompt_id, replayed, from_step"), ("selections", "step, prompt_id"),
          ("reference", "step, prompt_id, round"), ("evals", "phase, step, grp"))


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ledger_rows(root: Path, table: str, order: str) -> list[dict]:
    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        rows = led.query(f"SELECT * FROM {table} ORDER BY {order}")
    return [{k: v for k, v in r.items() if k not in ("run_id", "logged_at")} for r in rows]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The one-process run, and the warm-start cache the sharded runs share with it."""
    tmp = tmp_path_factory.mktemp("single")
    cache = f"paths.cache={tmp / 'cache'}"
    return _run([sys.executable, "-m", "flows.cli", "run", *COMMON, cache, f"paths.root={tmp / 'root'}", "--json"]), \
        cache, tmp / "root"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_torchrun_pipeline_matches_single_process(tmp_path, single_run, backend):
    single, cache, single_root = single_run
    sharded = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), "-m", "flows.train_dist", *COMMON, cache,
                    f"paths.root={tmp_path / 'dist'}", f"scale.backend={backend}", "--json"])
    assert single["status"] == sharded["status"] == "completed"
    assert single["steps"] == sharded["steps"] == 4
    metrics = [json.loads(line) for line in (Path(sharded["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all("train/loss" in m for m in metrics)
    assert (Path(sharded["run_dir"]) / "checkpoints" / "latest").exists()
    a = load_file(str(Path(single["model_path"]) / "model.safetensors"))
    b = load_file(str(Path(sharded["model_path"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=0, msg=k)
    for table, order in TABLES:
        want, got = ledger_rows(single_root, table, order), ledger_rows(tmp_path / "dist", table, order)
        assert got and got == want, f"{table} differs from the one-process run's"
    # the same rollouts step by step (their tokens; the ledger holds their rewards)
    want = [json.loads(line) for line in (Path(single["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    for key in ("rollout/tokens", "rollout/generated", "train/reward_mean"):
        assert [m[key] for m in metrics] == [m[key] for m in want], key
    # rank 1 decoded half of every call (each call's prompts are even in number: 8 a step, 8 reference, 24 held out)
    last = metrics[-1]
    assert last["rollout/rank1_prompts"] == last["rollout/rank0_prompts"] > 0
