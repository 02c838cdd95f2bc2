"""The seam through which a technique that acts inside a step reaches the plan (docs/algorithms.md section 9.5).

A technique of this kind changes which prompts a step draws (a weight on the draw: the pre-rollout skip,
rlcore/silent_skip.py), how a step spends its rollouts on them (the draw itself: per-prompt rollout budgets,
rlcore/rollout_budget.py) or what the likelihood screen's pass scores (the prescreen, rlcore/selection.py). It
describes itself to the plan (rlcore/plan_draw.py, rlcore/plan.py) with a :class:`StepRule`, built from its config
section by its one registration (tasks/training/techniques.py), which the training reads too. The plan then needs
no field and no branch of its own for it: it reads back the rule's weights on the draw (rlcore/plan_draw.py), the
candidates the screen's pass scores (:meth:`StepRule.screen_pass`) and, handing each rule a :class:`StepView` of
the reference set under the candidate's draw, a :class:`DrawOutcome` (rlcore/plan.py). A rule states only what it
changes: :class:`Unchanged` holds the answers of a rule that changes nothing. The training side meets such a
technique through :class:`PromptFilter` (the selection's per-prompt state), :class:`ScreenOrder` (which drawn
candidates the screen scores) or a draw of its own.

Shape letters: K reference prompts, C a step's drawn candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["DrawOutcome", "PromptFilter", "ScreenOrder", "StepRule", "StepView", "Unchanged"]


@dataclass(frozen=True)
class StepView:
    """What a rule sees of a candidate and the reference set: ``n`` rollouts a full group, ``m`` kept for the update,
    ``g`` reference rollouts a prompt and each one's ``successes`` [K]; ``estimate`` [K], the pass rate a run would
    estimate for each before rolling it out (the screen's likelihood, DOTS's level rate; NaN: none);
    ``kept`` [K], the draw's weights (after the screen); ``fresh``, B, the fresh groups the step is asked for."""

    n: int
    m: int
    g: int
    successes: torch.Tensor
    estimate: torch.Tensor
    kept: torch.Tensor
    fresh: float


@dataclass(frozen=True)
class DrawOutcome:
    """A step's fresh draw in expectation, as a rule that replaces the draw of B groups of n predicts it:
    ``calls``: its generate calls, each (prompts, rollouts a prompt, [K] where its rollouts go: weights over the
    reference set, for their lengths); ``generated`` rollouts; ``informative`` groups trained that are mixed;
    ``trained`` groups in all; ``rows`` the update's rows of the informative ones; ``screened``: prompts the draw
    selects (the screen scores f of them each)."""

    calls: tuple[tuple[float, int, torch.Tensor], ...]
    generated: float
    informative: float
    trained: float
    rows: float
    screened: float


class StepRule(Protocol):
    """A technique inside a step, as the plan predicts it (module docstring)."""

    name: str

    def weigh(self, successes: torch.Tensor, g: int, n: int, weights: torch.Tensor) -> torch.Tensor:
        """[K] the draw's ``weights`` over reference prompts with ``successes`` [K] of g, for groups of n, with this
        rule applied (unchanged: return ``weights``)."""
        ...

    def outcome(self, view: StepView) -> DrawOutcome | None:
        """The step's fresh draw when this rule replaces the draw of B groups of n (None: it does not)."""
        ...

    def screen_pass(self, f: int) -> int:
        """Candidates the screen's pass scores a prompt kept when the screen chooses among ``f`` (unchanged: f)."""
        ...


class Unchanged:
    """The answers of a :class:`StepRule` that changes nothing; a rule subclasses it and overrides what it changes."""

    def weigh(self, successes: torch.Tensor, g: int, n: int, weights: torch.Tensor) -> torch.Tensor:
        return weights

    def outcome(self, view: StepView) -> DrawOutcome | None:
        return None

    def screen_pass(self, f: int) -> int:
        return f


class ScreenOrder(Protocol):
    """Which of a step's drawn candidates the likelihood screen's pass scores (tasks/selection/screen.py), read
    before the pass from each candidate's last screened pass rate."""

    def pick(self, last: torch.Tensor, age: torch.Tensor, need: int) -> torch.Tensor:
        """[C'] increasing indices of the C drawn candidates to score, when the step keeps ``need`` of them;
        ``last`` [C] float64 each one's last screened pass rate (NaN: never screened), ``age`` [C] steps since."""
        ...


class PromptFilter(Protocol):
    """A technique's per-prompt state that the selection reads before each draw (tasks/selection/selector.py): it
    hears every measurement of a prompt and leaves prompts out of a draw. Checkpointed with the selector."""

    name: str

    def record(self, idx: list[int], counts: list[int], agree: list[bool]) -> None:
        """Prompts ``idx`` were measured: ``counts`` rollouts each, ``agree`` whether those all had one reward."""
        ...

    def keep(self, probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
        """[M] ``probs`` with the prompts left out of this draw at 0 (``probs`` itself when fewer than k would
        keep a weight)."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """Its metrics since the last call (the draw that just ended), then forget them."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
