"""A prompt's pass rate as a Beta posterior: DOTS's prediction as the prior, the prompt's own groups as evidence.

Ours, not a paper's. DOTS (arXiv 2506.05316, section 3.1) predicts one success rate p_hat per prompt and weighs
prompts by it as if it were the prompt's true pass rate. On the bundled task the predictions are right on average
and too narrow per prompt: prompts predicted near 0.5 are mostly solved or mostly failed, so the chance that
their group carries a gradient is far below 1 - p_hat^n - (1 - p_hat)^n (docs/algorithms.md section 7.7). This
module treats p_hat as the mean of a Beta prior whose concentration s is fitted to how the measured groups spread
around the predictions, and adds the prompt's own earlier groups as binomial evidence:

    p_q ~ Beta(a_q, b_q),   a_q = s * p_hat_q + k_q,   b_q = s * (1 - p_hat_q) + (t_q - k_q)

where k_q of t_q earlier rollouts of prompt q were right (discounted with age by the caller). A group of n
rollouts then has k successes with the beta-binomial chance

    P(k) = C(n, k) * B(k + a, n - k + b) / B(a, b)

and carries a gradient (rewards not all equal) with chance 1 - P(0) - P(n). A small s says the predictions are
vague, which makes 0 or n successes likely; a prompt whose own last group was mixed gets a posterior near its
measured rate and a high chance of a gradient, one whose last group was all right or all wrong a low one.

Letters: M prompts, N measured groups, n rollouts a group. Probabilities are float64.
"""

from __future__ import annotations

import math

import torch

#: Predictions are clamped to [EPS, 1 - EPS] so that both Beta parameters stay positive.
EPS = 1e-3
#: The concentrations :func:`fit_concentration` chooses from: 0.25 to 256, geometric, 41 values.
CONCENTRATION_GRID = tuple(0.25 * 2 ** (i / 4) for i in range(41))


def _evidence(pred: torch.Tensor, succ: torch.Tensor,
              trials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked float64 (clamped prediction, successes, failures), each [*]; a ValueError says what is wrong."""
    pred = torch.as_tensor(pred, dtype=torch.float64)
    succ = torch.as_tensor(succ, dtype=torch.float64)
    trials = torch.as_tensor(trials, dtype=torch.float64)
    if not (pred.shape == succ.shape == trials.shape):
        raise ValueError(f"pred, succ and trials must have one shape, got {tuple(pred.shape)}, {tuple(succ.shape)} "
                         f"and {tuple(trials.shape)}")
    if not ((pred >= 0) & (pred <= 1)).all():
        raise ValueError("pred must be success rates in [0, 1] (NaN not allowed)")
    if not ((succ >= 0) & (succ <= trials)).all():
        raise ValueError("own evidence must satisfy 0 <= succ <= trials (NaN not allowed)")
    return pred.clamp(EPS, 1 - EPS), succ, trials - succ


def _posterior(concentration: float, p: torch.Tensor, succ: torch.Tensor,
               fail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Beta posterior parameters (a, b) from checked evidence (:func:`_evidence`) and the prior's concentration."""
    if not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"concentration must be a positive number, got {concentration}")
    return concentration * p + succ, concentration * (1 - p) + fail


def _log_beta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)


def beta_binomial_log_pmf(k: torch.Tensor, n: torch.Tensor | int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[*] log P(k successes of n) when the pass rate is Beta(a, b).

    log C(n, k) + log B(k + a, n - k + b) - log B(a, b), with k, a, b broadcast together.
    """
    k = torch.as_tensor(k, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    log_choose = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    return log_choose + _log_beta(k + a, n - k + b) - _log_beta(a, b)


def informative_chance(pred: torch.Tensor, succ: torch.Tensor, trials: torch.Tensor, n: int, *,
                       concentration: float) -> torch.Tensor:
    """[M] chance that a new group of n rollouts has unequal rewards, 1 - P(0) - P(n), under each prompt's posterior.

    Args:
        pred: [M] predicted success rates in [0, 1] (DOTS's predictor).
        succ: [M] the prompt's own earlier successes (0 where never measured; may be fractional after discounting).
        trials: [M] the rollouts those successes came from, >= succ.
        n: rollouts a group (``rollout.n``), >= 2.
        concentration: s, the prior's pseudo-rollouts (> 0).
    """
    if n < 2:
        raise ValueError(f"n must be >= 2 (a group of one rollout never has unequal rewards), got {n}")
    a, b = _posterior(concentration, *_evidence(pred, succ, trials))
    none = beta_binomial_log_pmf(torch.zeros_like(a), n, a, b).exp()
    every = beta_binomial_log_pmf(torch.full_like(a, float(n)), n, a, b).exp()
    return (1.0 - none - every).clamp_min(0.0)


def fit_concentration(pred: torch.Tensor, succ: torch.Tensor, trials: torch.Tensor, k: torch.Tensor,
                      n: torch.Tensor, grid: tuple[float, ...] = CONCENTRATION_GRID) -> float:
    """The s in ``grid`` that maximises the beta-binomial likelihood of N measured groups.

    Args:
        pred: [N] the prediction each group's prompt had when it was drawn.
        succ, trials: [N] the prompt's own discounted evidence at that time (as in :func:`informative_chance`).
        k: [N] successes the group then had.
        n: [N] its rollouts (k <= n).
        grid: candidate concentrations, each > 0.

    Returns:
        The maximising s (the smallest on ties); ``grid``'s geometric middle when there are no groups.
    """
    k = torch.as_tensor(k, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    if k.shape != n.shape or k.shape != torch.as_tensor(pred).shape or not ((k >= 0) & (k <= n)).all():
        raise ValueError(f"k and n must match pred's shape with 0 <= k <= n, got {tuple(k.shape)} and {tuple(n.shape)}")
    if not grid or min(grid) <= 0:
        raise ValueError("grid must hold positive concentrations")
    if k.numel() == 0:
        return math.sqrt(min(grid) * max(grid))
    evidence = _evidence(pred, succ, trials)
    loglik = [float(beta_binomial_log_pmf(k, n, *_posterior(s, *evidence)).sum()) for s in grid]
    return grid[max(range(len(grid)), key=lambda i: (loglik[i], -i))]
