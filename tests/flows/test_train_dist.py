"""``torchrun -m flows.train_dist`` (2 CPU processes) ends where ``rlsift run`` ends (slow: about 2.5 minutes).

Both runs use ``tests/fixtures/tiny.yaml`` with a 400-step warm start shared through one cache folder, so the policy
solves a few prompts and some steps have non-zero advantages (the 20-step default solves none and the
updates would all be zero). The sharded run goes through the whole driver protocol: rank 0 runs the
pipeline, the other rank serves the updates, weights come back to rank 0 after every step, checkpoints
gather the optimizer state. Measured: final weights within 7e-8 of the one-process run (DDP); tolerance 1e-5.
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

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["-c", "tests/fixtures/tiny.yaml", "model.warmstart.steps=400", "tracking.register_model=false"]



def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp"])
def test_torchrun_pipeline_matches_single_process(tmp_path, backend):
    cache = f"paths.cache={tmp_path / 'cache'}"
    single = _run([sys.executable, "-m", "flows.cli", "run", *COMMON, cache, f"paths.root={tmp_path / 'single'}",
                   "--json"])
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
