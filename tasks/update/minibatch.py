"""Which rows one training step computes, and in which micro-batches (the first part of the update).

Shape letters: N rows (every group's rollouts, in order), L the batch's longest completion, n / k rows of one
minibatch / of what it computes.

A step's groups become N rows (:class:`BatchRows`), cut into ``train.minibatches`` minibatches (one optimizer step
each). Of a minibatch, the rows that carry a gradient are computed (:func:`rows_with_gradient`,
``train.skip_zero_advantage``), in micro-batches of at most ``train.micro_batch_tokens`` padded tokens each
(:func:`tasks.model.forward.length_buckets`; with ``train.shared_prefix`` whole groups, each prompt computed once, in
micro-batches of at most that many packed tokens, :func:`tasks.model.shared_prefix.group_buckets`): each micro-batch's
forward and backward run before the next, so the
update's memory is set by the micro-batch, whatever the batch (TRL's gradient accumulation, verl's
``ppo_max_token_len_per_gpu``, OpenRLHF's ``micro_train_batch_size``). The loss stays the whole minibatch's: each
micro-batch's aggregated loss is weighted by its share of the minibatch's loss units (:func:`loss_units`), so the
accumulated gradient is the whole-minibatch gradient up to float rounding.

Under scale-out every rank sees the same rows and cuts the same micro-batches, each of at least ``world`` rows;
rank r computes its contiguous slice of each (``DataShard.rows``), so every rank runs the same number of forward
and backward passes (FSDP2 and ZeRO-3 gather weights in each). The budget holds for each rank's slice
(``length_buckets``' ``parts``), not for the micro-batch over all ranks: 64 rows of 7,000 tokens on 8 ranks at
16,384 tokens a rank give every rank 2 rows (14,000 tokens) a pass, where a bucket of 8 x 16,384 tokens cut by
rows gave rank 0 three (21,000).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlcore.advantages import solved_mask
from rlcore.seeding import derive_seed
from rlcore.types import RolloutGroup
from tasks.model.forward import length_buckets
from tasks.model.shared_prefix import group_buckets, rows_by_group
from tasks.update.distributed import DataShard


def flatten(groups: Sequence[RolloutGroup]):
    """Rows of all groups: prompts (N tensors), completions [N, L], mask [N, L], advantages [N]."""
    width = max(g.completion_ids.shape[1] for g in groups)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    prompts = [g.prompt_ids for g in groups for _ in range(g.size)]
    comp = torch.cat([pad(g.completion_ids, 0) for g in groups])
    mask = torch.cat([pad(g.completion_mask, False) for g in groups])
    adv = torch.cat([g.advantages for g in groups]).float()
    return prompts, comp, mask, adv, width


def kl_draw(seed: int, group: RolloutGroup, position: int) -> float:
    """``train.kl_sample``'s uniform draw in [0, 1) for the group at ``position`` in a step's batch: a function of
    the run's seed, the group's step, its position and its prompt, so every rank and a resumed run draw alike."""
    return derive_seed(seed, group.step, position, group.prompt_id, "kl-sample") / 2.0**63


@dataclass(frozen=True)
class BatchRows:
    """A step's groups as N rows, with what the loss needs of each.

    Attributes:
        prompts: N prompt id tensors; completions: [N, L]; mask: [N, L] bool valid tokens; advantages: [N].
        group: [N] the position of each row's group in the step's batch (rows of a group share their prompt).
        kl_weight: [N] the weight of each row's KL term; 0 marks a silent row (no gradient, and no KL term to
            compute), 1 / kl_sample a drawn one (``train.kl_sample``).
        own_behaviour: [N] bool, mu stored with the group (replayed, or the sampler's log-probs).
        capped: [N] bool, fresh rows with their sampler's mu (``train.behaviour_cap`` applies).
        behaviour: [N, L] those mu (0 elsewhere).
        measured: [N] bool, fresh rows with the sampler's log-probs (the mismatch metrics).
        sampler: [N, L] those log-probs (0 elsewhere).
    """

    prompts: list[torch.Tensor]
    completions: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    group: torch.Tensor
    kl_weight: torch.Tensor
    own_behaviour: torch.Tensor
    capped: torch.Tensor
    behaviour: torch.Tensor
    measured: torch.Tensor
    sampler: torch.Tensor

    @property
    def n(self) -> int:
        return self.completions.shape[0]

    @property
    def width(self) -> int:
        return self.completions.shape[1]

    @property
    def silent(self) -> torch.Tensor:
        """[N] bool: rows the update need not compute (no policy gradient, no KL term)."""
        return self.kl_weight == 0.0

    def tokens(self, rows: torch.Tensor, shared_prefix: bool = False) -> int:
        """Real prompt + completion tokens of ``rows``; with ``shared_prefix`` each group's prompt counts once (what
        the shared-prefix layout computes)."""
        with_prompt = [g[0] for g in rows_by_group(self.group[rows]).values()] if shared_prefix else range(len(rows))
        return sum(self.prompts[int(rows[i])].numel() for i in with_prompt) + int(self.mask[rows].sum())


def batch_rows(groups: Sequence[RolloutGroup], *, kl_coef: float, kl_rows: str, kl_sample: float,
               seed: int) -> BatchRows:
    """The rows of ``groups`` (see :class:`BatchRows`; the KL settings are ``train.kl_*``)."""
    sampled = kl_sample < 1 and kl_coef > 0

    def kl_weight_of(i: int, g: RolloutGroup) -> float:  # the group's KL weight; 0: it adds nothing, so it is skipped
        if not bool((g.advantages == 0).all()):
            return 1.0  # a policy gradient
        if kl_coef == 0 or kl_rows == "informative":
            return 0.0
        if kl_rows == "informative_and_solved" and not bool(solved_mask(g.rewards.unsqueeze(0))):
            return 0.0
        if not sampled:
            return 1.0
        return 1.0 / kl_sample if kl_draw(seed, g, i) < kl_sample else 0.0

    prompts, comp, mask, adv, width = flatten(groups)

    def per_row(value) -> torch.Tensor:  # [N] from one value per group
        return torch.cat([torch.full((g.size,), value(i, g)) for i, g in enumerate(groups)])

    def rows_of(attr: str, has) -> torch.Tensor:  # [N, L]; 0 where not has
        return torch.cat([torch.nn.functional.pad(getattr(g, attr), (0, width - getattr(g, attr).shape[1]))
                          if has(g) else torch.zeros(g.size, width) for g in groups])

    def measured(g: RolloutGroup) -> bool:  # a fresh group with its sampler's log-probs
        return g.replayed_from is None and g.sampler_logp.numel() > 0

    return BatchRows(prompts=prompts, completions=comp, mask=mask, advantages=adv,
                     group=per_row(lambda i, _g: i).long(), kl_weight=per_row(kl_weight_of).float(),
                     own_behaviour=per_row(lambda _i, g: g.has_behaviour),
                     capped=per_row(lambda _i, g: g.has_behaviour and g.replayed_from is None),
                     behaviour=rows_of("behaviour_logp", lambda g: g.has_behaviour),
                     measured=per_row(lambda _i, g: measured(g)), sampler=rows_of("sampler_logp", measured))


def loss_units(mask: torch.Tensor, aggregation: str) -> float:
    """What the loss of rows with valid-token ``mask`` [n, L] is a mean over: valid tokens (``"token"``) or
    sequences with a valid token (``"sequence"``; rlcore.grpo_loss.masked_aggregate)."""
    return float(mask.sum() if aggregation == "token" else (mask.sum(1) > 0).sum())


def rows_with_gradient(rows: torch.Tensor, silent: torch.Tensor, mask: torch.Tensor, aggregation: str, *,
                       min_rows: int = 1) -> tuple[torch.Tensor, float]:
    """The rows of a minibatch the update must compute, and the share of the minibatch's loss units they hold.

    A rollout of a group whose advantages are all 0 adds 0 to the clipped surrogate (without a KL term), so
    leaving it out changes neither loss nor gradient as long as the loss is still divided by the whole
    minibatch's units: the caller multiplies the computed rows' aggregated loss by the returned share.

    Args:
        rows: [n] row indices of one minibatch.
        silent: [N] bool, True for rows of groups whose advantages are all 0.
        mask: [N, L] bool valid-token mask.
        aggregation: ``"token"`` (units are valid tokens) or ``"sequence"`` (sequences with a valid token).
        min_rows: compute at least this many rows (scale-out needs one per rank); when fewer carry a gradient,
            the minibatch is computed whole.

    Returns:
        ``(kept [k] row indices in their original order, share in (0, 1])``. A minibatch without any gradient
        keeps its first ``min_rows`` rows: the optimizer still takes its (zero-gradient) step, as without the skip.
    """
    kept = rows[~silent[rows]]
    if kept.numel() == 0:
        kept = rows[:min_rows]
    whole, part = loss_units(mask[rows], aggregation), loss_units(mask[kept], aggregation)
    if kept.numel() < min_rows or whole == 0 or part == 0:
        return rows, 1.0
    return kept, part / whole


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step's rows, as this process computes them.

    Attributes:
        units: loss units (:func:`loss_units`) of the whole minibatch, computed rows or not: the loss's normaliser.
        computed: [k] the rows computed with autograd, over all ranks.
        angle_only: rows left out by the skip whose hidden states GAIN-RL's angle still needs (one process only).
        micro: this process's part of each micro-batch (row indices; the same count on every rank, a part may be
            empty of valid tokens but never of rows).
        tokens: valid completion tokens of ``computed`` (the normaliser of the token-level metrics).
    """

    units: float
    computed: torch.Tensor
    angle_only: torch.Tensor
    micro: list[torch.Tensor]
    tokens: float


@dataclass(frozen=True)
class PassTokens:
    """The tokens the update's passes with autograd compute in this process: ``real``, the rows' prompt and
    completion tokens (each group's prompt once in the shared-prefix layout); ``padded``, every micro-batch's rows
    times its longest row (the contiguous layout of :func:`tasks.model.forward.contiguous_rows` pads each row to the
    pass's longest; a packed pass has no pads), what the matrix products run over. Model FLOPs and MFU count
    ``real``; ``padded - real`` is the padding's share of the compute."""

    real: int
    padded: int

    @classmethod
    def of(cls, rows: BatchRows, plan: Sequence[Minibatch], shared_prefix: bool = False) -> PassTokens:
        """The tokens of ``plan``'s micro-batches of ``rows`` (:func:`cut_minibatches`; ``shared_prefix``: it cut
        them for the shared-prefix layout)."""
        parts = [part for mb in plan for part in mb.micro if part.numel()]
        if shared_prefix:
            real = sum(rows.tokens(part, shared_prefix=True) for part in parts)
            return cls(real=real, padded=real)
        lengths = torch.tensor([int(p.numel()) for p in rows.prompts], dtype=torch.long) + rows.mask.sum(1)
        return cls(real=sum(int(lengths[part].sum()) for part in parts),
                   padded=sum(len(part) * int(lengths[part].max()) for part in parts))


def cut_minibatches(rows: BatchRows, *, count: int, aggregation: str, skip: bool, micro_batch_tokens: int,
                    shard: DataShard | None, shared_prefix: bool = False) -> list[Minibatch]:
    """Cut ``rows`` into ``count`` minibatches (contiguous, as ``torch.chunk``), each into micro-batches.

    Args:
        skip: leave silent rows out (:func:`rows_with_gradient`); ``aggregation``: the loss's.
        micro_batch_tokens: padded-token budget of one micro-batch on one process (``train.micro_batch_tokens``;
            0: the whole minibatch in one pass).
        shard: scale-out (None: one process).
        shared_prefix: micro-batches of whole groups for the shared-prefix layout, of at most
            ``micro_batch_tokens`` packed tokens (:func:`~tasks.model.shared_prefix.group_buckets`); one process only.
    """
    if shared_prefix and shard is not None:
        raise ValueError("the shared-prefix layout cuts micro-batches of whole groups in one process; under "
                         "scale-out each rank computes a slice of rows")
    world = shard.world if shard is not None else 1
    prompt_lens = torch.tensor([int(p.numel()) for p in rows.prompts])
    completion_lens = rows.mask.sum(1)
    out = []
    for whole in torch.arange(rows.n).chunk(count):
        computed = rows_with_gradient(whole, rows.silent, rows.mask, aggregation, min_rows=world)[0] if skip \
            else whole
        cut = (group_buckets(rows.group[computed], prompt_lens[computed], completion_lens[computed],
                             micro_batch_tokens) if shared_prefix
               else length_buckets(prompt_lens[computed], completion_lens[computed], micro_batch_tokens,
                                   min_rows=world, parts=world))
        micro = [computed[c] for c in cut]
        if shard is not None:
            micro = [shard.rows(m) for m in micro]
        out.append(Minibatch(units=loss_units(rows.mask[whole], aggregation), computed=computed,
                             angle_only=whole[~torch.isin(whole, computed)], micro=micro,
                             tokens=float(rows.mask[computed].sum())))
    return out
