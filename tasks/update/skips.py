"""A minibatch the update does not apply because its loss or gradient is not finite: what the micro-batch's loss
says of the cause (:func:`non_finite_loss`) and where the first non-finite value appeared (:func:`locate_skip`, by
re-running the micro-batch under ``tasks.update.nan_locator.locate``'s hooks).

tasks/update/policy_update.py skips such a minibatch (``tasks.update.distributed.optimizer_step`` keeps its step
out of the weights) and hands each :class:`~tasks.update.nan_locator.SkippedUpdate` on in its result.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from tasks.update.distributed import DataShard, is_deepspeed
from tasks.update.nan_locator import SkippedUpdate, locate


def non_finite_loss(minibatch: int, piece: torch.Tensor, m: dict[str, float]) -> SkippedUpdate:
    """What a micro-batch's non-finite loss ``piece`` says (``m``: its metrics,
    :func:`~tasks.update.loss.micro_batch_loss`): the loss itself is not finite; or the surrogate is (``train/loss``
    in ``m``) and the loss was made NaN because pi_old, mu or the reference was not finite on a valid token; or the
    loss is finite here and not on another rank."""
    own = float(piece.detach())
    if math.isfinite(own):
        return SkippedUpdate(minibatch, "loss", "finite on this rank, not on another")
    if math.isfinite(m.get("train/loss", math.nan)):
        return SkippedUpdate(minibatch, "inputs", "pi_old, behaviour or reference log-probs not finite on a valid "
                                                  "token; the surrogate loss itself is finite")
    return SkippedUpdate(minibatch, "loss", f"loss {own}")


#: The most micro-batches :func:`locate_skip` re-runs for one skipped minibatch, and the seconds after which it starts
#: no other: a skip must not cost minutes (a 512-row step on a GPU has 59 micro-batches). The passes run longest rows
#: first (``length_buckets``), so the first ones re-run are the ones most likely to show a length-dependent value.
LOCATE_MICRO_BATCHES = 4
LOCATE_SECONDS = 60.0


def locate_skip(model: torch.nn.Module, shard: DataShard | None, rerun: Callable[[torch.Tensor], torch.Tensor],
                skip: SkippedUpdate, parts: Sequence[torch.Tensor], *, limit: int = LOCATE_MICRO_BATCHES,
                seconds: float = LOCATE_SECONDS, clock: Callable[[], float] = time.monotonic) -> SkippedUpdate:
    """``skip`` with the site :func:`~tasks.update.nan_locator.locate` finds re-running ``parts`` (micro-batches'
    rows) one at a time until one shows it: at most ``limit`` of them, none started ``seconds`` after the first
    (``clock``); in one process only (else ``skip`` says why not). Runs only for an update already skipped, so a
    finite update pays nothing."""
    if shard is not None or is_deepspeed(model):
        return replace(skip, note="not located under scale-out (the locator runs in one process: "
                                  "scale.backend=single)")
    t0, tried = clock(), 0
    for n, part in enumerate(parts):
        if tried >= limit or (tried and clock() - t0 > seconds):
            break
        tried += 1
        try:
            site = locate(model, functools.partial(rerun, part), rows=part.tolist())
        except RuntimeError as err:  # out of memory, a kernel's error: the diagnosis fails, the skip stands
            return replace(skip, note=f"the locator's re-run failed: {str(err).splitlines()[0][:200]}")
        if site is not None:
            return replace(skip, site=site, note=f"micro-batch {n + 1} of {len(parts)}" if len(parts) > 1 else "")
    if tried < len(parts):
        return replace(skip, note=f"re-running {tried} of its {len(parts)} micro-batches one at a time (the "
                                  f"locator's cap: {limit} micro-batches, {seconds:.0f} s) gives finite values "
                                  "throughout")
    return replace(skip, note=f"re-running its {len(parts)} micro-batch{'es' if len(parts) > 1 else ''} one at a "
                              "time gives finite values throughout (the value needs them accumulated, or does not "
                              "reproduce)")
