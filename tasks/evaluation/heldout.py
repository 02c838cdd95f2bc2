"""Evaluation stage: held-out greedy accuracy and sampled avg@k and pass@k, by difficulty level and by source.

With k sampled completions per prompt, avg@k is their mean reward (the expected accuracy of one sample) and pass@k
the share of prompts with at least one correct completion among them (Chen et al. 2021, arXiv 2107.03374 section
2.1, with n = k: the plain estimate). A policy that grows sharper (greedy and avg@k up) at the cost of the
answers it no longer tries shows it as pass@k falling (Zhu et al. 2025, arXiv 2506.01347 section 3).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore.seeding import derive_seed
from tasks.data.prompts import PromptRecord
from tasks.data.rewards import batch_rewards
from tasks.records.files import write_json
from tasks.records.ledger import EvalRow


@dataclass(frozen=True)
class EvalCell:
    """Accuracy over one group of prompts: ``n`` prompts, greedy accuracy, sampled avg@k and pass@k (None when
    k = 0; pass@k also None in files written before it was recorded)."""

    n: int
    greedy_acc: float
    avg_at_k: float | None = None
    pass_at_k: float | None = None

    def to_json(self) -> dict[str, Any]:
        sampled = {"avg_at_k": self.avg_at_k, "pass_at_k": self.pass_at_k}
        return {"n": self.n, "greedy_acc": self.greedy_acc} | {k: v for k, v in sampled.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvalCell:
        return cls(n=int(d["n"]), greedy_acc=float(d["greedy_acc"]), avg_at_k=d.get("avg_at_k"),
                   pass_at_k=d.get("pass_at_k"))


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: overall, by difficulty level (None: records without one) and by source.

    ``prompt_ids``, ``greedy_correct`` (0/1) and ``levels`` are per record, in record order, for
    :func:`paired_change` and the benchmark's per-level comparison with the start (``levels`` is empty in files
    written before it was recorded).
    Saved as ``eval_<phase>.json`` (:meth:`save`); in JSON ``by_level`` is a list of cells each carrying its
    ``level`` (an int or null), so the level keys come back typed (:meth:`load`).
    """

    overall: EvalCell
    by_level: dict[int | None, EvalCell]
    by_source: dict[str, EvalCell]
    k: int
    prompt_ids: tuple[str, ...]
    greedy_correct: tuple[int, ...]
    levels: tuple[int | None, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"overall": self.overall.to_json(),
                "by_level": [{"level": lv, **c.to_json()} for lv, c in self.by_level.items()],
                "by_source": {s: c.to_json() for s, c in self.by_source.items()},
                "k": self.k, "prompt_ids": list(self.prompt_ids), "greedy_correct": list(self.greedy_correct),
                "levels": list(self.levels)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EvalResult:
        if not isinstance(d.get("by_level"), list):
            raise ValueError("not an evaluation in this version's format (by_level must be a list of cells with "
                             "their level); re-run the evaluation")
        return cls(overall=EvalCell.from_json(d["overall"]),
                   by_level={c["level"]: EvalCell.from_json(c) for c in d["by_level"]},
                   by_source={s: EvalCell.from_json(c) for s, c in d["by_source"].items()},
                   k=int(d["k"]), prompt_ids=tuple(d["prompt_ids"]),
                   greedy_correct=tuple(int(x) for x in d["greedy_correct"]), levels=tuple(d.get("levels") or ()))

    def save(self, path: Path) -> Path:
        write_json(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: Path) -> EvalResult:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from err


@dataclass(frozen=True)
class PairedChange:
    """Prompts that turned right and wrong between two evaluations, and the exact McNemar p-value."""

    turned_right: int
    turned_wrong: int
    mcnemar_p: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def evaluate(policy, records: list[PromptRecord], *, samples: int, seed: int, workers: int = 4) -> EvalResult:
    """Greedy accuracy (and avg@k and pass@k with ``samples`` = k sampled completions) over ``records``."""
    prompts = policy.prompts(records)
    greedy = policy.engine.generate(prompts, n=1, seed=derive_seed(seed, "eval-greedy"), greedy=True)
    g_ok = torch.tensor(batch_rewards(records, greedy.texts, workers=workers))
    s_ok = None
    if samples:
        gen = policy.engine.generate(prompts, n=samples, seed=derive_seed(seed, "eval-sample"))
        s_ok = torch.tensor(batch_rewards([r for r in records for _ in range(samples)], gen.texts,
                                          workers=workers)).view(len(records), samples)  # [M, k]

    def cell(idx: list[int]) -> EvalCell:
        t = torch.tensor(idx)
        if s_ok is None:
            return EvalCell(n=len(idx), greedy_acc=float(g_ok[t].mean()))
        return EvalCell(n=len(idx), greedy_acc=float(g_ok[t].mean()), avg_at_k=float(s_ok[t].mean()),
                        pass_at_k=float((s_ok[t] > 0).any(1).float().mean()))

    levels, sources = defaultdict(list), defaultdict(list)
    for i, r in enumerate(records):
        levels[r.level].append(i)
        sources[r.source].append(i)
    return EvalResult(
        overall=cell(list(range(len(records)))),
        by_level={lv: cell(ix) for lv, ix in sorted(levels.items(), key=lambda kv: (kv[0] is None, kv[0]))},
        by_source={s: cell(ix) for s, ix in sources.items()},
        k=samples, prompt_ids=tuple(r.id for r in records), greedy_correct=tuple(int(x) for x in g_ok.tolist()),
        levels=tuple(r.level for r in records))


def paired_change(before: EvalResult, after: EvalResult) -> PairedChange | None:
    """How greedy correctness changed prompt by prompt between two evaluations of the same prompts.

    A change in accuracy of a point or two on a few hundred prompts can be noise; the paired view counts
    the prompts that turned right and those that turned wrong, and the exact McNemar test (a two-sided
    binomial test of ``turned_right`` among the prompts that changed, at p = 1/2) says how surprising the
    split is if the two policies were equally good.

    Returns:
        The counts and p-value, or None when the two evaluations cover different prompts.
    """
    if before.prompt_ids != after.prompt_ids:
        return None
    return paired_counts(before.greedy_correct, after.greedy_correct)


def paired_counts(before: Sequence[int], after: Sequence[int]) -> PairedChange:
    """Prompts that turned right (0 -> 1) and wrong (1 -> 0) between two 0/1 correctness lists of the same
    prompts in the same order, with the exact McNemar p (two-sided binomial test at 1/2; 1 when none changed)."""
    if len(before) != len(after):
        raise ValueError(f"paired evaluations differ in length: {len(before)} vs {len(after)}")
    right = sum(1 for a, b in zip(before, after, strict=True) if not a and b)
    wrong = sum(1 for a, b in zip(before, after, strict=True) if a and not b)
    from scipy.stats import binomtest  # here: scipy.stats takes seconds to import, at the run's end

    p = binomtest(right, right + wrong, 0.5).pvalue if right + wrong else 1.0
    return PairedChange(turned_right=right, turned_wrong=wrong, mcnemar_p=float(p))


def flat_metrics(result: EvalResult, prefix: str = "eval") -> dict[str, float]:
    """``eval/accuracy``, ``eval/avg_at_k``, ``eval/pass_at_k``, ``eval/level_3/accuracy``, ... for the tracker."""
    out = {f"{prefix}/accuracy": result.overall.greedy_acc}
    for name in ("avg_at_k", "pass_at_k"):
        if getattr(result.overall, name) is not None:
            out[f"{prefix}/{name}"] = getattr(result.overall, name)
    for lv, c in result.by_level.items():
        if lv is not None:
            out[f"{prefix}/level_{lv}/accuracy"] = c.greedy_acc
    return out


def table_rows(result: EvalResult, phase: str, step: int) -> list[EvalRow]:
    """Ledger rows (table ``evals``) for one evaluation."""
    groups = [("overall", result.overall), *((f"level_{lv}", c) for lv, c in result.by_level.items()),
              *((f"source:{s}", c) for s, c in result.by_source.items())]
    return [EvalRow(phase=phase, step=step, grp=grp, n=c.n, greedy_acc=c.greedy_acc, avg_at_k=c.avg_at_k,
                    pass_at_k=c.pass_at_k) for grp, c in groups]
