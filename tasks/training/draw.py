"""A training step's draw: select prompts, generate and verify rollouts, down-sample and build the groups.

What one step's update needs from sampling, made in the step itself (``overlap.lag`` 0) or one step ahead while the
previous update runs (lag 1, tasks/overlap/concurrent.py): the selector's prompts (tasks/selection/selector.py:
ScalingRL -> GAIN-RL -> DOTS, then the likelihood screen, tasks/selection/screen.py), n rollouts each with their
rewards (tasks/calibration/reference.py; n from the adaptive composition's plan, rlcore.adaptive_composition), PODS's m
of n kept and the group-relative advantages on them (rlcore.downsample, rlcore.advantages), with DAPO's dynamic
sampling drawing again until enough groups are informative (rlcore.dynamic_sampling), or with per-prompt rollout
budgets drawing the rollouts in two waves (tasks/training/waves.py, rlcore.rollout_budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from rlcore.adaptive_composition import CompositionPlan
from rlcore.advantages import group_advantages, solved_anchor
from rlcore.downsample import downsample
from rlcore.dynamic_sampling import BatchFiller
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.calibration.reference import rollout_rewards
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.records.ledger import ReferenceRow, SelectionRow
from tasks.run import Run
from tasks.selection.selector import Selector

#: The phases of a step's draw (``StepDraw.phases``; overlapped, its ``overlap/draw_<phase>_s`` metrics).
DRAW_PHASES = ("reference", "selection", "rollout")

T = TypeVar("T")


def beside(work: Callable[[], T], other: Callable[[], None] | None,
           after: Callable[[], None] | None = None, then: bool = False) -> T:
    """``work()``'s result, with ``other`` (where given) run at the same time on a second thread, once ``after()``
    (where given) has returned, both finished on return; an error in either is raised. The draws run the next step's
    selection work (``Selector.lookahead``) beside a generate call, which waits on a generator process or a server;
    a draw beside an update runs it once that update has ended (tasks/overlap/concurrent.py). ``then``: ``other``
    runs after ``work`` on this thread instead, not waiting for ``after`` (its pass is the generator process's,
    which serves one request at a time: ``Selector.ahead_after_draw``)."""
    if other is None:
        return work()
    if then:
        out = work()
        other()
        return out

    def later() -> None:
        if after is not None:
            after()
        other()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsift-screen") as pool:
        done = pool.submit(later)
        out = work()
        done.result()
    return out


def make_groups(gen: Generation, rewards: torch.Tensor, records: list[PromptRecord], step: int, *, m: int | None,
                rule: str, scale_std: bool, generator: torch.Generator, negative_weight: float, anchor: float,
                sampler_behaviour: bool = False, version: int | None = None) -> tuple[list[RolloutGroup], dict]:
    """PODS down-sampling (when m is set) and group-relative advantages on the kept rollouts; ``anchor``: the
    solved-skill guard's advantage for groups whose kept rollouts all succeed (``rlcore.advantages.solved_anchor``).

    Every group carries its rollouts' sampler log-probs; ``sampler_behaviour`` makes them its behaviour policy mu
    (``train.behaviour``), otherwise the update's pi_old is. ``version``: the sampling weights' update count."""
    b, n = rewards.shape
    if m is None:
        keep, stats = torch.arange(n).expand(b, n), {}
    else:
        keep, stats = downsample(rewards, m, rule=rule, generator=generator)
    kept_r = rewards.gather(1, keep)  # [B, G]
    adv = group_advantages(kept_r, scale_by_std=scale_std)  # [B, G]
    if negative_weight != 1.0:
        adv = torch.where(adv < 0, adv * negative_weight, adv)
    adv = solved_anchor(kept_r, adv, anchor)
    groups = []
    for i, rec in enumerate(records):
        rows = i * n + keep[i]
        sampler = gen.logprobs[rows]
        groups.append(RolloutGroup(
            prompt_id=rec.id, prompt_ids=gen.prompt_ids[i], completion_ids=gen.completion_ids[rows],
            completion_mask=gen.completion_mask[rows], rewards=kept_r[i], advantages=adv[i],
            behaviour_logp=sampler if sampler_behaviour else torch.zeros(0), success_rate=float(rewards[i].mean()),
            n_generated=n, step=step, sampler_logp=sampler, policy_version=version))
    return groups, stats


@dataclass(frozen=True)
class CarriedRollouts:
    """Rollouts a step's draw leaves for the next draw to complete (``waves.carry``, tasks/training/waves.py): the
    first waves of the candidates drawn at ``step`` that were given a completion, their ``records``, rows ``gen``
    (``gen.n`` each), ``rewards`` [K, gen.n] and the sampling weights' ``version``. Kept in the checkpoint."""

    step: int
    records: list[PromptRecord]
    gen: Generation
    rewards: torch.Tensor
    version: int | None


@dataclass(frozen=True)
class FreshBatch:
    """One step's freshly generated groups.

    Attributes:
        groups: the groups that enter the update (all of them, or with dynamic sampling the informative ones).
        idx: pool indices of every prompt selected this step (every generation round), in draw order.
        rows: a ledger row per selected prompt.
        records: the selected prompts.
        rewards: each selected prompt's rewards [n_i] of every rollout generated for it (labels for the predictor;
            n_i is n, or with per-prompt budgets its first wave or its completed group).
        generated: rollouts generated (discarded ones included); tokens: their completion tokens;
            prompt_tokens: their prompts' tokens (a prompt counted once per rollout).
        gen_s: wall seconds in generation and verification.
        stats: PODS and dynamic-sampling metrics, and the rollout engine's own (``RolloutEngine.metrics``).
        carry: rollouts for the next step's draw to complete (:class:`CarriedRollouts`), or None.
    """

    groups: list[RolloutGroup]
    idx: list[int]
    rows: list[SelectionRow]
    records: list[PromptRecord]
    rewards: list[torch.Tensor]
    generated: int
    tokens: int
    prompt_tokens: int
    gen_s: float
    stats: dict[str, float]
    carry: CarriedRollouts | None = None

    @property
    def reward_mean(self) -> float:
        """The mean reward over every generated rollout."""
        return float(torch.cat(self.rewards).mean())


def sample_fresh(run: Run, policy: Policy, selector: Selector, pool: list[PromptRecord], k: int,
                 step: int, n: int, *, meter: CostMeter | None = None, sampler_behaviour: bool = False,
                 version: int | None = None, carry: CarriedRollouts | None = None,
                 after_update: Callable[[], None] | None = None) -> FreshBatch:
    """Select k prompts, generate n rollouts each (``rollout.n``, or the adaptive composition's plan), verify,
    down-sample (PODS) and build groups.

    With ``dynamic.enabled`` (DAPO's dynamic sampling, rlcore/dynamic_sampling.py) further rounds select and
    generate until k informative groups are found or ``dynamic.max_rounds`` is reached; every round's
    rollouts count. Round 0 draws with the seeds of a step without dynamic sampling.

    ``meter``: where the phases are timed (default ``run.meter``; an overlapped draw keeps its own);
    ``sampler_behaviour`` and ``version``: :func:`make_groups`'; ``carry``: what the last draw left to complete
    (None here: a run resumed with the carried waves turned off is an error); ``after_update``: where the draw runs
    beside an update (lag 1), returns once it has ended, and the selection's look-ahead waits for it (:func:`beside`).
    """
    if carry is not None:
        raise ValueError(f"step {step}: the rollouts carried from step {carry.step} need the waves' draw "
                         "(waves.enabled and waves.carry); resume with the config that drew them")
    cfg, tc = run.cfg, run.cfg.train
    meter = meter if meter is not None else run.meter
    ds = cfg.dynamic
    filler = BatchFiller(k, ds.oversample, ds.max_rounds) if ds.enabled else None
    idx_all, rows_all, records_all, rewards_all, pods_all = [], [], [], [], []
    generated = tokens = prompt_tokens = 0
    gen_s = 0.0
    groups: list[RolloutGroup] = []
    attempt = 0

    def seed(purpose: str) -> int:  # round 0 keeps the seeds of a step without dynamic sampling
        return derive_seed(cfg.seed, step, purpose, *((attempt,) if attempt else ()))

    while True:
        want = filler.request() if filler is not None else k
        with meter.stage("selection"):
            idx, rows = selector.choose(want, step, attempt)
        records = [pool[i] for i in idx]
        with meter.stage("rollout"):
            t_gen = time.perf_counter()
            gen, rewards = beside(lambda records=records: rollout_rewards(policy, records, n, seed("train")),
                                  selector.lookahead() if attempt == 0 else None, after_update,
                                  selector.ahead_after_draw)
            gen_s += time.perf_counter() - t_gen
        gen_rng = torch.Generator().manual_seed(seed("pods"))
        with meter.stage("selection"):
            groups, pods_stats = make_groups(gen, rewards, records, step,
                                             m=cfg.pods.m if cfg.pods.enabled else None, rule=cfg.pods.rule,
                                             scale_std=tc.scale_std, generator=gen_rng,
                                             negative_weight=tc.negative_weight, anchor=cfg.guard.anchor,
                                             sampler_behaviour=sampler_behaviour, version=version)
        idx_all += idx
        rows_all += rows
        records_all += records
        rewards_all.append(rewards)
        pods_all.append((len(records), pods_stats))
        generated += gen.completion_ids.shape[0]
        tokens += gen.tokens
        prompt_tokens += n * sum(int(p.numel()) for p in gen.prompt_ids)
        attempt += 1
        if filler is None:
            break
        filler.add(groups)
        if filler.done:
            groups = filler.batch()
            break
    total = sum(b for b, _ in pods_all)
    stats = {key: sum(b * st[key] for b, st in pods_all) / total for key in pods_all[0][1]}
    if filler is not None:
        stats |= filler.metrics()
    stats |= policy.engine.metrics()  # a pool's live servers, the generator process's peak memory
    stats |= selector.take_filter_metrics()  # the skip's prompts left out of this draw
    return FreshBatch(groups=groups, idx=idx_all, rows=rows_all, records=records_all,
                      rewards=list(torch.cat(rewards_all)), generated=generated, tokens=tokens,
                      prompt_tokens=prompt_tokens,
                      gen_s=gen_s, stats=stats)


@dataclass(frozen=True)
class StepDraw:
    """What one step's sampling hands its update: drawn in the step itself (``overlap.lag`` 0) or, one step ahead,
    while the previous update ran (lag 1; then kept in the checkpoint until trained).

    Attributes:
        step: the step these rollouts are for.
        fresh: the freshly generated groups.
        plan: the adaptive composition's plan (rollouts a prompt, fresh share) the draw followed.
        n_replay: replayed groups to add at the update.
        version: updates the sampling weights had received (``step`` on-policy, ``step - 1`` with lag 1).
        metrics: the round start's metrics (reference rollouts, predictor, curriculum, window) when the step
            starts a round.
        references: the round start's reference rows for the ledger.
        phases: seconds of the draw's phases (reference, selection, rollout).
    """

    step: int
    fresh: FreshBatch
    plan: CompositionPlan
    n_replay: int
    version: int
    metrics: dict[str, float]
    references: tuple[ReferenceRow, ...]
    phases: dict[str, float]


def use_sampler_behaviour(cfg, lag: int) -> bool:
    """``train.behaviour``: whether fresh groups' mu is the sampler's log-probs (auto: whenever the sampler is not
    the trainer's own module at the step's start: ``lag`` 1, an engine outside this process, or the waves carried
    into the next step, whose first waves are one update older than the step)."""
    if cfg.train.behaviour != "auto":
        return cfg.train.behaviour == "sampler"
    return lag > 0 or cfg.rollout.engine != "hf" or (cfg.waves.enabled and cfg.waves.carry)
