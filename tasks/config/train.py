"""The GRPO update (``train.*``): steps and rounds, the optimizer and learning-rate schedule, the loss (clip,
aggregation, KL, behaviour policy) and how the update is computed (micro-batches, skipped rows, checkpoints);
tasks/training/loop.py, update.py, docs/algorithms.md section 0."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import _Frozen

#: ``train.kl_rows``: the rollouts the KL term is computed on (TrainConfig.kl_rows describes each).
KlRows = Literal["all", "informative", "informative_and_solved"]
#: ``train.shared_prefix``'s values.
SharedPrefix = bool | Literal["auto"]


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
    shared_prefix: SharedPrefix = Field("auto", description=(
        "Compute each group's prompt once in the update's passes (Prefix Grouper, arXiv 2506.05433): a group is "
        "packed as [prompt | completion_1 | ... | completion_n], every completion attending to the prompt and to "
        "itself, so the log-probs and gradients are the row layout's up to float rounding while the layers run "
        "over n - 1 fewer prompts a group. Micro-batches then hold whole groups, at most micro_batch_tokens packed "
        "tokens each (a group over it by itself in pieces, a prompt each). true / false; auto: on where the update "
        "runs on the CPU (measured there: plain GRPO's update 0.86x its time, SmolLM2-135M's 0.65x; "
        "docs/performance.md), off on a GPU, where its attention "
        "takes SDPA's masked kernel instead of flash attention (one H200, 1.5B: 2.2x slower than rows). One "
        "process only (scale-out and models not on SDPA attention keep the row layout), and not where GAIN-RL "
        "reads hidden states."))
    max_skipped_steps: int = Field(3, ge=0, description=(
        "Stop the run after this many steps in a row whose update was skipped (every minibatch's loss or gradient "
        "not finite, so no weight moved), with an error naming the cause and the site the NaN locator found "
        "(tasks/update/nan_locator.py); a single skipped step is logged, counted (train/skipped_updates) and "
        "recorded in the ledger's skipped_updates table, and the run goes on. 0: never stop."))
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N steps (0: round boundaries only).")
    gradient_checkpointing: bool = Field(False, description=(
        "Activation checkpointing in the update: each decoder layer's activations are recomputed in the backward "
        "pass instead of kept (transformers' gradient_checkpointing_enable, non-reentrant), for less memory at "
        "about one more forward pass. Loss and gradients are unchanged; generation is unaffected."))
    behaviour: Literal["auto", "sampler", "trainer"] = Field("auto", description=(
        "Whose log-probs are a fresh rollout's behaviour policy mu in the loss. sampler: the rollout engine's own "
        "(the in-process generator computes them while sampling, vLLM returns them); trainer: the update's "
        "recomputed pi_old (mu = pi_old, plain PPO-clip). auto: sampler whenever the sampler is not the trainer's "
        "own module at the step's start (overlap.lag > 0, rollout.engine=vllm, or waves.carry with waves.enabled), "
        "else trainer "
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
