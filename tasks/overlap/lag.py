"""The overlap's lag for a training (``overlap.lag``, :func:`decide_lag`): as configured, or for ``auto``
rlcore.overlap_lag.choose_lag (the pure decision), from where the sampler and the trainer run
(tasks/overlap/concurrent.py ``separate_devices``) and, where they share a device, :func:`probe_overlap`: the same
draw and update, alone and at once, probed only where the probe can pay for itself (:func:`probe_worth`).

Who asks: the plan, for the config its chosen candidate trains (tasks/plan/planner.py ``make_plan``, with the
step's predicted seconds); the pipeline's overlap stage where no plan ran (tasks/stages.py); the training stage
itself when called without a decided lag (tasks/training/entry.py). A lag-1 probe's generator process is handed over
to the training (tasks/overlap/concurrent.py :class:`~tasks.overlap.concurrent.SamplerHandover`). The choice is
stored as JSON (:func:`lag_to_json`, :func:`lag_from_json`): in the plan's ``plan.json`` and the run's
``overlap.json``, which a resumed run reuses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from rlcore.overlap_lag import LagChoice, OverlapProbe, ProbeWorth, choose_lag, probe_cost
from rlcore.seeding import derive_seed
from tasks.config import Config
from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.model.forward import token_logprobs
from tasks.overlap.concurrent import Sampler, SamplerHandover, separate_devices, thread_split
from tasks.overlap.generator_process import start_method
from tasks.policy import Policy
from tasks.update.backend import ranks_generate


def decide_lag(cfg: Config, policy: Policy, records: list[PromptRecord], device: torch.device | str = "cpu", *,
               expected: tuple[float, float] | None = None, handover: SamplerHandover | None = None) -> LagChoice:
    """``overlap.lag`` for training ``cfg``: 0 or 1 as set, or for ``auto`` rlcore.overlap_lag.choose_lag from where the
    sampler and the trainer run and, where they share a device, :func:`probe_overlap` on ``records`` (``expected``,
    ``handover``: its own). ``auto`` under a sharded backend on several ranks with the in-process engine: 0, so that
    every rank generates its share (docs/scale-out.md)."""
    known = lag_without_probe(cfg, policy, device)
    if known is not None:
        return known
    return probe_overlap(policy, records, cfg, derive_seed(cfg.seed, "overlap-probe"), device, expected, handover)


def lag_without_probe(cfg: Config, policy: Policy, device: torch.device | str = "cpu") -> LagChoice | None:
    """The lag :func:`decide_lag` gives without its probe: ``overlap.lag`` as set; for ``auto``, 0 under a sharded
    backend whose ranks each generate, 1 where the sampler and the trainer run apart; None where they share a device
    and the probe decides (what the plan predicts a candidate with, before its choice: rlcore/plan.py)."""
    oc = cfg.overlap
    if oc.lag != "auto":
        return LagChoice(oc.lag, "config", f"lag {oc.lag}: overlap.lag={oc.lag} in the config")
    ranks = ranks_generate(cfg, policy.engine)
    if ranks > 1:  # lag 1 would leave generation to rank 0 alone (tasks/update/backend.py share_generation)
        return LagChoice(0, "config", f"lag 0: scale.backend={cfg.scale.backend} on {ranks} ranks, each generating "
                                      "its share of every call; the overlap would leave generation to rank 0")
    separate = separate_devices(policy.engine, device, oc.generator_threads)
    return choose_lag(separate, None, oc.min_gain) if separate else None


#: The overlap probe repeats its draw, update and both at once until the time one after the other adds up to this
#: many seconds (a tiny model's step is a tenth of a second, within a loaded machine's noise), at most
#: :data:`OVERLAP_PROBE_REPEATS` times.
OVERLAP_PROBE_S = 2.0
OVERLAP_PROBE_REPEATS = 5


#: ``overlap.start_s`` unset: the generator process's predicted start (the process, its imports, the weights, its first
#: call) by the trainer's device and how the child starts (tasks/overlap/generator_process.py ``start_method``). A CPU,
#: forked (one generator thread): nothing to import, ready in about 0.3 s. A CPU, spawned: a Python importing torch and
#: transformers, about 4 s (docs/algorithms.md 8.3). An accelerator: also its runtime and the first call's graph
#: captures and compiles, 17.5 s and 18.4 s for the tiny model on one H200 (docs/performance.md, "The generator process
#: started early"), about what a 1.5B's first call adds to its imports.
START_S = {"cpu-fork": 1.0, "cpu": 5.0, "accelerator": 20.0}


def predicted_start_s(cfg: Config, device: torch.device | str) -> float:
    """Seconds the generator process is predicted to take to start: ``overlap.start_s``, or :data:`START_S`."""
    if cfg.overlap.start_s is not None:
        return cfg.overlap.start_s
    if torch.device(device).type != "cpu":
        return START_S["accelerator"]
    threads = thread_split(torch.get_num_threads(), cfg.overlap.generator_threads)[0]
    return START_S["cpu-fork" if start_method(device, threads) == "fork" else "cpu"]


def probe_worth(draw_s: float, update_s: float, cfg: Config, device: torch.device | str = "cpu") -> ProbeWorth:
    """Whether the overlap probe can pay for itself on a run of ``cfg`` on ``device`` whose step draws in ``draw_s``
    and updates in ``update_s`` (rlcore/overlap_lag.py :class:`ProbeWorth`; the process's start predicted by
    :func:`predicted_start_s`)."""
    start = predicted_start_s(cfg, device)
    return ProbeWorth(draw_s=draw_s, update_s=update_s, steps=cfg.train.steps, start_s=start,
                      probe_s=probe_cost(draw_s, update_s, start, OVERLAP_PROBE_S, OVERLAP_PROBE_REPEATS))


def probe_overlap(policy: Policy, records: list[PromptRecord], cfg: Config, seed: int,
                  device: torch.device | str = "cpu", expected: tuple[float, float] | None = None,
                  handover: SamplerHandover | None = None) -> LagChoice:
    """The lag on a device the sampler and the trainer share, probed where the probe pays for itself.

    One step's draw (``train.prompts_per_step`` of ``records``, cycled, ``rollout.n`` rollouts each) and one update
    over its rows (forward and backward, no optimizer step) are timed alone with every thread (lag 0), after a
    first call of each. ``expected`` (a step's draw and update seconds, the plan's prediction) or these timings
    say whether the rest of the probe can pay for itself (:func:`probe_worth`); where it cannot, lag 0 without it.
    Else the generator process starts (timed until its first call came back) and the draw runs in it while the
    update runs here, as a lag-1 run has them, alternating with both alone (:data:`OVERLAP_PROBE_S`) so that
    each repeat sees the same load; the record holds their medians. Where the choice is lag 1 and ``handover`` is
    given, the process is kept there for the training (tasks/overlap/concurrent.py :class:`SamplerHandover`); else
    it is closed, as it is on any error."""
    rc, oc = cfg.rollout, cfg.overlap
    worth = None if expected is None else probe_worth(*expected, cfg, device)
    if worth is not None and not worth.pays:
        return choose_lag(None, None, oc.min_gain, worth)
    prompts = policy.prompts([records[i % len(records)] for i in range(cfg.train.prompts_per_step)])
    policy.engine.generate(prompts[:1], n=rc.n, seed=seed)  # warm-up: first-call costs are not the draw's
    t0 = time.perf_counter()
    gen = policy.engine.generate(prompts, n=rc.n, seed=seed)
    first_draw_s = time.perf_counter() - t0
    update = update_timer(policy, gen, cfg, device)
    update(slice(None))  # warm-up: the update at once runs on the same rows
    first_update_s = update(slice(None))
    if worth is None:
        worth = probe_worth(first_draw_s, first_update_s, cfg, device)
        if not worth.pays:
            return choose_lag(None, None, oc.min_gain, worth)
    total = torch.get_num_threads()
    t0 = time.perf_counter()
    sampling = Sampler(policy, 1, threads=oc.generator_threads)
    kept = False
    try:
        engine = sampling.policy.engine
        sampling.process.ready(wait=True)  # the draws at once are the child's, not ones made here while it starts
        engine.generate(prompts[:1], n=rc.n, seed=seed)
        start_s = time.perf_counter() - t0
        times: list[tuple[float, float, float]] = []  # (draw, update, at once) of each repeat
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsift-probe") as pool:
            while not times or (len(times) < OVERLAP_PROBE_REPEATS
                                and sum(d + u for d, u, _ in times) < OVERLAP_PROBE_S):
                torch.set_num_threads(total)  # alone: every thread, as lag 0 has them
                t0 = time.perf_counter()
                policy.engine.generate(prompts, n=rc.n, seed=seed)
                draw_s = time.perf_counter() - t0
                update_s = update(slice(None))
                torch.set_num_threads(thread_split(total, oc.generator_threads)[1])
                t0 = time.perf_counter()
                drawn = pool.submit(engine.generate, prompts, rc.n, seed)
                update(slice(None))
                drawn.result()
                times.append((draw_s, update_s, time.perf_counter() - t0))
        draw_s, update_s, at_once_s = (statistics.median(t) for t in zip(*times, strict=True))
        probe = OverlapProbe(draw_s=draw_s, update_s=update_s, at_once_s=at_once_s, repeats=len(times),
                             start_s=start_s)
        choice = choose_lag(None, probe, oc.min_gain, worth)
        if choice.lag == 1 and handover is not None:
            handover.keep(sampling)
            kept = True
        return choice
    finally:
        if not kept:
            sampling.close()


def update_timer(policy: Policy, gen: Generation, cfg: Config,
                 device: torch.device | str) -> Callable[[slice], float]:
    """``rows -> seconds`` for the overlap probe: the update's work on rows of ``gen`` (a slice): a no-grad forward
    (pi_old), then a forward and backward pass; the gradients are dropped, the weights do not change."""
    rc, tc = cfg.rollout, cfg.train
    prompts = [gen.prompt_ids[i // gen.n] for i in range(gen.completion_ids.shape[0])]
    pad, model = policy.tokenizer.pad_token_id, policy.model

    def update(r: slice) -> float:
        args = (model, prompts[r], gen.completion_ids[r], gen.completion_mask[r], pad, rc.temperature, device)
        t0 = time.perf_counter()
        with torch.no_grad():
            token_logprobs(*args, max_tokens=tc.micro_batch_tokens)
        token_logprobs(*args, max_tokens=tc.micro_batch_tokens).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return update


def lag_to_json(choice: LagChoice) -> dict[str, Any]:
    """``choice`` as JSON values (``overlap.json``, ``plan.json``'s ``overlap``)."""
    return asdict(choice)


def lag_from_json(d: dict[str, Any]) -> LagChoice:
    """The :class:`~rlcore.overlap_lag.LagChoice` that :func:`lag_to_json` wrote."""
    probe, worth = d.get("probe"), d.get("worth")
    return LagChoice(lag=d["lag"], basis=d["basis"], reason=d["reason"],
                     probe=OverlapProbe(**probe) if probe is not None else None,
                     worth=ProbeWorth(**worth) if worth is not None else None)
