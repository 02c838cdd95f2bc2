"""The benchmark's arms and how each is configured: the user presets and the experimental arms, the ``-sync`` arms,
the baseline, the leave-one-out arms, the benchmark's defaults, the config of one arm x seed, and the plan's
prediction of the arms (``rlsift plan`` with every predictable arm as a candidate). The flow that runs them is
flows/benchmark.py.

Configuration of one run, later items winning: ``-c CONFIG`` (shared settings: model, data, budget) <
the benchmark's defaults (:data:`DEFAULTS`, and :data:`QUICK` with ``--quick``) < the preset's own keys
(``conf/presets/<name>.yaml`` and the presets it builds on, not ``base.yaml``) < the command line's
``key=value`` overrides < ``seed`` and, after the first run, ``model.path`` (the shared warm start).
"""

from __future__ import annotations

import json

from tasks.config import Config
from tasks.config.load import conf_dir, load_config
from tasks.config.load import preset_overrides as named_overrides

#: The user presets (conf/presets), in report order; the benchmark's arms are the files of conf/bench (:func:`arms`).
PRESETS = ("grpo", "auto", "dapo", "dots", "pods", "scalingrl", "gain", "all")
#: Arms ``<preset>-sync``: the preset with generation and update one after the other (``overlap.lag=0``).
SYNC = "-sync"
#: The baseline every arm is measured against: plain GRPO, generation then update (what TRL's GRPOTrainer does).
BASELINE = f"grpo{SYNC}"
#: Leave-one-out arms: the ``all`` preset without one technique each (``--presets ablation`` runs them all).
#: Without PODS every generated rollout enters the update, so ``rollout.n`` drops to ``all``'s ``pods.m``
#: (added by :func:`preset_overrides`).
LEAVE_ONE_OUT: dict[str, tuple[str, ...]] = {
    "all-dots": ("select.method=uniform",), "all-replay": ("replay.enabled=false",),
    "all-pods": ("pods.enabled=false",), "all-scalingrl": ("curriculum.enabled=false",),
    "all-gain": ("gain.enabled=false",), "all-adapt": ("adapt.enabled=false",),
}
#: Benchmark settings under every configuration: evaluate on a fixed schedule; don't register models.
DEFAULTS = ("eval.every=10", "tracking.register_model=false")
#: ``--quick``: two seeds of a short budget on 300 held-out prompts (6-8 minutes on 2 cores with the warm start
#: cached): enough steps that GRPO's gain is far above one seed's noise, and two seeds for an interval on the clock.
QUICK = ("train.steps=30", "train.round_steps=5", "eval.every=10", "eval.limit=300", "eval.samples=0")
QUICK_SEEDS = 2
#: ``--quick`` without ``--presets``: what a user chooses between (with the baseline and TRL).
QUICK_PRESETS = ("auto", "dapo")
SEEDS = 3


def arms() -> tuple[str, ...]:
    """The benchmark's arms, experimental variants: every file of ``conf/bench``, by name (adding a file adds the
    arm)."""
    return tuple(sorted(p.stem for p in (conf_dir() / "bench").glob("*.yaml")))


def ablation() -> tuple[str, ...]:
    """``--presets ablation``: every preset, every arm and every leave-one-out arm."""
    return (*PRESETS, *arms(), *LEAVE_ONE_OUT)


def preset_overrides(name: str) -> list[str]:
    """The keys a preset sets itself (with the presets it builds on, not ``base.yaml``) as dotted overrides.

    A leave-one-out arm (:data:`LEAVE_ONE_OUT`) is ``all``'s keys followed by the switch that turns one off; a
    ``<preset>-sync`` arm (:data:`SYNC`) is the preset's keys and ``overlap.lag=0``.
    """
    if name.endswith(SYNC):
        return [*preset_overrides(name[:-len(SYNC)]), "overlap.lag=0"]
    if name in LEAVE_ONE_OUT:
        full = preset_overrides("all")
        n = [f"rollout.n={o.split('=', 1)[1]}" for o in full if o.startswith("pods.m=")] if name == "all-pods" else []
        return [*full, *LEAVE_ONE_OUT[name], *n]
    return named_overrides(name)


def configuration(config: str | None, overrides: list[str], preset: str, seed: int, quick: bool,
                  policy_path: str | None) -> Config:
    """The validated config of one benchmark run (see the module docstring for the order)."""
    return load_config(config, configuration_items(overrides, preset, seed, quick, policy_path))


def configuration_items(overrides: list[str], preset: str, seed: int, quick: bool, policy_path: str | None,
                        ) -> list[str]:
    """The dotted overrides of one benchmark run over ``-c CONFIG`` (:func:`configuration`)."""
    items = [*DEFAULTS, *(QUICK if quick else ()), *preset_overrides(preset), *overrides, f"seed={seed}"]
    return [*items, f"model.path={json.dumps(policy_path)}"] if policy_path else items


def composition_of(arm: str) -> str | None:
    """The preset or bench-arm file whose composition an arm runs (``-sync`` arms run their preset's), or None for
    arms the plan cannot predict: TRL, the leave-one-out arms and ``auto`` (its own plan chooses)."""
    name = arm[:-len(SYNC)] if arm.endswith(SYNC) else arm
    return name if name in (*PRESETS, *arms()) and name != "auto" else None


def plan_base(names: list[str]) -> str:
    """The preset whose keys the plan of the arms ``names`` runs over: plain GRPO as the arms run it
    (``overlap.lag=auto``, so that the screen run ahead and the rounds started ahead count as in the overlapped
    arms), or ``grpo-sync`` where an arm besides the baseline is a ``-sync`` arm (the plan predicts every candidate
    at one lag; plain GRPO's own prediction is the same at either)."""
    return BASELINE if any(n.endswith(SYNC) and n != BASELINE for n in names) else "grpo"


def plan_arms(config: str | None, overrides: list[str], names: list[str], seed: int, quick: bool,
              policy_path: str) -> dict | None:
    """``rlsift plan`` on the benchmark's pool and budget with every predictable arm as a candidate (setup, on no
    arm's clock): the predictions the report sets against the measurements. None when no arm is predictable. Its
    probe's timings are not kept (``plan.reuse_probe_hours=0``): an ``auto`` arm's first run times its own probe, as
    a first run on the machine does, and its later seeds reuse that run's (tasks/plan/probe_cache.py)."""
    from flows.pipeline import plan_flow

    candidates = sorted({c for c in map(composition_of, names) if c is not None})
    if not candidates:
        return None
    items = configuration_items(overrides, plan_base(names), seed, quick, policy_path)
    return plan_flow(config=config, overrides=[*items, f"plan.candidates={json.dumps(candidates)}",
                                               "plan.prune=false", "plan.reuse_probe_hours=0",
                                               "tracking.register_model=false"])["plan"]
