"""A step's draw with per-prompt rollout budgets (``waves.enabled``): the rule is rlcore/rollout_budget.py's.

    select   ceil(waves.candidates x B) candidate prompts, as a step selects its prompts (tasks/selection/selector.py:
             DOTS, the screen, the pre-rollout skip), each with its best pass-rate estimate (``Selector.estimate``)
    wave 1   waves.first rollouts of every candidate, one generate call, verified
    allocate each candidate's chance that its completed group is mixed; at most B completed, by that chance
    wave 2   rollout.n - waves.first more rollouts of each completed candidate, one generate call, verified
    groups   the completed groups (n rollouts: the first wave's rows then the second's) and the mixed first waves
             past the budget (waves.first rollouts), each with PODS (where it keeps fewer than the group has) and
             the configured advantages on its own rollouts (tasks/training/draw.py ``make_groups``, one call per
             group size); first waves that agreed and were not completed are not trained

Groups are in draw order. Every rollout of both waves counts in ``rollout/generated``, the tokens, the rollout time
and the cost, and every candidate's rewards label the selection (``FreshBatch.rewards``, of unequal lengths).
Seeds: wave 1 draws with the seed a step without waves uses (``train``), wave 2 with its own (``wave-2``); both are
part of one draw, so a checkpoint (tasks/training/checkpoint.py) holds a lag-1 draw with both waves or neither.
"""

from __future__ import annotations

import math
import time

import torch

from rlcore.rollout_budget import allocate, completion_chance
from rlcore.seeding import derive_seed
from tasks.calibration.reference import rollout_rewards
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.run import Run
from tasks.selection.selector import Selector
from tasks.training.draw import FreshBatch, make_groups


def rows_of(gen: Generation, prompts: list[int]) -> Generation:
    """The rows of ``gen``'s prompts ``prompts`` (indices into its prompts), prompt-major as generated."""
    n = gen.n
    rows = torch.tensor([p * n + j for p in prompts for j in range(n)], dtype=torch.long)
    return Generation(prompt_ids=[gen.prompt_ids[p] for p in prompts], completion_ids=gen.completion_ids[rows],
                      completion_mask=gen.completion_mask[rows], texts=[gen.texts[int(r)] for r in rows], n=n,
                      logprobs=gen.logprobs[rows])


def join_waves(first: Generation, second: Generation) -> Generation:
    """Each prompt's first-wave rows followed by its second-wave rows (both of the same prompts, in one order):
    groups of ``first.n + second.n``, right-padded to the wider wave."""
    b, w, r = len(first.prompt_ids), first.n, second.n
    width = max(first.completion_ids.shape[1], second.completion_ids.shape[1])

    def per_prompt(a: torch.Tensor, c: torch.Tensor, value) -> torch.Tensor:
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)  # noqa: E731
        return torch.cat([pad(a).view(b, w, width), pad(c).view(b, r, width)], 1).view(b * (w + r), width)

    texts = [t for p in range(b) for t in (first.texts[p * w:(p + 1) * w] + second.texts[p * r:(p + 1) * r])]
    return Generation(prompt_ids=list(first.prompt_ids), completion_ids=per_prompt(first.completion_ids,
                                                                                    second.completion_ids, 0),
                      completion_mask=per_prompt(first.completion_mask, second.completion_mask, False),
                      texts=texts, n=w + r, logprobs=per_prompt(first.logprobs, second.logprobs, 0.0))


def sample_waves(run: Run, policy: Policy, selector: Selector, pool: list[PromptRecord], budget: int, step: int,
                 n: int, *, meter: CostMeter | None = None, sampler_behaviour: bool = False,
                 version: int | None = None) -> FreshBatch:
    """One step's fresh groups drawn in two waves (module docstring): ``budget`` B completed groups at most, ``n``
    the full group; ``meter``, ``sampler_behaviour`` and ``version`` as tasks/training/draw.py ``sample_fresh``'s."""
    cfg, tc, wc = run.cfg, run.cfg.train, run.cfg.waves
    meter = meter if meter is not None else run.meter
    w = wc.first
    seed = lambda purpose: derive_seed(cfg.seed, step, purpose)  # noqa: E731
    with meter.stage("selection"):
        idx, rows = selector.choose(math.ceil(wc.candidates * budget), step)
        prior = selector.estimate(idx)
    records = [pool[i] for i in idx]
    with meter.stage("rollout"):
        t0 = time.perf_counter()
        gen1, r1 = rollout_rewards(policy, records, w, seed("train"))  # [C, w]
        gen_s = time.perf_counter() - t0
    mixed = r1.amax(1) > r1.amin(1)  # [C]
    with meter.stage("selection"):
        chance = torch.where(mixed, 1.0, completion_chance((r1 >= 0.5).sum(1), w, n, prior, wc.prior_strength))
        top = allocate(chance, budget, wc.min_chance)
    topped = top.nonzero().squeeze(1).tolist()
    partial = (mixed & ~top).nonzero().squeeze(1).tolist()
    rewards = list(r1)
    generated, tokens = gen1.completion_ids.shape[0], gen1.tokens
    prompt_tokens = w * sum(int(p.numel()) for p in gen1.prompt_ids)
    parts: list[tuple[list[int], Generation, torch.Tensor]] = []  # (candidates, their rows, rewards) per group size
    if topped:
        with meter.stage("rollout"):
            t0 = time.perf_counter()
            gen2, r2 = rollout_rewards(policy, [records[j] for j in topped], n - w, seed("wave-2"))
            gen_s += time.perf_counter() - t0
        for k, j in enumerate(topped):
            rewards[j] = torch.cat([r1[j], r2[k]])
        parts.append((topped, join_waves(rows_of(gen1, topped), gen2), torch.cat([r1[topped], r2], 1)))
        generated, tokens = generated + gen2.completion_ids.shape[0], tokens + gen2.tokens
        prompt_tokens += (n - w) * sum(int(p.numel()) for p in gen2.prompt_ids)
    if partial:
        parts.append((partial, rows_of(gen1, partial), r1[partial]))
    if not parts:  # nothing mixed and nothing completed: the first waves, all silent (no gradient; the step counts)
        parts.append((list(range(len(idx))), gen1, r1))
    pods_stats, made = [], {}
    with meter.stage("selection"):
        for size_rank, (which, gen, r) in enumerate(parts):
            m = cfg.pods.m if cfg.pods.enabled and cfg.pods.m < gen.n else None
            groups, st = make_groups(gen, r, [records[j] for j in which], step, m=m, rule=cfg.pods.rule,
                                     scale_std=tc.scale_std,
                                     generator=torch.Generator().manual_seed(seed(f"pods-{size_rank}")),
                                     negative_weight=tc.negative_weight, anchor=cfg.guard.anchor,
                                     sampler_behaviour=sampler_behaviour, version=version)
            made |= dict(zip(which, groups, strict=True))
            if st:
                pods_stats.append((len(which), st))
    stats = wave_metrics(len(idx), len(topped), len(partial), int(mixed.sum()), generated)
    if pods_stats:
        total = sum(b for b, _ in pods_stats)
        stats |= {key: sum(b * st[key] for b, st in pods_stats) / total for key in pods_stats[0][1]}
    stats |= policy.engine.metrics()
    stats |= selector.take_filter_metrics()
    return FreshBatch(groups=[made[j] for j in sorted(made)], idx=idx, rows=rows, records=records, rewards=rewards,
                      generated=generated, tokens=tokens, prompt_tokens=prompt_tokens, gen_s=gen_s, stats=stats)


def wave_metrics(candidates: int, topped: int, partial: int, mixed: int, generated: int) -> dict[str, float]:
    """``waves/*``: the step's candidates, completed groups, mixed first waves trained as they were, first waves that
    were mixed, agreeing first waves left untrained, and rollouts a candidate."""
    return {"waves/candidates": float(candidates), "waves/completed": float(topped), "waves/partial": float(partial),
            "waves/mixed_first": float(mixed), "waves/dropped": float(candidates - topped - partial),
            "waves/rollouts_per_candidate": generated / max(candidates, 1)}
