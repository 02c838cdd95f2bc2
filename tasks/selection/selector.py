"""Prompt selection, composed as docs/algorithms.md section 6 lays out: pool (ScalingRL) -> prompt (GAIN-RL, DOTS).

Each round (every ``train.round_steps`` = mu steps) starts with ScalingRL's active pool, GAIN-RL's window over it and
DOTS's predictions of the pool's success rates, which set the round's selection weights (tasks/selection/rounds.py,
tasks/selection/dots.py). Steps inside a round draw without replacement from the round's weights. With every
technique off the weights are uniform: plain GRPO.

**Likelihood screen** (``select.screen`` = f > 1, tasks/selection/screen.py; ours): each step draws f candidates per
prompt it needs from the weights above, estimates each candidate's pass rate as the policy's probability of its
worked solution (one forward pass) and keeps those whose groups are most likely to have unequal rewards
(``rlcore.selection.screen``); the rest stay available to the round's later steps. A registered technique may say
which drawn candidates the pass scores (rlcore/step_rules.py ``ScreenOrder``: the prescreen).

**Prompt filters** (rlcore/step_rules.py ``PromptFilter``, registered in tasks/training/techniques.py; the
pre-rollout skip, rlcore/silent_skip.py, GRESO arXiv 2506.02177): each hears every measurement of a prompt (the
calibration, DOTS's reference rollouts, every group, first waves included) and, before each step's draw, leaves
prompts out of it (the skip: a prompt whose last rollouts all agreed, with a chance that rises with its consecutive
agreeing rollouts). They act on the weights above, so the screen never scores a left-out prompt, and DOTS's predictor
still learns from every silent group (its labels); left-out prompts stay available to the round's later steps.
:meth:`Selector.estimate` gives each chosen prompt's best pass-rate estimate (the screen's, DOTS's, or its last
measured rate), which the per-prompt rollout budgets read (tasks/training/waves.py).

Every trained group's success rate over all its rollouts also labels the predictor (free labels); with
``calibrate.reference=trained`` (ours) those labels are the next round's reference set too (tasks/selection/rounds.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from rlcore.angle import angle_order
from rlcore.difficulty import pearson
from rlcore.seeding import derive_seed
from rlcore.selection import guard_picks, sample_prompts, uniform_weights
from rlcore.step_rules import PromptFilter, ScreenOrder
from tasks.calibration.record import Calibration
from tasks.calibration.reference import Measure
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.records.ledger import ReferenceRow, SelectionRow
from tasks.selection.dots import dots_predictor, pool_weights
from tasks.selection.features import Features
from tasks.selection.rounds import (
    curriculum_scheduler,
    dots_round,
    gain_window,
    gain_window_sampler,
    posterior_round,
    scalingrl_pool,
    weight_metrics,
    window_weights,
)
from tasks.selection.screen import Likelihood, ScreenScores, require_solutions


class Selector:
    """Chooses each step's fresh prompts and records why. Checkpointable (``state_dict``)."""

    def __init__(self, cfg: Config, pool: list[PromptRecord], features: Features,
                 likelihood: Likelihood | None = None, filters: Sequence[PromptFilter] = (),
                 screen_order: ScreenOrder | None = None, apart: bool = False, ahead_after_draw: bool = False):
        """``likelihood``: the current policy's :data:`~tasks.selection.screen.Likelihood`, needed when
        ``select.screen`` > 1 (every pool prompt then needs a worked solution); ``filters`` and ``screen_order``:
        the prompt filters and the screen's order of the techniques the run turns on (tasks/training/techniques.py);
        ``apart``: whether the rollouts are generated apart from the trainer (tasks/overlap/concurrent.py
        ``Sampler.apart``), so that the next step's selection work may run beside them where ``select.screen_ahead``
        and ``select.round_ahead`` say so (:meth:`lookahead`; after them: ``ahead_after_draw``, screen in sampler)."""
        self.cfg, self.pool, self.filters, self.ahead_after_draw = cfg, pool, list(filters), ahead_after_draw
        self.references: list[ReferenceRow] = []  # reference rows not yet in the ledger (take_references)
        m = len(pool)
        if cfg.select.screen > 1:
            if likelihood is None:
                raise ValueError(f"select.screen={cfg.select.screen} needs the policy's likelihood; none was given")
            require_solutions(pool)  # at start, not at the first step that draws such a prompt
        self.scores = (ScreenScores(likelihood, pool, n=cfg.rollout.n, order=screen_order)
                       if cfg.select.screen > 1 else None)  # by step
        self.screens_ahead = apart and cfg.select.screen > 1 and cfg.select.screen_ahead
        self.starts_ahead = apart and cfg.select.round_ahead
        self.started: tuple[int, dict[str, float]] | None = None  # a round started ahead: its index, its metrics
        self.asked: tuple[int, int] | None = None  # the last choose's (prompts, step), its first generation round
        if not features.scored and (cfg.select.method == "dots" or cfg.curriculum.enabled or cfg.gain.enabled):
            raise ValueError("DOTS, ScalingRL and GAIN-RL read the score stage's embeddings and angles; these "
                             "features are the tokenizer's alone (tasks/selection/features.py static_features)")
        self.scored = features.scored
        self.emb = features.emb.float()  # [M, D]
        self.angle = features.angle.float()  # [M]
        self.cot = features.cot.float()  # [M]
        self.history: list[list[float]] = [[] for _ in range(m)]
        self.last_success = torch.full((m,), float("nan"))
        self.pred = torch.full((m,), float("nan"))
        self.probs = uniform_weights(m)
        self.used = torch.zeros(m, dtype=torch.bool)
        self.info: dict[str, torch.Tensor] = {}
        self.round_acc: list[float] = []
        self.heldout_acc: float | None = None
        self.recent: list[int] = []  # pool indices measured since the round started (calibrate.reference=trained)
        self.seen_pred: list[float] = []  # select.weighting=observed: each drawn prompt's prediction when drawn,
        self.seen_informative: list[bool] = []  # ... and whether its group had unequal rewards
        self.own_successes = torch.zeros(m, dtype=torch.float64)  # [M] discounted successes of the prompt's rollouts
        self.own_trials = torch.zeros(m, dtype=torch.float64)  # [M] ... and their discounted count
        self.round_evidence = (self.own_successes.clone(), self.own_trials.clone())  # both at the round's start
        self.seen_groups: list[tuple[float, float, float, int, int]] = []  # weighting=posterior: each drawn group's
        # (prediction, own successes, own trials) when drawn, then (successes, n); rewards are 0 or 1
        self.concentration = float("nan")  # weighting=posterior: the round's fitted Beta concentration
        sc = cfg.select
        self.predictor = dots_predictor(cfg, self.emb.shape[1], linear_recalibration=sc.predictor.linear_recalibration
                                        ) if sc.method == "dots" else None
        self.scheduler = curriculum_scheduler(cfg, m) if cfg.curriculum.enabled else None
        self.order = angle_order(self.angle) if self.scored else torch.arange(m)  # rank -> pool index
        self.rank = torch.empty(m, dtype=torch.long)
        self.rank[self.order] = torch.arange(m)
        self.window = gain_window_sampler(cfg, m) if cfg.gain.enabled else None

    # ---- round ------------------------------------------------------------------------------------
    def begin_round(self, round_: int, step: int, measure: Measure) -> dict[str, float]:
        """Refresh predictions and pools for a new round; ``measure`` takes DOTS's reference rollouts, whose ledger
        rows wait in :meth:`take_references` (the loop writes them with the round's first step). A round already
        started ahead (:meth:`lookahead`) returns the metrics of its start."""
        started, self.started = self.started, None
        if started is not None and started[0] == round_:
            return started[1] | {"select/round_ahead": 1.0}
        return self._start_round(round_, step, measure) | ({"select/round_ahead": 0.0} if self.starts_ahead else {})

    def _start_round(self, round_: int, step: int, measure: Measure | None) -> dict[str, float]:
        """:meth:`begin_round`'s work (``measure`` None: the round takes no reference rollouts,
        :meth:`_needs_rollouts`): the active pool, the window over it, DOTS's predictions, the round's weights
        (tasks/selection/rounds.py)."""
        cfg, m = self.cfg, len(self.pool)
        metrics: dict[str, float] = {}
        active = torch.ones(m, dtype=torch.bool)
        if self.scheduler is not None:
            active, info, metrics = scalingrl_pool(cfg, self.scheduler, round_, self.round_acc, self.heldout_acc,
                                                   self.pred, self.emb, self.cot, self.history, self.last_success)
            self.info |= info
        self.round_acc = []
        prior = None
        if self.window is not None:
            active, prior, self.info["gain_window"], window_metrics = gain_window(
                cfg, self.window, self.order, active, dots=self.predictor is not None)
            metrics |= window_metrics
        if self.predictor is not None:
            trained, recent, self.recent = not self._needs_rollouts(), self.recent, []
            self.pred, dots_metrics, rows = dots_round(self.predictor, cfg, self.pool, self.emb, active, measure,
                                                       self._record, recent, self.last_success, round_, step,
                                                       trained=trained)
            self.references.extend(rows)
            metrics |= dots_metrics
            if cfg.select.weighting == "posterior":
                self.own_successes, self.own_trials, self.concentration = posterior_round(
                    cfg.select.posterior_decay, self.own_successes, self.own_trials, self.seen_groups)
                self.round_evidence = (self.own_successes.clone(), self.own_trials.clone())
                metrics["select/concentration"] = self.concentration
            self.probs = pool_weights(cfg.select, cfg.rollout.n, self.pred, prior, active,
                                      evidence=self.round_evidence, concentration=self.concentration,
                                      seen_pred=self.seen_pred, seen_informative=self.seen_informative)
        elif self.window is not None:
            self.probs = window_weights(self.info["gain_window"], active)
        else:
            self.probs = uniform_weights(m, mask=active)
        self.used = ~active
        return metrics | weight_metrics(self.probs, active)

    def take_references(self) -> list[ReferenceRow]:
        """The reference rows measured since the last call (and forget them)."""
        out, self.references = self.references, []
        return out

    def _needs_rollouts(self) -> bool:
        """Whether a round started now takes DOTS's reference rollouts (``calibrate.reference`` fresh, or trained
        with fewer than two prompts measured since the last round start)."""
        return self.predictor is not None and not (self.cfg.calibrate.reference == "trained"
                                                   and len(set(self.recent)) >= 2)

    def _record(self, idx: torch.Tensor, success: torch.Tensor, n: int | torch.Tensor,
                agree: torch.Tensor) -> None:
        """Success rates over n rollouts each (one count, or [K] per prompt) of the prompts ``idx`` [K], and ``agree``
        [K] bool, whether each one's rollouts all had one reward (the skip's evidence, rlcore.silent_skip)."""
        counts = torch.as_tensor(n).expand(len(idx)).tolist()
        for i, s, c in zip(idx.tolist(), success.tolist(), counts, strict=True):
            self.history[i].append(float(s))
            self.last_success[i] = s
            self.own_successes[i] += s * c
            self.own_trials[i] += c
        for f in self.filters:
            f.record(idx.tolist(), counts, agree.tolist())
        self.recent += idx.tolist()

    def seed_labels(self, calibration: Calibration) -> None:
        """Measurements from the calibrate stage: history, and the predictor's first labels."""
        t = torch.tensor(calibration.indices, dtype=torch.long)
        success = calibration.success.float()
        self._record(t, success, self.cfg.calibrate.g, (success == 0) | (success == 1))
        if self.predictor is not None:
            self.predictor.observe(self.emb[t], success, -1)

    # ---- step -------------------------------------------------------------------------------------
    def solved(self) -> torch.Tensor:
        """[M] bool: prompts whose last measured pass rate is 1 (``select.drop_solved`` keeps them out)."""
        return self.last_success == 1.0

    def _candidates(self, k: int, step: int, attempt: int, used: torch.Tensor
                    ) -> tuple[list[int], torch.Tensor, int, bool]:
        """A draw of k prompts from the state as it is: the guard's picks, the candidates drawn [C] (f per prompt
        still needed with the screen), how many of them the step keeps, and whether the round was exhausted (its
        ``used`` to clear). Changes nothing but the prompt filters' metrics."""
        cfg = self.cfg
        probs = self.probs
        if cfg.select.drop_solved:
            unsolved = torch.where(self.solved(), torch.zeros_like(probs), probs)
            if int((unsolved > 0).sum()) >= k:  # solved prompts come back only when too few unsolved remain
                probs = unsolved
        fresh = torch.where(used, torch.zeros_like(probs), probs)
        exhausted = int((fresh > 0).sum()) < k  # round exhausted: allow repeats within the round
        if exhausted:
            used = torch.zeros_like(used)
        else:
            probs = fresh
        for f in self.filters:
            probs = f.keep(probs, k, torch.Generator().manual_seed(
                derive_seed(cfg.seed, step, f.name, *((attempt,) if attempt else ()))))
        guard = guard_picks(self.solved() & ~used, round(cfg.guard.share * k), torch.Generator().manual_seed(
            derive_seed(cfg.seed, step, "guard"))) if attempt == 0 else []  # a step's first generation round only
        if guard:
            probs = probs.clone()
            probs[guard] = 0.0
        method = cfg.select.sampler if self.predictor is not None else "weighted"
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, step, "select", *((attempt,) if attempt else ())))
        positive = int((probs > 0).sum())
        need = min(k - len(guard), positive)
        drawn = sample_prompts(probs, min(cfg.select.screen * need, positive), gen, method=method)
        return guard, drawn, need, exhausted

    def choose(self, k: int, step: int, attempt: int = 0) -> tuple[list[int], list[SelectionRow]]:
        """k distinct prompts for this step, and a ledger row per prompt saying why.

        ``attempt``: the generation round within the step (dynamic sampling asks again); 0 draws exactly as a
        step without dynamic sampling does.
        """
        cfg = self.cfg
        guard, drawn, need, exhausted = self._candidates(k, step, attempt, self.used)
        if exhausted:
            self.used[:] = False
        if attempt == 0:
            self.asked = (k, step)
        if self.scores is not None:
            drawn = self.scores.choose(drawn, need, step, read_ahead=attempt == 0)
        idx = guard + drawn.tolist()
        self.used[idx] = True
        name = "+".join(n for n, on in (("scalingrl", self.scheduler is not None), ("gain", self.window is not None),
                                        ("dots", self.predictor is not None), ("screen", cfg.select.screen > 1))
                        if on) or "uniform"
        rows = [SelectionRow(prompt_id=self.pool[i].id, selector="guard" if j < len(guard) else name,
                             weight=float(self.probs[i]),
                             pred_success=_num(self.pred[i]), angle_score=_num(self.angle[i]),
                             gain_rank=int(self.rank[i]) if self.scored else None,
                             screen_success=self.scores.estimate(step, i) if self.scores is not None else None,
                             **{key: _num(self.info[key][i]) if key in self.info else None
                                for key in ("des", "des_difficulty", "des_cot", "des_adaptability")})
                for j, i in enumerate(idx)]
        return idx, rows

    def lookahead(self) -> Callable[[], None] | None:
        """The next step's selection work, to run beside this step's generate call (the sampler apart from the
        trainer; docs/algorithms.md 7.8):

        - ``select.round_ahead``, where the next step starts a round that takes no reference rollouts: the round's
          start (DOTS's predictor fitted on the labels observed so far, its predictions and the round's weights;
          ScalingRL's pool, GAIN-RL's window), one step's labels earlier than in the round's own first draw. That
          draw then reads the start's metrics (:meth:`begin_round`).
        - ``select.screen_ahead``: the screen's pass over the candidates the next step's draw would take if nothing
          changed before it (as many prompts as the last :meth:`choose` asked for), scored with the sampling
          weights of now, one update older than the next step's; at a round's first step only after its start ran
          ahead. That draw reads the scores of the candidates it does take and scores the others itself.

        None where there is nothing to run ahead: both off, the next step past the last, or it starts a round
        that cannot start ahead."""
        cfg = self.cfg
        if self.asked is None:
            return None
        k, step = self.asked[0], self.asked[1] + 1
        if step >= cfg.train.steps:
            return None
        starts = step % cfg.train.round_steps == 0
        start = starts and self.starts_ahead and not self._needs_rollouts()
        screen = self.screens_ahead and (start or not starts)
        if not (start or screen):
            return None

        def work() -> None:
            if start:
                self.started = (step // cfg.train.round_steps,
                                self._start_round(step // cfg.train.round_steps, step, None))
            if screen:
                kept = [f.state_dict() for f in self.filters]  # a look ahead: the filters' metrics stay as they are
                try:
                    _, drawn, need, _ = self._candidates(k, step, 0, self.used)
                finally:
                    for f, state in zip(self.filters, kept, strict=True):
                        f.load_state_dict(state)
                self.scores.score_ahead(step, self.scores.candidates(drawn, need, step).tolist())

        return work

    def take_filter_metrics(self) -> dict[str, float]:
        """The prompt filters' metrics since the last call (a draw reads them when it ends)."""
        out: dict[str, float] = {}
        for f in self.filters:
            out |= f.take_metrics()
        return out

    def estimate(self, idx: list[int], step: int) -> torch.Tensor:
        """[k] float64 the best estimate of each prompt ``idx`` step ``step`` chose: the screen's likelihood where the
        step screened it, else DOTS's prediction, else its last measured success rate, else NaN."""
        out = []
        for i in idx:
            if self.scores is not None and (q := self.scores.estimate(step, i)) is not None:
                out.append(q)
            elif not math.isnan(float(self.pred[i])):
                out.append(float(self.pred[i]))
            else:
                out.append(float(self.last_success[i]))
        return torch.tensor(out, dtype=torch.float64).clamp(0, 1)

    def observe(self, step: int, idx: list[int], rewards: list[torch.Tensor], accuracy: float,
                angle: float | None) -> dict[str, float]:
        """Feed back a step's outcome: ``rewards``, each drawn prompt's rewards [n_i] of all its rollouts (the same
        n for every prompt, or per-prompt budgets: rlcore/rollout_budget.py)."""
        success = torch.stack([r.float().mean() for r in rewards])
        agree = torch.tensor([bool(r.max() == r.min()) for r in rewards])
        counts = torch.tensor([r.numel() for r in rewards])
        t = torch.tensor(idx)
        if self.predictor is not None and self.cfg.select.weighting == "posterior":
            pred, (own_s, own_t) = self.pred[t].clamp(0, 1), self.round_evidence
            self.seen_groups += [(float(pred[j]), float(own_s[i]), float(own_t[i]), int(r.round().long().sum()),
                                  r.numel()) for j, (i, r) in enumerate(zip(idx, rewards, strict=True))]
        self._record(t, success, counts, agree)
        self.round_acc.append(accuracy)
        metrics: dict[str, float] = {}
        if self.predictor is not None:
            self.predictor.observe(self.emb[t], success, step)
            pred = self.pred[t]
            if self.cfg.select.weighting == "observed":
                self.seen_pred += pred.clamp(0, 1).tolist()
                self.seen_informative += (~agree).tolist()
            metrics["select/pred_success_mean"] = float(pred.mean())
            if len(idx) > 2:
                metrics["select/pred_pearson_trained"] = pearson(pred, success)
        if self.window is not None:
            self.window.update(accuracy, angle)
            metrics |= self.window.metrics()
        if self.scheduler is not None:
            metrics |= self.scheduler.metrics()
        if self.scores is not None:  # the screen's estimates against the pass rates its picks then showed
            metrics |= self.scores.metrics(step, idx, success)
        metrics["select/selected_success_mean"] = float(success.mean())
        return metrics

    def set_heldout_accuracy(self, acc: float) -> None:
        self.heldout_acc = acc

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"history": self.history, "last_success": self.last_success, "pred": self.pred, "probs": self.probs,
                "used": self.used, "info": self.info, "round_acc": self.round_acc, "heldout_acc": self.heldout_acc,
                "recent": self.recent, "seen_pred": self.seen_pred, "seen_informative": self.seen_informative,
                "own_successes": self.own_successes, "own_trials": self.own_trials,
                "round_evidence": self.round_evidence, "seen_groups": self.seen_groups,
                "concentration": self.concentration, "filters": {f.name: f.state_dict() for f in self.filters},
                "screen": self.scores.state_dict() if self.scores is not None else None, "started": self.started,
                "predictor": self.predictor.state_dict() if self.predictor is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "window": self.window.state_dict() if self.window is not None else None}

    def load_state_dict(self, s: dict) -> None:
        self.history, self.last_success, self.pred, self.probs = s["history"], s["last_success"], s["pred"], s["probs"]
        self.used, self.info, self.round_acc, self.heldout_acc = s["used"], s["info"], s["round_acc"], s["heldout_acc"]
        self.recent = s.get("recent", [])  # checkpoints written before calibrate.reference existed have none
        self.seen_pred, self.seen_informative = s.get("seen_pred", []), s.get("seen_informative", [])
        if "own_trials" in s:  # checkpoints written before weighting=posterior existed have none
            self.own_successes, self.own_trials = s["own_successes"], s["own_trials"]
            self.round_evidence, self.seen_groups = s["round_evidence"], s["seen_groups"]
            self.concentration = s["concentration"]
        if self.scores is not None:  # older checkpoints: only the scores ahead, or (before select.screen_ahead) none
            self.scores.load_state_dict(s.get("screen") or {"ahead": s.get("ahead", {})})
        self.started = s.get("started")  # ... and before select.round_ahead
        for f in self.filters:  # checkpoints written before prompt filters existed have none
            if f.name in s.get("filters", {}):
                f.load_state_dict(s["filters"][f.name])
        for name in ("predictor", "scheduler", "window"):
            obj = getattr(self, name)
            if obj is not None:
                obj.load_state_dict(s[name])


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v
