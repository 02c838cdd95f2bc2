"""Score stage: one batched forward pass over the pool -> embeddings, angle concentration, static features.

Per prompt: the mean-pooled last hidden state (DOTS's embedding), GAIN-RL's C_intra / C_inter from the
last layer's MLP inputs, with the fixed prefix (system prompt, template head) and tail measured from the
tokenizer rather than hard-coded, the prompt's token count, its level, and the reference solution's token
count (ScalingRL's chain-of-thought complexity). Saved to ``<run>/features.pt`` and the ledger.

A run whose techniques read none of the hidden-state features (plain GRPO, PODS, the screen on a uniform draw:
tasks/plan/planner.py ``reads_upfront``) gets :func:`static_features` instead: the token counts and levels from
the tokenizer alone, no forward pass over the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from rlcore.angle import angle_concentration
from tasks.data.prompts import PromptRecord
from tasks.model.forward import prompt_batches
from tasks.model.loading import add_special
from tasks.records.files import atomic_write
from tasks.records.ledger import FeatureRow
from tasks.records.progress import progress_bar


@dataclass(frozen=True, eq=False)
class Features:
    """Per-prompt features of a pool of M prompts, in pool order (``ids[i]`` is row i of every tensor).

    Attributes:
        ids: the prompts' ids, length M.
        emb: [M, D] mean-pooled last hidden state (DOTS's embedding).
        angle_intra, angle_inter: [M] GAIN-RL's C_intra and C_inter (arXiv 2506.02281; rlcore/angle.py).
        angle: [M] their combination, the angle-concentration score GAIN-RL orders by.
        prompt_tokens: [M] int, tokens of the formatted prompt.
        cot: [M] float, tokens of the reference solution (0 without one): ScalingRL's CoT complexity.
        level: [M] int, difficulty level (0 without one).

    Without the forward pass (:func:`static_features`) ``emb`` is [M, 0] and the angles NaN (:attr:`scored` False).

    Saved as ``features.pt``: a plain dict of these fields (:meth:`save`, :meth:`load`).
    """

    ids: list[str]
    emb: torch.Tensor
    angle_intra: torch.Tensor
    angle_inter: torch.Tensor
    angle: torch.Tensor
    prompt_tokens: torch.Tensor
    cot: torch.Tensor
    level: torch.Tensor

    def __post_init__(self) -> None:
        m = len(self.ids)
        for f in fields(self)[1:]:
            t = getattr(self, f.name)
            if t.shape[0] != m:
                raise ValueError(f"Features.{f.name} has {t.shape[0]} rows for {m} prompts")

    @property
    def scored(self) -> bool:
        """Whether the hidden-state features were computed (the score stage's forward pass)."""
        return self.emb.shape[1] > 0

    def save(self, path: Path) -> Path:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        atomic_write(Path(path), lambda fh: torch.save(state, fh))
        return path

    @classmethod
    def load(cls, path: Path) -> Features:
        state = torch.load(path, weights_only=True)
        names = {f.name for f in fields(cls)}
        if set(state) != names:
            raise ValueError(f"{path} holds {sorted(state)}, not the features {sorted(names)}: delete it to rescore")
        return cls(**state)

    def ledger_rows(self) -> list[FeatureRow]:
        """One ledger row (table ``features``) per prompt."""
        return [FeatureRow(prompt_id=pid, prompt_tokens=int(self.prompt_tokens[i]), level=int(self.level[i]),
                           cot_tokens=int(self.cot[i]), angle_intra=float(self.angle_intra[i]),
                           angle_inter=float(self.angle_inter[i]), angle_score=float(self.angle[i]))
                for i, pid in enumerate(self.ids)]


def _solution_tokens(tok, records: list[PromptRecord]) -> torch.Tensor:
    """[M] float tokens of each record's reference solution (0 without one)."""
    return torch.tensor([len(tok(r.solution, add_special_tokens=False)["input_ids"]) if r.solution else 0
                         for r in records], dtype=torch.float32)


def _levels(records: list[PromptRecord]) -> torch.Tensor:
    return torch.tensor([r.level or 0 for r in records])


def static_features(policy, records: list[PromptRecord]) -> Features:
    """The features the tokenizer alone gives (token counts, levels), in record order; no embedding (``emb``
    [M, 0]) and NaN angles: for a run whose techniques read no hidden-state feature (module docstring)."""
    tok, m = policy.tokenizer, len(records)
    lengths = [len(tok(p, add_special_tokens=add_special(tok))["input_ids"]) for p in policy.prompts(records)]
    nan = torch.full((m,), float("nan"))
    return Features(ids=[r.id for r in records], emb=torch.zeros(m, 0), angle_intra=nan, angle_inter=nan.clone(),
                    angle=nan.clone(), prompt_tokens=torch.tensor(lengths, dtype=torch.long),
                    cot=_solution_tokens(tok, records), level=_levels(records))


def prefix_suffix(tokenizer, prompt: str, question: str) -> tuple[int, int]:
    """Token counts of the formatted prompt before and after the question text."""
    at = prompt.rfind(question)
    if at < 0:
        return 0, 0
    head = len(tokenizer(prompt[:at], add_special_tokens=add_special(tokenizer))["input_ids"])
    tail = len(tokenizer(prompt[at + len(question):], add_special_tokens=False)["input_ids"])
    return head, tail


def compute_features(policy, records: list[PromptRecord], *, inter_weight: float, batch_size: int, device,
          progress: bool = False) -> Features:
    """Features of every record, in record order (see the module docstring)."""
    tok = policy.tokenizer
    prompts = policy.prompts(records)
    bounds = torch.tensor([prefix_suffix(tok, p, r.question) for p, r in zip(prompts, records, strict=True)])
    embs, intra, inter, angle, lengths = [], [], [], [], []
    batches = prompt_batches(policy.model, tok, prompts, batch_size=batch_size, device=device)
    n_batches = -(-len(prompts) // batch_size)
    for b, (emb, mlp_in, mask) in enumerate(progress_bar(batches, total=n_batches, desc="score", unit="batch")
                                            if progress else batches):
        sl = slice(b * batch_size, b * batch_size + emb.shape[0])
        s = angle_concentration(mlp_in, mask, prefix_len=bounds[sl, 0], suffix_len=bounds[sl, 1],
                                inter_weight=inter_weight)
        embs.append(emb)
        intra.append(s.intra.float())
        inter.append(s.inter.float())
        angle.append(s.score.float())
        lengths.append(mask.sum(1))
    return Features(ids=[r.id for r in records], emb=torch.cat(embs), angle_intra=torch.cat(intra),
                    angle_inter=torch.cat(inter), angle=torch.cat(angle), prompt_tokens=torch.cat(lengths),
                    cot=_solution_tokens(tok, records), level=_levels(records))
