"""Typed, frozen, validated configuration.

Defaults live here, in one place; YAML files under ``conf/`` only set values, and command-line
overrides are dotted ``key=value`` pairs (``train.steps=40 select.method=dots``). Everything is
validated before any work starts: an unknown key or a bad value raises :class:`ConfigError` naming the
dotted key and what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem, with the dotted key and what is allowed."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class PathsConfig(_Frozen):
    root: str = Field("./rlsift-runs", description="Folder for the ledger, MLflow store, checkpoints, reports.")
    cache: str | None = Field(None, description="Warm-start cache folder (default: <root>/cache).")


class SourceConfig(_Frozen):
    """One data source: the bundled generator or a local file/folder."""

    kind: Literal["bundled", "file"] = "bundled"
    # bundled generator
    mix: str | dict[int, float] = Field("default", description="Level mix: 'default', 'balanced' or {level: weight}.")
    n_train: int = Field(2000, ge=1)
    n_test: int = Field(1000, ge=0)
    seed: int = 0
    # files
    path: str | None = None
    format: Literal["gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf"] | None = None
    split: Literal["train", "test"] | None = None
    fields: dict[str, str] | None = Field(None, description="Field mapping {question, answer, solution, level}.")
    reward: Literal["arith", "numeric", "math", "code"] | None = None
    limit: int | None = Field(None, ge=1, description="Keep at most this many rows per split (after ingest).")

    @model_validator(mode="after")
    def _need_path(self) -> SourceConfig:
        if self.kind == "file" and not self.path:
            raise ValueError("a 'file' source needs 'path'")
        return self


class DataConfig(_Frozen):
    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    test_from_train: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this share of train prompts as test when a source has no test split."
    )


class WarmStartConfig(_Frozen):
    steps: int = Field(1200, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(2e-3, gt=0)
    mix: str = Field("warmstart", description="Level mix of the worked solutions (tasks/data/arith.py MIXES).")
    flawed: float = Field(0.5, ge=0, le=1, description=(
        "Share of demonstrations (where it matters) that slip: left to right, ignoring precedence "
        "(tasks/data/arith.py flawed_solution); the habit RL then removes."))


class ModelConfig(_Frozen):
    path: str | None = Field(None, description="Local model folder; None builds and warm-starts the tiny default.")
    hidden: int = Field(128, ge=32)
    layers: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    warmstart: WarmStartConfig = WarmStartConfig()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    system_prompt: str = "Let's think step by step and output the final answer within \\boxed{}."

    @model_validator(mode="after")
    def _head_size(self) -> ModelConfig:
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ValueError(
                f"hidden/heads must be an integer >= 32 (vLLM's CPU kernels); got {self.hidden}/{self.heads}")
        return self


class RolloutConfig(_Frozen):
    engine: Literal["hf", "vllm"] = "hf"
    vllm_url: str = "http://127.0.0.1:8000"
    n: int = Field(8, ge=2, description="Rollouts generated per prompt (PODS keeps pods.m of them).")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    chunk: int = Field(512, ge=1, description="Sequences per generate() call.")


class TrainConfig(_Frozen):
    steps: int = Field(150, ge=0)
    prompts_per_step: int = Field(32, ge=1, description="B: prompt groups per optimizer step (fresh + replayed).")
    round_steps: int = Field(5, ge=1, description="mu: steps per selection round (DOTS's selection interval).")
    lr: float = Field(3e-5, gt=0)
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup over the first N steps (0: off).")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    aggregation: Literal["token", "sequence"] = "token"
    scale_std: bool = Field(False, description="Divide advantages by the group std (standard GRPO); off = Dr.-GRPO.")
    kl_coef: float = Field(0.0, ge=0, description="KL to the starting policy (k3 estimator); 0 = off.")
    negative_weight: float = Field(1.0, ge=0, le=1, description=(
        "Scale of negative advantages (1: GRPO; 0: reinforce successes only, as rejection-sampling fine-tuning)."))
    minibatches: int = Field(1, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0: round boundaries only).")


class ScaleConfig(_Frozen):
    """Training backend (launched with torchrun for the multi-process ones; see README "Scale out")."""

    backend: Literal["single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = "single"
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state on the CPU.")


class CalibrateConfig(_Frozen):
    k: int = Field(64, ge=2, description="Reference-set size K.")
    g: int = Field(8, ge=2, description="Rollouts per reference prompt.")


class PredictorConfig(_Frozen):
    hidden: int = Field(64, ge=4)
    layers: int = Field(2, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    tau_att: float = Field(1.0, gt=0)
    calibration: Literal["group_logit_temp", "none"] = "group_logit_temp"
    linear_recalibration: bool = False
    min_labels: int = Field(128, ge=0, description="Labels needed before the towers replace off-the-shelf attention.")
    fit_steps: int = Field(100, ge=0)
    lr: float = Field(1e-3, gt=0)


class SelectConfig(_Frozen):
    method: Literal["uniform", "dots"] = "uniform"
    alpha: float = Field(0.5, ge=0, le=1, description="DOTS target difficulty.")
    tau: float = Field(1e-3, gt=0, description="DOTS sampling temperature.")
    sampler: Literal["weighted", "greedy", "gumbel"] = "weighted"
    drop_solved: bool = Field(False, description=(
        "Never resample solved prompts: a prompt whose measured pass rate reached 1 (reference rollouts or a "
        "trained group, over all n) leaves the pool, as prime-rl and open-instruct do; solved prompts come back "
        "only when fewer unsolved prompts remain than a step needs."))
    predictor: PredictorConfig = PredictorConfig()


class PodsConfig(_Frozen):
    enabled: bool = False
    m: int = Field(8, ge=2, description="Rollouts kept per prompt (of rollout.n generated).")
    rule: Literal["max_variance", "random", "max_reward"] = "max_variance"


class DynamicSamplingConfig(_Frozen):
    """DAPO's dynamic sampling (arXiv 2503.14476 section 3.2; rlcore/dynamic_sampling.py)."""

    enabled: bool = Field(False, description=(
        "Over-sample prompts, drop groups whose kept rewards are all equal, and generate again until the "
        "step's fresh groups are all informative or dynamic.max_rounds is reached. Discarded rollouts count in "
        "time, rollouts and cost."))
    oversample: float = Field(2.0, ge=1.0, description=(
        "Prompts generated per informative group still missing (a round asks ceil(oversample * missing))."))
    max_rounds: int = Field(3, ge=1, description=(
        "Generation rounds per step at most (verl's max_num_gen_batches); then the step trains on what it has."))


class ReplayConfig(_Frozen):
    enabled: bool = False
    fresh_frac: float = Field(0.5, gt=0, le=1, description="delta: share of each batch that is freshly rolled out.")
    capacity: int = Field(256, ge=0)
    max_age: int | None = Field(None, ge=1)


class CurriculumConfig(_Frozen):
    enabled: bool = False
    weights: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)
    difficulty_form: Literal["peak", "monotone"] = "peak"
    s_min: float = Field(0.25, gt=0, le=1, description="Smallest active pool, as a share of the pool.")
    s_max: float = Field(1.0, gt=0, le=1)
    scale0: float = Field(0.5, gt=0, le=1)
    kappa: float = Field(0.25, ge=0)
    theta_lo: float = Field(0.2, ge=0, le=1)
    theta_hi: float = Field(0.7, ge=0, le=1)
    theta_learned: float = Field(0.9, ge=0, le=1)
    rho0: float = Field(0.2, ge=0, le=1)
    rho_step: float = Field(0.1, ge=0, le=1)


class GainConfig(_Frozen):
    enabled: bool = False
    mode: Literal["gate", "prior"] = Field("gate", description="gate: DOTS picks inside the window; prior: weight.")
    prior_lambda: float = Field(0.2, ge=0)
    gate_width: float = Field(0.5, gt=0, le=1, description="Share of the pool the gate keeps.")
    inter_weight: float = Field(1.0, ge=0)
    sigma_frac: float = Field(0.13, gt=0)
    step_frac: float = Field(0.05, ge=0)
    alpha: float = 2.0
    beta: float = Field(0.5, ge=0, le=1)
    gamma: float = 0.5


class EvalConfig(_Frozen):
    samples: int = Field(4, ge=0, description="k for sampled avg@k (0: greedy only).")
    temperature: float = Field(1.0, gt=0)
    limit: int | None = Field(None, ge=1, description="Evaluate at most this many test prompts.")
    every: int = Field(0, ge=0, description="Also evaluate greedily every N steps during training (0: off).")
    batch_size: int = Field(256, ge=1)


class TrackingConfig(_Frozen):
    uri: str | None = Field(None, description="MLflow tracking URI (default: sqlite under paths.root).")
    experiment: str = "rlsift"
    register_model: bool = True
    model_name: str = "rlsift-policy"


class CostConfig(_Frozen):
    device: str | None = Field(None, description="Device type for pricing (default: detected).")
    prices: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.10, "nvidia-h200": 3.50, "nvidia-h100": 2.50, "nvidia-a100": 1.50,
                                 "nvidia-l40s": 1.00, "cuda": 2.00},
        description="Price per device hour, by device type.",
    )


class Config(_Frozen):
    seed: int = 0
    paths: PathsConfig = PathsConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    scale: ScaleConfig = ScaleConfig()
    calibrate: CalibrateConfig = CalibrateConfig()
    select: SelectConfig = SelectConfig()
    pods: PodsConfig = PodsConfig()
    dynamic: DynamicSamplingConfig = DynamicSamplingConfig()
    replay: ReplayConfig = ReplayConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    gain: GainConfig = GainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    cost: CostConfig = CostConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.pods.enabled and self.pods.m >= self.rollout.n:
            raise ValueError(f"pods.m ({self.pods.m}) must be below rollout.n ({self.rollout.n}) when PODS is on")
        if self.curriculum.s_min > self.curriculum.s_max:
            raise ValueError("curriculum.s_min must not exceed curriculum.s_max")
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


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=40")
    key, raw = item.split("=", 1)
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key {key!r}")
    return key.split("."), yaml.safe_load(raw) if raw else ""


def _set(tree: dict, keys: list[str], value: Any) -> None:
    node = tree
    for k in keys[:-1]:
        if not isinstance(node.get(k, {}), dict):
            raise ConfigError(f"{'.'.join(keys)}: {k!r} is a value, not a section")
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _allowed(model: type[BaseModel], loc: tuple) -> str:
    """The allowed keys or values at a location, for error messages."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        options = getattr(ann, "__args__", (ann,))
        cls = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), ann)
    fields = getattr(cls, "model_fields", None)
    return f"; allowed keys: {', '.join(fields)}" if fields else ""


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_allowed(Config, loc)}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (optional), apply dotted overrides, validate.

    A YAML file may name another to start from with a top-level ``base: other.yaml`` (relative to itself).
    """
    tree: dict = {}
    if path is not None:
        tree = _read_yaml(Path(path))
    for item in overrides:
        keys, value = parse_override(item)
        group = conf_dir() / keys[0] / f"{value}.yaml" if len(keys) == 1 and isinstance(value, str) else None
        if group is not None and group.is_file():  # a config group: data=gsm8k -> conf/data/gsm8k.yaml
            tree[keys[0]] = _read_yaml(group)
            continue
        _set(tree, keys, value)
    return validate(tree)


def conf_dir() -> Path:
    """``conf/`` of the current directory, else the one shipped beside the package."""
    here = Path("conf")
    return here if here.is_dir() else Path(__file__).resolve().parents[1] / "conf"


def validate(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = tree.pop("base", None)
    if base:
        tree = _merge(_read_yaml(path.parent / base), tree)
    return tree


def to_json(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
