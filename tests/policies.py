"""A :class:`~tasks.policy.Policy` around a bare model, for tests of what takes a policy (the updater,
checkpoints): the bundled tokenizer (pad id 0) and an in-process engine on the model."""

import torch

from tasks.generation.rollout import HFEngine
from tasks.model.loading import build_tokenizer
from tasks.policy import Policy


def policy_of(model: torch.nn.Module) -> Policy:
    tok = build_tokenizer()
    engine = HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=64,
                      stop_ids=(tok.eos_token_id,))  # the model may be any module: no generation config to read
    return Policy(model=model, tokenizer=tok, engine=engine)
