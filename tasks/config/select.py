"""Which prompts each step rolls out: prompt selection (``select.*``, uniform or DOTS, its weighting and the
screen), DOTS's difficulty predictor (``select.predictor``) and its reference set (``calibrate.*``);
tasks/selection/selector.py, rlcore/difficulty.py, docs/algorithms.md section 1."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import _Frozen

#: ``select.screen_precision``'s values (tasks/selection/screen.py resolves them).
ScreenPrecision = Literal["auto", "model", "bf16"]
#: ``select.screen_process``'s values (tasks/selection/screen.py ``in_sampler`` resolves them).
ScreenProcess = Literal["auto", "trainer", "sampler"]


class CalibrateConfig(_Frozen):
    """DOTS's reference set (docs/algorithms.md section 1.3): measured with the current policy each round."""

    k: int = Field(64, ge=2, description="Reference-set size K.")
    g: int = Field(8, ge=2, description="Rollouts per reference prompt.")
    reference: Literal["fresh", "trained"] = Field("fresh", description=(
        "fresh: each round rolls out K new reference prompts, drawn at random, with the current policy (the "
        "paper's); trained: a round's reference set is every prompt rolled out since the last round started "
        "(the calibrate stage's prompts for round 0, then the trained groups, all n rollouts of each), no rollouts "
        "of its own; its labels are up to train.round_steps steps old (tasks/selection/rounds.py)."))


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
    """Which prompts each step rolls out (tasks/selection/selector.py; docs/algorithms.md section 1.3)."""

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
        "tasks/selection/screen.py) and the prompts whose groups of rollout.n are most likely to have unequal "
        "rewards are kept; the rest go back to the round's pool. Needs a worked solution for every pool prompt; "
        "the forward passes count in the selection time (ours)."))
    prescreen: int = Field(0, ge=0, description=(
        "With the screen: candidates its pass scores per prompt a step needs (0: all of select.screen's). Of the "
        "screen's f candidates a prompt, those whose last screen score said their groups were most likely mixed "
        "are scored again (that chance pulled toward the draw's mean as it ages, prescreen_half_life); a candidate "
        "never scored counts at that mean; the rest go back to the pool unscored. The pass then costs prescreen "
        "candidates a prompt instead of f, while the screen still chooses among f (rlcore.selection.prescreen; "
        "ours). Must be below select.screen."))
    prescreen_half_life: float = Field(20.0, gt=0, description=(
        "select.prescreen: steps after which a remembered score's chance is halfway back to the draw's mean "
        "(the policy has moved since it was scored)."))
    screen_ahead: bool = Field(True, description=(
        "With the screen, where the rollouts are generated apart from the trainer (overlap.lag 1's generator "
        "process, or an engine outside this process): score the next step's candidates beside this step's generate "
        "call, with this step's sampling weights (one update older than the next step's), instead of before the "
        "next generate call. The next step reads the scores of the candidates it does draw and scores any others "
        "itself; a step that starts a round scores its own. false: every step scores its candidates before its "
        "own generate call (ours)."))
    screen_precision: ScreenPrecision = Field("auto", description=(
        "The dtype of the screen's pass: model (the sampler's weights as they are), bf16 (a bfloat16 copy of them, "
        "refreshed before each pass, where they are float32; tasks/model/bf16_copy.py) or auto (bf16 where the "
        "pass runs on a CPU with native bf16 matrix products, AVX512-BF16 or AMX; else model: on a GPU the weights "
        "are bf16 already under model.precision auto). The pass only ranks candidates: in bf16 its log-likelihood "
        "of a worked solution moves by bf16 rounding (up to 0.3 nats on the bundled task) and it takes 0.44x the "
        "time on a CPU with AVX512-BF16 (docs/performance.md, 'The screen's pass in bf16')."))
    screen_process: ScreenProcess = Field("auto", description=(
        "Where the screen's passes run when overlap.lag 1 draws in a generator process: trainer (this process, the "
        "look-ahead after the update it runs beside, on the trainer's cores), sampler (the generator process, on "
        "its copy of the same weights, the look-ahead right after its generate call: the same scores, the pass on "
        "the generator's core, where it idles while the trainer updates) or auto (sampler on a CPU, where the two "
        "split its cores; trainer elsewhere, unmeasured). Ignored without the screen or the generator process "
        "(docs/performance.md, 'The screen's pass in the generator process')."))
    round_ahead: bool = Field(False, description=(
        "Where the rollouts are generated apart from the trainer (overlap.lag 1's generator process, or an engine "
        "outside this process) and a round's start takes no reference rollouts (calibrate.reference trained, or "
        "no DOTS): start the next round (DOTS's predictor fitted, its predictions and the round's weights; with "
        "screen_ahead, also the screen of the round's first candidates) beside the generate call of the round's "
        "last step, on the labels observed until then (one step's fewer than at the round's first draw). Off by "
        "default: 4 % off dots_screen's clock on 2 CPU cores, at -0.4 points on the balanced mix (noise-level; "
        "docs/benchmarks.md, 'Every idea tried'); on in the prescreened arms (conf/bench/grpo_prescreen.yaml), whose "
        "uniform draw reads no label at a round's start: -7.5 % of their training stage with the screen in the "
        "generator process. false: the round starts in its first step's draw (ours)."))
    predictor: PredictorConfig = Field(PredictorConfig(), description="The DOTS difficulty predictor.")

    @model_validator(mode="after")
    def _prescreen_below_screen(self) -> SelectConfig:
        if self.prescreen and self.prescreen >= self.screen:
            raise ValueError(f"select.prescreen ({self.prescreen}) scores that many of the screen's candidates a "
                             f"prompt, so it must be below select.screen ({self.screen}); 0 scores them all")
        return self
