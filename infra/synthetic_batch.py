"""A synthetic batch of rollout groups at given sizes, for the GPU check's update timing (infra/gpu-bench.py) and
its learning part (infra/learning-check.py): random tokens, rewards half right so every row carries a gradient."""

from __future__ import annotations

import torch

from rlcore.types import RolloutGroup

GROUP = 8  # rollouts a prompt


def batch(rows: int, prompt: int, completion: int, vocab: int) -> list[RolloutGroup]:
    """``rows / 8`` groups of 8 rollouts, rewards half right so every row carries a gradient; prompts of
    ``prompt / 2`` to ``prompt`` tokens and completions of ``completion / 2`` to ``completion`` (padding, a mask)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0] * (GROUP // 2))
    groups = []
    for k in range(max(rows // GROUP, 1)):
        p_len = int(torch.randint(max(prompt // 2, 1), prompt + 1, (1,), generator=g))
        lens = torch.randint(max(completion // 2, 1), completion + 1, (GROUP,), generator=g)
        lens[0] = completion  # every batch reaches its longest row
        groups.append(RolloutGroup(prompt_id=f"p{k}", prompt_ids=torch.randint(4, vocab, (p_len,), generator=g),
                                   completion_ids=torch.randint(4, vocab, (GROUP, completion), generator=g),
                                   completion_mask=torch.arange(completion) < lens[:, None], rewards=rewards,
                                   advantages=rewards - rewards.mean(), behaviour_logp=torch.zeros(0),
                                   success_rate=0.5, n_generated=GROUP, step=0))
    return groups
