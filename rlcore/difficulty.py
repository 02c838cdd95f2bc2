"""DOTS attention-based adaptive-difficulty predictor.

Paper: Sun et al., "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through Difficulty-targeted
Online Data Selection and Rollout Replay", arXiv 2506.05316 (NeurIPS 2025); official code
github.com/ASTRAL-Group/data-efficient-llm-rl (``adaptive_difficulty_prediction/model.py``,
``rl_training/.../teacher_utils.py``). Summary: docs/algorithms.md section 1.2.

The prediction for a query prompt q is an attention-weighted mean of the *measured* success rates y_i of K
reference prompts (rolled out with the current policy)::

    s_i   = <P_ref(z_i), P_q(z_q)> / sqrt(hidden)            # two separate projection towers
    a     = softmax_i(s_i / tau_att)
    p_raw = sum_i a_i * y_i
    temp, bias from MLP(2->10->2) on [mean(y), std(y)]:  temp = clamp(softplus(o1), 0.01, 10), bias = tanh(o2)
    p     = sigmoid(logit(clamp(p_raw, 1e-4, 1-1e-4)) / temp + bias)   # code option scaling=group_logit_temp

Choices and deviations (from the paper and the official code):

* **Online training instead of an offline multi-model corpus.** DOTS trains the towers once, offline, on
  pass rates of many LLMs disjoint from the policy. We have no such corpus, so the predictor keeps a bounded
  label store of (embedding, measured success rate, step) filled by :meth:`observe` (newest kept), and
  :meth:`fit` trains towers and calibration head with BCE on the soft labels by repeatedly splitting stored
  examples into a pseudo-reference set and queries. The official pairing "query labelled by the same model
  as its references" becomes "query labelled at the same step (policy snapshot) as its references"
  (``pair_window`` steps apart at most; ``None`` mixes the whole store).
* **Off-the-shelf mode.** Until :meth:`fit` has run with at least ``min_labels`` stored labels,
  :meth:`predict` uses attention over the raw embeddings with cosine / sqrt(D) scores, no towers and no
  calibration head (the paper's "off-the-shelf embedding" baseline, Table 2, which uses the raw dot product;
  the cosine makes it invariant to embedding scale). :attr:`mode` says which path is active.
* **Optimiser.** Adam at a constant lr (``select.predictor.lr``, 1e-3; official: Adam 1e-3 with warmup and
  linear decay over 20 offline epochs); the optimiser state persists across :meth:`fit` calls and in the
  state dict.
* **Size.** rlsift's towers are ``select.predictor.hidden`` = 64, ``select.predictor.layers`` = 2 (official
  896 and 3, for 1536-d embeddings and a large corpus); ``layers`` counts the Linear layers of a tower:
  LayerNorm -> [Linear -> GELU -> Dropout] x (layers-1) -> Linear -> LayerNorm.
* **std of the reference labels** is the unbiased ``torch.std`` as in the code (the paper writes the
  population std); it is 0 when K = 1.
* **Linear recalibration** (code only, not in the paper; ``linear_recalibration=True``): fit y = a x + b by
  least squares, x = predictions for the reference prompts themselves (attending over the reference set,
  as the code predicts for all prompts including the reference ones), map every prediction through the line
  and then **clip to [0, 1]** (the code does not clip). When the reference predictions are constant the
  line is undefined and predictions are left unchanged. Applied in both modes, never during training.
* ``calibration="none"`` drops the head (the raw attention mean is already in [0, 1]); the code's other
  heads (``platt``, ``temperature``) are not implemented. ``top_k`` keeps the k best-scoring references
  (official option, off by default).
* Labels are success rates (as the code); the paper's failure rate is 1 - p, and the 0.5 target is symmetric.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_EPS_CLAMP = 1e-4
CALIBRATIONS = ("group_logit_temp", "none")


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two equal-length 1-D tensors (computed in float64).

    Returns NaN when either input is constant (the correlation is undefined there).
    """
    x = torch.as_tensor(x, dtype=torch.float64).flatten()
    y = torch.as_tensor(y, dtype=torch.float64).flatten()
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"pearson needs two tensors of equal length >= 2, got {x.numel()} and {y.numel()}")
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    return float((xc * yc).sum()) / denom if denom > 0 else float("nan")


def _tower(dim: int, hidden: int, layers: int, dropout: float) -> nn.Sequential:
    mods: list[nn.Module] = [nn.LayerNorm(dim)]
    width = dim
    for _ in range(layers - 1):
        mods += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
        width = hidden
    mods += [nn.Linear(width, hidden), nn.LayerNorm(hidden)]
    return nn.Sequential(*mods)


def _attention_mean(scores: torch.Tensor, ref_labels: torch.Tensor, tau: float, top_k: int | None) -> torch.Tensor:
    """softmax(scores / tau) over references [M, K], then the weighted mean of the labels [K] -> [M]."""
    scores = scores / tau
    if top_k is not None and top_k < scores.shape[1]:
        kth = scores.topk(top_k, dim=1).values[:, -1:]  # [M, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.softmax(scores, dim=1) @ ref_labels  # [M]


class AttentionDifficultyPredictor(nn.Module):
    """Predicts per-prompt success rates under the current policy from embeddings and a labelled reference set.

    The knobs the config sets are required keywords (defaults in ``tasks/config/select.py``, ``PredictorConfig``;
    ``seed`` is the run's ``seed``); the label store and episode sizes, which it does not set, keep theirs here.

    Args:
        dim: embedding dimension D.
        hidden: width of the projection towers (official 896).
        layers: Linear layers per tower (official 3).
        dropout: dropout inside the towers (official 0.1).
        tau_att: attention temperature (official 1.0).
        calibration: ``"group_logit_temp"`` (official head) or ``"none"``.
        linear_recalibration: apply the code-only least-squares line fitted on the reference prompts.
        min_labels: stored labels needed before :meth:`fit` trains (and the trained path is used).
        max_labels: capacity of the label store; the oldest examples are dropped first.
        ref_size: pseudo-reference set size K per training episode (capped at half the candidates).
        batch_size: queries per training episode.
        lr: Adam learning rate.
        pair_window: references and queries of an episode are labelled at most this many steps apart
            (``None``: any stored labels).
        top_k: keep only the k best-scoring references in the attention (``None``: all, official default).
        seed: seeds the initial weights.
    """

    def __init__(
        self,
        dim: int,
        *,
        hidden: int,
        layers: int,
        dropout: float,
        tau_att: float,
        calibration: str,
        linear_recalibration: bool,
        min_labels: int,
        lr: float,
        seed: int,
        max_labels: int = 8192,
        ref_size: int = 64,
        batch_size: int = 128,
        pair_window: int | None = 0,
        top_k: int | None = None,
    ) -> None:
        super().__init__()
        if dim < 1 or hidden < 1 or layers < 1:
            raise ValueError(f"dim, hidden and layers must be >= 1, got {dim}, {hidden}, {layers}")
        if calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
        if tau_att <= 0 or not 0 <= dropout < 1:
            raise ValueError(f"need tau_att > 0 and 0 <= dropout < 1, got {tau_att}, {dropout}")
        if min_labels < 2 or max_labels < min_labels:
            raise ValueError(f"need 2 <= min_labels <= max_labels, got {min_labels}, {max_labels}")
        if ref_size < 1 or batch_size < 1 or lr <= 0:
            raise ValueError(f"ref_size, batch_size and lr must be positive, got {ref_size}, {batch_size}, {lr}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {top_k}")
        self.dim, self.hidden, self.tau_att = dim, hidden, tau_att
        self.calibration, self.linear_recalibration = calibration, linear_recalibration
        self.min_labels, self.max_labels = min_labels, max_labels
        self.ref_size, self.batch_size, self.pair_window, self.top_k = ref_size, batch_size, pair_window, top_k
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.query_tower = _tower(dim, hidden, layers, dropout)
            self.ref_tower = _tower(dim, hidden, layers, dropout)
            self.calib_head = nn.Sequential(nn.Linear(2, 10), nn.ReLU(), nn.Linear(10, 2))
        # foreach: one call a step over the 20 small tensors (the per-tensor loop was a quarter of a fit's time; a
        # fit of 100 steps 165 ms against 177 ms); the same element-wise kernels, so the same bits
        # (tests/rlcore/test_difficulty.py)
        self._optimizer = torch.optim.Adam(self.parameters(), lr=lr, foreach=True)
        self._store_emb = torch.zeros(0, dim)
        self._store_y = torch.zeros(0)
        self._store_step = torch.zeros(0, dtype=torch.long)
        self._observe_calls = 0
        self._fit_steps = 0
        self._trained = False

    # ------------------------------------------------------------------ label store
    @property
    def mode(self) -> str:
        """``"trained"`` once :meth:`fit` has trained on >= ``min_labels`` labels, else ``"off_the_shelf"``."""
        return "trained" if self._trained else "off_the_shelf"

    @property
    def num_labels(self) -> int:
        return int(self._store_y.numel())

    def observe(self, emb: torch.Tensor, labels: torch.Tensor, step: int | None = None) -> None:
        """Append labelled examples to the store (oldest dropped beyond ``max_labels``).

        Args:
            emb: [M, D] prompt embeddings.
            labels: [M] measured success rates in [0, 1].
            step: the training step whose policy produced the labels (default: the number of earlier calls).
        """
        emb, labels = self._check_emb(emb, "emb"), self._check_labels(labels, "labels")
        if emb.shape[0] != labels.shape[0]:
            raise ValueError(f"emb has {emb.shape[0]} rows but labels has {labels.shape[0]}")
        step = self._observe_calls if step is None else int(step)
        self._observe_calls += 1
        steps = torch.full((labels.numel(),), step, dtype=torch.long)
        self._store_emb = torch.cat([self._store_emb, emb])[-self.max_labels :]
        self._store_y = torch.cat([self._store_y, labels])[-self.max_labels :]
        self._store_step = torch.cat([self._store_step, steps])[-self.max_labels :]

    # ------------------------------------------------------------------ model
    def forward(self, query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_labels: torch.Tensor) -> torch.Tensor:
        """Trained path (towers + calibration head), differentiable.

        Args:
            query_emb: [M, D]. ref_emb: [K, D]. ref_labels: [K] success rates in [0, 1].

        Returns:
            [M] predicted success rates in (0, 1).
        """
        q = self.query_tower(query_emb)  # [M, h]
        r = self.ref_tower(ref_emb)  # [K, h]
        p = _attention_mean(q @ r.T / math.sqrt(self.hidden), ref_labels, self.tau_att, self.top_k)  # [M]
        if self.calibration == "none":
            return p
        std = ref_labels.std() if ref_labels.numel() > 1 else ref_labels.new_zeros(())
        o = self.calib_head(torch.stack([ref_labels.mean(), std]))  # [2]
        temp = F.softplus(o[0]).clamp(0.01, 10.0)
        bias = torch.tanh(o[1])
        return torch.sigmoid(torch.logit(p.clamp(_EPS_CLAMP, 1 - _EPS_CLAMP)) / temp + bias)

    def _off_the_shelf(self, query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_labels: torch.Tensor) -> torch.Tensor:
        cos = F.normalize(query_emb, dim=1) @ F.normalize(ref_emb, dim=1).T  # [M, K]
        return _attention_mean(cos / math.sqrt(self.dim), ref_labels, self.tau_att, self.top_k)

    @torch.no_grad()
    def predict(self, query_emb: torch.Tensor, ref_emb: torch.Tensor, ref_labels: torch.Tensor) -> torch.Tensor:
        """Predicted success rates of the query prompts given a reference set with measured success rates.

        Args:
            query_emb: [M, D] embeddings of the prompts to score.
            ref_emb: [K, D] embeddings of the reference prompts (K >= 1).
            ref_labels: [K] their measured success rates in [0, 1].

        Returns:
            [M] float32 predicted success rates in [0, 1].
        """
        query_emb, ref_emb = self._check_emb(query_emb, "query_emb"), self._check_emb(ref_emb, "ref_emb")
        ref_labels = self._check_labels(ref_labels, "ref_labels")
        if ref_emb.shape[0] != ref_labels.shape[0] or ref_emb.shape[0] == 0:
            raise ValueError(
                f"need K >= 1 references with one label each, got {ref_emb.shape[0]} and {ref_labels.shape[0]}"
            )
        was_training = self.training
        self.eval()
        try:
            fn = self.forward if self._trained else self._off_the_shelf
            pred = fn(query_emb, ref_emb, ref_labels)
            if self.linear_recalibration:
                x = fn(ref_emb, ref_emb, ref_labels).double()  # [K] predictions for the references
                y = ref_labels.double()
                var = ((x - x.mean()) ** 2).sum()
                if ref_labels.numel() > 1 and float(var) > 1e-12:
                    a = ((x - x.mean()) * (y - y.mean())).sum() / var
                    b = y.mean() - a * x.mean()
                    pred = (a * pred.double() + b).clamp(0.0, 1.0).float()
        finally:
            self.train(was_training)
        return pred.clamp(0.0, 1.0)

    # ------------------------------------------------------------------ training
    def fit(self, steps: int, generator: torch.Generator | None = None) -> dict[str, float]:
        """Train towers and calibration head online on the label store.

        Each step draws an anchor example, takes the stored examples labelled within ``pair_window`` steps of
        it, splits them at random into K pseudo-references and up to ``batch_size`` queries, and takes one
        Adam step on BCE(predicted, measured) of the queries. Does nothing while fewer than ``min_labels``
        labels are stored.

        Args:
            steps: number of optimiser steps.
            generator: source of the random splits and of dropout (via a derived seed); ``None`` uses a
                generator seeded with the number of steps trained so far.

        Returns:
            Metrics: ``difficulty/fit_loss`` (mean BCE over the steps), ``difficulty/fit_steps``,
            ``difficulty/num_labels``, ``difficulty/trained`` (1.0 or 0.0).
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        n = self.num_labels
        out = {"difficulty/num_labels": float(n), "difficulty/fit_steps": 0.0, "difficulty/fit_loss": float("nan")}
        if n < self.min_labels or steps == 0:
            out["difficulty/trained"] = float(self._trained)
            return out
        gen = generator if generator is not None else torch.Generator().manual_seed(self._fit_steps)
        losses = []
        was_training = self.training
        self.train()
        try:
            with torch.random.fork_rng(devices=[]):  # dropout draws from a seed derived from `gen`
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
                for _ in range(steps):
                    ref_idx, q_idx = self._split(gen)
                    y_ref = self._store_y[ref_idx]
                    pred = self.forward(self._store_emb[q_idx], self._store_emb[ref_idx], y_ref)
                    loss = F.binary_cross_entropy(pred.clamp(1e-6, 1 - 1e-6), self._store_y[q_idx])
                    self._optimizer.zero_grad(set_to_none=True)
                    loss.backward()  # type: ignore[no-untyped-call]
                    self._optimizer.step()
                    losses.append(loss.item())
        finally:
            self.train(was_training)
        self._fit_steps += steps
        self._trained = True
        out.update(
            {
                "difficulty/fit_steps": float(steps),
                "difficulty/fit_loss": sum(losses) / len(losses),
                "difficulty/trained": 1.0,
            }
        )
        return out

    def _split(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_labels
        cand = torch.arange(n)
        if self.pair_window is not None:
            anchor = int(torch.randint(0, n, (1,), generator=gen))
            near = (self._store_step - self._store_step[anchor]).abs() <= self.pair_window
            if int(near.sum()) >= 2:  # otherwise fall back to the whole store
                cand = cand[near]
        cand = cand[torch.randperm(cand.numel(), generator=gen)]
        k = min(self.ref_size, cand.numel() // 2)
        return cand[:k], cand[k : k + self.batch_size]

    # ------------------------------------------------------------------ checks and state
    def _check_emb(self, emb: torch.Tensor, name: str) -> torch.Tensor:
        emb = torch.as_tensor(emb).detach().float()
        if emb.ndim != 2 or emb.shape[1] != self.dim:
            raise ValueError(f"{name} must have shape [*, {self.dim}], got {tuple(emb.shape)}")
        if not torch.isfinite(emb).all():
            raise ValueError(f"{name} contains NaN or inf")
        return emb

    @staticmethod
    def _check_labels(labels: torch.Tensor, name: str) -> torch.Tensor:
        labels = torch.as_tensor(labels).detach().float()
        if labels.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(labels.shape)}")
        if not ((labels >= 0) & (labels <= 1)).all():
            raise ValueError(f"{name} must be success rates in [0, 1] (NaN not allowed)")
        return labels

    def get_extra_state(self) -> dict[str, Any]:
        """Label store, mode, counters and optimiser state (saved in ``state_dict()['_extra_state']``)."""
        return {
            "store_emb": self._store_emb.clone(),
            "store_y": self._store_y.clone(),
            "store_step": self._store_step.clone(),
            "observe_calls": self._observe_calls,
            "fit_steps": self._fit_steps,
            "trained": self._trained,
            "optimizer": self._optimizer.state_dict(),
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        shape = tuple(state["store_emb"].shape)
        if len(shape) != 2 or shape[1] != self.dim:
            raise ValueError(f"stored embeddings have shape {shape}, expected [*, {self.dim}]")
        self._store_emb = state["store_emb"].clone()
        self._store_y = state["store_y"].clone()
        self._store_step = state["store_step"].clone()
        self._observe_calls = int(state["observe_calls"])
        self._fit_steps = int(state["fit_steps"])
        self._trained = bool(state["trained"])
        self._optimizer.load_state_dict(state["optimizer"])
