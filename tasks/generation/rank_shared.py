"""Every rank of a sharded run generates its share of each ``generate`` call (``scale.backend`` ddp, fsdp2,
deepspeed_zero2/3 under ``torchrun``; docs/scale-out.md).

Rank 0 meets it through the :class:`~tasks.generation.rollout.RolloutEngine` interface: :class:`RankSharedEngine`
wraps rank 0's in-process :class:`~tasks.generation.rollout.HFEngine` (made by
:meth:`tasks.update.sharded_update.Driver.share_generation`, which sends the other ranks the engine's settings and
tokenizer once, :class:`GenerationSetup`). A call:

1. rank 0 cuts the B prompts into ``world`` contiguous shares of whole prompts (whole groups; sizes differ by at most
   one, :func:`tasks.generation.split.share_bounds`) and sends the call to every rank (:class:`GenerateCall`, the
   sharded update's command channel);
2. under FSDP2 and ZeRO-3 every rank takes part in gathering the full weights into its generation copy
   (:func:`gather_weights_into`, collective; rank 0 generates with its own full ``policy.model``, which the update
   keeps current, and drops what it gathers);
3. each rank decodes its share with its ``HFEngine`` (same settings), prompt b of the call seeded by its index in the
   whole call (``first``), so the rollouts do not depend on the number of ranks;
4. the shares come back to rank 0 (``gather_object``) and are joined in order (:func:`tasks.generation.split.join`).
   Rewards, the ledger and selection stay on rank 0.

Each rank's generation weights (:class:`RankGenerator`): DDP and ZeRO-2 keep full weights on every rank, so a rank
generates with its replica's own module (no copy) when its dtype is the generation dtype (rank 0's ``policy.model``'s;
else a cast copy, refreshed locally each call). FSDP2 and ZeRO-3 shard the weights, so ranks 1..W-1 keep a full copy
in the generation dtype (bf16 on a GPU), gathered at every call: :func:`generation_copy_bytes` is what the memory
check counts for it. Deviations: the gather runs at every ``generate`` call rather than once a step (a step has one
or a few calls; the reference rollouts at a round start and each evaluation add one each); the split is by prompt
count, not by the ranks' speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tasks.generation.rollout import Generation, HFEngine, RolloutEngine
from tasks.generation.split import join, share_bounds
from tasks.model.wrappers import is_deepspeed, unwrap

#: Backends whose ranks hold only a shard of the weights: generation needs a gathered full copy.
GATHERED = ("fsdp2", "deepspeed_zero3")


def generation_copy_bytes(backend: str, params: int, generation_dtype: torch.dtype, train_dtype: torch.dtype,
                          rank: int) -> int:
    """Bytes rank ``rank`` holds for generation beyond its training replica and rank 0's ``policy.model``: for the
    memory check (tasks/update/memory_check.py).

    Under FSDP2 / ZeRO-3 ranks 1..W-1 hold a full copy of the ``params`` weights in ``generation_dtype``; under DDP /
    ZeRO-2 none, unless the replica trains in another dtype (then a cast copy). Rank 0 generates with
    ``policy.model`` (already counted). Not counted here: the KV cache of the rank's share, and under FSDP2 the one
    full parameter that is whole at a time while it is gathered.
    """
    if rank == 0 or (backend not in GATHERED and generation_dtype == train_dtype):
        return 0
    return params * torch.empty((), dtype=generation_dtype).element_size()


@torch.no_grad()
def gather_weights_into(model, dst: torch.nn.Module | None) -> None:
    """Copy the full weights of the (wrapped) training ``model`` into ``dst`` (a plain module of the same
    architecture, any dtype); ``dst`` None: take part in the gather only. Call on every rank: collective for FSDP2
    (each parameter's ``full_tensor``, one at a time) and ZeRO-3 (``deepspeed.zero.GatheredParameters``, one module's
    own parameters at a time); local otherwise."""
    from torch.distributed.tensor import DTensor

    target = dict(dst.named_parameters()) if dst is not None else {}
    if is_deepspeed(model) and model.zero_optimization_stage() == 3:
        import deepspeed

        names = {id(p): name for name, p in model.module.named_parameters()}
        for module in model.module.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            with deepspeed.zero.GatheredParameters(own, modifier_rank=None):
                for p in own:
                    if dst is not None and id(p) in names:
                        target[names[id(p)]].copy_(p.data)
        return
    for name, p in unwrap(model).named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.data
        if dst is not None:
            target[name].copy_(full)


@dataclass(frozen=True)
class GenerationSetup:
    """What ranks 1..W-1 need to generate as rank 0 does (sent once, :meth:`Driver.share_generation`).

    Attributes:
        tokenizer: rank 0's tokenizer (prompts are tokenized and completions decoded on each rank).
        settings: rank 0's ``HFEngine.settings()`` (each rank puts its own device in).
        config: the model's transformers config (a gathered copy is built from it).
        dtype: the generation dtype (rank 0's ``policy.model``'s).
        backend: ``scale.backend``.
    """

    tokenizer: object
    settings: dict
    config: object
    dtype: torch.dtype
    backend: str


@dataclass(frozen=True)
class GenerateCall:
    """One ``generate`` call, as rank 0 sends it to every rank.

    Attributes:
        prompts: the call's B prompts; n, seed, greedy: ``generate``'s.
        first: the index of ``prompts[0]`` in the caller's whole call (prompt b draws from ``first + b``'s seed).
        bounds: each rank's ``[start, end)`` share of ``prompts`` (``world`` of them, some maybe empty).
    """

    prompts: tuple[str, ...]
    n: int
    seed: int
    greedy: bool
    first: int
    bounds: tuple[tuple[int, int], ...]


def take_part(engine: HFEngine, call: GenerateCall, rank: int) -> list | None:
    """Decode this rank's share of ``call`` and gather every rank's to rank 0 (collective); rank 0 gets each rank's
    ``(Generation or None, error or None)`` in rank order, the others None. An error in a rank's decode is sent to
    rank 0 (which raises it) rather than raised there, so no rank is left waiting in the gather."""
    a, b = call.bounds[rank]
    result, error = None, None
    if b > a:
        try:
            result = engine.generate(list(call.prompts[a:b]), call.n, call.seed, call.greedy, first=call.first + a)
        except Exception as err:  # noqa: BLE001 - handed to rank 0, which stops the run with it
            error = f"rank {rank}: {type(err).__name__}: {err}"
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((result, error), parts, dst=0)
    return parts


class RankGenerator:
    """Ranks 1..W-1: the weights and engine this rank generates its shares with (module docstring).

    Args:
        model: this rank's wrapped training replica.
        setup: rank 0's :class:`GenerationSetup`.
        device: where this rank computes.
    """

    def __init__(self, model, setup: GenerationSetup, device: torch.device):
        self.model, self.setup = model, setup
        own = unwrap(model)
        if setup.backend not in GATHERED and next(own.parameters()).dtype == setup.dtype:
            self.copy = None  # generate with the replica's own full weights
            module = own
        else:
            from transformers import AutoModelForCausalLM

            with torch.device(device):
                module = AutoModelForCausalLM.from_config(setup.config, dtype=setup.dtype)
            self.copy = module.eval().requires_grad_(False)
        self.engine = HFEngine(module, setup.tokenizer, **{**setup.settings, "device": device})

    def run(self, call: GenerateCall) -> None:
        """Refresh the copy (collective where the weights are sharded), decode this rank's share, send it to rank 0."""
        if self.copy is not None:
            gather_weights_into(self.model, self.copy)
        take_part(self.engine, call, dist.get_rank())


class RankSharedEngine(RolloutEngine):
    """Rank 0's engine under a sharded backend: every rank decodes a contiguous share of each call (module docstring).

    Args:
        local: rank 0's in-process engine (on ``policy.model``, which the update keeps current).
        model: rank 0's wrapped training replica (it takes part in the other ranks' gathers).
        backend: ``scale.backend``.
        announce: sends a :class:`GenerateCall` to ranks 1..W-1 (the sharded update's command channel).
    """

    def __init__(self, local: HFEngine, model, backend: str, announce: Callable[[GenerateCall], None]):
        self.local, self.model, self.backend, self.announce = local, model, backend, announce
        self.world = dist.get_world_size()
        self.answered = [0] * self.world

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False, *, first: int = 0) -> Generation:
        """``n`` completions for each prompt, prompt b seeded by ``first + b`` whichever rank decodes it.

        Raises:
            RuntimeError: a rank's decode failed (every rank's error, by rank).
        """
        if not prompts:
            return self.local.generate(prompts, n, seed, greedy, first=first)
        call = GenerateCall(prompts=tuple(prompts), n=n, seed=seed, greedy=greedy, first=first,
                            bounds=tuple(share_bounds(len(prompts), self.world)))
        self.announce(call)
        if self.backend in GATHERED:
            gather_weights_into(self.model, None)  # rank 0 has policy.model; the others need its shards
        parts = take_part(self.local, call, 0)
        errors = [e for _, e in parts if e is not None]
        if errors:
            raise RuntimeError("generation failed on " + "; ".join(errors))
        for r, (start, end) in enumerate(call.bounds):
            self.answered[r] += end - start
        return join([g for g, _ in parts if g is not None], self.local.tok.pad_token_id)

    def sync_weights(self, model: torch.nn.Module, tokenizer, folder) -> float:
        """Rank 0's engine samples from ``policy.model`` itself; the other ranks refresh their weights at each call."""
        return self.local.sync_weights(model, tokenizer, folder)

    def metrics(self) -> dict[str, float]:
        """``rollout/rank<r>_prompts``: the prompts rank r has decoded so far."""
        return {f"rollout/rank{r}_prompts": float(k) for r, k in enumerate(self.answered)}
