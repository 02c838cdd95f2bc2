"""The run's :class:`~tasks.training.update.Updater` for ``scale.backend`` (:func:`build_updater`).

The one module that knows both backends: ``update`` (one process) and ``sharded_update`` (torchrun ranks), which
builds on ``update``; so imports go one way, backend -> sharded_update -> update.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from tasks.config import Config
from tasks.model.lora import BaseModelView, base_model, is_lora
from tasks.training.fit import check_update_fits
from tasks.training.sharded_update import Driver
from tasks.training.update import LocalUpdater, LossSettings, Updater, gradient_checkpointing


def build_updater(cfg: Config, model: torch.nn.Module, *, pad_id: int, device: torch.device | str) -> Updater:
    """The run's updater for ``scale.backend``: :class:`~tasks.training.update.LocalUpdater` or the sharded
    :class:`~tasks.training.sharded_update.Driver`.

    Before anything is built, :func:`~tasks.training.fit.check_update_fits` stops a run whose update would not fit
    its device. For ``single`` the KL reference (``train.kl_coef > 0``) is a frozen copy of ``model`` as it is now, or, under
    LoRA, the same model with its adapters disabled (no copy; tasks/model/lora.py); the sharded backends keep one
    per rank (tasks/training/sharded_update.py).
    """
    settings = LossSettings.from_config(cfg, pad_id)
    tc = cfg.train
    if isinstance(base_model(model), PreTrainedModel):  # the estimate reads a transformers decoder's shape
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_update_fits(cfg, model, base_model(model).config, device, lora=is_lora(model), world=world)
    if cfg.scale.backend != "single":
        return Driver(cfg, model, settings)
    ref = None
    if tc.kl_coef > 0:
        ref = BaseModelView(model) if is_lora(model) else copy.deepcopy(model).eval()
    gradient_checkpointing(base_model(model), tc.gradient_checkpointing)
    return LocalUpdater(model, settings, lr=tc.lr, betas=tc.betas, eps=tc.adam_eps, weight_decay=tc.weight_decay,
                        device=device, ref_model=ref)
