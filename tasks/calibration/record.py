"""What the calibrate stage (tasks/stages.py ``calibrate_stage``) hands the plan and the training stage.

K reference prompts of the pool, stratified by level, each rolled out G times with the starting policy:
their measured success rates are DOTS's first predictor labels (arXiv 2506.05316) and the
pool's first difficulty measurements (tasks/selection/selector.py ``Selector.seed_labels``). Saved as the
run's ``calibrate.json`` so a resumed run reuses it. The rollouts themselves and their seconds
(:class:`CalibrationDraw`) go to the plan's probe in memory only (tasks/plan/probe.py: its largest generate call,
already made and timed); a loaded calibration has none, and the pipeline drops them once the plan is made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.data.prompts import PromptRecord
from tasks.generation.rollout import Generation
from tasks.records.files import write_json


@dataclass(frozen=True, eq=False)
class CalibrationDraw:
    """The calibrate stage's rollouts as drawn: ``records`` [K] (the reference prompts, in order), their
    ``generation`` (K x G rollouts in the engine's calls of at most ``rollout.chunk`` rows) and its ``seconds``
    (generation and verification, as the probe times a call: tasks/calibration/reference.py ``rollout_rewards``),
    timed once."""

    records: tuple[PromptRecord, ...]
    generation: Generation
    seconds: float

    def __post_init__(self) -> None:
        if len(self.records) != len(self.generation.prompt_ids) or not self.seconds > 0:
            raise ValueError(f"CalibrationDraw: {len(self.records)} records for {len(self.generation.prompt_ids)} "
                             f"prompts generated in {self.seconds!r} s")


@dataclass(frozen=True, eq=False)
class Calibration:
    """``indices``: the K reference prompts' positions in the pool; ``success``: [K] float32 success rates;
    ``draw``: their rollouts and seconds where this process drew them (None once loaded or dropped)."""

    indices: tuple[int, ...]
    success: torch.Tensor
    draw: CalibrationDraw | None = None

    def __post_init__(self) -> None:
        if self.success.shape != (len(self.indices),):
            raise ValueError(f"Calibration: {len(self.indices)} indices but success of shape "
                             f"{tuple(self.success.shape)}")

    @property
    def metrics(self) -> dict[str, float]:
        """``calibrate/*``: mean success, and the shares of prompts with mixed (effective), all-right and
        all-wrong rollouts."""
        rates = self.success
        return {"calibrate/success_mean": float(rates.mean()),
                "calibrate/effective": float(((rates > 0) & (rates < 1)).float().mean()),
                "calibrate/solved": float((rates == 1).float().mean()),
                "calibrate/unsolved": float((rates == 0).float().mean())}

    def first(self, pool: list, k: int) -> list:
        """The first k reference prompts of ``pool`` (the plan's and the overlap's probe prompts)."""
        return [pool[i] for i in self.indices[:k]]

    def to_json(self) -> dict[str, Any]:
        return {"indices": list(self.indices), "success": self.success.tolist(), **self.metrics}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        return cls(indices=tuple(int(i) for i in d["indices"]), success=torch.tensor(d["success"], dtype=torch.float32))

    def save(self, path: Path) -> Path:
        write_json(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: Path) -> Calibration:
        return cls.from_json(json.loads(Path(path).read_text()))
