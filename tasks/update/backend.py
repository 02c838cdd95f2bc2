"""The run's :class:`~tasks.update.updater.Updater` for ``scale.backend`` (:func:`build_updater`).

The one module that knows both backends: ``update`` (one process) and ``sharded_update`` (torchrun ranks), which
builds on ``update``; so imports go one way, backend -> sharded_update -> update.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from tasks.config import Config
from tasks.generation.rollout import HFEngine, RolloutEngine
from tasks.model.lora import base_model
from tasks.policy import Policy
from tasks.update.memory_check import check_update_fits
from tasks.update.policy_update import LocalUpdater, gradient_checkpointing, uses_shared_prefix
from tasks.update.precision import Precision, model_dtype, resolve_precision
from tasks.update.sharded_update import Driver
from tasks.update.updater import LossSettings, Updater

log = logging.getLogger(__name__)


def ranks_generate(cfg: Config, engine: RolloutEngine) -> int:
    """How many ranks decode each ``generate`` call at ``overlap.lag`` 0 (tasks/generation/rank_shared.py): the
    world size under a sharded backend with the in-process engine on more than one rank, else 1 (one process, or
    vLLM servers generating)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world if cfg.scale.backend != "single" and isinstance(engine, HFEngine) else 1


def share_generation(cfg: Config, policy: Policy, updater: Updater, lag: int) -> str | None:
    """Under a sharded backend on several ranks with the in-process engine, make ``policy.engine`` the
    :class:`~tasks.update.sharded_update.Driver`'s rank-shared engine, so every rank decodes its share of each
    ``generate`` call for the rest of the run (training rollouts, reference rollouts, evaluations). Returns one line
    saying who generates (for the log), None where nothing changes (one process, vLLM servers).

    With ``lag`` 1 the engine stays rank 0's alone: the overlap draws in rank 0's generator process while every rank
    updates, and the other ranks, inside the update, cannot decode at the same time (docs/scale-out.md).
    """
    world = ranks_generate(cfg, policy.engine)
    if world == 1 or not isinstance(updater, Driver):
        return None
    if lag > 0:
        return (f"overlap.lag 1 under scale.backend={cfg.scale.backend}: rank 0 alone generates, in its generator "
                f"process, while the {world} ranks update (set overlap.lag=0 for every rank to generate its share)")
    policy.engine = updater.share_generation(policy.engine)
    return f"every one of the {world} ranks generates its share of each call (scale.backend={cfg.scale.backend})"


def build_updater(cfg: Config, policy: Policy, *, device: torch.device | str, precision: Precision | None = None,
                  prompt_tokens: int | None = None) -> Updater:
    """The run's updater for ``scale.backend``: :class:`~tasks.update.policy_update.LocalUpdater` or the sharded
    :class:`~tasks.update.sharded_update.Driver`, training ``policy.model`` in place.

    Before anything is built, :func:`~tasks.update.memory_check.check_update_fits` stops a run whose update would not
    fit its device (``prompt_tokens``: the pool's longest prompt, in tokens, where known). For ``single`` the
    optimizer steps the policy's trainable parameters and the KL reference
    (``train.kl_coef > 0``) is the policy's (:meth:`~tasks.policy.Policy.kl_reference`: under LoRA the same
    model with its adapters disabled); the sharded backends keep one per rank (tasks/update/sharded_update.py).
    ``precision``, the run's resolved ``model.precision`` (``Run.precision``; None: resolved here for ``device``, for
    callers without a run), picks the optimizer: under ``bf16-mixed`` float32 master weights
    and AdamW state behind the policy's bf16 weights, which must already be in the compute dtype.
    """
    model = policy.model
    settings = LossSettings.from_config(cfg, policy.tokenizer.pad_token_id)
    tc = cfg.train
    lm = base_model(model)
    precision = precision or resolve_precision(cfg.model.precision, torch.device(device))
    if model_dtype(lm) != precision.compute:
        raise ValueError(f"model.precision={cfg.model.precision} ({precision.name}) computes in {precision.compute}, "
                         f"but the policy's weights are {model_dtype(lm)}: load it in the compute dtype "
                         "(tasks/stages.py prepare_stage does)")
    from transformers import PreTrainedModel  # here: loaded with the model, not at import

    if isinstance(lm, PreTrainedModel):  # the estimate reads a transformers decoder's shape
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_update_fits(cfg, model, lm.config, device, precision=precision,
                          lora=policy.has_adapters, world=world, prompt_tokens=prompt_tokens)
    if cfg.scale.backend != "single":
        return Driver(cfg, model, settings)
    ref = policy.kl_reference() if tc.kl_coef > 0 else None
    gradient_checkpointing(lm, tc.gradient_checkpointing)
    if uses_shared_prefix(settings, model, device, None):
        log.info("update: each group's prompt computed once (train.shared_prefix=%s on %s; tasks/model/"
                 "shared_prefix.py)", tc.shared_prefix, torch.device(device).type)
    return LocalUpdater(model, settings, params=policy.trainable_parameters(), lr=tc.lr, betas=tc.betas,
                        eps=tc.adam_eps, weight_decay=tc.weight_decay, device=device, ref_model=ref,
                        precision=precision)
