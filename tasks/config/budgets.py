"""Where a step spends its rollouts inside the selected prompts: per-prompt rollout budgets in two waves
(``waves``; rlcore/rollout_budget.py) and the pre-rollout skip of prompts whose last groups were silent (``skip``;
rlcore/silent_skip.py). Both off by default (plain GRPO); docs/algorithms.md section 7.9."""

from __future__ import annotations

from pydantic import Field

from tasks.config.base import _Frozen


class WavesConfig(_Frozen):
    """Per-prompt rollout budgets (Reinforce-Ada arXiv 2510.04996, AR3PO arXiv 2509.25808, Knapsack RL arXiv
    2509.25849; ours as composed: rlcore/rollout_budget.py)."""

    enabled: bool = Field(False, description=(
        "Draw each step's rollouts in two waves: waves.first rollouts for each candidate prompt, then rollout.n - "
        "waves.first more for at most train.prompts_per_step of them, those whose first wave is mixed or whose "
        "completed group would be mixed with chance at least waves.min_chance. Mixed first waves past that budget "
        "are trained as groups of waves.first; agreeing ones not completed are not trained (their rollouts count)."))
    first: int = Field(2, ge=1, description="Rollouts each candidate prompt gets in the first wave (below rollout.n).")
    candidates: float = Field(1.5, ge=1.0, description=(
        "Candidate prompts a step, as a multiple of train.prompts_per_step (the budget of completed groups); "
        "each is drawn as a step's prompts are (the selection, the screen, the skip)."))
    min_chance: float = Field(0.5, ge=0, le=1, description=(
        "A candidate whose first wave agrees is completed only when the chance that its full group is mixed "
        "(Beta posterior of its pass rate given the first wave) is at least this (1: only mixed first waves)."))
    carry: bool = Field(False, description=(
        "Draw a step's second wave in the next step's generate call, beside that step's first waves: one call a "
        "step instead of two. The completed groups are trained one step later, their first wave one update older "
        "than their second (both corrected as off-policy rollouts: train.behaviour auto uses the sampler's "
        "log-probs). The last step completes its own groups."))
    prior_strength: float = Field(2.0, ge=0, description=(
        "Pseudo-rollouts the candidate's estimated pass rate is worth in that posterior (the screen's likelihood, "
        "else DOTS's prediction, else its last measured rate; none known: the Jeffreys prior alone)."))


class SkipConfig(_Frozen):
    """The pre-rollout skip (GRESO, arXiv 2506.02177; rlcore/silent_skip.py)."""

    enabled: bool = Field(False, description=(
        "Before each step's draw (and before the screen scores a candidate), skip each prompt whose last rollouts "
        "all agreed with chance min(skip.cap, 1 - skip.explore^z), z its consecutive agreeing rollouts over "
        "rollout.n; a mixed group resets z."))
    explore: float = Field(0.5, gt=0, lt=1, description=(
        "Chance a prompt returns after one silent group of rollout.n (multiplied again for each further one)."))
    cap: float = Field(0.9, ge=0, lt=1, description=(
        "Highest skip chance: a prompt silent for ever is still drawn with chance 1 - cap of its weight."))
