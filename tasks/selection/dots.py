"""DOTS's side of a round (docs/algorithms.md section 1.3): the predictor (:func:`dots_predictor`), its reference set
and fit at the round's start (:func:`fresh_reference_round`: K reference prompts rolled out G times, half to fit and
half to score the fit; :func:`trained_reference_round`: the prompts measured since the last round), the pool's
selection weights from its success-rate predictions (``select.weighting``), and the metrics of the round's
reference set and fit.

The :class:`~tasks.selection.selector.Selector` keeps the state these read (the predictions, the labels, the groups
drawn so far, each prompt's own evidence) and calls them each round (through tasks/selection/rounds.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlcore.difficulty import AttentionDifficultyPredictor, pearson
from rlcore.seeding import derive_seed
from rlcore.selection import (
    dots_weights,
    informative_weights,
    observed_informative_weights,
    posterior_informative_weights,
)
from tasks.calibration.reference import Measure, random_reference, reference_rollouts
from tasks.config import Config, SelectConfig
from tasks.data.prompts import PromptRecord
from tasks.records.ledger import ReferenceRow

#: ``(pool indices [K], success rates [K], rollouts each, all agreed [K] bool) -> None``: the selector's record of a
#: measurement (its history, its last success rates, the prompt filters' evidence).
Record = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]


def dots_predictor(cfg: Config, dim: int, *, linear_recalibration: bool) -> AttentionDifficultyPredictor:
    """DOTS's predictor with the run's ``select.predictor`` settings (the estimate without DOTS,
    tasks/selection/rounds.py ``estimate_success``, uses only its attention)."""
    pc = cfg.select.predictor
    return AttentionDifficultyPredictor(
        dim, hidden=pc.hidden, layers=pc.layers, dropout=pc.dropout, tau_att=pc.tau_att, calibration=pc.calibration,
        linear_recalibration=linear_recalibration, min_labels=max(2, pc.min_labels), lr=pc.lr, seed=cfg.seed)


def fit_predictor(predictor: AttentionDifficultyPredictor, cfg: Config, round_: int) -> dict[str, float]:
    """Train the predictor's towers on every label so far, once it has ``select.predictor.min_labels``."""
    if predictor.num_labels < predictor.min_labels:
        return {}
    return predictor.fit(cfg.select.predictor.fit_steps,
                         torch.Generator().manual_seed(derive_seed(cfg.seed, round_, "fit")))


def fresh_reference_round(predictor: AttentionDifficultyPredictor, cfg: Config, pool: Sequence[PromptRecord],
                          emb: torch.Tensor, active: torch.Tensor, measure: Measure, record: Record, round_: int,
                          step: int) -> tuple[torch.Tensor, dict[str, float], list[ReferenceRow]]:
    """A round whose reference set is ``calibrate.k`` prompts drawn from the ``active`` [M] pool and rolled out
    ``calibrate.g`` times now: the predictor is labelled with the first half, fitted, scored on the other half
    (``select/pred_pearson``, held out of the fit), then labelled with the rest. Returns [M] the predicted success
    rates of every pool prompt (``emb`` [M, D]) with the whole reference set as context, the round's metrics, and
    the reference rows for the ledger; ``record`` hears the measurement."""
    ref = random_reference(active.nonzero().squeeze(1), cfg.calibrate.k, derive_seed(cfg.seed, round_, "reference"))
    k = len(ref)
    rewards = reference_rollouts(measure, pool, ref, cfg.calibrate.g, derive_seed(cfg.seed, round_, "ref-roll"))
    labels = rewards.float().mean(1)  # [K]
    record(ref, labels, cfg.calibrate.g, rewards.amax(1) == rewards.amin(1))
    half = k // 2
    fit, hold = ref[:half], ref[half:]
    predictor.observe(emb[fit], labels[:half], step)
    fit_stats = fit_predictor(predictor, cfg, round_)
    held_pred = predictor.predict(emb[hold], emb[fit], labels[:half])
    r = pearson(held_pred, labels[half:]) if len(hold) > 2 else float("nan")
    predictor.observe(emb[hold], labels[half:], step)
    pred = predictor.predict(emb, emb[ref], labels)
    rows = [ReferenceRow(round=round_, step=step, prompt_id=pool[int(i)].id, n=cfg.calibrate.g,
                         successes=int(round(float(y) * cfg.calibrate.g)), success_rate=float(y),
                         predicted=float(held_pred[j - half]) if j >= half else None)
            for j, (i, y) in enumerate(zip(ref.tolist(), labels.tolist(), strict=True))]
    mae = float((held_pred - labels[half:]).abs().mean()) if len(hold) else float("nan")
    return pred, {"select/pred_pearson": r, "select/pred_mae": mae,
                  **reference_metrics(predictor, labels, k * cfg.calibrate.g, fit_stats)}, rows


def trained_reference_round(predictor: AttentionDifficultyPredictor, cfg: Config, emb: torch.Tensor,
                            ref: torch.Tensor, labels: torch.Tensor, round_: int
                            ) -> tuple[torch.Tensor, dict[str, float]]:
    """A round whose reference set is the prompts measured since the last round (``calibrate.reference=trained``,
    already labelled): ``ref`` [K] pool indices, the latest measured first, and ``labels`` [K] their last success
    rates. Returns [M] the predictions of every pool prompt and the round's metrics."""
    fit_stats = fit_predictor(predictor, cfg, round_)
    pred = predictor.predict(emb, emb[ref], labels)
    return pred, {"select/reference_size": float(len(ref)), **reference_metrics(predictor, labels, 0, fit_stats)}


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
