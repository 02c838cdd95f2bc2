"""Typed, frozen, validated configuration.

Defaults live here, in one place; YAML files under ``conf/`` only set values, and command-line
overrides are dotted ``key=value`` pairs (``train.steps=40 select.method=dots``). Everything is
validated before any work starts: an unknown key or a bad value raises :class:`ConfigError` naming the
dotted key and what is allowed. Reading files, overrides and the environment: ``tasks/config_load.py``.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: ``train.kl_rows``: the rollouts the KL term is computed on (TrainConfig.kl_rows describes each).
KlRows = Literal["all", "informative", "informative_and_solved"]


class ConfigError(ValueError):
    """A configuration problem, with the dotted key and what is allowed."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class PathsConfig(_Frozen):
    """Where a run root keeps its files (README "Where the data lives")."""

    root: str = Field("./rlsift-runs", description=(
        "Folder for the ledger (ledger.duckdb), the MLflow store (mlflow.db), runs/<run_id>/ and the warm-start "
        "cache (tasks/run.py open_run)."))
    cache: str | None = Field(None, description=(
        "Warm-start cache folder, keyed by fingerprint (tasks/model/warmstart.py); None: <root>/cache."))


class SourceConfig(_Frozen):
    """One data source: the bundled generator or a local file/folder (tasks/data/sources.py)."""

    kind: Literal["bundled", "file"] = Field("bundled", description=(
        "bundled: the generated arithmetic task (tasks/data/arith.py); file: a local file or folder at 'path'."))
    # bundled generator
    mix: str | dict[int, float] = Field("default", description=(
        "Bundled only: level mix, 'default', 'balanced' (tasks/data/arith.py MIXES) or {level: weight}."))
    n_train: int = Field(2000, ge=1, description="Bundled only: prompts generated for the train split.")
    n_test: int = Field(1000, ge=0, description="Bundled only: prompts generated for the held-out test split.")
    seed: int = Field(0, description="Bundled only: generator seed (the problems depend on it alone).")
    # files
    path: str | None = Field(None, description="File only: local file or folder to read (required for kind=file).")
    format: Literal["gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf"] | None = Field(
        None, description="File only: row format (tasks/data/sources.py); None: guessed from the content.")
    split: Literal["train", "test"] | None = Field(None, description=(
        "File only: split of the rows; None: from the file name (train/test in it), else the format's default."))
    fields: dict[str, str] | None = Field(None, description=(
        "File only, generic formats (jsonl, parquet, hf): field mapping {question, answer, solution, level}."))
    reward: Literal["arith", "numeric", "math", "code"] | None = Field(None, description=(
        "File only: verifier (tasks/data/rewards.py); None: the format's own, math for generic formats."))
    limit: int | None = Field(None, ge=1, description="Keep at most this many rows per split (after ingest).")

    @model_validator(mode="after")
    def _need_path(self) -> SourceConfig:
        if self.kind == "file" and not self.path:
            raise ValueError("a 'file' source needs 'path'")
        return self


class DataConfig(_Frozen):
    """The prompt pool and held-out set (ingest stage, tasks/data/ingest.py)."""

    sources: tuple[SourceConfig, ...] = Field((SourceConfig(),), description=(
        "Data sources, ingested in order into one pool (exact duplicates dropped, bad rows quarantined)."))
    test_from_train: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this share of train prompts as test when a source has no test split."
    )


class WarmStartConfig(_Frozen):
    """Supervised warm start of the tiny default policy (tasks/model/warmstart.py); unused with model.path."""

    steps: int = Field(1200, ge=0, description="AdamW steps on worked solutions (0: the untrained tiny model).")
    batch_size: int = Field(64, ge=1, description="Worked solutions per warm-start step.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (5 % linear warmup, then cosine decay to 0).")
    mix: str = Field("warmstart", description="Level mix of the worked solutions (tasks/data/arith.py MIXES).")
    flawed: float = Field(0.7, ge=0, le=1, description=(
        "Share of demonstrations (where it matters) that slip: left to right, ignoring precedence "
        "(tasks/data/arith.py flawed_solution); the habit RL then removes."))


class LoraConfig(_Frozen):
    """LoRA adapters through PEFT (tasks/model/lora.py; LoRA: arXiv 2106.09685): only the adapters train."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    rank: int = Field(16, ge=1, description="r: the rank of each adapter's update B A.")
    alpha: float = Field(32.0, gt=0, description="alpha: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "Dropout on the adapters' input in training mode. Must be 0 while the rollouts' own log-probs are the "
        "loss's behaviour policy (train.behaviour), since the sampler runs without it."))
    target_modules: str | tuple[str, ...] = Field("all-linear", description=(
        "Layers that get adapters: module names (e.g. [q_proj, v_proj]) or 'all-linear' (every linear layer but "
        "the output head), as PEFT reads them."))


class ModelConfig(_Frozen):
    """The policy (tasks/model/policy.py): a local model folder, or the tiny Llama built and warm-started here."""

    path: str | None = Field(None, description="Local model folder; None builds and warm-starts the tiny default.")
    hidden: int = Field(128, ge=32, description="Tiny default only: hidden size of the Llama.")
    layers: int = Field(4, ge=1, description="Tiny default only: transformer layers.")
    heads: int = Field(4, ge=1, description="Tiny default only: attention heads (hidden/heads >= 32).")
    warmstart: WarmStartConfig = Field(WarmStartConfig(), description="Warm start of the tiny default.")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters (off: every weight trains).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "Device of the policy: auto picks cuda when visible, else cpu (tasks/run.py resolve_device)."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weights dtype: auto is bfloat16 on a CUDA device that supports it, else float32."))
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    system_prompt: str = Field("Let's think step by step and output the final answer within \\boxed{}.", description=(
        "System message for tokenizers with a chat template (DOTS's template, arXiv 2506.05316); the tiny "
        "default has none and uses the plain 'Q: ...' prompt."))

    @model_validator(mode="after")
    def _head_size(self) -> ModelConfig:
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ValueError(
                f"hidden/heads must be an integer >= 32 (vLLM's CPU kernels); got {self.hidden}/{self.heads}")
        return self


class RolloutConfig(_Frozen):
    """Sampling the training rollouts (tasks/model/rollout.py, tasks/model/vllm_engine.py)."""

    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "hf: transformers generate() in process; vllm: a vLLM server over HTTP (docs/scale-out.md)."))
    vllm_url: tuple[str, ...] = Field(("http://127.0.0.1:8000",), description=(
        "Base URLs of the vLLM servers (engine=vllm): a list, or one URL for one server. Each generate call's prompts "
        "are spread over them, and a server that fails is dropped for the run (tasks/model/server_pool.py). On the "
        "command line: rollout.vllm_url=[http://a:8000,http://b:8000]."))
    vllm_timeout: float = Field(600.0, gt=0, description=(
        "Seconds a vLLM request may take (engine=vllm); a server that does not answer within it counts as failed."))
    n: int = Field(8, ge=2, description="Rollouts generated per prompt (PODS keeps pods.m of them).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description=(
        "Sampling temperature of the rollouts (and of the log-probs the update computes for them)."))
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0: off).")
    chunk: int = Field(512, ge=1, description="Sequences per generate() call.")

    @field_validator("vllm_url", mode="before")
    @classmethod
    def _url_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("vllm_url")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        if not urls:
            raise ValueError("give at least one vLLM server URL, e.g. [http://127.0.0.1:8000]")
        for url in urls:
            try:
                parts = urlsplit(url)
                ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            except ValueError:  # a port that is not a number in 0-65535
                ok = False
            if not ok or any(c.isspace() for c in url):
                raise ValueError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8000")
        bare = [u.rstrip("/") for u in urls]
        twice = sorted({u for u in bare if bare.count(u) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} given more than once")
        return urls


class TrainConfig(_Frozen):
    """The GRPO update (tasks/training/loop.py, update.py; docs/algorithms.md section 0)."""

    steps: int = Field(150, ge=0, description="Optimizer steps of RL training.")
    prompts_per_step: int = Field(32, ge=1, description="B: prompt groups per optimizer step (fresh + replayed).")
    round_steps: int = Field(5, ge=1, description="mu: steps per selection round (DOTS's selection interval).")
    lr: float = Field(3e-5, gt=0, description="AdamW peak learning rate (reached after warmup_steps).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup over the first N steps (0: off).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description=(
        "After the warmup: constant (verl's default), linear (TRL's default) or cosine decay from lr to "
        "lr * min_lr_ratio at the last of train.steps."))
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description=(
        "The decayed schedules' final learning rate as a share of lr (linear and cosine only)."))
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0, description=(
        "AdamW's epsilon. Where it exceeds a weight's gradient RMS, that weight moves in proportion to its "
        "gradient instead of by about lr per step, so weights the reward barely touches stay put."))
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient's global L2 norm to this value.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description=(
        "epsilon of the PPO clip window, centred on pi_old/mu for replayed groups (rlcore/grpo_loss.py)."))
    aggregation: Literal["token", "sequence"] = Field("token", description=(
        "Loss reduction: token = mean over every valid token (Dr. GRPO, arXiv 2503.20783); sequence = mean of "
        "per-sequence means (GRPO paper, arXiv 2402.03300)."))
    scale_std: bool = Field(False, description="Divide advantages by the group std (standard GRPO); off = Dr.-GRPO.")
    kl_coef: float = Field(0.0, ge=0, description="KL to the starting policy (k3 estimator); 0 = off.")
    kl_rows: KlRows = Field("all", description=(
        "The rollouts the KL term is computed on: all (the KL-regularised objective; the update then computes "
        "every rollout, train.skip_zero_advantage does not apply); informative (only those with a policy gradient, "
        "so the skip stays: the KL holds back what the update moves, at the cost of one reference forward pass of "
        "the computed rollouts); informative_and_solved (also the rollouts of groups that all earn reward 1: an "
        "anchor of the solved prompts to the starting policy). Rollouts left out count 0 in the KL's mean; they "
        "are left out by not computing them, so a value other than all needs train.skip_zero_advantage."))
    kl_sample: float = Field(1.0, gt=0, le=1, description=(
        "Share of the silent groups (advantages all 0, so only their KL term counts) that a step computes for the "
        "KL term train.kl_rows gives them: each such group is drawn with this chance (seeded by the run's seed, "
        "its step and its place in the batch) and its KL term weighted by 1 / kl_sample, an unbiased estimate "
        "of the full term (Horvitz-Thompson) at a fraction of its forward, backward and reference passes "
        "(docs/algorithms.md section 0.2). 1: every such group (GRPO's objective exactly). Below 1 it needs "
        "train.kl_coef > 0 and train.skip_zero_advantage=true."))
    negative_weight: float = Field(1.0, ge=0, le=1, description=(
        "Scale of negative advantages (1: GRPO; 0: reinforce successes only, as rejection-sampling fine-tuning)."))
    minibatches: int = Field(1, ge=1, description="Optimizer steps per training step, each on a slice of the batch.")
    micro_batch_tokens: int = Field(2048, ge=0, description=(
        "Padded-token budget of one forward and backward pass in the update (and of one pass of the no-grad "
        "log-prob passes): rows are grouped by length into micro-batches of at most this many (rows x padded "
        "length) tokens, each micro-batch's gradient accumulates before the next runs, and each minibatch steps "
        "the optimizer once. The loss is the whole minibatch's (each micro-batch weighted by its share of the "
        "minibatch's tokens or sequences), so loss and gradient are the same up to float rounding, and the "
        "update's peak memory is set by this budget, not by the batch (docs/performance.md). Before training the "
        "run checks that one micro-batch fits the device. 0: each minibatch in one pass."))
    skip_zero_advantage: bool = Field(True, description=(
        "Leave rollouts whose advantage is 0 (groups whose rewards are all equal) out of the update's forward and "
        "backward passes; the loss keeps their tokens in its normaliser, so the gradient is the same up to float "
        "rounding and only the wasted compute goes (docs/performance.md). With kl_coef > 0 the rollouts "
        "train.kl_rows names are computed too. With GAIN-RL the skipped rollouts get a forward pass without "
        "autograd for its online angle (and are not skipped under scale-out). false: every rollout is computed."))
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0: round boundaries only).")
    gradient_checkpointing: bool = Field(False, description=(
        "Activation checkpointing in the update: each decoder layer's activations are recomputed in the backward "
        "pass instead of kept (transformers' gradient_checkpointing_enable, non-reentrant), for less memory at "
        "about one more forward pass. Loss and gradients are unchanged; generation is unaffected."))
    behaviour: Literal["auto", "sampler", "trainer"] = Field("auto", description=(
        "Whose log-probs are a fresh rollout's behaviour policy mu in the loss. sampler: the rollout engine's own "
        "(the in-process generator computes them while sampling, vLLM returns them); trainer: the update's "
        "recomputed pi_old (mu = pi_old, plain PPO-clip). auto: sampler whenever the sampler is not the trainer's "
        "own module at the step's start (overlap.lag > 0, or rollout.engine=vllm), else trainer "
        "(docs/algorithms.md section 8)."))
    behaviour_cap: float | None = Field(2.0, ge=1, description=(
        "Truncated importance sampling (arXiv 2505.24298 section 5 uses the uncapped form): a fresh token's weight "
        "pi_old / mu is capped at this value in the decoupled loss. None: no cap."))

    @model_validator(mode="after")
    def _floor_needs_a_decay(self) -> TrainConfig:
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio} is the floor of a decay, but train.lr_schedule "
                             "is constant: set lr_schedule to linear or cosine, or min_lr_ratio to 0")
        return self


class OverlapConfig(_Frozen):
    """Generation and update at once (docs/algorithms.md section 8; tasks/training/overlap.py)."""

    lag: Literal["auto", 0, 1] = Field("auto", description=(
        "Updates by which the sampling weights may trail the trainer's: 1 generates step t+1's rollouts (with the "
        "weights before update t) while update t runs; 0 is the sequential loop (rollout, then update). One step "
        "in flight already hides the shorter phase behind the longer; deeper lags are not offered. auto: chosen "
        "before training (rlcore/plan.py choose_lag): 1 where the sampler and the trainer run on different devices "
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

    @field_validator("lag", mode="before")
    @classmethod
    def _lag(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value in (0, 1)):
            return value
        raise ValueError("must be auto, 0 (sequential) or 1 (one step off)")


class ScaleConfig(_Frozen):
    """Training backend (launched with torchrun for the multi-process ones; see README "Scale out")."""

    backend: Literal["single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = Field("single", description=(
        "single: one process; the others shard each update over torchrun ranks (tasks/training/distributed.py)."))
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state on the CPU.")


class CalibrateConfig(_Frozen):
    """DOTS's reference set (docs/algorithms.md section 1.3): measured with the current policy each round."""

    k: int = Field(64, ge=2, description="Reference-set size K.")
    g: int = Field(8, ge=2, description="Rollouts per reference prompt.")
    reference: Literal["fresh", "trained"] = Field("fresh", description=(
        "fresh: each round rolls out K new reference prompts, drawn at random, with the current policy (the "
        "paper's); trained: a round's reference set is every prompt rolled out since the last round started "
        "(the calibrate stage's prompts for round 0, then the trained groups, all n rollouts of each), no rollouts "
        "of its own; its labels are up to train.round_steps steps old (tasks/training/selector.py)."))


class PredictorConfig(_Frozen):
    """DOTS's attention-based difficulty predictor (rlcore/difficulty.py; docs/algorithms.md section 1.2)."""

    hidden: int = Field(64, ge=4, description="Width of the two projection towers (official 896).")
    layers: int = Field(2, ge=1, description="Linear layers per tower (official 3).")
    dropout: float = Field(0.1, ge=0, lt=1, description="Dropout inside the towers while fitting.")
    tau_att: float = Field(1.0, gt=0, description="Temperature of the attention over the reference prompts.")
    calibration: Literal["group_logit_temp", "none"] = Field("group_logit_temp", description=(
        "group_logit_temp: the official calibration head (temperature and bias from the reference mean and "
        "std); none: the raw attention mean."))
    linear_recalibration: bool = Field(False, description=(
        "Map predictions through a least-squares line fitted on the reference prompts (official code only), "
        "clipped to [0, 1]."))
    min_labels: int = Field(128, ge=0, description="Labels needed before the towers replace off-the-shelf attention.")
    fit_steps: int = Field(100, ge=0, description="Adam steps of predictor training per round.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate of the predictor.")


class SelectConfig(_Frozen):
    """Which prompts each step rolls out (tasks/training/selector.py; docs/algorithms.md section 1.3)."""

    method: Literal["uniform", "dots"] = Field("uniform", description=(
        "uniform: plain GRPO; dots: weights exp(-|d - alpha| / tau) from predicted difficulty (arXiv 2506.05316)."))
    weighting: Literal["target", "informative", "observed", "posterior"] = Field("target", description=(
        "How DOTS turns predicted success p into selection weights: target: exp(-|(1 - p) - alpha| / tau) "
        "(the paper's); informative: 1 - p^n - (1 - p)^n with n = rollout.n, the chance that the group has "
        "unequal rewards, which is the prompt distribution of DAPO's dynamic-sampling batch "
        "(rlcore.selection.informative_weights; ours); observed: that chance measured per bin of predicted p on "
        "the groups drawn so far, shrunk toward 1 - p^n - (1 - p)^n (rlcore.selection.observed_informative_weights; "
        "ours); posterior: that chance under a Beta posterior of each prompt's pass rate, the prediction its mean "
        "with a concentration fitted to the groups drawn so far, the prompt's own earlier rollouts its evidence "
        "(rlcore.selection.posterior_informative_weights; ours)."))
    observed_bins: int = Field(10, ge=1, description="weighting=observed: equal bins of predicted p in [0, 1].")
    observed_strength: float = Field(8.0, gt=0, description=(
        "weighting=observed: pseudo-groups per bin of the binomial chance the measured share is shrunk toward."))
    posterior_decay: float = Field(0.9, ge=0, le=1, description=(
        "weighting=posterior: the weight a prompt's own earlier rollouts keep at each round start (1: never "
        "forgotten; 0: only the prediction counts), since the policy moves its pass rate."))
    alpha: float = Field(0.5, ge=0, le=1, description="DOTS target difficulty (weighting=target).")
    tau: float = Field(1e-3, gt=0, description="DOTS sampling temperature (weighting=target).")
    sampler: Literal["weighted", "greedy", "gumbel"] = Field("weighted", description=(
        "DOTS draw without replacement: weighted (multinomial, official), greedy (top-k) or gumbel (Gumbel-top-k)."))
    drop_solved: bool = Field(False, description=(
        "Never resample solved prompts: a prompt whose measured pass rate reached 1 (reference rollouts or a "
        "trained group, over all n) leaves the pool, as prime-rl and open-instruct do; solved prompts come back "
        "only when fewer unsolved prompts remain than a step needs."))
    screen: int = Field(1, ge=1, description=(
        "Candidates drawn per prompt a step needs (1: off). Each candidate's pass rate is estimated as the "
        "policy's probability of writing its worked reference solution (one forward pass, no sampling; "
        "tasks/training/screen.py) and the prompts whose groups of rollout.n are most likely to have unequal "
        "rewards are kept; the rest go back to the round's pool. Needs a worked solution for every pool prompt; "
        "the forward passes count in the selection time (ours)."))
    predictor: PredictorConfig = Field(PredictorConfig(), description="The DOTS difficulty predictor.")


class PodsConfig(_Frozen):
    """PODS down-sampling (rlcore/downsample.py; arXiv 2504.13818; docs/algorithms.md section 3)."""

    enabled: bool = Field(False, description="Generate rollout.n per prompt and train on pods.m of them.")
    m: int = Field(8, ge=2, description="Rollouts kept per prompt (of rollout.n generated).")
    rule: Literal["max_variance", "random", "max_reward"] = Field("max_variance", description=(
        "max_variance: the PODS rule; random and max_reward: the paper's ablations."))


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
    """Rollout Replay (rlcore/replay_buffer.py; arXiv 2506.05316; docs/algorithms.md section 2)."""

    enabled: bool = Field(False, description="Replay informative groups from a FIFO buffer.")
    fresh_frac: float = Field(0.5, gt=0, le=1, description="delta: share of each batch that is freshly rolled out.")
    capacity: int = Field(256, ge=0, description="C: most groups kept in the buffer (FIFO eviction).")
    max_age: int | None = Field(None, ge=1, description=(
        "Groups older than this many steps are not replayed (our addition; None: no limit, as in the paper)."))


class AdaptConfig(_Frozen):
    """The adaptive composition (our addition; rlcore/adaptive_composition.py, docs/algorithms.md section 6.5): PODS
    and Rollout Replay turned down as the share r of fresh groups that are informative on pods.m rollouts rises."""

    enabled: bool = Field(False, description=(
        "Each step, set the rollouts a prompt (between pods.m and rollout.n) and the fresh share of the batch "
        "(between replay.fresh_frac and 1) from the moving average of r; needs PODS or replay on."))
    low: float = Field(0.5, ge=0, lt=1, description=(
        "r at or below which PODS and replay run as configured (at least half the groups of m silent)."))
    high: float = Field(0.9, gt=0, le=1, description=(
        "r at or above which both are off (rollout.n = pods.m, every prompt fresh); linear in between."))
    momentum: float = Field(0.8, ge=0, lt=1, description=(
        "Weight of the previous average of r at each step (0.8: about the last five steps)."))


class PlanConfig(_Frozen):
    """The plan (our addition; rlcore/plan.py, tasks/training/plan.py, docs/algorithms.md section 9): measure the pool
    and the cost of a generated and an updated token, predict each candidate composition's effective-group ratio
    and training clock against plain GRPO, and choose."""

    auto: bool = Field(False, description=(
        "Train the plan's choice: the chosen candidate's keys replace the run's (conf/presets/auto.yaml; "
        "`rlsift plan` shows the choice without training)."))
    candidates: tuple[str, ...] = Field(
        ("grpo", "dapo", "dots", "pods", "dots_n4", "dots_screen"), min_length=1, description=(
            "Compositions the plan predicts and chooses from: names of conf/presets or conf/bench files. "
            "Candidates with the screen are left out where a prompt has no worked solution."))
    baseline: str = Field("grpo", description="The composition predictions are relative to (plain GRPO).")
    min_signal: float = Field(0.8, ge=0, le=1, description=(
        "A candidate qualifies when its predicted informative groups a step are at least this share of the "
        "baseline's; the cheapest qualifying one is chosen."))
    probe_prompts: int = Field(16, ge=1, description=(
        "Reference prompts the probe generates rollout.n rollouts for and updates on (timed, no weight change)."))


class GuardConfig(_Frozen):
    """The solved-skill guard (our addition; docs/algorithms.md section 7): selection methods that train only where
    the predicted success is near 0.5 let solved skills drift. Both parts are off by default (plain GRPO)."""

    share: float = Field(0.0, ge=0, lt=1, description=(
        "Share of each step's fresh prompts drawn uniformly from prompts measured solved (pass rate 1 over their "
        "last reference or training rollouts); the rest are selected as usual."))
    anchor: float = Field(0.0, ge=0, description=(
        "Advantage of every rollout of a group whose rollouts all succeed (0 in GRPO): a clipped likelihood push "
        "that keeps solved behaviour where it is, like supervised replay of the policy's own correct answers."))


class CurriculumConfig(_Frozen):
    """ScalingRL DES and curriculum scheduler, a labelled reconstruction (rlcore/curriculum.py;
    docs/algorithms.md section 4.2)."""

    enabled: bool = Field(False, description="Each round, the scheduler sets the active pool's size and mix.")
    weights: tuple[float, float, float] = Field((1 / 3, 1 / 3, 1 / 3), description=(
        "DES weights (w_D, w_C, w_R) of difficulty, CoT complexity and reward adaptability (normalised to sum 1)."))
    difficulty_form: Literal["peak", "monotone"] = Field("peak", description=(
        "DES difficulty: peak = 1 - 2|p - 0.5|; monotone = 1 - p (harder is better)."))
    s_min: float = Field(0.25, gt=0, le=1, description="Smallest active pool, as a share of the pool.")
    s_max: float = Field(1.0, gt=0, le=1, description="Largest active pool, as a share of the pool.")
    scale0: float = Field(0.5, gt=0, le=1, description=(
        "Initial active pool, as a share of the pool (at least prompts_per_step * round_steps)."))
    kappa: float = Field(0.25, ge=0, description="Relative change of the active pool size per round.")
    theta_lo: float = Field(0.2, ge=0, le=1, description="Windowed train accuracy below which the pool shrinks.")
    theta_hi: float = Field(0.7, ge=0, le=1, description="Windowed train accuracy above which the pool grows.")
    theta_learned: float = Field(0.9, ge=0, le=1, description=(
        "A seen prompt whose success rate reaches this counts as learned and is not exploited."))
    rho0: float = Field(0.2, ge=0, le=1, description="Initial exploit share (seen, unlearned prompts) of the pool.")
    rho_step: float = Field(0.1, ge=0, le=1, description=(
        "Change of the exploit share per round: up when held-out accuracy drops, down when it rises."))


class GainConfig(_Frozen):
    """GAIN-RL angle concentration and Gaussian window (rlcore/angle.py, rlcore/gain_sampler.py; arXiv 2506.02281;
    docs/algorithms.md section 5)."""

    enabled: bool = Field(False, description="Order prompts by angle concentration and move a window over them.")
    mode: Literal["gate", "prior"] = Field("gate", description="gate: DOTS picks inside the window; prior: weight.")
    prior_lambda: float = Field(0.2, ge=0, description="mode=prior: selection weights times window_prob ** lambda.")
    gate_width: float = Field(0.5, gt=0, le=1, description="Share of the pool the gate keeps.")
    inter_weight: float = Field(1.0, ge=0, description=(
        "Weight of C_inter in the angle score C_intra + w C_inter (paper 1, official code 8)."))
    sigma_frac: float = Field(0.13, gt=0, description=(
        "Window width sigma, as a share of the pool (official: 1000 rank positions of GSM8K's 7.5K)."))
    step_frac: float = Field(0.05, ge=0, description=(
        "Step size n of the mu update, as a share of the pool (official: 500 of 7.5K, 0.065)."))
    alpha: float = Field(2.0, allow_inf_nan=False, description="Accuracy sensitivity of the mu update.")
    beta: float = Field(0.5, ge=0, le=1, description="Target accuracy of the mu update.")
    gamma: float = Field(0.5, allow_inf_nan=False, description=(
        "Angle sensitivity of the mu update (paper 0.5; the official code uses alpha)."))


class EvalConfig(_Frozen):
    """Held-out evaluation (tasks/training/evaluate.py): greedy accuracy and sampled avg@k and pass@k."""

    samples: int = Field(4, ge=0, description=(
        "k for sampled avg@k and pass@k (0: greedy only); samples at the rollout engine's settings "
        "(rollout.temperature, top_p, top_k), i.e. the policy as it is trained."))
    limit: int | None = Field(None, ge=1, description="Evaluate at most this many test prompts.")
    every: int = Field(0, ge=0, description=(
        "Also evaluate greedily every N steps during training (0: off); the accuracy also drives ScalingRL's "
        "explore/exploit share rho (curriculum.rho_step)."))
    batch_size: int = Field(256, ge=1, description="Prompts per forward pass of the score stage (embeddings, angles).")


class TrackingConfig(_Frozen):
    """MLflow tracking (tasks/records/tracking.py)."""

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


class CostConfig(_Frozen):
    """Device hours and money per stage (tasks/records/cost.py)."""

    device: str | None = Field(None, description="Device type for pricing (default: detected).")
    prices: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.10, "nvidia-h200": 3.50, "nvidia-h100": 2.50, "nvidia-a100": 1.50,
                                 "nvidia-l40s": 1.00, "cuda": 2.00},
        description="Price per device hour, by device type.",
    )


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
