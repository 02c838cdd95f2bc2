"""GAIN-RL Gaussian-probability sampling over angle-concentration rank positions, with the mu update.

Paper: Wang et al., "Angles Don't Lie: Unlocking Training-Efficient RL Through the Model's Own Signals"
(GAIN-RL), arXiv 2506.02281; official code github.com/wangqinsi1/GAINRL (``gainrl_sampler.py``,
``gainrl_trainer.py``, ``verl_gainrl`` batch sampler). Summary: docs/algorithms.md section 5.3.

Prompts are sorted by angle concentration (rank 0 = highest, see :func:`rlcore.angle.angle_order`). Rank
position i is drawn with probability P(i) proportional to exp(-(i - mu)^2 / (2 sigma^2)), mu_0 = 0; after each
sampling period::

    delta = n * tanh(alpha * (acc - beta)) + n * tanh(gamma * angle)
    delta = clamp(delta, adj_min, adj_max);   mu <- clip(mu + delta, 0, N - 1)

Choices and deviations:

* **0/1 accuracy.** ``acc`` is the mean reward scaled to [0, 1] by the caller, and the accuracy term is
  acc - beta. The trl code uses acc/2 - beta for its reward of 2 per correct answer; with verl's 0/1 rewards
  that term is never positive (a quirk of the official code, docs/algorithms.md section 5.3).
* **No lag.** The update applies to the very next draw (the trl script samples one epoch late).
* **Scale with the pool.** sigma, the step size n and adj_max are fractions of N: sigma = ``sigma_frac`` N,
  n = ``step_frac`` N, adj_max = ``adj_max_frac`` N. The official fixed 1000 / 500 / 1000 are 0.13 / 0.065 /
  0.13 of GSM8K's N = 7,473 (and only about 2.5 % of DeepScaleR's 40K for sigma). rlsift's defaults
  (``gain.sigma_frac`` = 0.13, ``gain.step_frac`` = 0.05 in ``tasks/config/techniques.py``; adj_max_frac 0.13 here)
  take a slightly smaller step than the official ratio. Absolute values may be given instead.
* **gamma** (angle sensitivity): the code uses alpha for both terms, a secondary summary of the paper says
  gamma = 0.5. ``gamma=None`` means gamma = alpha (the code); rlsift runs ``gain.gamma`` = 0.5 (the paper's).
* ``angle_signal=None`` drops the angle term (when no online angle is measured).
* mu is clipped to [0, N - 1] (the code lets it run past the end, where only the last items keep mass).
* Probabilities are computed in float64 log space, so a window far from some ranks never gives NaN.
* :meth:`sample` draws without replacement by Gumbel-top-k on the log weights (the same distribution as the
  code's ``torch.multinomial(replacement=False)``, but it never runs out of positive-probability ranks when
  sigma is tiny) and returns the ranks sorted ascending, so a batch is visited in rank order, as in the code.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class GaussianWindowSampler:
    """A Gaussian window over rank positions 0..N-1 that slides toward lower angle concentration.

    The knobs the config sets are required keywords (defaults in ``tasks/config/techniques.py``, ``GainConfig``);
    the absolute forms and the clamp bounds, which the config does not set, keep their defaults here.

    Args:
        num_items: pool size N (rank positions).
        sigma_frac: sigma as a fraction of N (official 1000 on GSM8K's 7.5K, about 0.13).
        step_frac: n as a fraction of N (official 500 on 7.5K, about 0.065).
        alpha: accuracy sensitivity (official 2).
        beta: target accuracy in [0, 1] (official 0.5).
        gamma: angle sensitivity; ``None`` means ``alpha`` (official code); the paper's is said to be 0.5.
        sigma: absolute window width in rank positions, overriding ``sigma_frac * N`` when given.
        step_size: absolute n, the largest move per update from each term, overriding ``step_frac * N``.
        adj_min: smallest move per update (official 0: mu never moves backward).
        adj_max: largest move per update; ``None`` means ``adj_max_frac * N``.
        adj_max_frac: adj_max as a fraction of N (official 1000 on 7.5K, about 0.13).
        mu0: initial window centre (official 0).
    """

    def __init__(
        self,
        num_items: int,
        *,
        sigma_frac: float,
        step_frac: float,
        alpha: float,
        beta: float,
        gamma: float | None,
        sigma: float | None = None,
        step_size: float | None = None,
        adj_min: float = 0.0,
        adj_max: float | None = None,
        adj_max_frac: float = 0.13,
        mu0: float = 0.0,
    ) -> None:
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        self.num_items = int(num_items)
        self.sigma = float(sigma) if sigma is not None else sigma_frac * num_items
        self.step_size = float(step_size) if step_size is not None else step_frac * num_items
        self.adj_max = float(adj_max) if adj_max is not None else adj_max_frac * num_items
        self.adj_min = float(adj_min)
        self.alpha, self.beta = float(alpha), float(beta)
        self.gamma = self.alpha if gamma is None else float(gamma)
        for name, value in (("sigma", self.sigma), ("step_size", self.step_size), ("adj_min", self.adj_min),
                            ("adj_max", self.adj_max), ("alpha", self.alpha), ("beta", self.beta),
                            ("gamma", self.gamma), ("mu0", float(mu0))):
            if not math.isfinite(value):  # NaN would pass every comparison below and turn the window into NaN
                raise ValueError(f"{name} must be finite, got {value}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0 (give sigma or sigma_frac > 0), got {self.sigma}")
        if self.step_size < 0:
            raise ValueError(f"step_size must be >= 0, got {self.step_size}")
        if self.adj_min > self.adj_max:
            raise ValueError(f"adj_min ({self.adj_min}) must not exceed adj_max ({self.adj_max})")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"beta is a target accuracy and must lie in [0, 1], got {beta}")
        self.mu = min(max(float(mu0), 0.0), self.num_items - 1.0)
        self.last_delta = 0.0

    def rank_probs(self) -> torch.Tensor:
        """[N] float64 probability of each rank position (sums to 1)."""
        return torch.softmax(self._log_weights(), dim=0)

    def _log_weights(self) -> torch.Tensor:
        i = torch.arange(self.num_items, dtype=torch.float64)
        return -((i - self.mu) ** 2) / (2 * self.sigma**2)  # [N], finite however far from mu

    def probs(self, order: torch.Tensor) -> torch.Tensor:
        """Per-item probabilities, for use as a prior (e.g. in :func:`rlcore.selection.dots_weights`).

        Args:
            order: [N] int64 permutation, ``order[r]`` = item at rank r (highest concentration first).

        Returns:
            [N] float64, ``out[order[r]] = P(rank r)``.
        """
        order = torch.as_tensor(order, dtype=torch.long)
        if order.shape != (self.num_items,) or not torch.equal(torch.sort(order).values, torch.arange(self.num_items)):
            raise ValueError(f"order must be a permutation of 0..{self.num_items - 1}")
        out = torch.empty(self.num_items, dtype=torch.float64)
        out[order] = self.rank_probs()
        return out

    def sample(
        self, k: int, generator: torch.Generator | None = None, order: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Draw k distinct rank positions, returned in ascending rank order.

        Args:
            k: number of draws, 0 <= k <= N.
            generator: torch RNG.
            order: optional [N] ranking; if given, the items at the drawn ranks are returned instead.

        Returns:
            [k] int64 ranks ascending (or ``order`` at those ranks).
        """
        if not 0 <= k <= self.num_items:
            raise ValueError(f"k must be in [0, {self.num_items}], got {k}")
        u = torch.rand(self.num_items, dtype=torch.float64, generator=generator).clamp_min(1e-300)
        keys = self._log_weights() - torch.log(-torch.log(u))  # Gumbel-top-k in log space
        ranks = torch.sort(torch.topk(keys, k).indices).values
        if order is None:
            return ranks
        order = torch.as_tensor(order, dtype=torch.long)
        if order.shape != (self.num_items,):
            raise ValueError(f"order must have shape [{self.num_items}], got {tuple(order.shape)}")
        return order[ranks]

    def compute_delta(self, accuracy: float, angle_signal: float | None = None) -> float:
        """The clamped move of mu for an accuracy in [0, 1] and an optional mean online angle signal."""
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be a mean 0/1 reward in [0, 1], got {accuracy}")
        delta = self.step_size * math.tanh(self.alpha * (accuracy - self.beta))
        if angle_signal is not None:
            if not math.isfinite(angle_signal):
                raise ValueError(f"angle_signal must be finite, got {angle_signal}")
            delta += self.step_size * math.tanh(self.gamma * angle_signal)
        return min(max(delta, self.adj_min), self.adj_max)

    def update(self, accuracy: float, angle_signal: float | None = None) -> float:
        """Move the window now (no one-period lag). Returns the applied delta (before the [0, N-1] clip)."""
        delta = self.compute_delta(accuracy, angle_signal)
        self.mu = min(max(self.mu + delta, 0.0), self.num_items - 1.0)
        self.last_delta = delta
        return delta

    def metrics(self) -> dict[str, float]:
        """``gain/mu``, ``gain/mu_frac`` (mu / (N-1)), ``gain/sigma``, ``gain/delta``."""
        return {
            "gain/mu": self.mu,
            "gain/mu_frac": self.mu / max(self.num_items - 1, 1),
            "gain/sigma": self.sigma,
            "gain/delta": self.last_delta,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_items": self.num_items,
            "sigma": self.sigma,
            "step_size": self.step_size,
            "alpha": self.alpha,
            "beta": self.beta,
            "gamma": self.gamma,
            "adj_min": self.adj_min,
            "adj_max": self.adj_max,
            "mu": self.mu,
            "last_delta": self.last_delta,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_items"]) != self.num_items:
            raise ValueError(f"state is for {state['num_items']} items, this sampler has {self.num_items}")
        for key in ("sigma", "step_size", "alpha", "beta", "gamma", "adj_min", "adj_max", "mu", "last_delta"):
            setattr(self, key, float(state[key]))
