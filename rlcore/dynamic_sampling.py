"""DAPO's dynamic sampling: keep generating until the batch holds B groups that carry a gradient.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476,
section 3.2 ("Dynamic Sampling"). A group whose rewards are all equal (every rollout right, or every one
wrong) has zero group-relative advantage and contributes nothing but noise to the update. DAPO
over-samples prompts, drops such groups, and keeps generating until the batch is full; the discarded
rollouts are still paid for. This module holds the bookkeeping (pure, no generation): which groups are
kept, how many prompts the next generation round asks for, when to stop; and what its rounds cost in expectation
(:func:`dynamic_rounds`, for the plan: rlcore/plan.py).

Our choices and deviations (verl's ``algorithm.filter_groups`` is the reference implementation we read):

- Rounds ask for ``ceil(oversample * missing)`` prompts, where ``missing`` is the number of informative
  groups still needed (the first round asks ``ceil(oversample * B)``). verl generates a fixed ``gen_batch``
  every round; asking only for what is missing wastes fewer rollouts near the end of filling.
- A cap of ``max_rounds`` generation rounds per step (verl: ``max_num_gen_batches``). verl raises an error
  when the cap is hit; we train on the informative groups found so far (a smaller batch), and when there
  are none, on the last round's groups (zero advantages: the step changes nothing but is counted).
- Groups beyond B are discarded in draw order (verl truncates the same way).
- "Informative" is judged on the rewards that enter the update (after PODS down-sampling), which is
  what decides whether the group has a gradient.

Shape notation as in ``rlcore/__init__.py`` (B groups of G kept rollouts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlcore.types import RolloutGroup


def is_informative(group: RolloutGroup) -> bool:
    """Whether the group's kept rewards [G] are not all equal (``rlcore.advantages.effective_mask`` for one group)."""
    return bool(group.rewards.max() > group.rewards.min())


@dataclass
class BatchFiller:
    """Collects one step's informative groups over several generation rounds.

    Args:
        target: B, the informative groups the batch needs.
        oversample: prompts asked per missing group (>= 1).
        max_rounds: generation rounds allowed per step (>= 1).
    """

    target: int
    oversample: float
    max_rounds: int
    kept: list[RolloutGroup] = field(default_factory=list)
    last: list[RolloutGroup] = field(default_factory=list)
    rounds: int = 0
    generated_groups: int = 0
    discarded_groups: int = 0

    def __post_init__(self) -> None:
        if self.target < 0:
            raise ValueError(f"target must be >= 0, got {self.target}")
        if not self.oversample >= 1.0:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")

    @property
    def missing(self) -> int:
        return max(self.target - len(self.kept), 0)

    @property
    def done(self) -> bool:
        return self.missing == 0 or self.rounds >= self.max_rounds

    def request(self) -> int:
        """Prompts to generate in the next round: ``ceil(oversample * missing)``."""
        return math.ceil(self.oversample * self.missing)

    def add(self, groups: Sequence[RolloutGroup]) -> None:
        """One round's groups: keep informative ones up to ``target``, count the rest as discarded."""
        self.rounds += 1
        self.generated_groups += len(groups)
        self.last = list(groups)
        for g in groups:
            if self.missing and is_informative(g):
                self.kept.append(g)
            else:
                self.discarded_groups += 1

    def batch(self) -> list[RolloutGroup]:
        """The groups to train on: the informative ones, or the last round's when none was found."""
        return list(self.kept) if self.kept else list(self.last)

    def metrics(self) -> dict[str, float]:
        gen = max(self.generated_groups, 1)
        return {"dynamic/rounds": float(self.rounds), "dynamic/generated_groups": float(self.generated_groups),
                "dynamic/discarded_groups": float(self.discarded_groups),
                "dynamic/kept_groups": float(len(self.kept)), "dynamic/discard_ratio": self.discarded_groups / gen,
                "dynamic/filled": float(len(self.kept) >= self.target)}


def _binomial_pmf(k: int, p: float) -> torch.Tensor:
    """[k + 1] float64: P(y successes of k, each with chance p)."""
    y = torch.arange(k + 1, dtype=torch.float64)
    if p <= 0 or p >= 1:
        return (y == (k if p >= 1 else 0)).to(torch.float64)
    log_c = torch.lgamma(torch.tensor(k + 1.0, dtype=torch.float64)) - torch.lgamma(y + 1) - torch.lgamma(k - y + 1)
    return torch.exp(log_c + y * math.log(p) + (k - y) * math.log1p(-p))


def dynamic_rounds(b: int, r: float, oversample: float, max_rounds: int,
                   round_s: Callable[[int], float] = lambda ask: 0.0) -> tuple[float, float, float]:
    """DAPO's filling of a batch of ``b`` informative groups (``rlcore.dynamic_sampling.BatchFiller``: each round
    asks ceil(oversample * missing) prompts, at most ``max_rounds`` rounds) when each prompt asked gives an
    informative group with chance ``r``, independently. Returns the expected prompts asked, informative groups
    kept and seconds (``round_s(ask)``: one round of ``ask`` prompts), exact over the binomial yields."""
    missing = torch.zeros(b + 1, dtype=torch.float64)  # P(missing = j)
    missing[b] = 1.0
    asked = seconds = 0.0
    for _ in range(max_rounds):
        nxt = torch.zeros_like(missing)
        nxt[0] = missing[0]
        for j in range(1, b + 1):
            p = float(missing[j])
            if p == 0.0:
                continue
            ask = math.ceil(oversample * j - 1e-9)
            asked += p * ask
            seconds += p * round_s(ask)
            left = (j - torch.arange(ask + 1)).clamp(min=0)  # missing after y informative groups
            nxt.index_add_(0, left, p * _binomial_pmf(ask, r))
        missing = nxt
    kept = b - float((torch.arange(b + 1, dtype=torch.float64) * missing).sum())
    return asked, kept, seconds
