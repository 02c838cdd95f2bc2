"""Which weights a run starts from: ``model.path`` (a Hugging Face folder, or a GGUF file or packaged model converted
once, tasks/model/gguf_source.py), or the tiny Llama warm-started on worked solutions (tasks/model/warmstart.py),
each cached by fingerprint under ``paths.cache`` (default ``<paths.root>/cache``)."""

from __future__ import annotations

from tasks.config import Config
from tasks.model import gguf_source
from tasks.model.warmstart import warm_start
from tasks.model.warmstart_data import SftRecipe

#: Warm-start data: worked solutions over all levels, from a seed the RL pool never uses.
WARMSTART_SEED = 10_000


def warmstart_recipe(cfg: Config) -> SftRecipe:
    """The warm start's data for ``cfg``: one pass over fresh worked solutions, drawn only if it trains."""
    ws = cfg.model.warmstart
    return SftRecipe(WARMSTART_SEED + cfg.seed, max(ws.steps, 1) * ws.batch_size, ws.mix, ws.flawed)


def policy_source(cfg: Config) -> str:
    """The folder of the run's starting policy (module docstring): made once where it is converted or trained, then
    found in the cache."""
    mc = cfg.model
    cache = str(cfg.paths.cache_dir)
    if mc.path and gguf_source.is_gguf(mc.path):
        return str(gguf_source.hf_folder(mc.path, cache))
    if mc.path:
        return mc.path
    ws = mc.warmstart
    return str(warm_start(warmstart_recipe(cfg), cache, hidden=mc.hidden,
                          layers=mc.layers, heads=mc.heads, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
                          seed=cfg.seed))
