"""The decode loop as it was before tasks/generation/decode.py (commit a2bf7a3), kept only as the benchmarks'
reference arm (infra/decode-bench.py, infra/gpu_bench_generation.py): ``DynamicCache`` grown by concatenation,
every prompt prefilled once per rollout, a finished row dropped from the cache at once
(``batch_select_indices``), one host sync a step, noise from one ``torch.Generator`` per chunk of prompts.
Not used by rlsift itself.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LogitsProcessorList

from rlcore.seeding import derive_seed
from tasks.generation.rollout import Generation, HFEngine, to_generation
from tasks.generation.sampling import CHUNK_ELEMENTS, Sampling
from tasks.model.loading import add_special


def sample_next_generator(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None = None,
                          max_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The code as it was (docstring: git show a2bf7a3:tasks/generation/sampling.py)."""
    r, v = logits.shape
    if r == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device), torch.zeros(0, device=logits.device)
    temperature = 1.0 if sampling is None else sampling.temperature
    warpers = LogitsProcessorList() if sampling is None else sampling.warpers()
    step = max(1, (max_elements or CHUNK_ELEMENTS) // max(v, 1))
    toks, logps = [], []
    for s in range(0, r, step):
        raw = logits[s:s + step]
        x = raw.to(torch.float32, copy=True)  # [r, V], ours to overwrite
        if temperature != 1.0:
            x.div_(temperature)
        if warpers:
            x = warpers(None, x)  # -inf outside the kept set; these warpers read no history
        top = x.amax(-1, keepdim=True)  # [r, 1]
        if sampling is None:
            tok = x.argmax(-1)
        p = x.sub_(top).exp_()  # unnormalised probabilities, the largest exactly 1
        total = p.sum(-1)
        if sampling is not None:
            noise = torch.empty_like(p).exponential_(generator=generator)
            tok = torch.div(p, noise, out=noise).argmax(-1)
        picked = raw.gather(1, tok[:, None]).squeeze(1).float()  # the drawn logit, unchanged by top-k / top-p
        if temperature != 1.0:
            picked = picked / temperature
        toks.append(tok)
        logps.append(picked - top.squeeze(1) - total.log())
    if len(toks) == 1:
        return toks[0], logps[0]
    return torch.cat(toks), torch.cat(logps)


@torch.inference_mode()
def decode_reference(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                     max_new_tokens: int, sampling: Sampling | None, eos_id: int, pad_id: int,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The code as it was (docstring: git show a2bf7a3:tasks/generation/rollout.py)."""
    b = input_ids.shape[0]
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)
    out_logp = torch.zeros(b, max_new_tokens, device=input_ids.device)
    if max_new_tokens == 0 or b == 0:
        return out[:, :0], out_logp[:, :0]
    live = torch.arange(b, device=input_ids.device)  # rows still generating, as indices into the B rows
    cache = DynamicCache()
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B_live, V] in the model's dtype
    pos = pos[:, -1:]
    width = max_new_tokens
    for t in range(max_new_tokens):
        tok, logp = sample_next_generator(logits, sampling, generator)
        out[live, t] = tok
        out_logp[live, t] = logp
        going = tok != eos_id
        n_going = int(going.sum())  # the step's one host sync
        if t + 1 == max_new_tokens or n_going == 0:
            width = t + 1
            break
        if n_going < len(live):  # drop finished rows from the batch and the cache
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, tok, pos, attention_mask = live[keep], tok[keep], pos[keep], attention_mask[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=1)
        pos = pos + 1
        logits = model(input_ids=tok[:, None], attention_mask=attention_mask, position_ids=pos,
                       past_key_values=cache, use_cache=True).logits[:, -1]
    out, out_logp = out[:, :width], out_logp[:, :width]
    if bool(out_logp.isnan().any()):
        raise FloatingPointError(f"decode: the model's logits were NaN for {int(out_logp.isnan().sum())} of the "
                                 f"drawn tokens ({b} rows); its weights are not finite")
    return out, out_logp


@torch.inference_mode()
def generate_reference(engine: HFEngine, prompts: list[str], n: int, seed: int, greedy: bool = False) -> Generation:
    """``HFEngine.generate`` as it was: chunks of ``engine.chunk`` rows, each prompt repeated n times, each chunk's
    noise from a generator seeded ``derive_seed(seed, chunk)``; stops at ``engine.stop_ids[0]`` alone."""
    tok = engine.tok
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special(tok))
    ids_all, am_all = enc["input_ids"], enc["attention_mask"]
    prompt_ids = [ids[am.bool()] for ids, am in zip(ids_all, am_all, strict=True)]
    per_call = max(1, engine.chunk // n)
    outs = []
    was_training = engine.model.training
    engine.model.eval()
    sampling = None if greedy else engine.sampling()
    for c, start in enumerate(range(0, len(prompts), per_call)):
        am = am_all[start:start + per_call]
        cut = int((am.sum(0) == 0).sum())
        ids, am = ids_all[start:start + per_call, cut:], am[:, cut:]
        gen = torch.Generator(device=engine.device).manual_seed(derive_seed(seed, c))
        outs.append(decode_reference(engine.model, ids.repeat_interleave(n, 0).to(engine.device),
                                     am.repeat_interleave(n, 0).to(engine.device),
                                     max_new_tokens=engine.max_new_tokens, sampling=sampling,
                                     eos_id=engine.stop_ids[0], pad_id=tok.pad_token_id, generator=gen))
    engine.model.train(was_training)
    width = max(o.shape[1] for o, _ in outs)
    ids = torch.cat([torch.nn.functional.pad(o.cpu(), (0, width - o.shape[1]), value=tok.pad_token_id)
                     for o, _ in outs])
    logp = torch.cat([torch.nn.functional.pad(lp.float().cpu(), (0, width - lp.shape[1])) for _, lp in outs])
    return to_generation(tok, prompt_ids, ids, logp, n, engine.stop_ids[:1])
