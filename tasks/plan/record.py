"""The plan's record: what it measured, predicted and chose (:class:`Plan`), saved as a run's ``plan.json`` and
``plan.md`` and shown by the CLI, the Prefect artifact, MLflow and the run summary; tasks/plan/planner.py makes it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlcore.overlap_lag import LagChoice
from rlcore.plan import Prediction
from rlcore.plan_choice import PAID, RunClock, paid_text, run_clock
from rlcore.step_costs import CallCost, UnitCosts
from tasks.overlap.lag import lag_from_json, lag_to_json
from tasks.records.files import write_json


@dataclass(frozen=True)
class Plan:
    """What the plan measured, predicted and chose; saved as the run's ``plan.json``.

    ``shares``: the pool's solved / unsolved / mixed shares at g rollouts; ``costs``: the probe's;
    ``baseline``: plain GRPO's prediction; ``predictions``: each candidate's; ``unavailable``: candidates left
    out and why; ``choice``, ``reason``: the chosen candidate and why in one line; ``overrides``: its keys;
    ``overlap``: the overlap's lag for the chosen candidate's config, and why (None in a plan saved before it);
    ``upfront_s``: what this run spent before its first step and plain GRPO would not: its calibration and the
    plan, measured (the pool's scoring, which a run does only for a choice that reads the scores, is the chosen
    prediction's ``scoring_s``; :attr:`clock` adds it; a plan saved before held it here); ``savings``: for each
    technique inside a candidate's step (rlcore/step_rules.py: the waves, the skip), what it saves on this pool
    against the candidate without it
    (:func:`saving`); ``out_of_reach``: candidates the probe stopped measuring for once what every step pays was
    timed, and why (tasks/plan/probe.py): their predictions leave out what they alone pay and was not timed, so
    their steps and clocks are lower bounds (their savings say so); ``reused``: the probe's parts whose timings an
    earlier plan on this machine kept (tasks/plan/probe_cache.py), not timed again."""

    shares: dict[str, float]
    g: int
    costs: UnitCosts
    baseline: Prediction
    predictions: tuple[Prediction, ...]
    unavailable: dict[str, str]
    choice: str
    reason: str
    overrides: tuple[str, ...]
    overlap: LagChoice | None = None
    upfront_s: float = 0.0
    savings: tuple[str, ...] = ()
    out_of_reach: dict[str, str] = field(default_factory=dict)
    reused: tuple[str, ...] = ()

    @property
    def chosen(self) -> Prediction:
        return next((p for p in self.predictions if p.name == self.choice), self.baseline)

    @property
    def clock(self) -> RunClock:
        """This run's predicted clock over plain GRPO's (rlcore/plan_choice.py :class:`RunClock`): the chosen
        candidate's training clock, and with what the run spends before its first step (``upfront_s`` and the
        choice's scoring) in place of its predicted calibration and scoring. Every place that shows a plan's clock
        shows this record's :meth:`~RunClock.text` or its two figures."""
        return run_clock(self.chosen, self.baseline, self.upfront_s)

    def metrics(self) -> dict[str, float]:
        """``plan/*``: one value each, at step 0."""
        c, base, fx = self.costs, self.baseline, self.costs.fixed
        return {"plan/pool_solved": self.shares["solved"], "plan/pool_unsolved": self.shares["unsolved"],
                "plan/pool_mixed": self.shares["mixed"],
                "plan/generate_us_per_token": 1e6 * base.generate_s / max(base.generated_tokens, 1.0),
                "plan/update_us_per_token": 1e6 * c.update.per_token(base.updated_tokens),
                "plan/optimizer_ms": 1e3 * fx.optimizer_s, "plan/bookkeeping_ms": 1e3 * fx.step_s,
                "plan/checkpoint_ms": 1e3 * fx.round_s, "plan/predictor_fit_ms": 1e3 * fx.fit_s,
                "plan/upfront_s": self.clock.upfront_s, "plan/predicted_training_clock": self.clock.training,
                "plan/predicted_clock_with_plan": self.clock.with_plan,
                "plan/predicted_effective_ratio": self.chosen.effective_ratio,
                "plan/probe_parts_reused": float(len(self.reused))} | self._overlap_metrics()

    def tags(self) -> dict[str, str]:
        """The MLflow run's ``rlsift.plan.*`` tags: the choice, why, and the clock's text (:attr:`clock`)."""
        return {"rlsift.plan.choice": self.choice, "rlsift.plan.reason": self.reason,
                "rlsift.plan.clock": self.clock.text()}

    def _overlap_metrics(self) -> dict[str, float]:
        o = self.overlap
        if o is None:
            return {}
        return {"plan/overlap_lag": float(o.lag)} | ({} if o.probe is None else {
            "plan/overlap_at_once_ratio": o.probe.ratio, "plan/overlap_sequential_s": o.probe.sequential_s})

    def rows(self) -> list[dict[str, Any]]:
        """One row per prediction (the baseline first) for tables: the Prefect artifact, ``rlsift plan``."""
        out = []
        for p in (self.baseline, *self.predictions):
            if p.name == self.baseline.name and p is not self.baseline:
                continue
            chosen = ("yes" if p.name == self.choice else
                      f"out of reach ({self.out_of_reach[p.name]}): its figures are lower bounds"
                      if p.name in self.out_of_reach
                      else "")
            out.append({"composition": p.name, "chosen": chosen,
                        "effective_ratio": round(p.effective_ratio, 3),
                        "informative_groups": round(p.informative, 1),
                        "informative_contrasts": round(p.signal, 1), "vs_grpo_signal": round(
                            p.signal / self.baseline.signal, 2) if self.baseline.signal else None,
                        "generated_rollouts": round(p.generated, 1),
                        "rollouts_per_informative": round(p.generated / p.informative, 2) if p.informative else None,
                        "step_s": round(p.step_s, 3),
                        "fixed_s": round(p.fixed_s, 3), "upfront_s": round(p.upfront_s, 2),
                        "clock_vs_grpo": round(p.clock, 3)})
        out += [{"composition": name, "chosen": f"left out: {why}"} for name, why in self.unavailable.items()]
        return out

    def summary(self) -> str:
        """The pool and the costs in one line, and the estimates the probe cannot trust, where there are any
        (``UnitCosts.untrusted``). A cost the probe could not measure is said so, never shown as 0.0 ms."""
        c, s, fx = self.costs, self.shares, self.costs.fixed
        step = (f"a decode step {_ms(c.generate.step_s)} whatever its rows" if c.generate.step_s > 0 else
                "a decode step's cost not told apart from a token's")
        out = (f"pool at g={self.g}: {s['mixed']:.0%} mixed, {s['solved']:.0%} solved, {s['unsolved']:.0%} "
               f"unsolved; a generated token {_per_token(c.generate)}, {step}; an updated one {_per_token(c.update)}; "
               f"a step's fixed costs: optimizer step {_ms(fx.optimizer_s)}, bookkeeping {_ms(fx.step_s)}; a "
               f"round's: checkpoint {_ms(fx.round_s)}, DOTS's predictor {_ms(fx.fit_s)}; "
               f"{c.completion_tokens:.0f} completion and {c.prompt_tokens:.0f} prompt tokens a rollout")
        if c.split is not None:
            gen, trainer = c.split.threads
            out += (f"; overlapped (lag 1) on {gen} generator and {trainer} trainer thread{'s'[:trainer != 1]}, "
                    f"each side beside the other: generation {c.split.generate:.2f}x as slow, the trainer's passes "
                    f"{c.split.passes:.2f}x")
        if self.reused:
            out += f"; kept from an earlier probe on this machine, not timed again: {', '.join(self.reused)}"
        if c.untrusted:
            out += f". Estimates the probe cannot trust: {'; '.join(c.untrusted)}"
        return out

    def line(self) -> str:
        """The choice, why and its predicted clock in one line (what the terminal shows), each figure once: the
        reason of a chosen candidate states its training clock (and, when the choice weighed it, the clock with the
        plan's own cost, at the choice: this run's, with what it spent after the choice, takes its place; else it is
        added); the baseline's says why nothing else was chosen, and gets its clock added."""
        clock = self.clock
        if self.choice == self.baseline.name:
            return f"{self.reason}; {clock.text().removeprefix(f'{self.choice}: ')}"
        if PAID.search(self.reason):
            return PAID.sub(paid_text(clock), self.reason, count=1)
        return (f"{self.reason}; {clock.with_plan:.2f}x with the plan's own cost ({clock.upfront_s:.0f} s before the "
                "first step)")

    def text(self) -> str:
        """The plan for a terminal (``rlsift plan``): :meth:`line`, the pool and the costs, the overlap, and the
        predictions as a plain table with aligned columns (:meth:`markdown` is the same for files and MLflow)."""
        rows = self.rows()
        cols = [k for k in rows[0] if any(r.get(k) is not None for r in rows)]
        cells = [cols] + [["" if r.get(k) is None else str(r[k]) for k in cols] for r in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
        return "\n".join([f"plan: {self.line()}", self.summary(),
                          *([f"overlap: {self.overlap.reason}"] if self.overlap is not None else []), "", *table])

    def markdown(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        run = f"This run: {self.clock.text()}."
        lines = [f"**Plan: {self.reason}**", "", self.summary(), "", run, "",
                 *([f"**Overlap: {self.overlap.reason}**", ""] if self.overlap is not None else []),
                 *[f"**{line}**" for line in self.savings], *([""] if self.savings else []),
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join("" if r.get(k) is None else str(r[k]) for k in cols) + " |" for r in rows]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"shares": self.shares, "g": self.g, "costs": asdict(self.costs), "baseline": asdict(self.baseline),
                "predictions": [asdict(p) for p in self.predictions], "unavailable": self.unavailable,
                "choice": self.choice, "reason": self.reason, "overrides": list(self.overrides),
                "overlap": None if self.overlap is None else lag_to_json(self.overlap), "upfront_s": self.upfront_s,
                "savings": list(self.savings), "out_of_reach": self.out_of_reach, "reused": list(self.reused)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(shares=d["shares"], g=d["g"], costs=costs_from_json(d["costs"]),
                   baseline=Prediction(**d["baseline"]), predictions=tuple(Prediction(**p) for p in d["predictions"]),
                   unavailable=d["unavailable"], choice=d["choice"], reason=d["reason"],
                   overrides=tuple(d["overrides"]),
                   overlap=lag_from_json(d["overlap"]) if d.get("overlap") is not None else None,
                   upfront_s=d.get("upfront_s", 0.0), savings=tuple(d.get("savings", ())),
                   out_of_reach=d.get("out_of_reach", {}), reused=tuple(d.get("reused", ())))

    def save(self, path: Path) -> Path:
        write_json(path, self.to_json())
        (path.parent / "plan.md").write_text(self.markdown())
        return path

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))


def costs_from_json(d: dict[str, Any]) -> UnitCosts:
    """``UnitCosts`` of a ``plan.json``; one saved before the probe timed calls of several sizes (seconds a token,
    ``generate_s``, ``update_s``, ``forward_s``) reads as lines through 0 with no fixed costs."""
    if "generate" in d:
        return UnitCosts.from_dict(d)
    return UnitCosts(generate=CallCost(0.0, d["generate_s"]), update=CallCost(0.0, d["update_s"]),
                     forward=CallCost(0.0, d["forward_s"]), completion_tokens=d["completion_tokens"],
                     prompt_tokens=d["prompt_tokens"], solution_tokens=d.get("solution_tokens", 0.0))


def _per_token(cost: CallCost) -> str:
    """What a token costs at the probe's smallest and largest calls, and whether that falls with the batch."""
    if len(cost.tokens) < 2:
        return f"{1e6 * cost.token_s:.0f} us"
    calls = sorted(zip(cost.tokens, cost.steps or (0.0,) * len(cost.tokens), strict=True))
    (lo, lo_steps), (hi, hi_steps) = calls[0], calls[-1]
    small, large = cost.per_token(lo, lo_steps), cost.per_token(hi, hi_steps)
    trend = ("falls with the batch" if large < (1 - FLAT) * small else
             f"flat: within {FLAT:.0%} at any batch")
    return f"{1e6 * small:.0f} us in a call of {lo:.0f} tokens, {1e6 * large:.0f} us in one of {hi:.0f} ({trend})"


def _ms(seconds: float) -> str:
    """``seconds`` in milliseconds with the digits a small one needs (``-`` for a cost not measured: 0)."""
    if seconds <= 0:
        return "-"
    ms = 1e3 * seconds
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3g} ms"


#: A token's cost that moves less than this between the probe's smallest and largest calls is called flat.
FLAT = 0.15
