"""Adaptive composition: turn PODS and Rollout Replay down when the fresh groups are mostly informative already.

Our addition (no paper; docs/algorithms.md section 6.5). Two of the five techniques pay for informative groups
that the fresh draw does not give:

* PODS (arXiv 2504.13818) generates n rollouts a prompt and trains on m of them. A kept group carries
  a gradient exactly when the n rollouts' rewards differ, which is likelier than for m rollouts; where groups of
  m are mixed anyway, the n - m extra rollouts buy nothing.
* Rollout Replay (arXiv 2506.05316) fills a share 1 - delta of each batch with stored informative
  groups. Where fresh groups are informative anyway, a replayed group (older, off-policy) only stands in for a
  fresh one that would carry as much.

The signal is r, the share of fresh groups whose rewards would be unequal on m rollouts, estimated without bias
from each group's n rewards (:func:`subset_informative`: the chance that m rollouts drawn without replacement
from the n are not all equal). Measured at m whatever n was generated, it does not move with PODS's own setting,
so turning PODS down cannot feed back into the signal that turned it down. An exponential moving average over
steps smooths it; before the first step it is unknown and the configured composition runs.

The level u = clip((r - low) / (high - low), 0, 1) moves both techniques linearly between the configured
composition (u = 0) and both off (u = 1):

    rollouts a prompt   n_u     = m + round((n - m) (1 - u))      (PODS: n generated, m kept; halves round up)
    fresh share         delta_u = delta + (1 - delta) u           (Replay: delta of each batch fresh)

With n = 2m and delta = 1/2 (conf/presets/all.yaml) a step generates B delta n = B m rollouts at both ends:
deep groups and replay where groups are often silent, wide fresh groups where they are informative. In between it
generates up to 9/8 of that (at u = 1/2: 3B/4 prompts of 3m/2 rollouts).

Shape letters as in ``rlcore/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AdaptiveComposition", "CompositionPlan", "subset_informative"]


def subset_informative(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """The chance that m of each group's rollouts, drawn without replacement, have rewards that are not all equal.

    For a group of n rewards in which value v occurs c_v times, that is 1 - sum_v C(c_v, m) / C(n, m)
    (hypergeometric); with m = n it is ``rlcore.advantages.effective_mask``. Any reward values (binary or not).

    Args:
        rewards: [B, n] finite rewards.
        m: rollouts drawn, 2 <= m <= n.

    Returns:
        [B] float64 chances in [0, 1].
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, n], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= n:
        raise ValueError(f"m must be an int in [2, n={n}], got {m!r}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    count = (rewards.unsqueeze(2) == rewards.unsqueeze(1)).sum(2)  # [B, n]: how often each rollout's value occurs
    comb = torch.tensor([math.comb(c, m) for c in range(n + 1)], dtype=torch.float64)  # C(c, m), exact
    # a value occurring c times is met once for each of its c rollouts, so each rollout adds C(c, m) / c
    same = (comb[count] / count).sum(1)  # [B]
    total = math.comb(n, m)
    return (1 - same / total).clamp(0, 1)


@dataclass(frozen=True)
class CompositionPlan:
    """What one step runs: ``rollouts`` generated a prompt (m <= rollouts <= n), the ``fresh_frac`` of the batch
    rolled out fresh (delta <= fresh_frac <= 1), at ``level`` u in [0, 1] (0: as configured, 1: both off)."""

    rollouts: int
    fresh_frac: float
    level: float

    def metrics(self) -> dict[str, float]:
        return {"adapt/level": self.level, "adapt/rollouts": float(self.rollouts), "adapt/fresh_frac": self.fresh_frac}


class AdaptiveComposition:
    """The moving average of r (the module docstring) and the plan it gives.

    Args:
        low: r at or below which the configured composition runs (u = 0), in [0, 1).
        high: r at or above which PODS and replay are off (u = 1), in (low, 1].
        momentum: weight of the previous average in each update, in [0, 1) (0: the last step alone).
    """

    def __init__(self, low: float, high: float, momentum: float) -> None:
        if not 0 <= low < high <= 1:
            raise ValueError(f"need 0 <= low < high <= 1, got low={low!r}, high={high!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.low, self.high, self.momentum = float(low), float(high), float(momentum)
        self.informative: float | None = None  # the moving average of r; None before the first step

    def observe(self, rewards: torch.Tensor, m: int) -> None:
        """Fold one step's fresh groups, [B, n] rewards of every generated rollout, into the average of r."""
        if rewards.shape[0] == 0:
            return
        r = float(subset_informative(rewards, m).mean())
        self.informative = r if self.informative is None else self.momentum * self.informative + (
            1 - self.momentum) * r

    @property
    def level(self) -> float:
        """u in [0, 1]: 0 before the first step."""
        if self.informative is None:
            return 0.0
        return min(1.0, max(0.0, (self.informative - self.low) / (self.high - self.low)))

    def plan(self, n: int, m: int, fresh_frac: float) -> CompositionPlan:
        """The step's plan for a configuration generating n and keeping m rollouts a prompt (m = n without PODS)
        with ``fresh_frac`` delta of each batch fresh (1 without replay)."""
        if not 1 <= m <= n:
            raise ValueError(f"need 1 <= m <= n, got m={m}, n={n}")
        if not 0 < fresh_frac <= 1:
            raise ValueError(f"fresh_frac must be in (0, 1], got {fresh_frac!r}")
        u = self.level
        rollouts = m + math.floor((n - m) * (1 - u) + 0.5)  # halves round up, as replay's mix_counts
        return CompositionPlan(rollouts=rollouts, fresh_frac=fresh_frac + (1 - fresh_frac) * u, level=u)

    def state_dict(self) -> dict:
        return {"informative": self.informative}

    def load_state_dict(self, state: dict) -> None:
        self.informative = state["informative"]
