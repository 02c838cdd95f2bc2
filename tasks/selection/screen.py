"""The likelihood screen: the policy's chance of writing a prompt's worked reference solution, without sampling.

``select.screen = f > 1`` (tasks/selection/selector.py ``Selector.choose``) draws f candidates per prompt a step
needs, scores each with :func:`policy_likelihood` and keeps the ones whose group of ``rollout.n`` is most likely
to have unequal rewards (``rlcore.selection.screen``). The score of a candidate is

    q = P_pi(solution + EOS | prompt) = exp(sum of the solution tokens' log-probs at the sampling temperature)

one teacher-forced forward pass over prompt and solution (no generation). It is the chance that a rollout is the
reference solution token for token, so a lower bound of the prompt's pass rate, and a tight one when the policy's
right answers take the reference's form, as on the bundled task, whose worked solutions are the warm start's
(on 800 of its training prompts, 16 rollouts each: Pearson 0.99 against the measured pass rate, 0.92-0.96 within
each level after 60 steps of training, where the prompt's embedding, which DOTS's predictor reads, does no better
than its level; docs/benchmarks.md, "Every idea tried", row "Likelihood screen"). Where right answers are
written in many ways (free-form mathematics), q is far below the pass rate and the screen ranks by it only as well
as the reference's form predicts the policy's.

Sources: scoring data by a model's loss on the reference response is the Instruction-Following Difficulty (IFD)
score of supervised data selection (Li et al. 2023, arXiv 2308.12032); the policy's probability of the reference
answer, after its own reasoning, as a stand-in for a verifier is RLPR's probability reward (arXiv 2506.18254).
Teacher-forcing the whole worked solution to estimate the pass rate before any rollout, and picking by it the RL
prompts whose groups will carry a gradient, are ours (docs/algorithms.md section 7.8).

Deviations and choices: the log-probs are those of the rollouts' sampling distribution at ``rollout.temperature``
(top-p / top-k truncation is not applied, so q is the untruncated chance); a solution longer than
``rollout.max_new_tokens`` cannot be written within the budget and scores 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tasks.data.prompts import PromptRecord
from tasks.model.forward import right_pad, token_logprobs
from tasks.model.loading import add_special
from tasks.policy import Policy

#: ``records [C] -> [C] float64`` chance in [0, 1] that the current policy writes each record's worked solution.
Likelihood = Callable[[list[PromptRecord]], torch.Tensor]


def require_solutions(records: list[PromptRecord]) -> None:
    """A ValueError naming how many of ``records`` have no worked solution, and the first one, if any has none."""
    missing = [r for r in records if not r.solution]
    if missing:
        raise ValueError(
            f"select.screen scores each prompt by its worked solution, but {len(missing)} of {len(records)} prompts "
            f"have none (first: {missing[0].id} from {missing[0].source}); set select.screen=1 or use a data set "
            "with worked solutions")


def policy_likelihood(policy: Policy, *, temperature: float, max_new_tokens: int, micro_batch_tokens: int,
                      device: torch.device | str = "cpu") -> Likelihood:
    """The :data:`Likelihood` of ``policy``'s current weights (read at each call).

    Args:
        temperature: the rollouts' sampling temperature (``rollout.temperature``).
        max_new_tokens: the longest completion (``rollout.max_new_tokens``); longer solutions score 0.
        micro_batch_tokens: padded tokens per forward pass (``train.micro_batch_tokens``; 0: one pass).
    """
    tok = policy.tokenizer

    @torch.inference_mode()
    def likelihood(records: list[PromptRecord]) -> torch.Tensor:
        require_solutions(records)
        enc = tok(policy.prompts(records), add_special_tokens=add_special(tok))["input_ids"]
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in enc]
        sols = [tok(r.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in records]
        comp, mask = right_pad(sols, tok.pad_token_id)  # [C, L] each
        was_training = policy.model.training
        policy.model.eval()
        try:
            logp = token_logprobs(policy.model, prompts, comp, mask, tok.pad_token_id, temperature, device,
                                  max_tokens=micro_batch_tokens).sum(1).double().cpu()  # [C]
        finally:
            policy.model.train(was_training)
        fits = torch.tensor([len(s) <= max_new_tokens for s in sols])
        return torch.where(fits, logp.exp(), torch.zeros_like(logp)).clamp(0.0, 1.0)

    return likelihood
