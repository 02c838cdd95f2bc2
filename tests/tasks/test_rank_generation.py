"""Every rank generates its share (tasks/generation/rank_shared.py, tasks/generation/split.py).

The split and the join on hand-worked records; then one ``torchrun --nproc_per_node 2`` launch of
``dist_generation_helper.py`` (gloo, CPU; about 15 s on 2 cores) under DDP and FSDP2 (and, marked slow, one under
DeepSpeed ZeRO-2 and ZeRO-3): the rank-shared engine's generations, greedy and sampled, before and after an update
step, equal one process's on the same weights, rank 1 decoded its share of every call, the training loop's
switch keeps rank 0's engine alone at ``overlap.lag`` 1, and ``overlap.lag=auto`` picks 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.generation.rank_shared import generation_copy_bytes
from tasks.generation.rollout import Generation
from tasks.generation.split import join, share_bounds
from tests.servers import torchrun_two_ranks

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("dist_generation_helper.py")
BACKENDS = ("ddp", "fsdp2")
DEEPSPEED = ("deepspeed_zero2", "deepspeed_zero3")


def test_share_bounds_are_contiguous_and_balanced():
    assert share_bounds(5, 2) == [(0, 3), (3, 5)]
    assert share_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert share_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # more ranks than prompts: empty shares
    assert share_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError, match="parts >= 1"):
        share_bounds(3, 0)


def _gen(prompts: list[list[int]], rows: list[list[int]], n: int, eos: int = 2) -> Generation:
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Generation(prompt_ids=[torch.tensor(p) for p in prompts], completion_ids=ids, completion_mask=mask,
                      texts=[str(r) for r in rows], n=n, logprobs=-torch.ones(ids.shape))


def test_join_pads_to_the_longest_share_in_order():
    a = _gen([[5, 6]], [[7, 2], [8, 2]], n=2)  # width 2
    b = _gen([[9], [4, 4]], [[3, 3, 2], [3, 2, 0], [6, 2, 0], [1, 1, 1]], n=2)  # width 3
    g = join([a, b], pad_id=0)
    assert [p.tolist() for p in g.prompt_ids] == [[5, 6], [9], [4, 4]]
    assert g.completion_ids.tolist() == [[7, 2, 0], [8, 2, 0], [3, 3, 2], [3, 2, 0], [6, 2, 0], [1, 1, 1]]
    assert g.completion_mask.tolist()[:2] == [[True, True, False]] * 2  # the padding joins as no token
    assert g.logprobs[:2, 2].tolist() == [0.0, 0.0] and g.logprobs[2:].eq(-1).all()
    assert g.texts == ["[7, 2]", "[8, 2]", "[3, 3, 2]", "[3, 2, 0]", "[6, 2, 0]", "[1, 1, 1]"] and g.n == 2
    with pytest.raises(ValueError, match="different rollouts a prompt"):
        join([a, _gen([[1]], [[1]], n=1)], pad_id=0)


def test_generation_copy_bytes():
    bf16, f32 = torch.bfloat16, torch.float32
    assert generation_copy_bytes("fsdp2", 1000, bf16, f32, rank=1) == 2000  # a gathered bf16 copy
    assert generation_copy_bytes("deepspeed_zero3", 1000, bf16, bf16, rank=1) == 2000
    assert generation_copy_bytes("fsdp2", 1000, bf16, f32, rank=0) == 0  # rank 0 has policy.model
    assert generation_copy_bytes("ddp", 1000, bf16, bf16, rank=1) == 0  # its replica's own module
    assert generation_copy_bytes("ddp", 1000, bf16, f32, rank=1) == 2000  # fp32 replica: a cast copy


def _launch(out: Path, backends: tuple[str, ...]) -> dict:
    return torchrun_two_ranks(HELPER, out, *backends)


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("gen") / "results.pt", BACKENDS)


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory):
    """ZeRO-2 and ZeRO-3 (slow: DeepSpeed's import, and its ``deepspeed_shm_comm`` op built on first use)."""
    return _launch(tmp_path_factory.mktemp("gen_ds") / "results.pt", DEEPSPEED)


def _same(got: Generation, want: Generation) -> None:
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert got.texts == want.texts and got.n == want.n
    assert [p.tolist() for p in got.prompt_ids] == [p.tolist() for p in want.prompt_ids]
    # the shares are decoded in other batches (other padding) than the one-process call: rounding only
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", [*BACKENDS, *(pytest.param(b, marks=pytest.mark.slow) for b in DEEPSPEED)])
def test_every_rank_generates_what_one_process_would(request, backend):
    got = request.getfixturevalue("deepspeed_results" if backend in DEEPSPEED else "shared_results")[backend]
    assert got["auto"][:2] == (0, "config") and "each generating its share" in got["auto"][2]
    assert got["lag1_kept"] and "rank 0 alone generates" in got["said"][1]  # the overlap: rank 0's alone
    assert got["engine"] == "RankSharedEngine" and "every one of the 2 ranks" in got["said"][0]
    for when in ("before", "after"):
        for kind in ("greedy", "sampled"):
            _same(*got[when][kind])
    # the update changed the weights every rank generates with (a stale copy on rank 1 would differ here)
    before, after = got["before"]["greedy"][1], got["after"]["greedy"][1]
    assert float((before.logprobs - after.logprobs).abs().max()) > 1e-3
    # 4 calls of 5 prompts: rank 0 decoded prompts 0-2 of each, rank 1 prompts 3-4
    assert got["metrics"] == {"rollout/rank0_prompts": 12.0, "rollout/rank1_prompts": 8.0}


def test_one_process_keeps_its_engine():
    """The default run (one process) and a sharded backend in a one-process group generate as before."""
    from tasks.config.load import validate
    from tasks.generation.rollout import HFEngine
    from tasks.model.loading import build_tiny_model, build_tokenizer
    from tasks.policy import Policy
    from tasks.update.backend import build_updater, ranks_generate, share_generation

    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0, tokenizer=tok)
    engine = HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=8)
    policy = Policy(model=model, tokenizer=tok, engine=engine)
    cfg = validate({})
    assert cfg.scale.backend == "single" and ranks_generate(cfg, engine) == 1
    assert share_generation(cfg, policy, build_updater(cfg, policy, device="cpu"), lag=0) is None
    assert policy.engine is engine
    assert ranks_generate(validate({"scale": {"backend": "ddp"}}), engine) == 1  # no process group: one rank
