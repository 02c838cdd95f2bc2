"""ScalingRL: Data Effectiveness Score (DES) and an adaptive curriculum scheduler -- a RECONSTRUCTION.

Paper: Chen, Zhang, Liu, Lin, Yin, "Scale Down to Speed Up" (ScalingRL), Findings of EMNLP 2025,
pp. 7806-7817, doi 10.18653/v1/2025.findings-emnlp.412.

**Only the abstract of this paper is public and no code is known.** The abstract says DES ranks prompts by
problem difficulty, chain-of-thought complexity and reward adaptability, and that an adaptive curriculum
scheduler adjusts the scale and the mix of training prompts, balancing exploration of new challenging data
against exploitation of learned concepts. Every formula below is rlsift's labelled reconstruction
(docs/algorithms.md section 4.2), not the paper's method; replace it when the paper is obtained.

DES (per prompt, every component normalised to [0, 1] over the pool)::

    D = 1 - 2 |p - 0.5|   ("peak", the DOTS view)   or   1 - p   ("monotone", harder is better)
    C = log(1 + CoT length)        (e.g. reference-solution tokens)
    R = reward adaptability        (see reward_adaptability)
    DES = w_D D + w_C C + w_R R    (weights normalised to sum 1, default 1/3 each)

Scheduler (per round)::

    acc_bar = mean of the last ``window`` train accuracies on the active pool
    s       = +1 if acc_bar > theta_hi, -1 if acc_bar < theta_lo, else 0
    scale   = clip(scale * (1 + kappa s), s_min, s_max)              # active pool size
    rho     = clip(rho + rho_step * sign(prev_heldout - heldout), 0, 1)  # exploit share; up when held-out drops
    pool    = (1 - rho) * scale top-DES unseen prompts (explore) + rho * scale seen prompts whose success
              is still < theta_learned (exploit)

Choices (all ours):

* Normalisation is by rank by default (ties share their average rank, scaled to [0, 1]; a single prompt or a
  constant component gives 0.5), robust to the long tail of CoT lengths; ``normalise="minmax"`` is the other.
* Exploit prompts are drawn uniformly at random among the eligible ones (with the generator); explore takes
  the top DES deterministically (ties by lower index). If one side has too few candidates the other side
  fills the gap, and if both run short the rest of the pool fills by DES.
* The scale is kept as a float and rounded to a prompt count capped at the pool size; held-out accuracy is
  optional (rho stays put without it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

DIFFICULTY_FORMS = ("peak", "monotone")
NORMALISATIONS = ("rank", "minmax")


def _as_vector(x: Any, m: int | None, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if t.ndim != 1 or (m is not None and t.numel() != m) or t.numel() == 0:
        raise ValueError(
            f"{name} must be a non-empty 1-D tensor{'' if m is None else f' of length {m}'}, got shape {tuple(t.shape)}"
        )
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")
    return t


def rank_normalise(x: torch.Tensor) -> torch.Tensor:
    """Average ranks scaled to [0, 1] (ties share their mean rank; constant or length-1 input -> 0.5). [M] -> [M]."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.numel() == 1:
        return torch.full_like(x, 0.5)
    values, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each distinct value
    avg_rank = start.double() + (counts.double() - 1) / 2
    return avg_rank[inverse] / (x.numel() - 1) if values.numel() > 1 else torch.full_like(x, 0.5)


def minmax_normalise(x: torch.Tensor) -> torch.Tensor:
    """(x - min) / (max - min); constant input -> 0.5. [M] -> [M]."""
    x = torch.as_tensor(x, dtype=torch.float64)
    span = x.max() - x.min()
    return (x - x.min()) / span if float(span) > 0 else torch.full_like(x, 0.5)


def data_effectiveness_score(
    difficulty: torch.Tensor,
    cot_complexity: torch.Tensor,
    adaptability: torch.Tensor,
    *,
    weights: Sequence[float],
    difficulty_form: str,
    normalise: str = "rank",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reconstructed DES of every pool prompt (see the module docstring).

    Args:
        difficulty: [M] success rates p in [0, 1] (measured or predicted, e.g. by DOTS).
        cot_complexity: [M] non-negative CoT sizes, e.g. reference-solution token counts (log1p is taken).
        adaptability: [M] reward adaptability, e.g. from :func:`reward_adaptability`.
        weights: (w_D, w_C, w_R), non-negative, not all zero; normalised to sum 1 (``curriculum.weights``).
        difficulty_form: ``"peak"`` (1 - 2|p - 0.5|) or ``"monotone"`` (1 - p) (``curriculum.difficulty_form``).
        normalise: ``"rank"`` or ``"minmax"``.

    Returns:
        (des [M] float64 in [0, 1], parts) where parts has the normalised components ``"difficulty"``,
        ``"cot_complexity"`` and ``"adaptability"``, each [M].
    """
    if difficulty_form not in DIFFICULTY_FORMS:
        raise ValueError(f"difficulty_form must be one of {DIFFICULTY_FORMS}, got {difficulty_form!r}")
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise must be one of {NORMALISATIONS}, got {normalise!r}")
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (3,) or (w < 0).any() or float(w.sum()) <= 0 or not torch.isfinite(w).all():
        raise ValueError(f"weights must be three finite non-negative numbers, not all 0, got {tuple(weights)}")
    p = _as_vector(difficulty, None, "difficulty")
    m = p.numel()
    cot, ada = _as_vector(cot_complexity, m, "cot_complexity"), _as_vector(adaptability, m, "adaptability")
    if ((p < 0) | (p > 1)).any():
        raise ValueError("difficulty must be success rates in [0, 1]")
    if (cot < 0).any():
        raise ValueError("cot_complexity must be non-negative (e.g. token counts)")
    raw_d = 1 - 2 * (p - 0.5).abs() if difficulty_form == "peak" else 1 - p
    norm = rank_normalise if normalise == "rank" else minmax_normalise
    parts = {"difficulty": norm(raw_d), "cot_complexity": norm(torch.log1p(cot)), "adaptability": norm(ada)}
    w = w / w.sum()
    des = w[0] * parts["difficulty"] + w[1] * parts["cot_complexity"] + w[2] * parts["adaptability"]
    return des, parts


def reward_adaptability(history: Sequence[Sequence[float]], trend_weight: float = 0.5) -> torch.Tensor:
    """Proxy of "reward adaptability": how much a prompt's success rate can still move under training.

    Per prompt, with success rates p_1..p_n over its appearances (oldest first):

    * n = 0: 0.5, the largest value (an unseen prompt counts as fully adaptable);
    * n = 1: the Bernoulli std sqrt(p_n (1 - p_n)) (0 when always solved or always failed);
    * n >= 2: (1 - trend_weight) sqrt(p_n (1 - p_n)) + trend_weight min(|b|, 0.5), with b the least-squares
      slope of p over the appearance index (success change per appearance).

    Values lie in [0, 0.5].

    Returns:
        [M] float64.
    """
    if not 0 <= trend_weight <= 1:
        raise ValueError(f"trend_weight must lie in [0, 1], got {trend_weight}")
    out = []
    for q, rates in enumerate(history):
        r = [float(v) for v in rates]
        if any(not 0 <= v <= 1 for v in r):
            raise ValueError(f"history[{q}] has a success rate outside [0, 1]: {r}")
        if not r:
            out.append(0.5)
            continue
        spread = math.sqrt(r[-1] * (1 - r[-1]))
        if len(r) < 2:
            out.append(spread)
            continue
        t_mean, p_mean = (len(r) - 1) / 2, sum(r) / len(r)
        num = sum((t - t_mean) * (v - p_mean) for t, v in enumerate(r))
        den = sum((t - t_mean) ** 2 for t in range(len(r)))
        out.append((1 - trend_weight) * spread + trend_weight * min(abs(num / den), 0.5))
    return torch.tensor(out, dtype=torch.float64)


class CurriculumScheduler:
    """Reconstructed ScalingRL scheduler: sets the active pool's size (scale) and explore/exploit mix (rho).

    Every knob the config sets is a required keyword (its default lives in ``tasks/config/techniques.py``,
    ``CurriculumConfig``); only ``window`` has a default here.

    Args:
        pool_size: M, prompts in the full pool.
        s_min, s_max: bounds of the scale (active prompts), 1 <= s_min <= s_max (the abstract's 1.5K prompts
            suggest about 500 and 1500 at its scale).
        scale0: initial scale, in [s_min, s_max].
        kappa: relative scale change per round, >= 0.
        theta_lo, theta_hi: windowed train accuracy below/above which the pool shrinks/grows.
        theta_learned: a seen prompt with success >= this counts as learned and is not exploited.
        rho0: initial exploit share in [0, 1].
        rho_step: change of rho per held-out move, >= 0.
        window: number of recent train accuracies averaged, >= 1.
    """

    def __init__(
        self,
        pool_size: int,
        s_min: float,
        s_max: float,
        scale0: float,
        *,
        kappa: float,
        theta_lo: float,
        theta_hi: float,
        theta_learned: float,
        rho0: float,
        rho_step: float,
        window: int = 3,
    ) -> None:
        if pool_size < 1 or not 1 <= s_min <= s_max or not s_min <= scale0 <= s_max:
            raise ValueError(
                f"need pool_size >= 1 and 1 <= s_min <= scale0 <= s_max, got pool_size={pool_size}, "
                f"s_min={s_min}, scale0={scale0}, s_max={s_max}"
            )
        if kappa < 0 or rho_step < 0 or window < 1:
            raise ValueError(f"need kappa >= 0, rho_step >= 0, window >= 1, got {kappa}, {rho_step}, {window}")
        if not 0 <= theta_lo <= theta_hi <= 1 or not 0 <= theta_learned <= 1 or not 0 <= rho0 <= 1:
            raise ValueError("need 0 <= theta_lo <= theta_hi <= 1 and theta_learned, rho0 in [0, 1]")
        self.pool_size, self.s_min, self.s_max = int(pool_size), float(s_min), float(s_max)
        self.kappa, self.theta_lo, self.theta_hi = float(kappa), float(theta_lo), float(theta_hi)
        self.theta_learned, self.rho_step, self.window = float(theta_learned), float(rho_step), int(window)
        self.scale, self.rho = float(scale0), float(rho0)
        self.recent_acc: list[float] = []
        self.prev_heldout: float | None = None
        self.last_signal, self.last_explore, self.last_exploit = 0, 0, 0

    @property
    def active_size(self) -> int:
        """The scale rounded to a prompt count in [1, pool_size]."""
        return max(1, min(self.pool_size, round(self.scale)))

    def update(self, train_accuracy: float, heldout_accuracy: float | None = None) -> dict[str, float]:
        """Move scale with the windowed train accuracy and rho with the held-out trend; returns the metrics."""
        for name, v in (("train_accuracy", train_accuracy), ("heldout_accuracy", heldout_accuracy)):
            if v is not None and not 0 <= v <= 1:
                raise ValueError(f"{name} must lie in [0, 1], got {v}")
        self.recent_acc = (self.recent_acc + [float(train_accuracy)])[-self.window :]
        acc_bar = sum(self.recent_acc) / len(self.recent_acc)
        self.last_signal = 1 if acc_bar > self.theta_hi else (-1 if acc_bar < self.theta_lo else 0)
        self.scale = min(max(self.scale * (1 + self.kappa * self.last_signal), self.s_min), self.s_max)
        if heldout_accuracy is not None:
            if self.prev_heldout is not None and heldout_accuracy != self.prev_heldout:
                step = self.rho_step if heldout_accuracy < self.prev_heldout else -self.rho_step
                self.rho = min(max(self.rho + step, 0.0), 1.0)
            self.prev_heldout = float(heldout_accuracy)
        return self.metrics()

    def select_pool(
        self, des: torch.Tensor, seen: torch.Tensor, success: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """This round's active pool.

        Args:
            des: [M] DES of every prompt.
            seen: [M] bool, True for prompts trained on before.
            success: [M] latest success rate of each prompt (only read where ``seen``; NaN allowed elsewhere).
            generator: torch RNG for the exploit draw.

        Returns:
            [active_size] int64 distinct indices: explore prompts (by decreasing DES) then exploit prompts.
        """
        des = _as_vector(des, self.pool_size, "des")
        seen = torch.as_tensor(seen)
        success = torch.as_tensor(success, dtype=torch.float64)
        if seen.dtype != torch.bool or seen.shape != (self.pool_size,) or success.shape != (self.pool_size,):
            raise ValueError(
                f"seen must be bool [{self.pool_size}] and success [{self.pool_size}], got "
                f"{seen.dtype} {tuple(seen.shape)} and {tuple(success.shape)}"
            )
        if not ((success[seen] >= 0) & (success[seen] <= 1)).all():
            raise ValueError("success of seen prompts must lie in [0, 1]")
        n = self.active_size
        by_des = torch.sort(des, descending=True, stable=True).indices  # [M]
        unseen = by_des[~seen[by_des]]
        eligible = torch.nonzero(seen & (success < self.theta_learned)).flatten()
        eligible = eligible[torch.randperm(eligible.numel(), generator=generator)]
        n_exploit = min(round(self.rho * n), eligible.numel())
        n_explore = min(n - n_exploit, unseen.numel())
        n_exploit = min(n - n_explore, eligible.numel())  # exploit fills a shortage of unseen prompts
        explore, exploit = unseen[:n_explore], eligible[:n_exploit]
        chosen = torch.zeros(self.pool_size, dtype=torch.bool)
        chosen[explore] = True
        chosen[exploit] = True
        rest = by_des[~chosen[by_des]][: n - n_explore - n_exploit]  # both short: fill by DES
        self.last_explore, self.last_exploit = n_explore, n_exploit
        return torch.cat([explore, exploit, rest])

    def metrics(self) -> dict[str, float]:
        return {
            "curriculum/scale": self.scale,
            "curriculum/rho": self.rho,
            "curriculum/signal": float(self.last_signal),
            "curriculum/explore": float(self.last_explore),
            "curriculum/exploit": float(self.last_exploit),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "pool_size": self.pool_size,
            "scale": self.scale,
            "rho": self.rho,
            "recent_acc": list(self.recent_acc),
            "prev_heldout": self.prev_heldout,
            "last_signal": self.last_signal,
            "last_explore": self.last_explore,
            "last_exploit": self.last_exploit,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["pool_size"]) != self.pool_size:
            raise ValueError(f"state is for a pool of {state['pool_size']}, this scheduler has {self.pool_size}")
        self.scale, self.rho = float(state["scale"]), float(state["rho"])
        self.recent_acc = [float(v) for v in state["recent_acc"]][-self.window :]
        self.prev_heldout = None if state["prev_heldout"] is None else float(state["prev_heldout"])
        self.last_signal = int(state["last_signal"])
        self.last_explore, self.last_exploit = int(state["last_explore"]), int(state["last_exploit"])
