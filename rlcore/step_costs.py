"""What the work of a step costs, as the plan's probe measures it (docs/algorithms.md 9.1; tasks/plan/probe.py
times it, rlcore/plan.py predicts with it): :class:`CallCost` (a call's seconds in its tokens and, for generation,
its decode steps), :class:`FixedCosts` (what a step and a round pay whatever their tokens), :class:`ThreadSplit` (each
side's slowdown where the overlap splits a CPU's cores between the sampler and the trainer) and :class:`UnitCosts`
(all of them, with the lengths the probe saw)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CallCost", "FixedCosts", "ThreadSplit", "UnitCosts", "check_seconds"]


def check_seconds(owner: str, **values: float) -> None:
    for name, v in values.items():
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}.{name} must be finite and >= 0, got {v!r}")


@dataclass(frozen=True)
class CallCost:
    """Seconds of one call of some work (a batch generated, an update, a screen pass) as a line in the tokens it
    processes and, for generation, its decode steps: ``fixed_s + step_s * steps + token_s * tokens``. A generate
    call decodes one step per token of its longest completion, and a step costs ``step_s`` whatever its rows (the
    model's weights are read, the loop's launches made) on top of ``token_s`` a row: so a call of many short
    completions costs less a token than one that waits for a long one, and a bigger batch less a token than a
    small one. ``tokens``, ``seconds`` and ``steps`` (() where steps are not counted): the timed calls it was
    fitted to (:meth:`fit`)."""

    fixed_s: float
    token_s: float
    tokens: tuple[float, ...] = ()
    seconds: tuple[float, ...] = ()
    step_s: float = 0.0
    steps: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens", "seconds", "steps"):
            object.__setattr__(self, name, tuple(float(t) for t in getattr(self, name)))
        check_seconds("CallCost", fixed_s=self.fixed_s, token_s=self.token_s, step_s=self.step_s)
        if len(self.tokens) != len(self.seconds) or (self.steps and len(self.steps) != len(self.tokens)):
            raise ValueError(f"CallCost: {len(self.tokens)} token counts, {len(self.steps)} step counts for "
                             f"{len(self.seconds)} timings")
        check_seconds("CallCost", **{f"tokens[{i}]": t for i, t in enumerate(self.tokens)},
                       **{f"seconds[{i}]": s for i, s in enumerate(self.seconds)},
                       **{f"steps[{i}]": s for i, s in enumerate(self.steps)})

    @classmethod
    def fit(cls, tokens: Sequence[float], seconds: Sequence[float],
            steps: Sequence[float] | None = None) -> CallCost:
        """The least-squares fit to timed calls (``tokens[i]``, ``seconds[i]``): with ``steps`` (generation: each
        call's decode steps), ``step_s * steps + token_s * tokens``; without, a line ``fixed_s + token_s * tokens``.
        Where the points give a negative part (a timing's noise) or cannot tell the parts apart (one size only),
        the line through 0: a token costs the same in any call."""
        t = torch.tensor([float(x) for x in tokens], dtype=torch.float64)
        s = torch.tensor([float(x) for x in seconds], dtype=torch.float64)
        if len(t) == 0 or len(t) != len(s) or float(t.max()) <= 0:
            raise ValueError(f"CallCost.fit needs timed calls with tokens, got tokens={tokens}, seconds={seconds}")
        through_0 = float((t * s).sum() / (t * t).sum())
        if steps is not None:
            d = torch.tensor([float(x) for x in steps], dtype=torch.float64)
            if len(d) != len(t):
                raise ValueError(f"CallCost.fit: {len(d)} step counts for {len(t)} timed calls")
            x = torch.stack([d, t], dim=1)
            gram = x.T @ x
            if len(t) > 1 and float(torch.linalg.det(gram)) > 1e-9 * float(gram.diagonal().prod()):
                step, slope = torch.linalg.solve(gram, x.T @ s).tolist()
                if step >= 0 and slope >= 0:
                    return cls(fixed_s=0.0, token_s=slope, step_s=step, tokens=tuple(t.tolist()),
                               seconds=tuple(s.tolist()), steps=tuple(d.tolist()))
            return cls(fixed_s=0.0, token_s=through_0, tokens=tuple(t.tolist()), seconds=tuple(s.tolist()),
                       steps=tuple(d.tolist()))
        fixed, slope = 0.0, through_0
        if len(set(t.tolist())) > 1:
            tm, sm = t.mean(), s.mean()
            b = float(((t - tm) * (s - sm)).sum() / ((t - tm) ** 2).sum())
            a = float(sm - b * tm)
            if a >= 0 and b >= 0:
                fixed, slope = a, b
        return cls(fixed_s=fixed, token_s=slope, tokens=tuple(t.tolist()), seconds=tuple(s.tolist()))

    def time(self, tokens: float, steps: float = 0.0) -> float:
        """Seconds of one call over ``tokens`` in ``steps`` decode steps (0 tokens: no call, 0 s)."""
        return self.fixed_s + self.step_s * steps + self.token_s * tokens if tokens > 0 else 0.0

    def per_token(self, tokens: float, steps: float = 0.0) -> float:
        """Seconds a token in a call of ``tokens`` in ``steps`` decode steps."""
        return self.time(tokens, steps) / tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class FixedCosts:
    """Seconds a step or a round pays whatever its tokens, timed by the probe.

    ``optimizer_s``: one optimizer step (gradient clipping and AdamW over the trainable parameters), a step;
    ``step_s``: a step's bookkeeping (the draw over the pool, the ledger's selection and group rows, the metrics
    line), a step; ``round_s``: a round's checkpoint (the weights and the optimizer's state); ``fit_s``: DOTS's
    predictor a round (its fit on the labels and its predictions over the pool), paid only by compositions that
    draw with it."""

    optimizer_s: float = 0.0
    step_s: float = 0.0
    round_s: float = 0.0
    fit_s: float = 0.0

    def __post_init__(self) -> None:
        check_seconds("FixedCosts", optimizer_s=self.optimizer_s, step_s=self.step_s, round_s=self.round_s,
                       fit_s=self.fit_s)


@dataclass(frozen=True)
class ThreadSplit:
    """Where the overlap (lag 1) splits a CPU's cores between the sampler and the trainer (tasks/overlap/concurrent.py
    ``thread_split``: one generator and one trainer thread on 2 cores), how much slower each side's work runs, while
    the other side works, than the probe's calls on all threads in one process: ``generate`` for a generate call in
    the generator process, ``passes`` for the trainer's forward and backward passes on its threads (the cores'
    caches, memory bandwidth and hyper-threads are shared: a side alone runs faster, which a timing of one side
    alone would credit); ``threads``: (generator, trainer) threads. Deviation: one pace a side, from a generate call
    of half the baseline's prompts and the probe's small update (tasks/plan/probe_split.py ``split_prompts``); a
    larger call gains more from more threads (on 2 cores 1.13x at 24 rollouts, 1.37x at 128, about 1.5x at 512), so
    the pace is a few per cent low for the largest calls and high for the smallest."""

    generate: float
    passes: float
    threads: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("generate", "passes"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"ThreadSplit.{name} must be finite and > 0, got {v!r}")
        if len(self.threads) != 2 or min(self.threads) < 1:
            raise ValueError(f"ThreadSplit.threads is (generator, trainer), each >= 1, got {self.threads!r}")
        object.__setattr__(self, "threads", tuple(int(t) for t in self.threads))


@dataclass(frozen=True)
class UnitCosts:
    """What the work of a step costs, measured by a probe, and the mean token counts it saw.

    ``generate``: a call that generates and verifies rollouts, in their completion tokens; ``update``: the update's
    passes over the rows it computes, in their prompt and completion tokens (the optimizer step is in ``fixed``);
    ``forward``: the screen's teacher-forced pass, in prompt and solution tokens; ``completion_tokens``,
    ``prompt_tokens``, ``solution_tokens``: mean tokens of a completion, a prompt and a worked solution (0 where
    there is none); ``fixed``: what a step and a round pay whatever their tokens; ``score_s``: seconds to score
    (embed) one pool prompt before training; ``levels``: (level, completion tokens, prompt tokens), the mean lengths
    of a rollout of each level's prompts the probe drew (a draw that favours some levels has their lengths);
    ``completion_lengths``: (level, the completion tokens of each rollout of that level's prompts the probe drew),
    from which :meth:`longest` predicts a call's decode steps; ``split``: each side's slowdown where a run overlapping
its draw with its update splits the CPU's cores between them (None: no split, or the sampler apart on other
hardware: each side as timed); ``untrusted``: the estimates the probe cannot
    trust, one line each saying which and why (a timing whose repeats never agreed, a decode step's cost that the
    fit could not tell from a token's), logged and shown with the plan; empty when it trusts them all."""

    generate: CallCost
    update: CallCost
    forward: CallCost
    completion_tokens: float
    prompt_tokens: float
    solution_tokens: float = 0.0
    fixed: FixedCosts = field(default_factory=FixedCosts)
    score_s: float = 0.0
    levels: tuple[tuple, ...] = ()
    completion_lengths: tuple[tuple, ...] = ()
    split: ThreadSplit | None = None
    untrusted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "untrusted", tuple(str(x) for x in self.untrusted))
        object.__setattr__(self, "levels", tuple((lv, float(c), float(p)) for lv, c, p in self.levels))
        object.__setattr__(self, "completion_lengths",
                           tuple((lv, tuple(int(x) for x in xs)) for lv, xs in self.completion_lengths))
        if any(not xs or min(xs) < 0 for _, xs in self.completion_lengths):
            raise ValueError("UnitCosts.completion_lengths: each level needs at least one length, none negative")
        check_seconds("UnitCosts", completion_tokens=self.completion_tokens, prompt_tokens=self.prompt_tokens,
                       solution_tokens=self.solution_tokens, score_s=self.score_s,
                       **{f"levels[{i}]": x for i, (_, c, p) in enumerate(self.levels) for x in (c, p)})

    @classmethod
    def from_dict(cls, d: dict) -> UnitCosts:
        """The inverse of ``dataclasses.asdict``."""
        return cls(**{**d, **{k: CallCost(**d[k]) for k in ("generate", "update", "forward")},
                      "fixed": FixedCosts(**d.get("fixed", {})), "levels": tuple(map(tuple, d.get("levels", ()))),
                      "split": ThreadSplit(**d["split"]) if d.get("split") else None,
                      "completion_lengths": tuple((lv, tuple(xs)) for lv, xs in d.get("completion_lengths", ()))})

    def lengths(self, levels: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """[K] float64 each: the mean completion and prompt tokens of a rollout of a prompt of each of ``levels``
        (the probe's for that level; its mean over every level where it drew none of that level)."""
        by = {lv: (c, p) for lv, c, p in self.levels}
        pairs = [by.get(lv, (self.completion_tokens, self.prompt_tokens)) for lv in levels]
        return (torch.tensor([c for c, _ in pairs], dtype=torch.float64),
                torch.tensor([p for _, p in pairs], dtype=torch.float64))

    def longest(self, mix: dict, rows: int) -> float:
        """The expected longest completion of ``rows`` rollouts drawn from the levels with shares ``mix`` (level ->
        share; a level the probe drew none of counts as every level the probe drew): a generate call's decode
        steps. With F the mix of the levels' empirical length distributions, E[max] = sum over x >= 0 of
        1 - F(x)^rows. 0 where the probe recorded no lengths."""
        if rows <= 0 or not self.completion_lengths:
            return 0.0
        by = {lv: torch.tensor(xs, dtype=torch.float64) for lv, xs in self.completion_lengths}
        every = torch.cat(list(by.values()))
        top = int(every.max())
        grid = torch.arange(top + 1, dtype=torch.float64)
        total = sum(mix.values())
        if total <= 0:
            mix, total = dict.fromkeys(by, 1.0), float(len(by))
        cdf = torch.zeros(top + 1, dtype=torch.float64)
        for lv, share in mix.items():
            xs = by.get(lv, every)
            cdf += share / total * (xs.unsqueeze(0) <= grid.unsqueeze(1)).to(torch.float64).mean(1)
        return float((1 - cdf.clamp(0, 1)[:top] ** rows).sum())
