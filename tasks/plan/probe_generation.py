"""The plan's probe of generation (tasks/plan/probe.py, docs/algorithms.md 9.1): two generate calls timed, a decode
step's cost told apart from a token's (``rlcore.step_costs.CallCost.fit``).

Rollouts are generated and verified (the training step's rollout phase, tasks/calibration/reference.py) in a call as
small as the smallest first call a candidate makes and one as large as the baseline's largest, after a one-prompt
warm-up, from the probe's prompts (repeated where a call needs more). Where the calibrate stage drew its rollouts in
this process in calls at least as large as the large one (``Calibration.draw``) and that took at least
:data:`RETIME_BELOW_S`, they are the large call, as drawn and timed (once): only the small one is timed, and without a
warm-up, unless that one sample cost a token almost as much as the small call (:data:`CHEAPER_A_TOKEN`: a cold first
call, a busy moment), when the large call is timed as without it. A quicker calibration call is timed again at the
large size, warm (the calibration's call warmed the engine): its one sample was the run's first call at its size.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rlcore.plan import call_rows
from rlcore.step_costs import CallCost
from tasks.calibration.record import CalibrationDraw
from tasks.calibration.reference import rollout_rewards
from tasks.config.rollout import RolloutConfig
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.plan.timing import COSTLY, Untrusted
from tasks.policy import Policy

#: The calibration's call stands for the probe's large call only where it cost at most this share of the small
#: call's seconds a token (a larger call costs less a token: 0.53-0.83 measured on 2 CPU cores, 1.0 for a first
#: call in a cold process that took twice as long as the same call later).
CHEAPER_A_TOKEN = 0.95

#: The calibration's call stands for the large call only where it took at least this many seconds. It is one
#: sample and the run's first call at its size, which costs more than the same call again: 1.06-1.15x in
#: `rlsift run` and `rlsift plan`, 1.08-1.39x in `rlsift bench`'s runs on 2 CPU cores (the tiny default, 512
#: rollouts; the first call's allocations), enough to charge plain GRPO's step 15 % too much. Below it, timing the
#: large call again costs a few tenths of a second; above it, the first call's extra is a small share of a call that
#: would cost seconds to repeat.
RETIME_BELOW_S = 2.0

#: One timed generate call: its rollouts, its seconds, its decode steps (each engine call to its longest completion).
TimedCall = tuple[Generation, float, int]


def probe_generation(policy: Policy, rc: RolloutConfig, records: list[PromptRecord], drawn_by_calibration:
                     CalibrationDraw | None, sizes: tuple[int, int], seed: int, untrusted: Untrusted,
                     say: Callable[[str], None]) -> tuple[CallCost, list[list[PromptRecord]], list[TimedCall]]:
    """The generate calls' cost (module docstring) for calls of ``sizes`` (small, large) prompts of ``rc.n``
    rollouts; with the calls' prompts and timed calls, whose rollouts the probe reuses (lengths, update groups)."""
    small, large = sizes
    drawn = calibration_call(drawn_by_calibration, large * rc.n, rc.chunk if rc.engine == "hf" else 0)
    warm = drawn is not None  # the calibration's call warmed the engine
    why = ""
    if drawn is not None and drawn[1][1] < RETIME_BELOW_S:
        drawn, why = None, " (the calibration's call, a first call, timed again at this size)"
    elif drawn is not None:
        why = f" (the calibration's {len(drawn[0])} x {drawn[1][0].n}, drawn and timed already, as the largest)"
    first = (small,) if drawn is not None else (small, large)
    say(f"probe: generation, calls of {' and '.join(map(str, first))} prompts x {rc.n} rollouts{why}")
    if not warm:  # warm-up: first-call costs are not a token's
        rollout_rewards(policy, records[:1], rc.n, seed)
    batches: list[list[PromptRecord]] = []
    draws: list[TimedCall] = []

    def time_calls(ks: tuple[int, ...]) -> None:
        for k in ks:
            batches.append(cycle_records(records, k))
            seconds, gen = untrusted.timed(lambda b=batches[-1]: rollout_rewards(policy, b, rc.n, seed)[0], COSTLY,
                                           f"a generate call of {k} prompts")
            draws.append((gen, seconds, int(gen.completion_mask.sum(1).max())))

    time_calls(first)
    if drawn is not None and _per_token(drawn[1]) > CHEAPER_A_TOKEN * _per_token(draws[0]):
        # one sample, not repeated until it held still, and hardly cheaper a token than the small call: it would
        # charge its slowness to every token of the larger calls and hide a decode step's cost
        say(f"probe: the calibration's call took {_per_token(drawn[1]) * 1e6:.0f} us a token against the small "
            f"call's {_per_token(draws[0]) * 1e6:.0f} us: timing a call of {large} prompts instead")
        drawn = None
        time_calls((large,))
    if drawn is not None:
        batches.append(drawn[0])
        draws.append(drawn[1])
    generate = CallCost.fit([g.tokens for g, _, _ in draws], [s for _, s, _ in draws],
                            steps=[d for _, _, d in draws])
    if generate.step_s <= 0:
        untrusted.append("a decode step: the two generate calls do not tell its cost from a token's (the fit "
                         "charges every token alike)")
    return generate, batches, draws


def call_lengths(draws: list[tuple[list[PromptRecord], Generation]]
             ) -> tuple[tuple[float, float], tuple[tuple, ...], tuple[tuple, ...]]:
    """The mean completion and prompt tokens of a rollout, over every drawn prompt; (level, completion, prompt)
    of each level's; and (level, every rollout's completion tokens) of each level's."""
    rows = [(batch[i // gen.n].level, tokens, int(gen.prompt_ids[i // gen.n].numel()))
            for batch, gen in draws for i, tokens in enumerate(gen.completion_mask.sum(1).tolist())]

    def mean(of: list[tuple]) -> tuple[float, float]:
        return statistics.fmean(c for _, c, _ in of), statistics.fmean(p for _, _, p in of)

    levels = dict.fromkeys(lv for lv, _, _ in rows)
    return (mean(rows), tuple((lv, *mean([r for r in rows if r[0] == lv])) for lv in levels),
            tuple((lv, tuple(c for x, c, _ in rows if x == lv)) for lv in levels))


def calibration_call(draw: CalibrationDraw | None, rows: int, chunk: int
                      ) -> tuple[list[PromptRecord], tuple[Generation, float, int]] | None:
    """The calibrate stage's rollouts as the probe's largest generate call (its records, and its rollouts, seconds
    and decode steps: each of its calls, at most ``chunk`` rows, rlcore.plan.call_rows, decodes to its longest
    completion), where this process drew them and its largest call has at least ``rows`` rollouts (the size the
    probe would time: the line through the two calls then spans every call a candidate makes); else None."""
    if draw is None:
        return None
    gen = draw.generation
    calls = call_rows(len(draw.records), gen.n, chunk)
    if max(calls) < rows:
        return None
    lengths = gen.completion_mask.sum(1)
    starts = [sum(calls[:i]) for i in range(len(calls))]
    steps = sum(int(lengths[a:a + r].max()) for a, r in zip(starts, calls, strict=True))
    return list(draw.records), (gen, draw.seconds, steps)


def _per_token(call: tuple[Generation, float, int]) -> float:
    """Seconds a generated token of one timed call (its rollouts, seconds and decode steps)."""
    return call[1] / max(float(call[0].tokens), 1.0)


def cycle_records(records: list[PromptRecord], k: int) -> list[PromptRecord]:
    return [records[i % len(records)] for i in range(k)]
