"""The techniques a run composes on top of GRPO, each off by default: PODS (``pods``), DAPO's dynamic
sampling (``dynamic``), Rollout Replay (``replay``), the adaptive composition (``adapt``), the plan that chooses
among them (``plan``), the solved-skill guard (``guard``), ScalingRL's curriculum (``curriculum``) and GAIN-RL
(``gain``); docs/algorithms.md sections 2-9."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.base import _Frozen


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
    """The plan (our addition; rlcore/plan.py, tasks/plan/planner.py, docs/algorithms.md section 9): measure the pool
    and the cost of a generated and an updated token, predict each candidate composition's effective-group ratio
    and training clock against plain GRPO, and choose."""

    auto: bool = Field(False, description=(
        "Train the plan's choice: the chosen candidate's keys replace the run's (conf/presets/auto.yaml; "
        "`rlsift plan` shows the choice without training)."))
    candidates: tuple[str, ...] = Field(
        ("grpo", "dapo", "dots", "pods", "dots_n4", "dots_screen", "dots_screen_24", "dots_screen_waves",
         "grpo_screen", "grpo_screen_24", "grpo_screen_28", "grpo_prescreen", "grpo_prescreen_18",
         "grpo_prescreen_20", "grpo_prescreen_n6", "grpo_prescreen_n6_11", "grpo_prescreen_n6_14",
         "grpo_screen_waves"),
        min_length=1,
        description=(
            "Compositions the plan predicts and chooses from: names of conf/presets or conf/bench files. "
            "Candidates with the screen are left out where a prompt has no worked solution; for each technique inside "
            "a candidate's step (the waves, the skip) the plan also says what it saves (rollouts a step and per "
            "informative group, the step) against the candidate without it."))
    baseline: str = Field("grpo", description="The composition predictions are relative to (plain GRPO).")
    min_signal: float = Field(0.45, ge=0, le=1, description=(
        "A candidate qualifies when its predicted informative contrasts a step (each informative group's trained "
        "rows less one: rlcore/plan.py) are at least this share of the baseline's; the cheapest qualifying one is "
        "chosen. 1: GRPO's signal. The prescreen's groups of 4 on 16-20 prompts stand at 0.33-0.41 of plain GRPO's "
        "contrasts on `balanced`, where they ended 0.1-1.0 points below GRPO in every benchmark S52-S59; at 0.45 "
        "they fall out and the fewest groups of 6 that clear it are chosen (11 prompts at 0.55-0.59 on the default "
        "pool, 12 at 0.47 on `balanced`), at a higher effective share for about the same step (docs/benchmarks.md, "
        "'Every idea tried', the rows of the signal floor and of groups of 6)."))
    prune: bool = Field(True, description=(
        "Once the probe has timed what every step pays (generation, the update, the optimizer step, a checkpoint, "
        "the bookkeeping), stop measuring for the candidates that could not be chosen even if what they alone pay "
        "(the screen's pass, the scoring, DOTS's predictor) cost nothing; their predictions are then lower bounds. "
        "false: measure for every candidate (`rlsift bench` sets it, to compare every prediction)."))
    probe_prompts: int = Field(16, ge=1, description=(
        "Reference prompts the probe generates rollout.n rollouts for and updates on (timed, no weight change)."))
    reuse_probe_hours: float = Field(24.0, ge=0, description=(
        "A probe's timings are kept under paths.cache (plan-probe/) for the next plan on the same machine, model "
        "shape and settings (tasks/plan/probe_cache.py): a part whose timed sizes span the ones it needs is reused "
        "for this many hours and not timed again (a benchmark's next seed, a scheduled retraining). 0: time every "
        "part and keep nothing."))


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
