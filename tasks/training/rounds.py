"""A training round's one-line selection summary (in the pipeline the log of its Prefect task run ``round-<r>``,
tasks/stages.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from tasks.data.prompts import PromptRecord
from tasks.overlap.concurrent import OverlapTimes
from tasks.records.ledger import SelectionRow


@dataclass
class RoundLog:
    """One round's selection summary, tallied over its steps in this process and logged when it ends (one line; the
    Prefect round task's, tasks/stages.py): prompts selected by level and their mean predicted success (when DOTS
    predicts), the mean reward of the fresh rollouts, the shares of trained groups that had unequal rewards and that
    were replayed, the held-out accuracy when the round's last step ended on an evaluation (``eval.every``) and,
    overlapped, the seconds of its updates and of the next steps' draws beside them.
    """

    index: int
    steps: list[int]
    levels: Counter[int | None] = field(default_factory=Counter)
    predicted: list[float] = field(default_factory=list)
    groups: int = 0
    effective: float = 0.0
    replayed: int = 0
    reward_sum: float = 0.0
    rollouts: int = 0
    heldout: float | None = None
    overlapped: list[tuple[float, OverlapTimes]] = field(default_factory=list)

    def add(self, records: list[PromptRecord], rows: list[SelectionRow], eff: torch.Tensor, replayed: int,
            overlapped: tuple[float, OverlapTimes] | None, rewards: list[torch.Tensor],
            heldout: float | None) -> None:
        """One step: its fresh draw's prompts and ledger rows, ``eff`` [groups trained] 1.0 where a group's rewards
        were unequal else 0.0, the number of its groups that were replayed, (update s, timing) when it
        overlapped the next step's draw, ``rewards``, each drawn prompt's [rollouts] of its fresh rollouts, and the
        held-out accuracy when the step ended on an evaluation (else None)."""
        self.levels.update(r.level for r in records)
        self.reward_sum += sum(float(r.sum()) for r in rewards)
        self.rollouts += sum(r.numel() for r in rewards)
        self.heldout = heldout
        self.predicted += [r.pred_success for r in rows if r.pred_success is not None]
        self.groups += len(eff)
        self.effective += float(eff.sum())
        self.replayed += replayed
        if overlapped is not None:
            self.overlapped.append(overlapped)

    def line(self) -> str:
        """E.g. ``round 1, steps 2-3: 12 prompts selected (level 1: 5, 2: 7), predicted success 0.41; reward mean
        0.47; 16 groups trained, effective 0.62, replayed 0.25; held-out accuracy 0.550``, the held-out accuracy only
        when the round ended on an evaluation, then the overlap's seconds when its steps overlapped."""
        levels = ", ".join(f"{'?' if lv is None else lv}: {self.levels[lv]}"
                           for lv in sorted(self.levels, key=lambda lv: (lv is None, lv or 0)))
        predicted = f", predicted success {sum(self.predicted) / len(self.predicted):.2f}" if self.predicted else ""
        line = (f"round {self.index}, steps {self.steps[0]}-{self.steps[-1]}: {self.levels.total()} prompts selected "
                f"(level {levels}){predicted}; reward mean {self.reward_sum / max(self.rollouts, 1):.2f}; "
                f"{self.groups} groups trained, effective {self.effective / self.groups:.2f}, replayed "
                f"{self.replayed / self.groups:.2f}")
        if self.heldout is not None:
            line += f"; held-out accuracy {self.heldout:.3f}"
        if not self.overlapped:
            return line
        times = [t for _, t in self.overlapped]
        return (f"{line}; {len(times)} steps overlapped: update {sum(u for u, _ in self.overlapped):.1f} s, next "
                f"steps' draws {sum(t.draw_s for t in times):.1f} s, at once {sum(t.overlap_s for t in times):.1f} s; "
                f"idle: trainer {sum(t.trainer_idle_s for t in times):.1f} s, generator "
                f"{sum(t.generator_idle_s for t in times):.1f} s")
