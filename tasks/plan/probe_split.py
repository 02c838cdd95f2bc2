"""The plan's probe of the overlap's split (tasks/plan/probe.py, docs/algorithms.md 9.1): where a lag-1 run splits a
CPU's cores between the sampler and the trainer, each side's pace beside the other, against the same work on all
threads (:class:`rlcore.step_costs.ThreadSplit`, read by rlcore/plan.py ``overlapped_step``)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from rlcore.step_costs import ThreadSplit
from rlcore.types import RolloutGroup
from tasks.calibration.reference import rollout_rewards
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.overlap.concurrent import Sampler, SamplerHandover
from tasks.plan.timing import Untrusted, relative_spread
from tasks.policy import Policy
from tasks.update.policy_update import LocalUpdater

#: Rounds of the split's four timings (:func:`probe_split`); each pace is the median of its
#: rounds' ratios, every round timing a side on all threads just before it times the same side split.
SPLIT_ROUNDS = 3
#: A split whose paces spread more than this over the rounds ((max - min) / median) is listed among the estimates
#: the probe cannot trust. Single calls of 0.1-0.4 s on 2 shared cores: 22-76 % in five plans on the smallest call,
#: so the repeat rule of the other timings (15 %) would flag every one.
SPLIT_SPREAD = 0.5


def split_prompts(sizes: tuple[int, int]) -> int:
    """Prompts of the split's generate call, from the probe's two generate sizes (small, large: the baseline's):
    half the baseline's, at least the small one. A generate call gains more from more threads the larger it is (its
    tokens' share of its cost grows against its decode steps'), so the generator's pace beside the update grows with
    the call: measured on 2 cores (S53, the default pool, eight and six probes of three rounds each), 1.13x (sd 0.15)
    at 3 prompts of 8 rollouts, 1.37x (sd 0.09) at 16, about 1.5x at 64. Half the baseline's call is within a few per
    cent of the pace at the calls an overlapped step makes (the baseline's; a screened candidate's of half as many
    prompts), where the smallest call's was a quarter low for plain GRPO's."""
    small, large = sizes
    return max(small, large // 2)


def probe_split(policy: Policy, cfg: Config, batch: list[PromptRecord], groups: list[RolloutGroup],
                updater: LocalUpdater, threads: tuple[int, int], seed: int, untrusted: Untrusted,
                handover: SamplerHandover | None = None) -> ThreadSplit:
    """Each side's pace where a lag-1 run splits a CPU's threads (:class:`rlcore.step_costs.ThreadSplit`): the
    generate call of ``batch`` (generated and verified) and the update of ``groups``, each timed on all threads in
    this process, then as the run has them, at once: the call in the generator process the run starts
    (tasks/overlap/concurrent.py :class:`Sampler`; ``threads``: (generator, trainer), as it splits them) on a second
    thread, as the run's draw, the update (by ``updater``, the probe's own at learning rate 0) here on the trainer's
    threads (:func:`at_once`). :data:`SPLIT_ROUNDS` rounds of the three, interleaved so that each pace's two timings
    see the same load (a 0.1 s call's time moved up to 60 % between two calls a second apart on 2 cores); each pace
    is the median over the rounds. The generator process is then kept in ``handover`` for a lag-1 training of
    ``policy`` (tasks/overlap/concurrent.py :class:`SamplerHandover`: the training samples from it where it fits,
    else stops it), so the run starts one, and the plan does not wait for it to stop (0.6 s on 2 cores); without a
    handover, or where the probe fails, it is stopped here."""
    model, was_training, every = policy.model, policy.model.training, torch.get_num_threads()
    sampling, done = None, False
    try:
        here, update = (lambda: rollout_rewards(policy, batch, cfg.rollout.n, seed)), (lambda: updater.step(groups))
        sampling = Sampler(policy, 1, threads=cfg.overlap.generator_threads)  # the trainer now on its share
        share = torch.get_num_threads()
        sampling.process.ready(wait=True)
        apart = sampling.policy

        def draw() -> object:
            return rollout_rewards(apart, batch, cfg.rollout.n, seed)

        # warm-ups, after the fork (whose shared pages the parent's first writes copy: a first round's update ran at
        # half its later pace): the first backward allocates, the first AdamW step makes its state, the child's call
        torch.set_num_threads(every)
        update(), here(), draw()
        rounds = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsift-probe") as pool:
            for _ in range(SPLIT_ROUNDS):
                torch.set_num_threads(every)
                gen_all, upd_all = _seconds(here), _seconds(update)
                torch.set_num_threads(share)
                gen_split, upd_split = at_once(draw, update, pool, draw_longer=gen_all >= upd_all)
                rounds.append((gen_split / gen_all, upd_split / upd_all))
        done = True
    finally:
        if sampling is not None and done and handover is not None:
            handover.keep(sampling)
        elif sampling is not None:
            sampling.close()
        torch.set_num_threads(every)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    generate, passes = (statistics.median(r) for r in zip(*rounds, strict=True))
    spread = max(relative_spread(r) for r in zip(*rounds, strict=True))
    if spread > SPLIT_SPREAD:
        untrusted.append(f"the overlap's split: its paces spread up to {spread:.0%} over {SPLIT_ROUNDS} rounds "
                         f"(trusted to {SPLIT_SPREAD:.0%})")
    return ThreadSplit(generate=generate, passes=passes, threads=threads)


def at_once(draw: Callable[[], object], update: Callable[[], object], pool: ThreadPoolExecutor,
            draw_longer: bool = True) -> tuple[float, float]:
    """Seconds of one ``draw`` (on ``pool``'s thread, as the run's draw) and of one ``update`` (on this thread, as the
    run's trainer), each while the other runs: the side that takes longer alone (``draw_longer``) runs once while
    the other repeats without pause beside it, and the repeated side's time is the long call's span over the calls'
    worth of its work done in the span (:func:`_inside`). Timing each side beside the other's repeats in turn took a
    call of each and then a wait for the other side's call in flight (up to another long call): on 2 cores the split
    took 8-10 s of an 11-16 s first plan that way, 5-7 s this way (S55, docs/benchmarks.md, "Every idea tried").
    Where no call of the short side fits inside the long one (alone the shorter, split the longer), that side is
    timed the other way round, once beside the other's repeats."""
    if draw_longer:
        draw_s, update_s = _draw_once(draw, update, pool)
        return draw_s, update_s if update_s is not None else _update_once(draw, update, pool)[1]
    draw_s, update_s = _update_once(draw, update, pool)
    return draw_s if draw_s is not None else _draw_once(draw, update, pool)[0], update_s


def _draw_once(draw: Callable[[], object], update: Callable[[], object],
               pool: ThreadPoolExecutor) -> tuple[float, float | None]:
    """One ``draw`` on ``pool``'s thread while ``update`` repeats here: its seconds, and an update's seconds beside it
    (:func:`_inside`; None: no update wholly inside it)."""
    running = pool.submit(_interval, draw)
    calls = []
    while not running.done():
        calls.append(_interval(update))
    start, end = running.result()
    return end - start, _inside(calls, start, end)


def _update_once(draw: Callable[[], object], update: Callable[[], object],
                 pool: ThreadPoolExecutor) -> tuple[float | None, float]:
    """One ``update`` here while ``draw`` repeats on ``pool``'s thread (started first): a draw's seconds beside it
    (:func:`_inside`; None: no draw wholly inside it), and its seconds."""
    stop, started = threading.Event(), threading.Event()

    def repeat() -> list[tuple[float, float]]:
        calls = []
        while not stop.is_set():
            started.set()
            calls.append(_interval(draw))
        return calls

    running = pool.submit(repeat)
    try:
        started.wait()
        start, end = _interval(update)
    finally:
        stop.set()
    return _inside(running.result(), start, end), end - start


def _interval(work: Callable[[], object]) -> tuple[float, float]:
    """When ``work()`` started and ended (``time.perf_counter``)."""
    t0 = time.perf_counter()
    work()
    return t0, time.perf_counter()


def _inside(calls: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Seconds a call of the repeated work took within ``start``-``end`` (the long call's span): the span over the
    calls' worth of work done in it, each call counted by the share of it that fell in the span (its work taken as
    even over its time). None where no call lies wholly inside. The median of the calls wholly inside would favour
    the short ones (a long call is likelier to cross the span's ends): in three plans on 2 cores it read the
    trainer's pace at 1.06-1.29x, against 1.18-1.47x from a single update beside the draw's repeats."""
    if not any(a >= start and b <= end for a, b in calls):
        return None
    work = sum(max(0.0, min(b, end) - max(a, start)) / (b - a) for a, b in calls if b > a)
    return (end - start) / work


def _seconds(work: Callable[[], object]) -> float:
    start, end = _interval(work)
    return end - start
