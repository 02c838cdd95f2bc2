"""Rollouts with verified rewards, and the reference rollouts that measure prompts' success rates.

``rollout_rewards`` is the one place a policy's completions meet the verifiers (tasks/data/rewards.py):
the training step's rollouts (tasks/training/loop.py) and every reference measurement go through it.

Reference rollouts (DOTS, Sun et al. 2025, arXiv 2506.05316; rlcore/difficulty.py: K reference prompts rolled out G
times with the current policy) are taken in two places, each with its own choice of prompts:

- the calibrate stage (tasks/stages.py), once before training: :func:`stratified_reference`, K prompts
  round-robin over difficulty levels, the first labels of the run;
- every DOTS round (tasks/selection/rounds.py): :func:`random_reference`, K prompts drawn uniformly from
  the round's active pool.

A round calls :func:`reference_rollouts` with a :data:`Measure` (``policy_measure(policy)``), which gives rewards
[K, G]; the calibrate stage calls :func:`rollout_rewards` itself, as it keeps the rollouts and their seconds for the
plan's probe (tasks/calibration/record.py ``CalibrationDraw``). Their success rates label the difficulty predictor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tasks.data.prompts import PromptRecord
from tasks.data.rewards import batch_rewards
from tasks.generation.rollout import Generation
from tasks.policy import Policy

#: ``(records [K], g, seed) -> rewards [K, g]``: g verified rollouts of each record with the current policy.
Measure = Callable[[list[PromptRecord], int, int], torch.Tensor]


def rollout_rewards(policy: Policy, records: list[PromptRecord], n: int, seed: int,
                    workers: int = 4) -> tuple[Generation, torch.Tensor]:
    """Generate n completions per record and verify them. Returns the generation and rewards [B, n] float32."""
    gen = policy.engine.generate(policy.prompts(records), n=n, seed=seed)
    rewards = batch_rewards([r for r in records for _ in range(n)], gen.texts, workers=workers)
    return gen, torch.tensor(rewards, dtype=torch.float32).view(len(records), n)


def policy_measure(policy: Policy) -> Measure:
    """The :data:`Measure` of ``policy``: :func:`rollout_rewards`' rewards, the generation dropped."""

    def measure(records: list[PromptRecord], g: int, seed: int) -> torch.Tensor:
        return rollout_rewards(policy, records, g, seed)[1]

    return measure


def stratified_reference(pool: Sequence[PromptRecord], k: int, seed: int) -> list[int]:
    """The calibrate stage's reference set: min(k, M) pool indices, round-robin over levels (ascending, no level
    last), each level's prompts in the order of a ``torch.randperm(M)`` seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    strata: dict = {}
    for i in torch.randperm(len(pool), generator=gen).tolist():
        strata.setdefault(pool[i].level, []).append(i)
    picked, k = [], min(k, len(pool))
    while len(picked) < k:  # round-robin over levels
        for lv in sorted(strata, key=lambda x: (x is None, x)):
            if strata[lv] and len(picked) < k:
                picked.append(strata[lv].pop())
    return picked


def random_reference(candidates: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """A DOTS round's reference set: min(k, C) of the ``candidates`` [C] (pool indices), drawn by a
    ``torch.randperm(C)`` seeded with ``seed``; returns [K] pool indices in draw order."""
    gen = torch.Generator().manual_seed(seed)
    return candidates[torch.randperm(len(candidates), generator=gen)[:min(k, len(candidates))]]


def reference_rollouts(measure: Measure, pool: Sequence[PromptRecord], indices: Sequence[int] | torch.Tensor,
                       g: int, seed: int) -> torch.Tensor:
    """g verified rollouts of each reference prompt ``pool[i]``, i in ``indices`` [K]: rewards [K, g]."""
    return measure([pool[int(i)] for i in indices], g, seed)
