"""The plan's choice (ours; docs/algorithms.md section 9.3): among the candidates rlcore/plan.py predicts, the
cheapest from here on (its steps, and its pool's scoring where it reads the scores) that keeps plain GRPO's signal,
and the run's predicted clock (:class:`RunClock`) that every place shows. What the run spent before the choice
(calibration, plan) is spent whatever is chosen, so it does not enter the choice; it does say which candidates the
probe need not measure further (:func:`out_of_reach`, docs/algorithms.md 9.1)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rlcore.plan import Prediction

#: Predicted step times within this share of the cheapest count as a tie, broken by the larger signal.
TIE = 0.05

__all__ = ["TIE", "RunClock", "choose", "dominated", "out_of_reach", "run_clock"]


@dataclass(frozen=True)
class RunClock:
    """A planned run's predicted clock against plain GRPO's: the one record the CLI, the ``plan`` artifact and
    ``plan.md``, the MLflow Description and tags and the run summary all show (:meth:`text`), two clearly named
    figures, each saying what it includes.

    ``training``: the chosen candidate's training clock over plain GRPO's (:attr:`Prediction.clock`, the figure
    :func:`choose`'s reason gives): its ``train.steps`` steps and the calibration and scoring it reads before
    them (``training_upfront_s`` seconds; 0 for one that reads none, as plain GRPO), predicted; ``with_plan``: the
    same steps with what this run spends before its first step in place of that prediction: ``upfront_s`` seconds of
    calibration and plan, measured, and the pool's scoring where the choice reads it, predicted (what the run's own
    clock is compared with). Plain GRPO's clock is its steps alone."""

    choice: str
    training: float
    with_plan: float
    upfront_s: float
    training_upfront_s: float = 0.0

    def text(self) -> str:
        """E.g. ``dots_screen: training clock predicted 0.92x plain GRPO's (its steps, calibration and scoring);
        1.07x with the plan's own cost (174 s before the first step: calibration and plan measured, scoring
        predicted)``."""
        its = "its steps, calibration and scoring" if self.training_upfront_s > 0 else "its steps"
        return (f"{self.choice}: training clock predicted {self.training:.2f}x plain GRPO's ({its}); "
                f"{self.with_plan:.2f}x with the plan's own cost ({self.upfront_s:.0f} s before the first step: "
                "calibration and plan measured, scoring predicted)")


def paid_text(clock: RunClock) -> str:
    """The clause of :func:`choose`'s reason that gives the clock with the plan's own cost, e.g. ``, 0.78x with the
    plan's own 18 s`` (:data:`PAID` finds it in a reason)."""
    return f", {clock.with_plan:.2f}x with the plan's own {clock.upfront_s:.0f} s"


#: :func:`paid_text` in a reason, whatever its figures: a run's final clock (its seconds spent after the choice too)
#: replaces the choice's where one line shows both (tasks/plan/record.py ``Plan.line``).
PAID = re.compile(r", \d+\.\d\dx with the plan's own \d+ s")


def run_clock(chosen: Prediction, base: Prediction, spent_s: float) -> RunClock:
    """The :class:`RunClock` of a run that trains ``chosen`` against plain GRPO's ``base`` after spending
    ``spent_s`` seconds on its calibration and plan, and then scoring its pool if ``chosen`` reads the scores
    (``chosen.scoring_s``, predicted). A prediction saved without a training clock (``base.train_s`` 0) gives the
    chosen candidate's own ``clock`` for both figures."""
    upfront_s = spent_s + chosen.scoring_s
    if base.train_s <= 0:
        return RunClock(chosen.name, chosen.clock, chosen.clock, upfront_s, chosen.upfront_s)
    steps_s = chosen.train_s - chosen.upfront_s
    return RunClock(chosen.name, chosen.train_s / base.train_s, (steps_s + upfront_s) / base.train_s, upfront_s,
                    chosen.upfront_s)


def _keeps_signal(p: Prediction, base: Prediction, min_signal: float) -> bool:
    return p.signal >= min_signal * base.signal - 1e-9


def _qualifies(p: Prediction, base: Prediction, min_signal: float) -> bool:
    """Whether :func:`choose` may take ``p``: it keeps the signal and its step is cheaper than ``base``'s."""
    return _keeps_signal(p, base, min_signal) and p.step_s < base.step_s


def _earns_back(p: Prediction, base: Prediction, plan_s: float) -> bool:
    """Whether ``p``'s clock with what the run spent before its first step is at most the baseline's (a prediction
    saved without a training clock has nothing to earn back with)."""
    return base.train_s <= 0 or run_clock(p, base, plan_s).with_plan <= 1


def out_of_reach(p: Prediction, base: Prediction, min_signal: float, plan_s: float) -> str | None:
    """Why the plan's probe stops measuring for ``p`` (tasks/plan/probe.py), or None.

    ``p`` is predicted with the costs not yet measured at 0 and ``plan_s`` is what the run has spent so far: every
    cost enters a prediction with a weight >= 0 (rlcore/plan.py), so ``p``'s step and clock can only grow, and its
    signal does not depend on costs. Out of reach: short of the signal or a step no cheaper than ``base``'s, which
    :func:`choose` could never take; or a clock that, with what the run has spent so far, does not come back under
    ``base``'s even with those costs at 0: a saving smaller than the planning it took, where measuring further
    would cost about as much again. ``base`` must need none of the costs not yet measured (its prediction is then
    exact). A candidate out of reach is not offered to :func:`choose` (tasks/plan/planner.py)."""
    if not _keeps_signal(p, base, min_signal):
        return (f"{p.signal / base.signal if base.signal else 0:.2f}x {base.name}'s informative contrasts a step, "
                f"under {min_signal:.0%}")
    if p.step_s >= base.step_s:
        return f"its step at least {p.step_s:.3g} s against {base.name}'s {base.step_s:.3g} s"
    if not _earns_back(p, base, plan_s):
        clock = run_clock(p, base, plan_s)
        return (f"at least {clock.with_plan:.2f}x {base.name}'s clock with the {clock.upfront_s:.0f} s "
                "spent before its first step")
    return None


def dominated(p: Prediction, exact: list[Prediction], base: Prediction, min_signal: float) -> str | None:
    """Why :func:`choose` can never take ``p``, a lower bound (its costs not yet measured at 0), against ``exact``,
    candidates predicted in full: one of them keeps the signal, has a step cheaper than ``base``'s and costs less from
    here on (:func:`_cost`) than ``p``'s lower bound by more than the tie margin. ``p``'s cost can only grow with the
    rest measured, so the cheapest qualifying candidate stays at most that rival's and ``p`` stays out of the tie
    (:data:`TIE`): exact, no estimate. None where no such rival exists."""
    rivals = [q for q in exact if _qualifies(q, base, min_signal)]
    if not rivals:
        return None
    rival = min(rivals, key=_cost)
    if _cost(p) <= (1 + TIE) * _cost(rival):
        return None
    return f"at least {_cost(p):.3g} s from here on against {rival.name}'s {_cost(rival):.3g} s, measured in full"


def _cost(p: Prediction) -> float:
    """What choosing ``p`` costs from here on: its steps, and the pool's scoring where it reads the scores (the
    calibration and the plan are spent whatever is chosen); a step's seconds for a prediction saved without a
    training clock."""
    return p.train_s - p.upfront_s + p.scoring_s if p.train_s > 0 else p.step_s


def choose(base: Prediction, predictions: list[Prediction], min_signal: float, plan_s: float = 0.0,
           work: tuple[Prediction, list[Prediction]] | None = None) -> tuple[Prediction, str]:
    """The prediction with the cheapest cost from here on (its steps, and its pool's scoring where it reads the
    scores: :func:`_cost`) whose signal is at least ``min_signal`` times the baseline's and whose step is cheaper;
    the baseline when none is, and why in one line. ``plan_s``, what the run spent on its calibration and plan,
    is spent whatever is chosen: the reason shows the clock with it (:class:`RunClock`'s ``with_plan``), the
    choice does not weigh it. ``work``: the same baseline and candidates (in order) predicted one after the other,
    ranked instead of ``predictions``, which the reason quotes (the plan compares the steps' work and predicts the
    clock the run will take: tasks/plan/planner.py)."""
    if not 0 <= min_signal <= 1:
        raise ValueError(f"min_signal must be in [0, 1], got {min_signal!r}")
    if not math.isfinite(plan_s) or plan_s < 0:
        raise ValueError(f"plan_s must be finite and >= 0, got {plan_s!r}")
    ranked_base, ranked = work if work is not None else (base, predictions)
    if [p.name for p in ranked] != [p.name for p in predictions]:
        raise ValueError("choose: work must predict the same candidates, in the same order, as predictions")
    qualify = [i for i, p in enumerate(ranked) if _qualifies(p, ranked_base, min_signal)]
    cheapest = min((_cost(ranked[i]) for i in qualify), default=_cost(ranked_base))
    best_i = max((i for i in qualify if _cost(ranked[i]) <= (1 + TIE) * cheapest), key=lambda i: ranked[i].signal,
                 default=None)
    if best_i is None:
        return base, (f"{base.name}: no candidate is predicted cheaper than plain GRPO with at least "
                      f"{min_signal:.0%} of its informative contrasts a step")
    best = predictions[best_i]
    slower = sorted((i for i in qualify if i != best_i), key=lambda i: _cost(ranked[i]))
    runner = f"; next {predictions[slower[0]].name} at {predictions[slower[0]].clock:.2f}x" if slower else ""
    clock = run_clock(best, base, plan_s)
    paid = paid_text(clock) if clock.upfront_s > 0 and base.train_s > 0 else ""
    return best, (f"{best.name}: predicted {best.clock:.2f}x plain GRPO's training clock{paid} with "
                  f"{best.signal / base.signal:.2f}x its informative contrasts a step (effective ratio "
                  f"{best.effective_ratio:.2f} against {base.effective_ratio:.2f}){runner}")
