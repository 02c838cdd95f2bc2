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

**Carried** (``waves.carry``): a step's second wave is drawn in the next step's call, beside that step's first
waves, so a step makes one generate call, not two (a call's decode steps cost the same whatever its rows:
docs/algorithms.md 9.1; the second call was most of what the waves cost, docs/benchmarks.md). The candidates given a
completion leave their first waves in ``FreshBatch.carry`` (:class:`~tasks.training.draw.CarriedRollouts`); the
next draw completes and trains them before its own groups. Their first wave was sampled one update before their
second: each rollout keeps its sampler's log-probs as its behaviour policy (``train.behaviour`` auto), as any
off-policy rollout. The first step has nothing carried in, so it trains only its mixed first waves past the budget
(or its silent ones); the last step (``train.steps``), or a step that would otherwise train nothing with a gradient,
completes its own groups in a second call. One call serves rows
of n - w and of w a prompt by asking a prompt several times (:func:`rollout_parts`).

Groups are in draw order (carried ones first). Every rollout of both waves counts in ``rollout/generated``, the
tokens, the rollout time and the cost of the step whose call drew it, and every candidate's first-wave rewards (with
its second wave's, when completed in the step) label the selection (``FreshBatch.rewards``, of unequal lengths); a
carried group's second wave labels nothing. Seeds: wave 1 draws with the seed a step without waves uses
(``train``), wave 2 with its own (``wave-2``); both are part of one draw, so a checkpoint
(tasks/training/checkpoint.py) holds a lag-1 draw with both waves or neither, and the carried first waves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from rlcore.rollout_budget import allocate, completion_chance
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.calibration.reference import rollout_rewards
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.policy import Policy
from tasks.records.cost import CostMeter
from tasks.run import Run
from tasks.selection.selector import Selector
from tasks.training.draw import CarriedRollouts, FreshBatch, beside, make_groups


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


def slice_rows(gen: Generation, start: int, prompts: int, per: int) -> Generation:
    """Rows ``start`` .. ``start + prompts * per`` of ``gen`` as ``prompts`` groups of ``per`` (a prompt's rows
    adjacent, as :func:`rollout_parts` asks them)."""
    rows = slice(start, start + prompts * per)
    return Generation(prompt_ids=[gen.prompt_ids[(start + i * per) // gen.n] for i in range(prompts)],
                      completion_ids=gen.completion_ids[rows], completion_mask=gen.completion_mask[rows],
                      texts=gen.texts[rows], n=per, logprobs=gen.logprobs[rows])


def rollout_parts(policy: Policy, parts: list[tuple[list[PromptRecord], int]],
                  seed: int) -> list[tuple[Generation, torch.Tensor]]:
    """One generate call for several sets of prompts, each (records, rollouts a prompt), verified; returns each
    set's rows and rewards [B_i, r_i]. A prompt of r rollouts is asked r / u times in a row, u the greatest common
    divisor of the r_i, so each copy is seeded by its own place in the call (tasks/generation/rollout.py)."""
    u = math.gcd(*(r for _, r in parts))
    asked = [rec for recs, r in parts for rec in recs for _ in range(r // u)]
    gen, rewards = rollout_rewards(policy, asked, u, seed)
    flat, out, row = rewards.flatten(), [], 0
    for recs, r in parts:
        out.append((slice_rows(gen, row, len(recs), r), flat[row:row + len(recs) * r].view(len(recs), r)))
        row += len(recs) * r
    return out


class WavePart(NamedTuple):
    """Groups of one size that a draw trains: their order ``keys`` in the batch, ``records``, rows ``gen``
    (``gen.n`` each), ``rewards`` [B_i, gen.n] and the sampling weights' ``version`` (a carried group's first
    wave's)."""

    keys: list[int]
    records: list[PromptRecord]
    gen: Generation
    rewards: torch.Tensor
    version: int | None


def part_groups(cfg: Config, parts: list[WavePart], step: int, seed: Callable[[str], int], sampler_behaviour: bool
                ) -> tuple[list[RolloutGroup], dict[str, float]]:
    """Each part's groups (tasks/training/draw.py ``make_groups``: PODS where it keeps fewer than a part's groups
    have, the configured advantages), in key order, and the PODS metrics weighted by each part's groups."""
    tc, made, pods = cfg.train, {}, []
    for rank, part in enumerate(parts):
        m = cfg.pods.m if cfg.pods.enabled and cfg.pods.m < part.gen.n else None
        groups, st = make_groups(part.gen, part.rewards, part.records, step, m=m, rule=cfg.pods.rule,
                                 scale_std=tc.scale_std, generator=torch.Generator().manual_seed(seed(f"pods-{rank}")),
                                 negative_weight=tc.negative_weight, anchor=cfg.guard.anchor,
                                 sampler_behaviour=sampler_behaviour, version=part.version)
        made |= dict(zip(part.keys, groups, strict=True))
        if st:
            pods.append((len(part.records), st))
    total = sum(b for b, _ in pods)
    stats = {key: sum(b * st[key] for b, st in pods) / total for key in pods[0][1]} if pods else {}
    return [made[k] for k in sorted(made)], stats


def sample_waves(run: Run, policy: Policy, selector: Selector, pool: list[PromptRecord], budget: int, step: int,
                 n: int, *, meter: CostMeter | None = None, sampler_behaviour: bool = False,
                 version: int | None = None, carry: CarriedRollouts | None = None,
                 after_update: Callable[[], None] | None = None) -> FreshBatch:
    """One step's fresh groups drawn in two waves (module docstring): ``budget`` B completed groups at most, ``n``
    the full group; ``meter``, ``sampler_behaviour``, ``version`` and ``after_update`` as tasks/training/draw.py
    ``sample_fresh``'s;
    ``carry``: the last step's candidates to complete in this step's call (``waves.carry``)."""
    cfg, tc, wc = run.cfg, run.cfg.train, run.cfg.waves
    meter = meter if meter is not None else run.meter
    w = wc.first
    seed = lambda purpose: derive_seed(cfg.seed, step, purpose)  # noqa: E731
    if carry is not None and not (wc.enabled and wc.carry and carry.gen.n == w):
        raise ValueError(f"step {step}: the rollouts carried from step {carry.step} ({carry.gen.n} a prompt) do not "
                         f"fit waves.carry={wc.carry}, waves.first={w}; resume with the config that drew them")
    with meter.stage("selection"):
        idx, rows = selector.choose(math.ceil(wc.candidates * budget), step)
        prior = selector.estimate(idx, step)
    records = [pool[i] for i in idx]
    carried = carry.records if carry is not None else []
    with meter.stage("rollout"):
        t0 = time.perf_counter()
        asked = ([(carried, n - w)] if carried else []) + [(records, w)]
        *done, (gen1, r1) = beside(lambda: rollout_parts(policy, asked, seed("train")),  # carried, then [C, w]
                                   selector.lookahead(), after_update, selector.ahead_after_draw)
        gen_s = time.perf_counter() - t0
    mixed = r1.amax(1) > r1.amin(1)  # [C]
    with meter.stage("selection"):
        chance = torch.where(mixed, 1.0, completion_chance((r1 >= 0.5).sum(1), w, n, prior, wc.prior_strength))
        top = allocate(chance, budget, wc.min_chance)
    topped = top.nonzero().squeeze(1).tolist()
    partial = (mixed & ~top).nonzero().squeeze(1).tolist()
    # carried into the next step's call, unless this is the last step or nothing else would train (every first wave
    # mixed and completed, and nothing carried in: then their silent first waves could not stand in)
    leave = wc.carry and step + 1 < tc.steps and bool(done or partial or not mixed.all())
    rewards = list(r1)
    generated = sum(g.completion_ids.shape[0] for g, _ in done) + gen1.completion_ids.shape[0]
    tokens = sum(g.tokens for g, _ in done) + gen1.tokens
    prompt_tokens = sum(g.n * sum(int(p.numel()) for p in g.prompt_ids) for g, _ in [*done, (gen1, r1)])
    parts: list[WavePart] = []  # the carried groups first (keys below 0), then this step's candidates in draw order
    if done:
        (gen2, r2), = done
        parts.append(WavePart(list(range(-len(carried), 0)), carried, join_waves(carry.gen, gen2),
                              torch.cat([carry.rewards, r2], 1), carry.version))
    out = None
    if topped and leave:
        out = CarriedRollouts(step=step, records=[records[j] for j in topped], gen=rows_of(gen1, topped),
                              rewards=r1[topped], version=version)
    elif topped:
        with meter.stage("rollout"):
            t0 = time.perf_counter()
            gen2, r2 = rollout_rewards(policy, [records[j] for j in topped], n - w, seed("wave-2"))
            gen_s += time.perf_counter() - t0
        for k, j in enumerate(topped):
            rewards[j] = torch.cat([r1[j], r2[k]])
        parts.append(WavePart(topped, [records[j] for j in topped], join_waves(rows_of(gen1, topped), gen2),
                              torch.cat([r1[topped], r2], 1), version))
        generated, tokens = generated + gen2.completion_ids.shape[0], tokens + gen2.tokens
        prompt_tokens += (n - w) * sum(int(p.numel()) for p in gen2.prompt_ids)
    if partial:
        parts.append(WavePart(partial, [records[j] for j in partial], rows_of(gen1, partial), r1[partial], version))
    if not parts:  # nothing completed or mixed to train: the silent first waves (no gradient; the step counts)
        silent = (~mixed).nonzero().squeeze(1).tolist()
        parts.append(WavePart(silent, [records[j] for j in silent], rows_of(gen1, silent), r1[silent], version))
    with meter.stage("selection"):
        groups, pods = part_groups(cfg, parts, step, seed, sampler_behaviour)
    stats = wave_metrics(len(idx), len(topped), len(partial), int(mixed.sum()), generated, len(carried)) | pods
    stats |= policy.engine.metrics()
    stats |= selector.take_filter_metrics()
    return FreshBatch(groups=groups, idx=idx, rows=rows, records=records, rewards=rewards,
                      generated=generated, tokens=tokens, prompt_tokens=prompt_tokens, gen_s=gen_s, stats=stats,
                      carry=out)


def wave_metrics(candidates: int, topped: int, partial: int, mixed: int, generated: int,
                 carried: int = 0) -> dict[str, float]:
    """``waves/*``: the step's candidates, those given a completion (in this step, or carried into the next), mixed
    first waves trained as they were, first waves that were mixed, agreeing first waves left untrained, rollouts a
    candidate (the call's carried second waves included) and the last step's groups completed in this step's call."""
    return {"waves/candidates": float(candidates), "waves/completed": float(topped), "waves/partial": float(partial),
            "waves/mixed_first": float(mixed), "waves/dropped": float(candidates - topped - partial),
            "waves/rollouts_per_candidate": generated / max(candidates, 1), "waves/carried": float(carried)}
