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
``rollout.max_new_tokens`` cannot be written within the budget and scores 0. Where the device has native bf16 matrix
products and the weights are float32 (a CPU with AVX512-BF16 or AMX), the pass runs on a bf16 copy of them
(``select.screen_precision``, :func:`in_bf16`): the pass only ranks, and there it takes 0.44x the time, log q moved by
bf16 rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch

from rlcore.difficulty import pearson
from rlcore.selection import screen
from rlcore.step_rules import ScreenOrder
from tasks.config import Config, ScreenPrecision, ScreenProcess
from tasks.data.prompts import PromptRecord
from tasks.model.bf16_copy import Bf16Copy, native_bf16
from tasks.model.forward import right_pad
from tasks.model.loading import add_special
from tasks.model.solution_logp import solution_logp
from tasks.policy import Policy

#: Records whose tokens :func:`policy_likelihood` keeps (a pool's prompts are scored again and again; about 0.2 KB
#: each on the bundled task).
TOKENIZED = 65536

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


def in_bf16(precision: ScreenPrecision, model: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether the screen's pass runs on a bf16 copy of ``model`` (``select.screen_precision`` ``precision``): where
    the weights are float32, and ``bf16`` asks for it or ``auto`` finds a CPU with native bf16 matrix products (not a
    GPU: its weights are bf16 under ``model.precision`` auto, and forced float32 there a copy would take its memory)."""
    if precision == "model" or next(model.parameters()).dtype != torch.float32:
        return False
    return precision == "bf16" or (torch.device(device).type == "cpu" and native_bf16())


class SolutionPasses(Protocol):
    """Where the screen's pass may run apart from this process: the generator process
    (tasks/overlap/generator_process.py ``GeneratorProcess.solution_logp``), on its copy of the sampler's weights."""

    def solution_logp(self, prompts: list[torch.Tensor], completions: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float, micro_batch_tokens: int, bf16: bool) -> torch.Tensor:
        """[C] float64 tasks/model/solution_logp.py ``solution_logp`` of the completions (a bf16 copy's where
        ``bf16``)."""
        ...


def policy_likelihood(policy: Policy, *, temperature: float, max_new_tokens: int, micro_batch_tokens: int,
                      device: torch.device | str = "cpu", precision: ScreenPrecision = "model",
                      sampler: SolutionPasses | None = None) -> Likelihood:
    """The :data:`Likelihood` of ``policy``'s current weights (read at each call).

    Args:
        temperature: the rollouts' sampling temperature (``rollout.temperature``).
        max_new_tokens: the longest completion (``rollout.max_new_tokens``); longer solutions score 0.
        micro_batch_tokens: padded tokens per forward pass (``train.micro_batch_tokens``; 0: one pass), in as few
            passes as that allows, cut where they pad least (tasks/model/forward.py ``least_padding_buckets``).
        precision: ``select.screen_precision``: where :func:`in_bf16`, the pass runs on a bf16 copy of the weights
            (tasks/model/bf16_copy.py), refreshed at each call.
        sampler: where given, the pass runs there (``select.screen_process``: the generator process, whose weights
            are ``policy``'s), the tokens sent from here; else here.
    """
    tok = policy.tokenizer
    bf16 = in_bf16(precision, policy.model, device)
    half = Bf16Copy() if bf16 and sampler is None else None  # the sampler keeps a copy of its own

    @functools.lru_cache(maxsize=TOKENIZED)
    def tokenized(question: str, solution: str) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A prompt's formatted question [P] and its solution's tokens with EOS: the same at every step, so tokenized
        once (a tenth of the pass over 48 candidates of the bundled task, the tokenizer called once a text)."""
        ids = tok(policy.prompt(question), add_special_tokens=add_special(tok))["input_ids"]
        sol = tok(solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return torch.tensor(ids, dtype=torch.long), tuple(sol)

    def likelihood(records: list[PromptRecord]) -> torch.Tensor:
        require_solutions(records)
        pairs = [tokenized(r.question, r.solution) for r in records]
        prompts, sols = [p for p, _ in pairs], [list(s) for _, s in pairs]
        comp, mask = right_pad(sols, tok.pad_token_id)  # [C, L] each
        if sampler is not None:  # the generator process's pass, on its copy of the same weights
            logp = sampler.solution_logp(prompts, comp, mask, temperature, micro_batch_tokens, bf16)
        else:
            model = policy.model if half is None else half.of(policy.model)
            logp = solution_logp(model, prompts, comp, mask, tok.pad_token_id, temperature, micro_batch_tokens,
                                 device)
        fits = torch.tensor([len(s) <= max_new_tokens for s in sols])
        return torch.where(fits, logp.exp(), torch.zeros_like(logp)).clamp(0.0, 1.0)

    return likelihood


def screen_likelihood(policy: Policy, cfg: Config, device: torch.device | str,
                      sampler: SolutionPasses | None = None) -> Likelihood:
    """:func:`policy_likelihood` with the run's settings (``rollout.temperature``, ``rollout.max_new_tokens``,
    ``train.micro_batch_tokens``, ``select.screen_precision``): what the training and the plan score with; the
    passes in ``sampler`` where given (:func:`in_sampler`)."""
    return policy_likelihood(policy, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens,
                             micro_batch_tokens=cfg.train.micro_batch_tokens, device=device,
                             precision=cfg.select.screen_precision, sampler=sampler)


def in_sampler(process: ScreenProcess, device: torch.device | str) -> bool:
    """Whether the screen's passes run in the generator process where a lag-1 run draws in one
    (``select.screen_process`` ``process``): ``sampler``, or ``auto`` on a CPU, whose cores the generator and the
    trainer split. There the trainer's update was the longer side of an overlapped step, its look-ahead pass after
    it (0.13 + 0.04 s a step of `grpo_prescreen` on 2 cores), while the generate call (0.125 s) left the generator's
    core idle: docs/performance.md, "The screen's pass in the generator process"."""
    return process == "sampler" or (process == "auto" and torch.device(device).type == "cpu")


class ScreenScores:
    """The screen's scores over a run (``select.screen`` f > 1; :class:`~tasks.selection.selector.Selector`): each
    step's candidates scored now or ahead (beside the last step's generate call, ``select.screen_ahead``), and the
    estimates of the candidates a step kept, until its outcome is observed (:meth:`metrics`). Everything is kept
    by step: overlapped (lag 1), step t + 1 is drawn before step t's outcome comes back.

    Attributes:
        ahead: step -> {pool index: q} scored ahead for that step (kept in the checkpoint).
        kept: step -> {pool index: q} of the candidates that step kept.
        counts: step -> [candidates it scored, of them read from ``ahead``, candidates drawn].
        last: pool index -> (step, q): each prompt's latest score a step read, and that step
            (the ``order`` reads it, :meth:`remembered`; a score ahead counts once its step reads it, so a
            step's look-ahead and the step itself see the same).
    """

    def __init__(self, likelihood: Likelihood, pool: list[PromptRecord], *, n: int, order: ScreenOrder | None = None):
        """``n``: rollouts a group (``rollout.n``); ``order``: which drawn candidates the pass scores, a registered
        technique's (tasks/training/techniques.py ``screen_order``: the prescreen), None: every one."""
        self.likelihood, self.pool, self.n, self.order = likelihood, pool, n, order
        self.ahead: dict[int, dict[int, float]] = {}
        self.kept: dict[int, dict[int, float]] = {}
        self.counts: dict[int, list[int]] = {}
        self.last: dict[int, tuple[int, float]] = {}

    def __call__(self, idx: list[int]) -> torch.Tensor:
        """[C] the likelihood of the candidates ``idx`` with the policy as it is."""
        return self.likelihood([self.pool[i] for i in idx])

    def candidates(self, drawn: torch.Tensor, need: int, step: int) -> torch.Tensor:
        """Of step ``step``'s drawn candidates [C] (pool indices), those the pass scores, in draw order: all of them,
        or those the ``order`` picks from what the screen remembers of them (:meth:`remembered`)."""
        if self.order is None:
            return drawn
        last, age = self.remembered(drawn.tolist(), step)
        return drawn[self.order.pick(last, age, need)]

    def choose(self, drawn: torch.Tensor, need: int, step: int, read_ahead: bool = True) -> torch.Tensor:
        """[need] the pool indices step ``step`` keeps of its drawn candidates [C]: :meth:`candidates` scored
        (:meth:`score`) and the ``need`` whose groups are likeliest mixed kept (rlcore.selection.screen, recorded)."""
        scored = self.candidates(drawn, need, step)
        q = self.score(scored.tolist(), step, read_ahead=read_ahead, drawn=len(drawn))  # [C']
        keep = screen(q, self.n, need)
        self.keep(step, scored[keep].tolist(), q[keep])
        return scored[keep]

    def score(self, idx: list[int], step: int, read_ahead: bool = True, drawn: int | None = None) -> torch.Tensor:
        """[C] float64 q of step ``step``'s candidates ``idx``: those scored ahead for it read from there (not for a
        later generation round of the step, ``read_ahead`` False), the rest scored now; the step's scores ahead are
        then dropped. ``drawn``: the candidates the step drew, where the ``order`` left some unscored (else C)."""
        known = self.ahead.pop(step, {}) if read_ahead else {}
        todo = [i for i in idx if i not in known]
        now = dict(zip(todo, self(todo).tolist(), strict=True)) if todo else {}
        self.last.update((i, (step, known[i] if i in known else now[i])) for i in idx)
        count = self.counts.setdefault(step, [0, 0, 0])
        count[0] += len(idx)
        count[1] += len(idx) - len(todo)
        count[2] += len(idx) if drawn is None else drawn
        return torch.tensor([known[i] if i in known else now[i] for i in idx], dtype=torch.float64)

    def score_ahead(self, step: int, idx: list[int]) -> None:
        """Score the candidates ``idx`` that step ``step`` is expected to draw (those of any earlier step ahead are
        dropped)."""
        self.ahead = {step: dict(zip(idx, self(idx).tolist(), strict=True))}

    def remembered(self, idx: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[C] float64 each candidate's latest score read by a step before ``step`` (NaN: none) and [C] its age in
        steps: what the ``order`` reads (not a later generation round's of ``step`` itself)."""
        seen = [self.last.get(i) for i in idx]
        seen = [x if x is not None and x[0] < step else None for x in seen]
        q = torch.tensor([math.nan if x is None else x[1] for x in seen], dtype=torch.float64)
        age = torch.tensor([0 if x is None else step - x[0] for x in seen], dtype=torch.float64)
        return q, age

    def keep(self, step: int, idx: list[int], q: torch.Tensor) -> None:
        """Step ``step`` keeps the candidates ``idx`` [K] whose q is ``q`` [K]."""
        self.kept.setdefault(step, {}).update(zip(idx, q.tolist(), strict=True))

    def estimate(self, step: int, i: int) -> float | None:
        """q of pool prompt ``i`` where step ``step`` kept it, else None."""
        return self.kept.get(step, {}).get(i)

    def state_dict(self) -> dict:
        return {"ahead": self.ahead, "kept": self.kept, "counts": self.counts, "last": self.last}

    def load_state_dict(self, s: dict) -> None:
        """``s`` as :meth:`state_dict` gives it; from a checkpoint written before the screen kept its picks by step,
        ``{"ahead": ...}`` alone."""
        self.ahead, self.kept, self.counts = s.get("ahead", {}), s.get("kept", {}), s.get("counts", {})
        self.last = s.get("last", {})

    def metrics(self, step: int, idx: list[int], success: torch.Tensor) -> dict[str, float]:
        """Step ``step``'s estimates against the pass rates ``success`` [B] its prompts ``idx`` then showed (empty
        when it kept nothing by the screen); the step's record is then dropped."""
        kept, (scored, from_ahead, *drawn) = self.kept.pop(step, {}), self.counts.pop(step, [0, 0, 0])
        drawn = drawn[0] if drawn else scored  # a checkpoint's counts from before the prescreen: all drawn scored
        picked = [j for j, i in enumerate(idx) if i in kept]
        if not picked:
            return {}
        q = torch.tensor([kept[idx[j]] for j in picked])
        out = {"select/screen_success_mean": float(q.mean()), "select/screen_candidates": float(scored),
               "select/screen_drawn": float(drawn), "select/screen_ahead_share": from_ahead / max(scored, 1)}
        if len(picked) > 2:
            out["select/screen_pearson"] = pearson(q, success[picked])
        return out
