"""The plan's probe timings, kept for the next plan on the same machine (docs/algorithms.md 9.1).

What a generated or an updated token costs depends on the machine, the model's shape and the run's settings, not on
its weights: a plan that runs again where those are the same (a benchmark's next seed, a scheduled retraining) need
not time them again. After each probe its timings are kept in ``<paths.cache>/plan-probe/<key>.json``, one file a
key: a hash of what the probe's parts time (:data:`TIMINGS`), the machine (CPU model, the cores this process may use,
torch's threads and version, the GPU), the model's shape (its config without its folder, its parameter counts and
dtype, the run's precision) and the settings the probe times with (``rollout``, ``train`` but its step count,
``model`` but its path, ``select``, ``gain``, ``calibrate``, ``eval.batch_size``).

The probe has parts (:data:`PARTS`), each timed at some sizes (a generate call's prompts, an update's groups, a
screen pass's prompts, the pool's prompts). A later plan with the same key, within ``plan.reuse_probe_hours`` of
the part's timing, reuses each part whose timed sizes span the ones it would time, to within :data:`COVER` at each
end (the probe predicts larger calls on the same lines, tasks/plan/probe.py); it times the rest and merges them into
the file. The lengths of a completion, which the weights decide, always come from this run's calibration rollouts.
The estimates a kept part could not trust (tasks/plan/timing.py) come back with it.

Deviations: a change of the machine's load since a part was timed is not seen (the age limit bounds it); the file
is replaced whole, so where two plans of one key finish at once, the later one's parts win.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlcore.step_costs import CallCost, ThreadSplit
from tasks.config import Config
from tasks.policy import Policy
from tasks.records.cost import cpu_model, usable_cores
from tasks.records.files import write_json

log = logging.getLogger(__name__)

#: What the probe's parts time, raised when that changes (2: a step's bookkeeping writes its ledger rows once a round,
#: as the run does), so that no kept timing of the older work is reused.
TIMINGS = 2

#: The probe's parts: generation, the update (with the optimizer step and a round's checkpoint), the overlap's split
#: of a CPU's threads, a step's bookkeeping, the screen's pass, the pool's scoring and DOTS's predictor.
PARTS = ("generate", "update", "split", "bookkeeping", "screen", "scoring", "predictor")
#: A kept part serves sizes up to this factor beyond those it was timed at, at either end: the probe's own lines
#: stand for calls several times larger than it timed (tasks/plan/probe.py), and a seed's calibration moves the
#: smallest call a candidate makes by a prompt or two (2 against 3 prompts, 3 against 5 groups, in a benchmark).
COVER = 2.0
#: A kept part's values that are a record (the others are seconds), by name.
RECORDS = {"generate": CallCost, "update": CallCost, "forward": CallCost, "split": ThreadSplit}


@dataclass(frozen=True)
class KeptPart:
    """One part's timings: ``sizes`` (the smallest and largest it was timed at), ``values`` (the costs it gives,
    by :class:`~rlcore.step_costs.UnitCosts` field), ``notes`` (the estimates among them it could not trust) and
    ``at`` (when it was timed, Unix seconds)."""

    sizes: tuple[int, int]
    values: dict[str, Any]
    notes: tuple[str, ...] = ()
    at: float = 0.0

    def serves(self, sizes: tuple[int, int]) -> bool:
        """Whether timings at ``self.sizes`` stand for a part timed at ``sizes`` (module docstring)."""
        return self.sizes[0] <= sizes[0] * COVER and self.sizes[1] * COVER >= sizes[1]

    def to_json(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "notes": list(self.notes), "at": self.at,
                "values": {k: asdict(v) if k in RECORDS else v for k, v in self.values.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KeptPart:
        values = {k: RECORDS[k](**v) if k in RECORDS else float(v) for k, v in d["values"].items()}
        lo, hi = d["sizes"]
        return cls(sizes=(int(lo), int(hi)), values=values, notes=tuple(map(str, d.get("notes", ()))),
                   at=float(d["at"]))


@dataclass
class ProbeMemo:
    """The kept parts of one key (module docstring), read before the probe and written after it: :meth:`reuse`
    hands out a part that serves, :meth:`keep` takes a part just timed, :meth:`save` writes the file. ``path``
    None: nothing is kept or reused (``plan.reuse_probe_hours=0``, or no cache folder)."""

    path: Path | None = None
    max_age_s: float = 0.0
    parts: dict[str, KeptPart] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, folder: Path | None, key: str, max_age_h: float) -> ProbeMemo:
        """The memo of ``key`` in ``folder``: its parts younger than ``max_age_h`` hours. A file that cannot be
        read is logged and timed over (it is replaced after the probe)."""
        if folder is None or max_age_h <= 0:
            return cls()
        path = Path(folder) / f"{key}.json"
        memo = cls(path=path, max_age_s=max_age_h * 3600.0)
        if path.exists():
            try:
                d = json.loads(path.read_text())
                memo.parts = {name: KeptPart.from_json(p) for name, p in d["parts"].items() if name in PARTS}
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("plan probe: the kept timings %s cannot be read (%s): timing every part again", path, err)
        return memo

    def serves(self, part: str, sizes: tuple[int, int]) -> bool:
        """Whether a kept ``part`` is young enough and serves ``sizes``."""
        kept = self.parts.get(part)
        return (self.path is not None and kept is not None and time.time() - kept.at <= self.max_age_s
                and kept.serves(sizes))

    def reuse(self, part: str, sizes: tuple[int, int]) -> KeptPart | None:
        """The kept ``part`` where it :meth:`serves` ``sizes`` (then listed in ``reused``); else None."""
        if not self.serves(part, sizes):
            return None
        self.reused.append(part)
        return self.parts[part]

    def keep(self, part: str, sizes: tuple[int, int], values: dict[str, Any], notes: tuple[str, ...]) -> None:
        """``part`` just timed at ``sizes``, giving ``values``, with the ``notes`` it could not trust."""
        self.parts[part] = KeptPart(sizes=(int(sizes[0]), int(sizes[1])), values=dict(values), notes=tuple(notes),
                                    at=time.time())

    def save(self) -> None:
        """Write the parts (those reused and those just timed) to the memo's file; nothing where ``path`` is None.
        A file that cannot be written costs the next plan a probe, not this one its plan: logged."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, {"parts": {name: p.to_json() for name, p in self.parts.items()}})
        except OSError as err:
            log.warning("plan probe: the timings could not be kept in %s (%s)", self.path, err)


def probe_key(cfg: Config, policy: Policy, device: torch.device | str) -> str:
    """The key of the probe's timings on this machine, for this model's shape and ``cfg``'s settings (module
    docstring): 16 hex digits."""
    model = policy.model
    shape = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    first = next(model.parameters())
    what = {
        "timings": TIMINGS,
        "machine": {"cpu": cpu_model(), "cores": usable_cores(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "device": str(torch.device(device)),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "model": {"class": type(model).__name__, "config": shape, "dtype": str(first.dtype),
                  "params": sum(p.numel() for p in model.parameters()),
                  "trainable": sum(p.numel() for p in policy.trainable_parameters())},
        "settings": {"rollout": cfg.rollout.model_dump(mode="json"),
                     "train": cfg.train.model_dump(mode="json", exclude={"steps"}),
                     "model": cfg.model.model_dump(mode="json", exclude={"path"}),
                     "select": cfg.select.model_dump(mode="json"), "gain": cfg.gain.model_dump(mode="json"),
                     "calibrate": cfg.calibrate.model_dump(mode="json"), "eval_batch": cfg.eval.batch_size},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

