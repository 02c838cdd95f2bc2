"""The plan's probe of the likelihood screen's teacher-forced pass (tasks/plan/probe.py, docs/algorithms.md 9.1): the
pass timed over as many candidates as the largest count a candidate screens a step and half of it, as a line in the
prompt and worked-solution tokens it reads (``rlcore.step_costs.CallCost``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlcore.plan_draw import Composition, screened_per_prompt
from rlcore.step_costs import CallCost
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.plan.probe_generation import cycle_records
from tasks.plan.timing import COSTLY, Untrusted
from tasks.policy import Policy
from tasks.selection.screen import screen_likelihood


def screen_counts(comps: Sequence[Composition]) -> list[int]:
    """The candidates a step's screen pass scores, for each candidate that screens."""
    return [screened_per_prompt(c) * max(1, round(c.prompts * c.fresh_frac)) for c in comps if c.screen > 1]


def solution_lengths(policy: Policy, records: list[PromptRecord]) -> list[int]:
    """Each record's worked solution in tokens, with its end (the screen reads it); [] where one has none."""
    if not all(r.solution for r in records):
        return []
    tok = policy.tokenizer
    return [len(tok(r.solution, add_special_tokens=False)["input_ids"]) + 1 for r in records]


def probe_screen(policy: Policy, records: list[PromptRecord], solutions: list[int], cfg: Config, counts: list[int],
                 device: torch.device | str, untrusted: Untrusted) -> CallCost:
    """The screen's pass at the largest of ``counts`` (candidates a step's pass scores) and half of it, over
    ``records`` (repeated where a pass needs more) whose solutions are ``solutions`` tokens long."""
    tok = policy.tokenizer
    likelihood = screen_likelihood(policy, cfg, device)
    likelihood(records[:1])  # warm-up
    points = []
    for k in sorted({max(1, max(counts) // 2), max(counts)}):
        batch = cycle_records(records, k)
        prompts = [len(ids) for ids in tok(policy.prompts(batch))["input_ids"]]
        points.append((sum(prompts) + sum(solutions[i % len(records)] for i in range(k)),
                       untrusted.timed(lambda b=batch: likelihood(b), COSTLY, f"the screen's pass of {k} prompts")[0]))
    return CallCost.fit([t for t, _ in points], [s for _, s in points])
