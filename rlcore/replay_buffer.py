"""Rollout Replay: a FIFO buffer of informative rollout groups, replayed uniformly.

Paper: Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through
Difficulty-targeted Online Data Selection and Rollout Replay", arXiv 2506.05316 (RR). Official code:
github.com/ASTRAL-Group/data-efficient-llm-rl, ``ray_trainer.py: select_buffer``. Summary: docs/algorithms.md
section 2.1.
The off-policy-corrected loss that replayed groups need is ``rlcore.grpo_loss.clipped_policy_loss`` with
``behaviour_logp = group.behaviour_logp``.

Each step trains on ``n_fresh`` fresh groups plus ``n_replay`` groups drawn uniformly without replacement
from a FIFO buffer of capacity C; fresh groups whose success rate (over all n generated rollouts) is
strictly between 0 and 1 are admitted.

Choices and deviations:
    * Admission is eager (at ``admit``); the official code filters lazily before each draw. Same content.
    * Dedup by prompt id, keep last: a new group for a prompt already stored replaces the old one and
      becomes the newest entry (the code's "keep the LAST occurrence per question").
    * FIFO eviction once more than ``capacity`` groups are stored. Capacity 0 never stores anything, so a run
      with it is plain GRPO.
    * ``max_age`` (our addition, docs/algorithms.md section 6.4; None = no limit as in the paper): at ``sample`` time,
      groups with ``step - group.step > max_age`` are dropped for good (their age only grows).
    * A draw asks for k groups and returns min(k, eligible) of them; replayed groups are deep copies with
      ``replayed_from`` set to the step that generated them. Groups can be replayed again at later steps,
      as in the paper. ``admit`` refuses replayed groups, so replay cannot refresh a group's FIFO position.
    * ``mix_counts`` refills a short buffer with fresh prompts so every step has ``batch_prompts`` groups
      (``refill=False`` gives the official code's short batch instead).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch

from rlcore.types import RolloutGroup

__all__ = ["ReplayBuffer", "mix_counts"]

_STATE_VERSION = 1


def _copy_group(group: RolloutGroup, **changes) -> RolloutGroup:
    """A deep copy (tensors cloned and detached) with some fields changed."""
    state = {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in group.state().items()
    }
    state.update(changes)
    return RolloutGroup.from_state(state)


class ReplayBuffer:
    """FIFO buffer of RolloutGroups keyed by prompt id (oldest first).

    Args:
        capacity: most groups kept, >= 0 (0: never replays) (``replay.capacity``).
        max_age: groups older than this many steps are not replayed (None: no limit) (``replay.max_age``).
    """

    def __init__(self, capacity: int, *, max_age: int | None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0):
            raise ValueError(f"max_age must be None or an int >= 0, got {max_age!r}")
        self.capacity = capacity
        self.max_age = max_age
        self._groups: OrderedDict[str, RolloutGroup] = OrderedDict()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._groups

    def prompt_ids(self) -> list[str]:
        """Prompt ids of the stored groups, oldest first (the eviction order)."""
        return list(self._groups)

    def admit(self, group: RolloutGroup) -> bool:
        """Store a fresh group if it is informative.

        Args:
            group: a fresh group (``replayed_from`` None); ``group.success_rate`` is over all n rollouts.

        Returns:
            True if stored: 0 < success_rate < 1 and capacity > 0. A stored group replaces any group with
            the same prompt id and becomes the newest; the oldest groups are evicted beyond capacity.

        Raises:
            ValueError: for a replayed group.
        """
        if group.replayed_from is not None:
            raise ValueError(
                f"admit expects a fresh group; group {group.prompt_id!r} was replayed from step "
                f"{group.replayed_from} (admit the fresh group once, when it is generated)"
            )
        if self.capacity == 0 or not 0.0 < float(group.success_rate) < 1.0:
            return False
        self._groups.pop(group.prompt_id, None)
        self._groups[group.prompt_id] = _copy_group(group)
        while len(self._groups) > self.capacity:
            self._groups.popitem(last=False)
        return True

    def _too_old(self, group: RolloutGroup, step: int) -> bool:
        return self.max_age is not None and step - group.step > self.max_age

    def prune(self, step: int) -> int:
        """Drop groups older than ``max_age`` at ``step``; returns how many were dropped."""
        stale = [pid for pid, g in self._groups.items() if self._too_old(g, step)]
        for pid in stale:
            del self._groups[pid]
        return len(stale)

    def sample(self, k: int, step: int, generator: torch.Generator) -> list[RolloutGroup]:
        """Draw up to k groups uniformly without replacement, after dropping over-age groups.

        Args:
            k: groups wanted, >= 0.
            step: the current training step (for ages).
            generator: CPU random generator (the draw is a ``torch.randperm``).

        Returns:
            min(k, len(self)) deep copies, in draw order, each with ``replayed_from = group.step``.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an int >= 0, got {k!r}")
        self.prune(step)
        groups = list(self._groups.values())
        if k == 0 or not groups:
            return []
        picks = torch.randperm(len(groups), generator=generator)[:k].tolist()
        return [_copy_group(groups[i], replayed_from=groups[i].step) for i in picks]

    def stats(self, step: int) -> dict[str, float]:
        """Metrics at ``step`` (does not prune): ``replay/size``, ``replay/mean_age``, ``replay/eligible``."""
        ages = [step - g.step for g in self._groups.values()]
        eligible = sum(1 for g in self._groups.values() if not self._too_old(g, step))
        return {
            "replay/size": float(len(ages)),
            "replay/mean_age": float(sum(ages) / len(ages)) if ages else 0.0,
            "replay/eligible": float(eligible),
        }

    def state_dict(self) -> dict:
        """A plain dict of numbers, strings and tensors (``torch.save``-able), oldest group first."""
        return {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "max_age": self.max_age,
            "groups": [_copy_group(g).state() for g in self._groups.values()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the groups saved by ``state_dict`` (capacity and max_age must match this buffer's)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unsupported replay buffer state version {state.get('version')!r}; expected {_STATE_VERSION}"
            )
        if state["capacity"] != self.capacity or state["max_age"] != self.max_age:
            raise ValueError(
                f"state was saved with capacity={state['capacity']}, max_age={state['max_age']}, but this buffer "
                f"has capacity={self.capacity}, max_age={self.max_age}; build the buffer with the saved values"
            )
        groups = [RolloutGroup.from_state(s) for s in state["groups"]]
        if len(groups) > self.capacity:
            raise ValueError(f"state holds {len(groups)} groups, more than capacity {self.capacity}")
        restored = OrderedDict((g.prompt_id, _copy_group(g)) for g in groups)
        if len(restored) != len(groups):
            raise ValueError("state holds duplicate prompt ids")
        self._groups = restored


def mix_counts(batch_prompts: int, fresh_frac: float, available: int, *, refill: bool = True) -> tuple[int, int]:
    """How many fresh and replayed groups make up a step's batch.

    Args:
        batch_prompts: B, groups per step, >= 0.
        fresh_frac: delta, the target share of fresh groups, in (0, 1]; n_fresh target = round(delta B)
            (halves round up).
        available: groups the buffer can replay now (0 in round 0 or with an empty buffer), >= 0.
        refill: if the buffer holds fewer than the target replay count, fill the rest with fresh groups
            (default); False keeps the official code's short batch.

    Returns:
        (n_fresh, n_replay). With ``available == 0`` this is (B, 0): all fresh.
    """
    if isinstance(batch_prompts, bool) or not isinstance(batch_prompts, int) or batch_prompts < 0:
        raise ValueError(f"batch_prompts must be an int >= 0, got {batch_prompts!r}")
    if not 0.0 < fresh_frac <= 1.0:
        raise ValueError(f"fresh_frac must be in (0, 1], got {fresh_frac!r}")
    if isinstance(available, bool) or not isinstance(available, int) or available < 0:
        raise ValueError(f"available must be an int >= 0, got {available!r}")
    if available == 0:
        return batch_prompts, 0
    target_fresh = min(batch_prompts, math.floor(fresh_frac * batch_prompts + 0.5))
    n_replay = min(batch_prompts - target_fresh, available)
    n_fresh = batch_prompts - n_replay if refill else target_fresh
    return n_fresh, n_replay
