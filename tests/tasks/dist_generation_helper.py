"""Run by ``tests/tasks/test_rank_generation.py`` under ``torchrun --nproc_per_node 2``: every rank generates its
share (tasks/generation/rank_shared.py).

For each backend named on the command line, rank 0 builds the ``Driver`` on the tiny model while rank 1 serves, and
asks ``decide_lag`` what ``overlap.lag=auto`` picks; then it lets the training loop's switch
(``tasks.update.backend.share_generation``) decide: at lag 1 the engine stays rank 0's alone, at lag 0 it
becomes the rank-shared engine. Rank 0 asks that one for greedy and sampled generations of
``PROMPTS`` (5 prompts: rank 0 decodes 3, rank 1 decodes 2), takes one update step with a large learning rate, and
asks again (rank 1 must generate with the updated weights: gathered under FSDP2 / ZeRO-3, its replica's own under
DDP). After each, rank 0's plain ``HFEngine`` on the same weights generates the whole call alone: the one-process
reference. Rank 0 writes everything to ``OUT`` (a ``torch.save`` file).
"""

from __future__ import annotations

import os
import sys

import torch

from tasks.config.load import validate
from tasks.generation.rollout import HFEngine
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.overlap.lag import decide_lag
from tasks.policy import Policy
from tasks.update.backend import share_generation
from tasks.update.distributed import init_distributed, is_rank0
from tasks.update.sharded_update import Driver, serve, stop_workers
from tasks.update.updater import LossSettings
from tests.tasks.dist_update_helper import make_batch

PROMPTS = ["Q: 1+2=\n", "Q: what is 17*3?\n", "Q: 9-4\n", "Q: the sum of 5 and 12\n", "Q: 2*2*2*2\n"]
#: The engine's settings (chunk 8 rows: the one-process call decodes prompts 0-3 in one batch, 4 in another, so
#: neither rank's share is decoded in the same batch as in the reference).
ENGINE = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, top_k=20, chunk=8, device="cpu")


def calls(engine, reference) -> dict:
    """The rank-shared engine's generations and the one-process reference's, greedy (n 2) and sampled (n 3)."""
    out = {}
    for name, kw in (("greedy", dict(n=2, seed=7, greedy=True)), ("sampled", dict(n=3, seed=11))):
        out[name] = (engine.generate(PROMPTS, **kw), reference.generate(PROMPTS, **kw))
    return out


def run(backend: str) -> dict | None:
    if not is_rank0():
        serve()
        return None
    cfg = validate({"scale": {"backend": backend}, "train": {"lr": 1e-2, "minibatches": 1, "grad_clip": 1.0}})
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0, tokenizer=tok)
    driver = Driver(cfg, model, LossSettings.from_config(cfg, tok.pad_token_id))
    local = HFEngine(model, tok, **ENGINE)
    policy = Policy(model=model, tokenizer=tok, engine=local)
    auto = decide_lag(cfg, policy, [])  # overlap.lag=auto (the default) under scale-out: 0, without a probe
    said = {1: share_generation(cfg, policy, driver, lag=1)}
    kept = policy.engine is local  # lag 1: rank 0's generator process draws alone
    said[0] = share_generation(cfg, policy, driver, lag=0)
    shared = policy.engine
    before = calls(shared, local)
    driver.step(make_batch(model))
    after = calls(shared, local)
    metrics = shared.metrics()
    stop_workers()
    return {"before": before, "after": after, "metrics": metrics, "said": said, "lag1_kept": kept,
            "engine": type(shared).__name__, "auto": (auto.lag, auto.basis, auto.reason)}


def main(out: str, backends: list[str]) -> None:
    torch.set_num_threads(1)
    init_distributed("cpu")
    results = {backend: run(backend) for backend in backends}
    if is_rank0():
        torch.save(results, out)
    torch.distributed.barrier()  # leave together (see dist_update_helper.main)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
