"""Model forward passes the algorithms need: token log-probs, pooled embeddings, last-layer MLP inputs.

Sequences are laid out as ``[left-padded prompt | right-padded completion]`` with explicit position ids
(the cumulative sum of the attention mask), the same positions ``generate`` uses with left padding, so
log-probs computed here match the sampling distribution token for token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from tasks.model.rollout import add_special


def last_mlp(model: torch.nn.Module) -> torch.nn.Module:
    """The MLP block of the model's last transformer layer (found by name, never a hard-coded index)."""
    best, best_i = None, -1
    for name, mod in model.named_modules():
        m = re.search(r"layers\.(\d+)\.mlp$", name)
        if m and int(m.group(1)) > best_i:
            best, best_i = mod, int(m.group(1))
    if best is None:
        raise ValueError(f"{type(model).__name__}: no 'layers.<i>.mlp' module found for the angle hook")
    return best


@contextmanager
def capture_mlp_input(model: torch.nn.Module):
    """Capture the input of the last layer's MLP (the post-attention-norm activations) as ``box[0]``."""
    box: list[torch.Tensor] = []
    handle = last_mlp(model).register_forward_pre_hook(lambda _m, args: box.append(args[0].detach()))
    try:
        yield box
    finally:
        handle.remove()


def pack(prompts: Sequence[torch.Tensor], completions: torch.Tensor, completion_mask: torch.Tensor,
         pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay out N sequences as left-padded prompts followed by right-padded completions.

    Args:
        prompts: N prompt id tensors [P_i].
        completions: [N, L] completion ids.
        completion_mask: [N, L] bool.
        pad_id: padding token id.

    Returns:
        input_ids [N, P+L], attention_mask [N, P+L], position_ids [N, P+L], and P (the prompt width).
    """
    n = len(prompts)
    width = max(int(p.numel()) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    am = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        am[i, width - p.numel():] = 1
    input_ids = torch.cat([ids, completions.to(torch.long)], dim=1)
    attn = torch.cat([am, completion_mask.to(torch.long)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attn, pos, width


def token_logprobs(model: torch.nn.Module, prompts: Sequence[torch.Tensor], completions: torch.Tensor,
                   completion_mask: torch.Tensor, pad_id: int, temperature: float = 1.0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-token log-probs of the completions under ``model`` at the sampling temperature.

    Returns:
        [N, L] float32 log-probs (0 where the mask is False). Differentiable when grad is enabled.
    """
    input_ids, attn, pos, width = pack(prompts, completions, completion_mask, pad_id)
    input_ids, attn, pos = input_ids.to(device), attn.to(device), pos.to(device)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    logits = logits[:, width - 1:-1].float() / temperature  # [N, L, V] predicts completion tokens
    target = completions.to(device)
    lp = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return lp * completion_mask.to(device)


@torch.inference_mode()
def prompt_batches(model: torch.nn.Module, tokenizer, texts: Sequence[str], batch_size: int = 64,
                   device: torch.device | str = "cpu"):
    """One forward pass over prompts, batch by batch.

    Yields:
        (embeddings [b, H] float32: the last hidden state mean-pooled over real tokens,
         mlp_inputs [b, T, H] float32: the last layer's MLP inputs, mask [b, T] bool).
    """
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i:i + batch_size]), return_tensors="pt", padding=True,
                        add_special_tokens=add_special(tokenizer))
        am = enc["attention_mask"].to(device)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        with capture_mlp_input(model) as box:
            out = model(input_ids=enc["input_ids"].to(device), attention_mask=am, position_ids=pos,
                        output_hidden_states=True, use_cache=False)
        h = out.hidden_states[-1].float()  # [b, T, H]
        m = am.unsqueeze(-1).float()
        yield ((h * m).sum(1) / m.sum(1).clamp(min=1)).cpu(), box[0].float().cpu(), am.bool().cpu()
