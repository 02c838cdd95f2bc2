"""What the calibrate stage (tasks/stages.py ``calibrate_stage``) hands the training stage.

K reference prompts of the pool, stratified by level, each rolled out G times with the starting policy:
their measured success rates are DOTS's first predictor labels (arXiv 2506.05316) and the
pool's first difficulty measurements (tasks/selection/selector.py ``Selector.seed_labels``). Saved as the
run's ``calibrate.json`` so a resumed run reuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.records.files import write_json


@dataclass(frozen=True, eq=False)
class Calibration:
    """``indices``: the K reference prompts' positions in the pool; ``success``: [K] float32 success rates."""

    indices: tuple[int, ...]
    success: torch.Tensor

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
