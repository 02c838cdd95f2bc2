"""The one registration of each technique that acts inside a step: what the plan and the training read of it.

A technique of this kind (docs/algorithms.md section 9.5) is an algorithm in ``rlcore`` (its runtime state or rule,
and a :class:`rlcore.step_rules.StepRule` for the plan), a config section in ``tasks/config`` and one
:class:`Technique` here. The plan (tasks/plan/planner.py ``composition``) reads :func:`step_rules`; the training
reads :func:`step_draw` (the loop's draw), :func:`prompt_filters` (the selection's per-prompt state) and
:func:`screen_order` (which drawn candidates the screen's pass scores). Nothing else in the plan, the selection or
the loop names the technique.

Registered: per-prompt rollout budgets in two waves (``waves``; rlcore/rollout_budget.py, its draw
tasks/training/waves.py), the pre-rollout skip (``skip``; rlcore/silent_skip.py) and the screen's prescreen
(``prescreen``; rlcore/selection.py ``Prescreen``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlcore.rollout_budget import WaveRule
from rlcore.selection import Prescreen
from rlcore.silent_skip import SilentSkip, SkipRule
from rlcore.step_rules import PromptFilter, ScreenOrder, StepRule
from tasks.config import Config
from tasks.training.draw import sample_fresh
from tasks.training.waves import sample_waves

#: A step's draw: tasks/training/draw.py ``sample_fresh``'s signature.
DrawFn = Callable[..., object]


@dataclass(frozen=True)
class Technique:
    """One technique inside a step: ``on`` (from its config section), ``rule`` (what the plan predicts with),
    ``draw`` (the step's draw in place of ``sample_fresh``, or None), ``prompt_filter`` (its per-prompt state in
    the selection, built for a pool of M prompts, or None) and ``screen_order`` (which drawn candidates the screen's
    pass scores, or None); ``rule`` is built for a pool of M prompts (0: unknown)."""

    name: str
    on: Callable[[Config], bool]
    rule: Callable[[Config, int], StepRule]
    draw: DrawFn | None = None
    prompt_filter: Callable[[Config, int], PromptFilter] | None = None
    screen_order: Callable[[Config], ScreenOrder] | None = None


def _prescreen(cfg: Config, pool_size: int = 0) -> Prescreen:
    return Prescreen(cfg.select.prescreen, cfg.rollout.n, cfg.select.prescreen_half_life)


TECHNIQUES: tuple[Technique, ...] = (
    Technique("waves", on=lambda cfg: cfg.waves.enabled,
              rule=lambda cfg, m: WaveRule(cfg.waves.first, cfg.waves.candidates, cfg.waves.min_chance,
                                           cfg.waves.prior_strength, cfg.waves.carry),
              draw=sample_waves),
    Technique("skip", on=lambda cfg: cfg.skip.enabled,
              rule=lambda cfg, m: SkipRule(cfg.skip.explore, cfg.skip.cap, SkipRule.seen_share(
                  cfg.train.steps, cfg.train.prompts_per_step * (cfg.waves.candidates if cfg.waves.enabled else 1), m)),
              prompt_filter=lambda cfg, m: SilentSkip(m, cfg.rollout.n, explore=cfg.skip.explore, cap=cfg.skip.cap)),
    Technique("prescreen", on=lambda cfg: cfg.select.screen > 1 and cfg.select.prescreen > 0, rule=_prescreen,
              screen_order=_prescreen),
)


def active(cfg: Config) -> tuple[Technique, ...]:
    return tuple(t for t in TECHNIQUES if t.on(cfg))


def step_rules(cfg: Config, pool_size: int = 0) -> tuple[StepRule, ...]:
    """The plan's rules of the techniques ``cfg`` turns on, for a pool of ``pool_size`` prompts (0: unknown)."""
    return tuple(t.rule(cfg, pool_size) for t in active(cfg))


def step_draw(cfg: Config) -> DrawFn:
    """The step's draw: ``sample_fresh``, or the one technique's that replaces it (two that do: an error)."""
    draws = [t for t in active(cfg) if t.draw is not None]
    if len(draws) > 1:
        raise ValueError(f"{' and '.join(t.name for t in draws)} each replace a step's draw: turn on one")
    return draws[0].draw if draws else sample_fresh


def prompt_filters(cfg: Config, num_prompts: int) -> list[PromptFilter]:
    """The selection's per-prompt filters of the techniques ``cfg`` turns on, for a pool of ``num_prompts``."""
    return [t.prompt_filter(cfg, num_prompts) for t in active(cfg) if t.prompt_filter is not None]


def screen_order(cfg: Config) -> ScreenOrder | None:
    """Which drawn candidates the screen's pass scores: the one technique's that says (two: an error), else None
    (every one)."""
    orders = [t for t in active(cfg) if t.screen_order is not None]
    if len(orders) > 1:
        raise ValueError(f"{' and '.join(t.name for t in orders)} each order the screen's pass: turn on one")
    return orders[0].screen_order(cfg) if orders else None
