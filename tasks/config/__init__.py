"""Typed, frozen, validated configuration: :class:`Config`, the whole run, assembled from one section per concern.

Defaults live in this package, in one place; YAML files under ``conf/`` only set values, and command-line
overrides are dotted ``key=value`` pairs (``train.steps=40 select.method=dots``). Everything is
validated before any work starts: an unknown key or a bad value raises :class:`ConfigError` naming the
dotted key and what is allowed. Reading files, overrides and the environment: ``tasks/config/load.py``.

The sections, by module: ``data`` (the pool and its sources), ``model`` (policy, warm start, LoRA), ``rollout``
(sampling), ``train`` (the GRPO update), ``select`` (selection, DOTS's predictor and reference set),
``techniques`` (PODS, DAPO's dynamic sampling, replay, adaptive composition, plan, guard, curriculum, GAIN-RL),
``budgets`` (per-prompt rollout budgets in waves, the pre-rollout skip),
``operations`` (paths, scale, overlap, evaluation, tracking, cost) and ``base`` (the frozen base class,
:class:`ConfigError`). Every name is importable from ``tasks.config``; this module holds :class:`Config` and the
checks that span sections.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tasks.config.base import ConfigError, _Frozen
from tasks.config.budgets import SkipConfig, WavesConfig
from tasks.config.data import DataConfig, SourceConfig
from tasks.config.model import LoraConfig, ModelConfig, WarmStartConfig
from tasks.config.operations import CostConfig, EvalConfig, OverlapConfig, PathsConfig, ScaleConfig, TrackingConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.select import CalibrateConfig, PredictorConfig, ScreenPrecision, ScreenProcess, SelectConfig
from tasks.config.techniques import (
    AdaptConfig,
    CurriculumConfig,
    DynamicSamplingConfig,
    GainConfig,
    GuardConfig,
    PlanConfig,
    PodsConfig,
    ReplayConfig,
)
from tasks.config.train import KlRows, SharedPrefix, TrainConfig

__all__ = [
    "AdaptConfig", "CalibrateConfig", "Config", "ConfigError", "CostConfig", "CurriculumConfig", "DataConfig",
    "DynamicSamplingConfig", "EvalConfig", "GainConfig", "GuardConfig", "KlRows", "LoraConfig", "ModelConfig",
    "OverlapConfig", "PathsConfig", "PlanConfig", "PodsConfig", "PredictorConfig", "ReplayConfig", "RolloutConfig",
    "ScaleConfig", "ScreenPrecision", "ScreenProcess", "SelectConfig", "SharedPrefix", "SkipConfig", "SourceConfig",
    "TrackingConfig", "TrainConfig", "WarmStartConfig", "WavesConfig",
]


class Config(_Frozen):
    """The whole run; every default of rlsift's pipeline lives here (conf/base.yaml states them all)."""

    seed: int = Field(0, description="Run seed: every random draw derives from it (rlcore/seeding.py derive_seed).")
    paths: PathsConfig = Field(PathsConfig(), description="Where results are written.")
    data: DataConfig = Field(DataConfig(), description="The prompt pool and held-out set.")
    model: ModelConfig = Field(ModelConfig(), description="The policy.")
    rollout: RolloutConfig = Field(RolloutConfig(), description="Rollout sampling.")
    train: TrainConfig = Field(TrainConfig(), description="The GRPO update.")
    scale: ScaleConfig = Field(ScaleConfig(), description="Training backend.")
    overlap: OverlapConfig = Field(OverlapConfig(), description="Generation overlapped with the update.")
    calibrate: CalibrateConfig = Field(CalibrateConfig(), description="DOTS reference set.")
    select: SelectConfig = Field(SelectConfig(), description="Prompt selection (uniform or DOTS).")
    pods: PodsConfig = Field(PodsConfig(), description="PODS rollout down-sampling.")
    dynamic: DynamicSamplingConfig = Field(DynamicSamplingConfig(), description="DAPO's dynamic sampling.")
    waves: WavesConfig = Field(WavesConfig(), description="Per-prompt rollout budgets, drawn in two waves.")
    skip: SkipConfig = Field(SkipConfig(), description="The pre-rollout skip of prompts whose last groups were silent.")
    replay: ReplayConfig = Field(ReplayConfig(), description="Rollout Replay.")
    adapt: AdaptConfig = Field(AdaptConfig(), description="Adaptive composition of PODS and replay.")
    plan: PlanConfig = Field(PlanConfig(), description="The plan: measure the pool, choose the composition.")
    guard: GuardConfig = Field(GuardConfig(), description="Solved-skill guard.")
    curriculum: CurriculumConfig = Field(CurriculumConfig(), description="ScalingRL curriculum (reconstruction).")
    gain: GainConfig = Field(GainConfig(), description="GAIN-RL angle ordering and window.")
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation.")
    tracking: TrackingConfig = Field(TrackingConfig(), description="MLflow tracking.")
    cost: CostConfig = Field(CostConfig(), description="Cost accounting.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.pods.enabled and self.pods.m >= self.rollout.n:
            raise ValueError(f"pods.m ({self.pods.m}) must be below rollout.n ({self.rollout.n}) when PODS is on")
        if self.curriculum.s_min > self.curriculum.s_max:
            raise ValueError("curriculum.s_min must not exceed curriculum.s_max")
        tc = self.train
        if tc.kl_coef > 0 and tc.kl_rows != "all" and not tc.skip_zero_advantage:
            raise ValueError(f"train.kl_rows={tc.kl_rows} leaves rollouts out of the KL term by skipping them in the "
                             "update: it needs train.skip_zero_advantage=true")
        if tc.kl_sample < 1 and (tc.kl_coef == 0 or not tc.skip_zero_advantage):
            raise ValueError(f"train.kl_sample={tc.kl_sample} samples the silent groups' KL term, so it needs "
                             "train.kl_coef > 0 and train.skip_zero_advantage=true (the skip is how the groups "
                             "not drawn are left out)")
        if self.adapt.enabled and not (self.pods.enabled or self.replay.enabled):
            raise ValueError("adapt.enabled turns PODS and replay down as groups get informative: it needs "
                             "pods.enabled or replay.enabled")
        if self.adapt.low >= self.adapt.high:
            raise ValueError(f"adapt.low ({self.adapt.low}) must be below adapt.high ({self.adapt.high})")
        if self.model.lora.enabled and self.scale.backend != "single":
            raise ValueError(f"model.lora is built for scale.backend=single, not {self.scale.backend}: train every "
                             "weight under scale-out, or LoRA on one process")
        if self.model.lora.enabled and self.model.lora.dropout > 0 and self.train.behaviour != "trainer":
            raise ValueError("model.lora.dropout > 0 makes the trainer's log-probs differ from the sampler's, which "
                             "are the loss's behaviour policy: set it to 0 or train.behaviour=trainer")
        if self.rollout.vllm_weight_sync == "adapter" and not self.model.lora.enabled:
            raise ValueError("rollout.vllm_weight_sync=adapter sends the servers LoRA adapters: it needs "
                             "model.lora.enabled=true (or set it to merged or auto)")
        if self.waves.enabled:
            if self.waves.first >= self.rollout.n:
                raise ValueError(f"waves.first ({self.waves.first}) must be below rollout.n ({self.rollout.n}): the "
                                 "second wave completes each group to rollout.n")
            for on, name in ((self.dynamic.enabled, "dynamic.enabled"), (self.adapt.enabled, "adapt.enabled")):
                if on:
                    raise ValueError(f"waves.enabled and {name} both decide a step's rollouts a prompt: set one")
        if self.guard.share > 0 and self.select.drop_solved:
            raise ValueError("guard.share keeps solved prompts in the batch and select.drop_solved removes them: "
                             "set one of them")
        return self

    @property
    def kept_per_prompt(self) -> int:
        """G: rollouts per prompt that enter the update."""
        return self.pods.m if self.pods.enabled else self.rollout.n

    def flat(self) -> dict[str, Any]:
        """The resolved config as flat ``a.b.c -> value`` pairs (for MLflow params)."""
        return dict(_flatten(self.model_dump(mode="json")))


def _flatten(d: Any, prefix: str = ""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d
