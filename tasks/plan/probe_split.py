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
    this process, then as the run has them, each while the other side's work repeats without pause: the call in
    the generator process the run starts (tasks/overlap/concurrent.py :class:`Sampler`; ``threads``: (generator,
    trainer), as it splits them), the update (by ``updater``, the probe's own at learning rate 0) here on the
    trainer's threads. :data:`SPLIT_ROUNDS` rounds of the four,
    interleaved so that each pace's two timings see the same load (a 0.1 s call's time moved up to 60 % between two
    calls a second apart on 2 cores); each pace is the median over the rounds. The generator process is then kept
    in ``handover`` for a lag-1 training of ``policy`` (tasks/overlap/concurrent.py :class:`SamplerHandover`: the
    training samples from it where it fits, else stops it), so the run starts one, and the plan does not wait for
    it to stop (0.6 s on 2 cores); without a handover, or where the probe fails, it is stopped here."""
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
                rounds.append((_beside(draw, update, pool) / gen_all, _beside(update, draw, pool) / upd_all))
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


def _seconds(work: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def _beside(work: Callable[[], object], other: Callable[[], object], pool: ThreadPoolExecutor) -> float:
    """Seconds of one call of ``work`` while ``other`` repeats without pause in ``pool``'s thread (started first)."""
    stop, started = threading.Event(), threading.Event()

    def load() -> None:
        while not stop.is_set():
            started.set()
            other()

    running = pool.submit(load)
    try:
        started.wait()
        return _seconds(work)
    finally:
        stop.set()
        running.result()
