"""What a plan.auto run trains (tasks/training/plan.py): the choice's keys over the run's own, from its record."""

import pytest

from rlcore.plan import Prediction, UnitCosts
from tasks.config import ConfigError
from tasks.config_load import load_config
from tasks.training.plan import Plan, candidate_config, composition, planned_config


def plan_choosing(name: str) -> Plan:
    p = Prediction(name, effective_ratio=0.5, signal=4, generated=32, generated_tokens=1, updated_tokens=1,
                   forward_tokens=0, step_s=1, clock=0.5)
    base = Prediction("grpo", effective_ratio=0.4, signal=4, generated=64, generated_tokens=1, updated_tokens=1,
                      forward_tokens=0, step_s=2, clock=1.0)
    return Plan(shares={"solved": 0.2, "unsolved": 0.3, "mixed": 0.5}, g=8,
                costs=UnitCosts(1e-4, 5e-5, 2e-5, 20, 10, 15), baseline=base, predictions=(p,), unavailable={},
                choice=name, reason=f"{name}: test", overrides=())


def test_the_choice_replaces_the_composition_keys_and_keeps_the_rest(tmp_path):
    cfg = load_config("conf/presets/auto.yaml", ["train.steps=7", "data=balanced"])
    assert cfg.plan.auto and cfg.select.method == "uniform"
    screen = planned_config(cfg, plan_choosing("dots_screen"))
    assert (screen.select.method, screen.select.screen, screen.rollout.n, screen.train.prompts_per_step) == \
        ("dots", 2, 4, 20)
    assert not screen.plan.auto and not screen.adapt.enabled
    assert screen.train.steps == 7 and screen.data == cfg.data  # the run's own keys hold
    dots = planned_config(cfg, plan_choosing("dots"))  # replay: the adaptive composition turns it down in the run
    assert dots.replay.enabled and dots.adapt.enabled
    grpo = planned_config(cfg, plan_choosing("grpo"))
    assert grpo == load_config("conf/presets/grpo.yaml", ["train.steps=7", "data=balanced"])


def test_a_plan_round_trips_and_names_its_choice(tmp_path):
    plan = plan_choosing("dots_n4")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan and plan.chosen.name == "dots_n4"
    assert "**Plan: dots_n4: test**" in (tmp_path / "plan.md").read_text()
    assert [r["composition"] for r in plan.rows()] == ["grpo", "dots_n4"]


def test_composition_reads_what_a_config_does():
    cfg = load_config(None)
    c = composition("dots", candidate_config(cfg, "dots"))
    assert (c.draw, c.weighting, c.fresh_frac, c.prompts, c.n, c.m) == ("dots", "target", 0.5, 32, 8, 8)
    assert c.reference_rollouts == pytest.approx(32 * 8 / 5)  # K x g every round of 5 steps
    pods = composition("pods", candidate_config(cfg, "pods"))
    assert (pods.n, pods.m, pods.reference_rollouts) == (16, 8, 0.0)
    assert composition("dapo", candidate_config(cfg, "dapo")).dynamic == (2.0, 3)
    with pytest.raises(ConfigError, match="plan.candidates: nope"):
        candidate_config(cfg, "nope")
