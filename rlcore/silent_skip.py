"""A pre-rollout skip of prompts whose last groups were silent (GRESO, Zheng et al. 2025, arXiv 2506.02177).

GRESO observes that a prompt whose group had zero reward variance at one visit is likely to have it again, and
skips such prompts before any rollout, with a probability that lets them come back (the policy moves their pass
rate). Ours: the evidence is counted in rollouts, not visits, so a first wave of a few agreeing rollouts
(rlcore/rollout_budget.py) counts for less than a full group. A prompt's silent evidence z is the number of its
consecutive agreeing rollouts (all right, or all wrong, since the last mixed group) over the group size n, and

    P(skip) = min(cap, 1 - explore^z)                 (0 for z = 0)

so one silent group of n skips it with chance 1 - explore, each further one multiplies the chance of its return
by explore, and it always returns with chance at least 1 - cap. A mixed group resets z to 0.

Deviations: GRESO tunes its exploration probability online toward a target share of silent groups, separately for
all-right and all-wrong prompts, and counts whole epochs; ours is fixed (``skip.explore``), the same for both,
counted in rollouts and capped (``skip.cap``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlcore.step_rules import Unchanged

__all__ = ["SilentSkip", "SkipRule", "skip_probability", "update_streak"]


def skip_probability(silent: torch.Tensor, explore: float, cap: float) -> torch.Tensor:
    """[M] float64 chance that each prompt is skipped before this step's draw; ``silent`` [M] is z, the prompts'
    silent evidence in groups (>= 0)."""
    if not 0 < explore < 1:
        raise ValueError(f"explore must be in (0, 1), got {explore!r}")
    if not 0 <= cap < 1:
        raise ValueError(f"cap must be in [0, 1), got {cap!r}")
    z = torch.as_tensor(silent, dtype=torch.float64)
    if not (z >= 0).all():
        raise ValueError("silent evidence must be >= 0 (NaN not allowed)")
    return (1 - torch.pow(torch.tensor(explore, dtype=torch.float64), z)).clamp(0, cap)


def update_streak(silent: float, rewards: torch.Tensor, n: int) -> float:
    """A prompt's silent evidence z after a visit whose rollouts got ``rewards`` [r]: z + r / n when they all agree,
    else 0 (``n``: the group size a full visit has)."""
    if n < 1 or rewards.numel() == 0:
        raise ValueError(f"need n >= 1 and at least one reward, got n={n}, {rewards.numel()} rewards")
    if not math.isfinite(silent) or silent < 0:
        raise ValueError(f"silent evidence must be finite and >= 0, got {silent!r}")
    return silent + rewards.numel() / n if bool(rewards.max() == rewards.min()) else 0.0


class SilentSkip:
    """The skip's state over a pool of M prompts (an rlcore.step_rules.PromptFilter): each prompt's silent evidence
    z, and the draws it leaves prompts out of."""

    name = "skip"

    def __init__(self, num_prompts: int, n: int, *, explore: float, cap: float):
        skip_probability(torch.zeros(1), explore, cap)  # checks both
        if num_prompts < 1 or n < 1:
            raise ValueError(f"need num_prompts >= 1 and n >= 1, got {num_prompts}, {n}")
        self.n, self.explore, self.cap = n, explore, cap
        self.silent = torch.zeros(num_prompts, dtype=torch.float64)  # [M] z
        self.skipped = 0  # prompts with weight left out of draws since take_metrics

    def record(self, idx: list[int], counts: list[int], agree: list[bool]) -> None:
        for i, c, a in zip(idx, counts, agree, strict=True):
            self.silent[i] = self.silent[i] + c / self.n if a else 0.0

    def keep(self, probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
        """One uniform draw a prompt from ``generator``: a prompt is left out with its skip chance."""
        out = torch.rand(len(probs), generator=generator, dtype=torch.float64) < skip_probability(
            self.silent, self.explore, self.cap)
        kept = torch.where(out, torch.zeros_like(probs), probs)
        if int((kept > 0).sum()) < k:
            return probs
        self.skipped += int(((probs > 0) & out).sum())
        return kept

    def take_metrics(self) -> dict[str, float]:
        out = {"skip/skipped": float(self.skipped), "skip/silent_prompts": float((self.silent > 0).sum())}
        self.skipped = 0
        return out

    def state_dict(self) -> dict:
        return {"silent": self.silent.clone(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.silent, self.skipped = state["silent"].clone(), int(state["skipped"])


@dataclass(frozen=True)
class SkipRule(Unchanged):
    """The skip as the plan predicts it (an rlcore.step_rules.StepRule): a reference prompt whose g rollouts agreed
    (evidence z = g / n for a visit) is drawn with 1 - seen x its skip chance of its weight, ``seen`` being the share
    of the pool a run has visited, averaged over its steps (:meth:`seen_share`): a prompt not yet visited is never
    skipped. Later visits of one prompt, which raise the chance, are not modelled."""

    explore: float
    cap: float
    seen: float = 1.0
    name: str = "skip"

    @staticmethod
    def seen_share(steps: int, drawn: float, pool: int) -> float:
        """The share of a pool of ``pool`` prompts visited at least once, averaged over ``steps`` steps of ``drawn``
        prompts each drawn uniformly: 1 - (1 - e^-x) / x with x = steps x drawn / pool (1 for an unknown pool)."""
        if pool <= 0 or steps <= 0 or drawn <= 0:
            return 1.0
        x = steps * drawn / pool
        return 1 - (1 - math.exp(-x)) / x

    def weigh(self, successes: torch.Tensor, g: int, n: int, weights: torch.Tensor) -> torch.Tensor:
        s = torch.as_tensor(successes)
        z = torch.where((s == 0) | (s == g), g / n, 0.0)
        return weights * (1 - self.seen * skip_probability(z, self.explore, self.cap))
