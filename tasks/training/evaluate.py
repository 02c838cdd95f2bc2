"""Evaluation stage: held-out greedy accuracy and sampled avg@k, by difficulty level and by source."""

from __future__ import annotations

from collections import defaultdict

import torch
from scipy.stats import binomtest

from rlcore.seeding import derive_seed
from tasks.data.prompts import PromptRecord
from tasks.data.rewards import batch_rewards


def evaluate(policy, records: list[PromptRecord], *, samples: int, seed: int, workers: int = 4) -> dict:
    """Greedy accuracy (and avg@k with ``samples`` = k sampled completions) over ``records``.

    Returns:
        ``{"overall": {...}, "by_level": {level: {...}}, "by_source": {source: {...}}, "k": k,
        "prompt_ids": [...], "greedy_correct": [0/1, ...]}``, each cell holding ``n``, ``greedy_acc`` and
        (when k > 0) ``avg_at_k``; the last two lists are per record, for ``paired_change``.
    """
    prompts = policy.prompts(records)
    greedy = policy.engine.generate(prompts, n=1, seed=derive_seed(seed, "eval-greedy"), greedy=True)
    g_ok = torch.tensor(batch_rewards(records, greedy.texts, workers=workers))
    s_ok = None
    if samples:
        gen = policy.engine.generate(prompts, n=samples, seed=derive_seed(seed, "eval-sample"))
        s_ok = torch.tensor(batch_rewards([r for r in records for _ in range(samples)], gen.texts,
                                          workers=workers)).view(len(records), samples).mean(1)

    def cell(idx: list[int]) -> dict:
        t = torch.tensor(idx)
        out = {"n": len(idx), "greedy_acc": float(g_ok[t].mean())}
        if s_ok is not None:
            out["avg_at_k"] = float(s_ok[t].mean())
        return out

    levels, sources = defaultdict(list), defaultdict(list)
    for i, r in enumerate(records):
        levels[r.level].append(i)
        sources[r.source].append(i)
    return {"overall": cell(list(range(len(records)))),
            "by_level": {lv: cell(ix) for lv, ix in sorted(levels.items(), key=lambda kv: (kv[0] is None, kv[0]))},
            "by_source": {s: cell(ix) for s, ix in sources.items()},
            "k": samples, "prompt_ids": [r.id for r in records], "greedy_correct": [int(x) for x in g_ok.tolist()]}


def paired_change(before: dict, after: dict) -> dict | None:
    """How greedy correctness changed prompt by prompt between two evaluations of the same prompts.

    A change in accuracy of a point or two on a few hundred prompts can be noise; the paired view counts
    the prompts that turned right and those that turned wrong, and the exact McNemar test (a two-sided
    binomial test of ``turned_right`` among the prompts that changed, at p = 1/2) says how surprising the
    split is if the two policies were equally good.

    Returns:
        ``{"turned_right", "turned_wrong", "mcnemar_p"}``, or None when either evaluation lacks per-prompt
        results or they cover different prompts.
    """
    if before.get("prompt_ids") is None or before.get("prompt_ids") != after.get("prompt_ids"):
        return None
    pairs = list(zip(before["greedy_correct"], after["greedy_correct"], strict=True))
    right = sum(1 for a, b in pairs if not a and b)
    wrong = sum(1 for a, b in pairs if a and not b)
    p = binomtest(right, right + wrong, 0.5).pvalue if right + wrong else 1.0
    return {"turned_right": right, "turned_wrong": wrong, "mcnemar_p": float(p)}


def flat_metrics(result: dict, prefix: str = "eval") -> dict[str, float]:
    """``eval/accuracy``, ``eval/avg_at_k``, ``eval/level_3/accuracy``, ... for the tracker."""
    out = {f"{prefix}/accuracy": result["overall"]["greedy_acc"]}
    if "avg_at_k" in result["overall"]:
        out[f"{prefix}/avg_at_k"] = result["overall"]["avg_at_k"]
    for lv, c in result["by_level"].items():
        if lv is not None:
            out[f"{prefix}/level_{lv}/accuracy"] = c["greedy_acc"]
    return out


def table_rows(result: dict, phase: str, step: int) -> list[dict]:
    """Ledger rows (table ``evals``) for one evaluation."""
    rows = [{"phase": phase, "step": step, "grp": "overall", **_cell(result["overall"])}]
    rows += [{"phase": phase, "step": step, "grp": f"level_{lv}", **_cell(c)} for lv, c in result["by_level"].items()]
    rows += [{"phase": phase, "step": step, "grp": f"source:{s}", **_cell(c)} for s, c in result["by_source"].items()]
    return rows


def _cell(c: dict) -> dict:
    return {"n": c["n"], "greedy_acc": c["greedy_acc"], "avg_at_k": c.get("avg_at_k")}
