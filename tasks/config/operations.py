"""How a run is carried out and recorded, not what it learns: where files go (``paths``), the training
backend (``scale``), generation overlapped with the update (``overlap``), held-out evaluation (``eval``), MLflow
tracking (``tracking``) and cost accounting (``cost``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from tasks.config.base import _Frozen


class PathsConfig(_Frozen):
    """Where a run root keeps its files (README "Where the data lives")."""

    root: str = Field("./rlsift-runs", description=(
        "Folder for the ledger (ledger.duckdb), the MLflow store (mlflow.db), runs/<run_id>/ and the warm-start "
        "cache (tasks/run.py open_run). Like every path: relative to the config file that sets it, or given on the "
        "command line or in RLSIFT_ROOT, to the current folder. null: ./rlsift-runs in the current folder."))
    cache: str | None = Field(None, description=(
        "Cache folder: warm starts and converted models keyed by fingerprint (tasks/model/warmstart.py) and the "
        "plan's kept probe timings (tasks/plan/probe_cache.py); None: <root>/cache."))

    @property
    def cache_dir(self) -> Path:
        """``cache``, or ``<root>/cache`` where it is None."""
        return Path(self.cache) if self.cache else Path(self.root).resolve() / "cache"

    @field_validator("root", mode="before")
    @classmethod
    def _root_default(cls, value: Any) -> Any:
        """null (conf/base.yaml's value): the default, ``./rlsift-runs`` in the folder the command runs in; a path
        written in a config file would be relative to the file (tasks/config/load.py), so base.yaml names none."""
        return "./rlsift-runs" if value is None else value


class ScaleConfig(_Frozen):
    """Training backend (launched with torchrun for the multi-process ones; see README "Scale out")."""

    backend: Literal["single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = Field("single", description=(
        "single: one process; the others shard each update over torchrun ranks (tasks/update/distributed.py)."))
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state on the CPU.")


class OverlapConfig(_Frozen):
    """Generation and update at once (docs/algorithms.md section 8; tasks/overlap/concurrent.py)."""

    lag: Literal["auto", 0, 1] = Field("auto", description=(
        "Updates by which the sampling weights may trail the trainer's: 1 generates step t+1's rollouts (with the "
        "weights before update t) while update t runs; 0 is the sequential loop (rollout, then update). One step "
        "in flight already hides the shorter phase behind the longer; deeper lags are not offered. auto: chosen "
        "before training (rlcore/overlap_lag.py choose_lag): 1 where the sampler and the trainer run on different "
        "devices "
        "(rollout.engine=vllm; on a CPU, generator and trainer threads that fit the cores this process may use), "
        "else 1 only when a probe of a draw and an update at once is at least min_gain faster than one after the "
        "other. The choice and why are in the run summary, `rlsift plan` and the MLflow tags rlsift.overlap.*."))
    generator_threads: int | None = Field(None, ge=1, description=(
        "In-process engine with lag 1: torch threads of the generator process; the trainer keeps the rest of "
        "torch's threads (at least 1). None: half of them."))
    min_gain: float = Field(0.05, ge=0, lt=1, description=(
        "lag auto on a shared device: overlap only when the probe's draw and update at once take at most "
        "(1 - min_gain) of their time one after the other. The margin covers the probe's noise and the cost of "
        "rollouts one update old."))
    start_s: float | None = Field(None, ge=0, description=(
        "lag auto on a shared device: predicted seconds to start the generator process (the process, its imports, "
        "the weights, its first call), part of the overlap probe's predicted cost. The probe runs only when that "
        "cost is below what lag 1 could save over train.steps (min(draw, update) a step); else lag 0 without it. "
        "None: by the trainer's device (tasks/overlap/lag.py START_S: on a CPU 1 s where the child is forked, one "
        "generator thread, and 5 s where it is spawned; 20 s on an accelerator, whose runtime and first-call "
        "compiles the child pays too: 17.5-18.4 s on an H200)."))

    @field_validator("lag", mode="before")
    @classmethod
    def _lag(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value in (0, 1)):
            return value
        raise ValueError("must be auto, 0 (sequential) or 1 (one step off)")


class EvalConfig(_Frozen):
    """Held-out evaluation (tasks/evaluation/heldout.py): greedy accuracy and sampled avg@k and pass@k."""

    samples: int = Field(4, ge=0, description=(
        "k for sampled avg@k and pass@k (0: greedy only); samples at the rollout engine's settings "
        "(rollout.temperature, top_p, top_k), i.e. the policy as it is trained."))
    limit: int | None = Field(None, ge=1, description="Evaluate at most this many test prompts.")
    every: int = Field(0, ge=0, description=(
        "Also evaluate greedily every N steps during training (0: off); the accuracy also drives ScalingRL's "
        "explore/exploit share rho (curriculum.rho_step)."))
    batch_size: int = Field(256, ge=1, description="Prompts per forward pass of the score stage (embeddings, angles).")


class TrackingConfig(_Frozen):
    """MLflow tracking (tasks/records/tracking/)."""

    uri: str | None = Field(None, description="MLflow tracking URI (default: sqlite under paths.root).")
    experiment: str = Field("rlsift", description="MLflow experiment name (created when missing).")
    register_model: bool = Field(True, description="Register the final model in the MLflow model registry.")
    model_name: str = Field("rlsift-policy", description="Registered model name (also the parent that retrain reads).")
    system_metrics_s: float | None = Field(10.0, gt=0, description=(
        "Sample CPU, memory, disk, network and GPU use every this many seconds into the run's system/* metrics "
        "(MLflow's system-metrics monitor); None: off."))
    register_tolerance: float | None = Field(0.02, ge=0, description=(
        "Quality gate: register only when held-out greedy accuracy after training is at least the starting "
        "model's (for a retrain: the parent version's, on the same test prompts) minus this; otherwise the run "
        "records why (tag rlsift.not_registered). None: register whatever was trained."))
    champion_min_steps: int = Field(100, ge=0, description=(
        "A registered version trained fewer steps than this is a short run (conf/smoke.yaml's 20 steps): its tags "
        "say so (rlsift.short_run=true) and it is never made champion, the alias retrain continues "
        "(docs/operations.md \"Champion\")."))


class CostConfig(_Frozen):
    """Device hours and money per stage (tasks/records/cost.py)."""

    device: str | None = Field(None, description="Device type for pricing (default: detected).")
    prices: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.10, "nvidia-h200": 3.50, "nvidia-h100": 2.50, "nvidia-a100": 1.50,
                                 "nvidia-l40s": 1.00, "cuda": 2.00},
        description="Price per device hour, by device type.",
    )
