"""The log-likelihood of given completions, teacher-forced, without autograd: the likelihood screen's pass
(tasks/selection/screen.py), run in the trainer's process or in the generator's (tasks/overlap/generator_process.py
``GeneratorProcess.solution_logp``, ``select.screen_process``). The same function on the same weights and thread
count gives the same bits in either.

Shape letters as in tasks/model/forward.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tasks.model.forward import least_padding_buckets, token_logprobs


def solution_logp(model: torch.nn.Module, prompts: Sequence[torch.Tensor], completions: torch.Tensor,
                  completion_mask: torch.Tensor, pad_id: int, temperature: float, micro_batch_tokens: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """[N] float64 each completion's log-prob under ``model`` (the sum of its tokens' at ``temperature``), without
    autograd: :func:`token_logprobs` over :func:`least_padding_buckets` of at most ``micro_batch_tokens`` padded
    tokens (0: one pass)."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logp = torch.zeros(len(prompts), dtype=torch.float64)  # [N]
            for rows in least_padding_buckets(torch.tensor([len(p) for p in prompts]), completion_mask.sum(1),
                                              micro_batch_tokens):
                logp[rows] = token_logprobs(model, [prompts[i] for i in rows], completions[rows],
                                            completion_mask[rows], pad_id, temperature, device).sum(1).double().cpu()
    finally:
        model.train(was_training)
    return logp
