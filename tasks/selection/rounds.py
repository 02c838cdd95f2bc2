"""A round's start in prompt selection (docs/algorithms.md section 6): ScalingRL's active pool, GAIN-RL's window over
it, DOTS's predictions from the round's reference set (the predictor, its fit and its weights: tasks/selection/dots.py)
and the posterior weighting's evidence, and the round's weights without DOTS. The
:class:`~tasks.selection.selector.Selector` keeps the state these read (``seen_pred``, ``seen_groups``,
``own_successes``, ... below are its attributes) and calls them at each round's start (``Selector.begin_round``).

Each round (every ``train.round_steps`` = mu steps):

1. **ScalingRL** (``curriculum.enabled``; a labelled reconstruction, rlcore/curriculum.py): the scheduler
   moves the active pool's size with the train accuracy and the explore/exploit mix rho with the held-out
   accuracy (the training loop's ``eval.every`` evaluations, ``Selector.set_heldout_accuracy``; without
   them rho stays at ``curriculum.rho0``), and the pool is the top
   prompts by Data Effectiveness Score (difficulty from DOTS's predictions when on, else the last measured
   success rate) plus still-unlearned prompts seen before.
2. **GAIN-RL** (``gain.enabled``, rlcore/angle.py + rlcore/gain_sampler.py): a Gaussian window over the
   angle-concentration order. ``mode=gate`` keeps the ``gate_width`` share of the active pool with the
   highest window probability (DOTS then chooses inside the gate); ``mode=prior`` multiplies the selection
   weights by ``window_prob ** prior_lambda``. Without DOTS, prompts are drawn from the window itself.
3. **DOTS** (``select.method=dots``, rlcore/difficulty.py + rlcore/selection.py, tasks/selection/dots.py): K
   reference prompts drawn from the active pool are rolled out G times with the current policy; the predictor is
   labelled with half of them, fitted, scored on the other half (``select/pred_pearson``: held out of the fit),
   then labelled with the rest; the pool's success rates are predicted with the whole reference set as
   context and prompts are weighted by exp(-|d - alpha| / tau) (``select.weighting=target``), or by the chance
   that their group has unequal rewards (``informative``, rlcore.selection.informative_weights), or by that
   chance measured on the groups drawn so far at similar predictions (``observed``; each drawn group's
   prediction and outcome are kept in ``seen_pred`` / ``seen_informative``), or by that chance under a Beta
   posterior of each prompt's pass rate (``posterior``): the prediction is its mean, with a concentration
   fitted by maximum likelihood to the groups drawn so far (``seen_groups``), and the prompt's own earlier
   rollouts (``own_successes`` / ``own_trials``, times ``select.posterior_decay`` at each round start) are its
   evidence.

Every trained group's success rate over all its rollouts also labels the predictor (free labels). With
``calibrate.reference=trained`` (ours) those labels are the reference set too: a round's context is every
prompt measured since the last round started (round 0: the calibrate stage's), so a round rolls out nothing
for DOTS; the labels are up to mu steps old and the prompts are the ones selected, not a random draw, and
there is no held-out score at round start (``select/pred_pearson_trained`` scores the round's predictions
on the groups it then trained). With every technique off the weights are uniform: plain GRPO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlcore.curriculum import CurriculumScheduler, data_effectiveness_score, reward_adaptability
from rlcore.difficulty import AttentionDifficultyPredictor
from rlcore.gain_sampler import GaussianWindowSampler
from rlcore.pass_rate_posterior import fit_concentration
from rlcore.seeding import derive_seed
from tasks.calibration.reference import Measure
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.records.ledger import ReferenceRow
from tasks.selection.dots import Record, dots_predictor, fresh_reference_round, trained_reference_round


def curriculum_scheduler(cfg: Config, m: int) -> CurriculumScheduler:
    """ScalingRL's scheduler over a pool of m prompts with the run's ``curriculum`` settings; the pool's size never
    falls below a round's draws (``train.prompts_per_step`` x ``train.round_steps``, or the whole pool)."""
    cc = cfg.curriculum
    floor = min(m, cfg.train.prompts_per_step * cfg.train.round_steps)
    return CurriculumScheduler(
        m, s_min=max(floor, cc.s_min * m), s_max=max(floor, cc.s_max * m), scale0=max(floor, cc.scale0 * m),
        kappa=cc.kappa, theta_lo=cc.theta_lo, theta_hi=cc.theta_hi, theta_learned=cc.theta_learned,
        rho0=cc.rho0, rho_step=cc.rho_step)


def gain_window_sampler(cfg: Config, m: int) -> GaussianWindowSampler:
    """GAIN-RL's Gaussian window over a pool of m prompts with the run's ``gain`` settings."""
    gc = cfg.gain
    return GaussianWindowSampler(m, sigma_frac=gc.sigma_frac, step_frac=gc.step_frac, alpha=gc.alpha,
                                 beta=gc.beta, gamma=gc.gamma)


def estimate_success(cfg: Config, emb: torch.Tensor, last_success: torch.Tensor) -> torch.Tensor:
    """Success rates of every prompt without DOTS: measured where known, else DOTS's off-the-shelf attention
    over the prompts measured so far (calibration and trained groups), else 0.5."""
    known = ~torch.isnan(last_success)
    if not known.any():
        return torch.full_like(last_success, 0.5)
    attention = dots_predictor(cfg, emb.shape[1], linear_recalibration=False)
    est = attention.predict(emb, emb[known], last_success[known])
    return torch.where(known, last_success, est)


def scalingrl_pool(cfg: Config, scheduler: CurriculumScheduler, round_: int, round_acc: Sequence[float],
                   heldout_acc: float | None, pred: torch.Tensor, emb: torch.Tensor, cot: torch.Tensor,
                   history: Sequence[Sequence[float]], last_success: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """ScalingRL's active pool for round ``round_``: the scheduler first moves with the mean of the last round's train
    accuracies ``round_acc`` (none before the first round) and the held-out accuracy ``heldout_acc``, then picks the
    pool by Data Effectiveness Score (difficulty: DOTS's predictions ``pred`` [M] where made, else
    :func:`estimate_success`) plus still-unlearned prompts seen before (``history``, ``last_success`` [M]). Returns
    the pool [M] bool, the score and its parts [M] each (the selector's ``info``), and the metrics."""
    metrics: dict[str, float] = {}
    if round_acc:
        metrics |= scheduler.update(sum(round_acc) / len(round_acc), heldout_acc)
    difficulty = torch.where(torch.isnan(pred), estimate_success(cfg, emb, last_success), pred)
    des, parts = data_effectiveness_score(difficulty, cot, reward_adaptability(history),
                                          weights=cfg.curriculum.weights,
                                          difficulty_form=cfg.curriculum.difficulty_form)
    seen = torch.tensor([bool(h) for h in history])
    idx = scheduler.select_pool(des, seen, torch.nan_to_num(last_success, nan=0.0),
                                torch.Generator().manual_seed(derive_seed(cfg.seed, round_, "pool")))
    active = torch.zeros(len(last_success), dtype=torch.bool)
    active[idx] = True
    info = {"des": des, "des_difficulty": parts["difficulty"], "des_cot": parts["cot_complexity"],
            "des_adaptability": parts["adaptability"]}
    return active, info, metrics | scheduler.metrics() | {"curriculum/active": float(active.sum())}


def gain_window(cfg: Config, window: GaussianWindowSampler, order: torch.Tensor, active: torch.Tensor, *, dots: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """GAIN-RL's window at the round's start, over the angle-concentration ``order`` (rank -> pool index):
    ``gain.mode=gate``, and always without DOTS (``dots`` False), keeps the ``gain.gate_width`` share of the
    ``active`` [M] bool pool with the highest window probability (at least a round's draws); ``mode=prior`` keeps
    the pool and gives DOTS's weights the prior ``window_prob ** gain.prior_lambda``. Returns the pool, the prior
    (None with the gate), the window probability [M] of each pool prompt, and the window's metrics."""
    m = len(active)
    prior = None
    wprob = window.probs(order).float()  # [M] per pool item
    if cfg.gain.mode == "gate" or not dots:
        k = max(cfg.train.prompts_per_step * cfg.train.round_steps,
                math.ceil(cfg.gain.gate_width * int(active.sum())))
        keep = torch.topk(torch.where(active, wprob, torch.full_like(wprob, -1.0)), min(k, int(active.sum())))
        gate = torch.zeros(m, dtype=torch.bool)
        gate[keep.indices] = True
        active = active & gate
    else:
        prior = wprob.clamp_min(1e-300) ** cfg.gain.prior_lambda
    return active, prior, wprob, window.metrics()


def dots_round(predictor: AttentionDifficultyPredictor, cfg: Config, pool: Sequence[PromptRecord], emb: torch.Tensor,
               active: torch.Tensor, measure: Measure | None, record: Record, recent: Sequence[int],
               last_success: torch.Tensor, round_: int, step: int, *, trained: bool
               ) -> tuple[torch.Tensor, dict[str, float], list[ReferenceRow]]:
    """DOTS's side of the round start (tasks/selection/dots.py): the predictions ``pred`` of every pool prompt,
    from fresh reference rollouts or from the prompts measured since the last round.

    ``trained``: whether the round's reference set is the prompts ``recent`` measured since the last round (in the
    order measured; their last success rates ``last_success`` [M]), else ``calibrate.k`` prompts of the ``active``
    [M] bool pool rolled out now with ``measure`` (which ``record`` hears). Returns [M] the predictions, the round's
    metrics, and the reference rows for the ledger (none with ``trained``)."""
    recent = list(dict.fromkeys(reversed(recent)))  # latest measurement of each first
    if trained:
        ref = torch.tensor(recent)
        pred, metrics = trained_reference_round(predictor, cfg, emb, ref, last_success[ref].float(), round_)
        return pred, metrics, []
    if measure is None:
        raise RuntimeError(f"round {round_}: DOTS's reference rollouts need a measure; a round started ahead "
                           "takes none")
    return fresh_reference_round(predictor, cfg, pool, emb, active, measure, record, round_, step)


def posterior_round(decay: float, own_successes: torch.Tensor, own_trials: torch.Tensor,
                    seen_groups: Sequence[tuple[float, float, float, int, int]]
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``select.weighting=posterior`` at the round's start: each prompt's own evidence ``own_successes`` /
    ``own_trials`` [M] times ``select.posterior_decay`` (``decay``), and the Beta concentration fitted by maximum
    likelihood to the groups drawn so far (``seen_groups``: each one's prediction, own successes and own trials when
    drawn, then its successes and n)."""
    seen = torch.tensor(seen_groups, dtype=torch.float64).reshape(-1, 5)  # [N, 5]
    return own_successes * decay, own_trials * decay, fit_concentration(*seen.T)


def window_weights(wprob: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """[M] float64 the round's selection weights with GAIN-RL's window and without DOTS: the window probabilities
    ``wprob`` [M] over the ``active`` [M] bool pool, normalised."""
    probs = (wprob.double() * active).clamp_min(0)
    return probs / probs.sum()


def weight_metrics(probs: torch.Tensor, active: torch.Tensor) -> dict[str, float]:
    """The round's weights ``probs`` [M]: their entropy and how many pool prompts were eligible (``active`` [M])."""
    ent = -(probs[probs > 0] * probs[probs > 0].log()).sum()
    return {"select/entropy": float(ent), "select/eligible": float(active.sum())}
