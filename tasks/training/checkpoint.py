"""Crash-safe checkpoints of the complete training state.

A checkpoint holds the model (under LoRA its adapters: the frozen base is the run's policy source), the optimizer
state (through the run's ``Updater``, tasks/update/updater.py, whatever the backend; under
``model.precision=bf16-mixed`` with the float32 master weights, tasks/update/precision.py), selector (DOTS
predictor, curriculum scheduler, GAIN-RL window, pool statistics), replay buffer, the adaptive composition's
average, cost meter, every RNG state, the step counter and, with ``overlap.lag`` 1, the next step's rollouts (drawn
while this step updated, not yet trained: restored on resume, never regenerated and never trained twice). It is
written to a temporary file, fsynced and renamed into place, then the ``latest`` pointer is replaced the same way: a
kill at any moment leaves either the previous or the new checkpoint, never a torn one. Randomness in the loop is
seeded from ``(seed, step, purpose)``, so a resumed run continues exactly as an uninterrupted one.

A checkpoint also keeps the MLflow metrics held for the steps it covers (with their timestamps), which the
training stage's recorder (tasks/training/recorder.py) sends once the checkpoint is written and again on a resume
(:attr:`Resume.held`): a kill between the ``latest`` pointer's update and the send would otherwise lose them.
The cost meter of a resumed run is the checkpoint's plus what the resuming process spent before training (redone
stages); the time a crashed process spent past its last checkpoint is not counted. A resume before the first
checkpoint keeps the stages the crashed process recorded (``Run.carried``), so their cost is in every later step's
totals. The step a resume continues from reports the peak memory of the phases an uninterrupted run's does
(tasks/records/memory.py): the checkpoint write's, kept in the ``latest`` pointer (measured when the file is written,
before the pointer and the metrics' send), not those of the stages the resuming process redid before training.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcore.seeding import derive_seed
from tasks.policy import Policy
from tasks.records.files import atomic_write
from tasks.update.updater import Updater

KEEP = 2


@dataclass(frozen=True)
class Resume:
    """Where training continues: ``step``, the rollouts already drawn for it (``overlap.lag`` 1; None when
    the checkpoint holds none: a fresh start, a sequential run, or a checkpoint at the last step) and the held MLflow
    metrics the checkpoint kept (None without a checkpoint) and the rollouts the latest draw left for the next one to
    complete (``waves.carry``; None: none)."""

    step: int
    draw: Any = None
    held: list | None = None
    carry: Any = None


def save(run, step: int, policy: Policy, updater: Updater, selector: dict, buffer, composer=None, draw=None,
         held: list | None = None, carry=None) -> Path:
    """Write the training state after ``step`` steps; ``selector``: the selector's state (``Selector.state_dict``);
    ``draw``: the next step's rollouts, drawn and not yet trained;
    ``carry``: the rollouts the latest draw left for the next draw to complete;
    ``held``: the MLflow metrics of the steps it covers not sent yet (tasks/training/recorder.py sends them after)."""
    folder = run.checkpoint_dir
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": policy.checkpoint_state(),
        "optimizer": updater.state_dict(),
        "selector": selector,
        "buffer": buffer.state_dict() if buffer is not None else None,
        "composer": composer.state_dict() if composer is not None else None,
        "meter": run.meter.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "metrics": list(held or []),
        "draw": draw,
        "carry": carry,
    }
    path = folder / f"step-{step:06d}.pt"
    t0 = time.perf_counter()
    atomic_write(path, lambda f: torch.save(state, f))
    # the pointer also keeps the write's seconds and peak memory, which the file could not hold (restore adds them)
    mb = run.meter.memory.peak() if run.meter.memory is not None else float("nan")
    atomic_write(folder / "latest", lambda f: f.write(f"{path.name}\n{time.perf_counter() - t0!r}\n{mb!r}\n".encode()))
    for old in sorted(folder.glob("step-*.pt"))[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def latest(run) -> Path | None:
    pointer = run.checkpoint_dir / "latest"
    if not pointer.exists():
        return None
    path = run.checkpoint_dir / pointer.read_text().split()[0]
    return path if path.exists() else None


def _write_seconds(run) -> float:
    """The seconds the latest checkpoint took to write (0 for a pointer written before they were kept)."""
    lines = (run.checkpoint_dir / "latest").read_text().split()
    return float(lines[1]) if len(lines) > 1 else 0.0


def _write_peak_mb(run) -> float:
    """The peak memory of the latest checkpoint's write (NaN where not measured or not kept)."""
    lines = (run.checkpoint_dir / "latest").read_text().split()
    return float(lines[2]) if len(lines) > 2 else float("nan")


def restore(run, policy: Policy, updater: Updater, selector, buffer, composer=None) -> Resume:
    """Load the latest checkpoint of ``run`` into the given objects; returns the step to continue from, the
    rollouts drawn for it and the held metrics it kept (what a crashed process recorded past it is the recorder's
    to drop, tasks/training/recorder.py)."""
    path = latest(run)
    if path is None:  # a fresh start, or a crash before the first checkpoint: same RNG state either way
        seed = derive_seed(run.cfg.seed, "train-start")
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        return Resume(0)
    state = torch.load(path, weights_only=False)
    policy.load_checkpoint_state(state["model"])
    updater.load_state_dict(state["optimizer"])  # after the model: the sharded updater pushes its weights
    selector.load_state_dict(state["selector"])
    if buffer is not None and state["buffer"] is not None:
        buffer.load_state_dict(state["buffer"])
    if composer is not None and state.get("composer") is not None:
        composer.load_state_dict(state["composer"])
    # work this process redid before training (the policy's loading), on top of what the crashed one recorded
    redone = {k: v - run.carried.get(k, 0.0) for k, v in run.meter.seconds.items()}
    run.meter.load_state_dict(state["meter"])
    run.meter.add("checkpoint", _write_seconds(run))
    if run.meter.memory is not None:  # the first step reports the phases an uninterrupted run's does:
        run.meter.memory.take()  # not the stages this process redid before training, but the checkpoint's write
        if not math.isnan(mb := _write_peak_mb(run)):
            run.meter.memory.record("checkpoint", mb)
    for name, seconds in redone.items():
        if seconds > 0:
            run.meter.add(name, seconds)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return Resume(int(state["step"]), state.get("draw"), list(state.get("metrics") or []), state.get("carry"))
