"""``bf16-mixed`` on the sharded backends (DDP, FSDP2, DeepSpeed ZeRO-2/3 on 2 gloo CPU ranks): each replica, built
as a run builds it on a bf16 model, moves its float32 master weights by the float32 single-process update within
2 % after 10 AdamW steps at lr 1e-6 (norm ratio 0.98-1.02, cosine >= 0.99; tests/tasks/test_precision.py has the
single process, LoRA and the settings); a checkpointed and resumed Driver (DDP, FSDP2) is the uninterrupted one,
bit for bit, its generation copy in bf16.

A ``torchrun --nproc_per_node 2`` launch of ``dist_precision_helper.py`` for DDP and FSDP2 (about 25 s on 2 cores),
another for DeepSpeed (marked slow: 2-3 min under load; its ``deepspeed_shm_comm`` op comes from the JIT cache
tests/tasks/test_distributed.py fills). Measured: every backend 0.998 / 0.997 (norm ratio / cosine), as the single
process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.servers import torchrun_two_ranks
from tests.tasks.test_precision import compare, trained_update

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("dist_precision_helper.py")
TORCH = ("ddp", "fsdp2")
DEEPSPEED = ("deepspeed_zero2", "deepspeed_zero3")


def launch(out: Path, backends: tuple[str, ...]) -> dict:
    return torchrun_two_ranks(HELPER, out, *backends)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """DDP and FSDP2 with the Drivers' resume: one launch, about 25 s on 2 cores."""
    return launch(tmp_path_factory.mktemp("dist") / "precision.pt", TORCH)


@pytest.fixture(scope="module")
def float32_update():
    return trained_update("fp32")


@pytest.mark.parametrize("backend", TORCH)
def test_sharded_bf16_mixed_moves_the_masters_by_the_float32_update(results, float32_update, backend):
    check_update(results[backend], float32_update, backend)


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("dist") / "precision_ds.pt", DEEPSPEED)


@pytest.mark.slow
@pytest.mark.parametrize("backend", DEEPSPEED)
def test_deepspeed_keeps_float32_masters_under_bf16(deepspeed_results, float32_update, backend):
    """DeepSpeed with ``bf16`` enabled (the replica's dtype) keeps fp32 master partitions and moments itself."""
    check_update(deepspeed_results[backend], float32_update, backend)


def check_update(got: dict, float32_update: dict, backend: str) -> None:
    assert got["micro_batches"] > 2  # gradients accumulate over micro-batches before the step
    assert all(t.dtype == torch.float32 for t in got["end"].values())
    update = {k: got["end"][k] - got["start"][k] for k in float32_update}
    ratio, cosine = compare(update, float32_update)
    assert 0.98 <= ratio <= 1.02 and cosine >= 0.99, (backend, ratio, cosine)
    # the replica computes in bf16 (DDP, DeepSpeed) or shards float32 behind FSDP2's bf16 mixed-precision policy
    assert got["replica_dtypes"] == (["torch.float32"] if backend == "fsdp2" else ["torch.bfloat16"])


@pytest.mark.parametrize("backend", ("ddp", "fsdp2"))
def test_a_resumed_driver_is_the_uninterrupted_one(results, backend):
    got = results[f"resume/{backend}"]
    assert got["dtypes"] == ["torch.bfloat16"]  # rank 0's generation copy stays bf16
    for k, v in got["uninterrupted"].items():
        assert torch.equal(got["resumed"][k], v), k
