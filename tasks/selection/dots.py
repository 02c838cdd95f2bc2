"""DOTS's side of a round (docs/algorithms.md section 1.3): the pool's selection weights from the predictor's
success-rate predictions (``select.weighting``), and the metrics of the round's reference set and fit.

The :class:`~tasks.selection.selector.Selector` keeps the state these read (the predictions, the groups drawn so
far, each prompt's own evidence) and calls them each round.
"""

from __future__ import annotations

import torch

from rlcore.difficulty import AttentionDifficultyPredictor
from rlcore.selection import (
    dots_weights,
    informative_weights,
    observed_informative_weights,
    posterior_informative_weights,
)
from tasks.config import SelectConfig


def pool_weights(sc: SelectConfig, n: int, pred: torch.Tensor, prior: torch.Tensor | None, active: torch.Tensor, *,
                 evidence: tuple[torch.Tensor, torch.Tensor], concentration: float, seen_pred: list[float],
                 seen_informative: list[bool]) -> torch.Tensor:
    """[M] selection probabilities from the round's predictions (``select.weighting``).

    Args:
        sc: the run's ``select`` section; n: rollouts per group (``rollout.n``).
        pred: [M] predicted success rates (clamped to [0, 1] here).
        prior: [M] GAIN-RL's window prior (``gain.mode=prior``) or None; active: [M] bool, the prompts eligible
            this round.
        evidence: [M] each prompt's own discounted successes and trials at the round's start
            (``weighting=posterior``); concentration: the round's fitted Beta concentration (likewise).
        seen_pred, seen_informative: each drawn group's prediction when drawn and whether its rewards were
            unequal (``weighting=observed``; ``informative`` weights until the first group is seen).
    """
    pred = pred.clamp(0, 1)
    if sc.weighting == "target":
        return dots_weights(pred, alpha=sc.alpha, tau=sc.tau, prior=prior, mask=active)
    if sc.weighting == "posterior":
        return posterior_informative_weights(pred, n, *evidence, concentration=concentration, prior=prior,
                                             mask=active)
    if sc.weighting == "informative" or not seen_pred:
        return informative_weights(pred, n, prior=prior, mask=active)
    return observed_informative_weights(pred, n, torch.tensor(seen_pred), torch.tensor(seen_informative),
                                        bins=sc.observed_bins, strength=sc.observed_strength, prior=prior,
                                        mask=active)


def reference_metrics(predictor: AttentionDifficultyPredictor, labels: torch.Tensor, rollouts: int,
                      fit_stats: dict[str, float]) -> dict[str, float]:
    """A round's reference set: [K] success rates, the rollouts it cost, and the predictor's fit."""
    return {"select/ref_success": float(labels.mean()),
            "select/ref_effective": float(((labels > 0) & (labels < 1)).float().mean()),
            "select/predictor_trained": float(predictor.mode == "trained"),
            "select/labels": float(predictor.num_labels), "select/reference_rollouts": float(rollouts),
            **{f"select/{k_}": v for k_, v in fit_stats.items()}}
