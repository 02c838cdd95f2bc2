"""Score stage: one batched forward pass over the pool -> embeddings, angle concentration, static features.

Per prompt: the mean-pooled last hidden state (DOTS's embedding), GAIN-RL's C_intra / C_inter from the
last layer's MLP inputs, with the fixed prefix (system prompt, template head) and tail measured from the
tokenizer rather than hard-coded, the prompt's token count, its level, and the reference solution's token
count (ScalingRL's chain-of-thought complexity). Saved to ``<run>/features.pt`` and the ledger.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from rlcore.angle import angle_concentration
from tasks.data.prompts import PromptRecord
from tasks.model.forward import prompt_batches
from tasks.model.rollout import add_special


def prefix_suffix(tokenizer, prompt: str, question: str) -> tuple[int, int]:
    """Token counts of the formatted prompt before and after the question text."""
    at = prompt.rfind(question)
    if at < 0:
        return 0, 0
    head = len(tokenizer(prompt[:at], add_special_tokens=add_special(tokenizer))["input_ids"])
    tail = len(tokenizer(prompt[at + len(question):], add_special_tokens=False)["input_ids"])
    return head, tail


def score(policy, records: list[PromptRecord], *, inter_weight: float, batch_size: int, device,
          progress: bool = False) -> dict:
    """Features of every record, in record order (see the module docstring)."""
    tok = policy.tokenizer
    prompts = policy.prompts(records)
    bounds = torch.tensor([prefix_suffix(tok, p, r.question) for p, r in zip(prompts, records, strict=True)])
    embs, intra, inter, angle, lengths = [], [], [], [], []
    batches = prompt_batches(policy.model, tok, prompts, batch_size=batch_size, device=device)
    for b, (emb, mlp_in, mask) in enumerate(tqdm(batches, total=-(-len(prompts) // batch_size), desc="score",
                                                 disable=not progress)):
        sl = slice(b * batch_size, b * batch_size + emb.shape[0])
        s = angle_concentration(mlp_in, mask, prefix_len=bounds[sl, 0], suffix_len=bounds[sl, 1],
                                inter_weight=inter_weight)
        embs.append(emb)
        intra.append(s.intra.float())
        inter.append(s.inter.float())
        angle.append(s.score.float())
        lengths.append(mask.sum(1))
    cot = torch.tensor([len(tok(r.solution, add_special_tokens=False)["input_ids"]) if r.solution else 0
                        for r in records], dtype=torch.float32)
    return {"ids": [r.id for r in records], "emb": torch.cat(embs), "angle_intra": torch.cat(intra),
            "angle_inter": torch.cat(inter), "angle": torch.cat(angle), "prompt_tokens": torch.cat(lengths),
            "cot": cot, "level": torch.tensor([r.level or 0 for r in records])}


def ledger_rows(features: dict) -> list[dict]:
    return [{"prompt_id": pid, "prompt_tokens": int(features["prompt_tokens"][i]), "level": int(features["level"][i]),
             "cot_tokens": int(features["cot"][i]), "angle_intra": float(features["angle_intra"][i]),
             "angle_inter": float(features["angle_inter"][i]), "angle_score": float(features["angle"][i])}
            for i, pid in enumerate(features["ids"])]


def save(features: dict, path: Path) -> Path:
    torch.save(features, path)
    return path
