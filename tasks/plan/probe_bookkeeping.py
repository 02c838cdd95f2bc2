"""The plan's probe of a step's bookkeeping (tasks/plan/probe.py, docs/algorithms.md 9.1): a round's draws over the
pool, its ledger rows written in one insert per table and its metrics lines, timed in a scratch folder."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import torch

from rlcore.selection import sample_prompts, uniform_weights
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.plan.probe_generation import cycle_records
from tasks.plan.timing import CHEAP, Untrusted
from tasks.records.ledger import GroupRow, Ledger, SelectionRow, StepRows
from tasks.records.tracking.outbox import Outbox

#: Values a training step logs (tasks/training/loop.py; 78-84 on the embedded task): the probe's metrics line.
STEP_METRICS = 80


def probe_bookkeeping(records: list[PromptRecord], cfg: Config, pool_size: int, scratch: Path | None,
                      untrusted: Untrusted) -> float:
    """Seconds of a step's bookkeeping (module docstring): the draw, the ledger's rows, the metrics line; the
    round's, over its steps (a warm-up round first: the first insert prepares what the later ones reuse)."""
    b, steps_a_round = cfg.train.prompts_per_step, cfg.train.round_steps
    ids = [r.id for r in cycle_records(records, b)]
    selections = tuple(SelectionRow(prompt_id=i, selector="uniform", weight=1.0 / pool_size) for i in ids)
    groups = tuple(GroupRow(prompt_id=i, n=cfg.rollout.n, successes=1, mean_reward=1 / cfg.rollout.n,
                            kept=cfg.rollout.n, kept_mean_reward=1 / cfg.rollout.n, replayed=False, from_step=0)
                   for i in ids)
    weights = uniform_weights(pool_size)
    metrics = {f"probe/value_{i}": float(i) for i in range(STEP_METRICS)}
    with tempfile.TemporaryDirectory(prefix="rlsift-probe-", dir=scratch) as tmp, \
            Ledger(Path(tmp) / "ledger.duckdb") as ledger:
        outbox, lines = Outbox(Path(tmp) / "outbox.jsonl"), Path(tmp) / "metrics.jsonl"

        steps = iter(range(1_000_000))

        def round_() -> None:
            held = []
            for s in itertools.islice(steps, steps_a_round):
                sample_prompts(weights, min(b, pool_size), torch.Generator().manual_seed(s), method="weighted")
                held.append(StepRows(0, s, (), selections, groups))
                outbox.append({"kind": "metrics", "step": s, "ts": 0, "metrics": metrics})
                with open(lines, "a") as f:
                    f.write(json.dumps({"step": s, **metrics}) + "\n")
            ledger.add_steps("probe", held)

        round_()  # warm-up: the first insert prepares what the later ones reuse
        return untrusted.timed(round_, CHEAP, "a round's bookkeeping")[0] / steps_a_round
