"""The micro-batched update (``train.micro_batch_tokens``) takes the whole-minibatch step, one micro-batch at a time,
and the chunked LM head gives the full computation's log-probs and gradients."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.types import RolloutGroup
from tasks.config import LoraConfig
from tasks.model.forward import length_buckets, selective_log_softmax, token_logprobs
from tasks.model.logprob_head import chunked_head
from tasks.model.lora import BaseModelView, apply_lora, trainable_parameters
from tasks.update.distributed_state import reference_copy
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h

#: A micro-batch budget that cuts each minibatch of the helper's batch (rows of 4-19 padded tokens) in several.
SMALL = 40


def _step(micro: int, *, lora: bool = False, kl: float = 0.0, silent: bool = False, angle: bool = False,
          **settings):
    """One update of the helper's batch (SGD at lr 0 keeps the gradients readable and the weights as they were),
    then one AdamW step; returns the metrics, the gradient and the weights after the AdamW step."""
    model = h.tiny_model()
    if lora:
        model = apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0), seed=0)
        with torch.no_grad():  # B starts at 0: give the adapters a start that carries a gradient everywhere
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    ref = (BaseModelView(model) if lora else reference_copy(model)) if kl > 0 else None
    batch = h.make_batch(h.tiny_model(), silent=silent)
    params = trainable_parameters(model)
    sgd = torch.optim.SGD(params, lr=0.0)
    kw = {**h.SETTINGS, "minibatches": 1, "grad_clip": 1e9, "aggregation": "token", **settings}
    stats = policy_update(model, sgd, copy.deepcopy(batch), LossSettings(kl_coef=kl, micro_batch_tokens=micro,
                          skip_zero_advantage=silent, angle=angle, **kw), ref_model=ref).metrics
    grads = torch.cat([p.grad.flatten() for p in params])
    adam = torch.optim.AdamW(params, lr=1e-3, eps=1e-3)  # eps >> rounding: no entry's sign is amplified
    policy_update(model, adam, copy.deepcopy(batch), LossSettings(kl_coef=kl, micro_batch_tokens=micro,
                  skip_zero_advantage=silent, **kw), ref_model=ref)
    return stats, grads, torch.cat([p.detach().flatten() for p in params])


CASES = {
    "token": {},
    "sequence": {"aggregation": "sequence"},
    "two minibatches": {"minibatches": 2},
    "kl": {"kl": 0.1},
    "skip": {"silent": True},
    "skip + sampled kl": {"silent": True, "kl": 0.1, "kl_sample": 0.5, "kl_rows": "all"},
    "lora + kl": {"lora": True, "kl": 0.1},
    "gain angle": {"angle": True},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_micro_batches_give_the_whole_minibatch_step(case):
    kw = CASES[case]
    whole, whole_grad, whole_w = _step(0, **kw)
    micro, micro_grad, micro_w = _step(SMALL, **kw)
    minibatches = kw.get("minibatches", 1)
    assert whole["train/micro_batches"] == minibatches and micro["train/micro_batches"] >= 2 * minibatches + 1
    assert float(whole_grad.abs().max()) > 1e-4  # not vacuous: there is a gradient to compare
    # the gradient, hence the weights after a step of SGD, within 1e-6
    torch.testing.assert_close(micro_grad, whole_grad, atol=1e-6, rtol=0)
    # and after AdamW, one step a minibatch. With eps 1e-8 its first step moves every weight by about lr * sign(g),
    # so for the few entries whose |g| is at rounding level the sign, and a 2 lr move, is set by rounding.
    torch.testing.assert_close(micro_w, whole_w, atol=1e-6, rtol=0)
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/clip_frac", "train/ratio_mean", "train/grad_norm",
                "train/update_rows", "train/update_tokens", "gain/angle_online"):
        if key in whole:
            assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_each_micro_batch_runs_its_own_backward_pass():
    """The graph of one micro-batch is gone before the next forward: as many backward passes as micro-batches, and
    never two forward passes' graphs alive at once."""
    model = h.tiny_model()
    backwards, live, most = [0], [0], [0]
    model.lm_head.weight.register_hook(lambda g: backwards.__setitem__(0, backwards[0] + 1))

    def on_forward(_m, _i, out):  # counts graphs alive: +1 at each forward with grad, -1 when its backward starts
        if torch.is_grad_enabled():
            live[0] += 1
            most[0] = max(most[0], live[0])
            out.register_hook(lambda g: live.__setitem__(0, live[0] - 1))

    model.model.embed_tokens.register_forward_hook(on_forward)
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    stats = policy_update(model, opt, h.make_batch(model), LossSettings(aggregation="token", kl_coef=0.0,
                          micro_batch_tokens=SMALL, **{**h.SETTINGS, "minibatches": 1})).metrics
    assert stats["train/micro_batches"] >= 3
    assert backwards[0] == stats["train/micro_batches"] and most[0] == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 40)), min_size=1, max_size=60),
       st.integers(1, 600), st.integers(1, 4))
def test_length_buckets_hold_min_rows(lens, budget, min_rows):
    p = torch.tensor([a for a, _ in lens])
    c = torch.tensor([b for _, b in lens])
    buckets = length_buckets(p, c, budget, min_rows=min_rows)
    assert sorted(torch.cat(buckets).tolist()) == list(range(len(lens)))
    if len(lens) >= min_rows:
        assert all(len(b) >= min_rows for b in buckets)
    def padded(b):  # contiguous rows: the longest prompt + completion, times the rows
        return len(b) * int((p[b] + c[b]).max())

    for b in buckets:  # over the budget: the rows it needed, or a bucket within it plus a merged tail
        head = b[:len(b) - (min_rows - 1)] if len(b) > min_rows else b
        assert padded(b) <= budget or len(head) <= min_rows or padded(head) <= budget


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_full_logits_with_gradients(temperature):
    torch.manual_seed(0)
    model = h.tiny_model()
    batch = h.make_batch(model)
    prompts = [g.prompt_ids for g in batch for _ in range(g.size)]
    comp = torch.cat([g.completion_ids for g in batch])
    mask = torch.cat([g.completion_mask for g in batch])
    vocab = model.config.vocab_size
    sizes = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: sizes.append(out.shape[:-1].numel()))

    def full(m):  # the oracle: the model's own logits, log-softmax over the whole vocabulary
        out = []
        for i, prompt in enumerate(prompts):
            ids = torch.cat([prompt, comp[i]]).unsqueeze(0)
            logits = m(input_ids=ids).logits[0, prompt.numel() - 1:-1]  # [L, V]
            out.append(selective_log_softmax(logits.unsqueeze(0), comp[i:i + 1], temperature)[0])
        return torch.stack(out) * mask

    def grads(m, fn):
        m.zero_grad()
        lp = fn(m)
        (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in m.parameters()])

    want_lp, want_g = grads(model, full)
    import tasks.model.logprob_head as head

    budget = head.HEAD_CHUNK_ELEMENTS
    head.HEAD_CHUNK_ELEMENTS = 7 * vocab  # 7 tokens a chunk: many chunks, recomputed in the backward pass
    try:
        sizes.clear()
        got_lp, got_g = grads(model, lambda m: token_logprobs(m, prompts, comp, mask, h.PAD, temperature))
    finally:
        head.HEAD_CHUNK_ELEMENTS = budget
    # passes of the head never see more than 7 tokens (with the recompute, each chunk runs twice)
    assert sizes and max(sizes) <= 7
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_g, want_g, atol=1e-5, rtol=1e-4)


def test_a_head_whose_output_the_model_transforms_is_left_alone():
    model = h.tiny_model()
    model.config.final_logit_softcapping = 30.0
    with chunked_head(model, torch.zeros(1, 1, dtype=torch.long), 1.0) as chunked:
        assert not chunked and isinstance(model.lm_head, torch.nn.Linear)


def _long_rows(n: int, seed: int) -> list:
    """Groups of 8 rollouts with prompts of 200-1,000 tokens and completions of 4,000-6,000."""
    from rlcore.types import RolloutGroup

    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(n // 8):
        lens = torch.randint(4_000, 6_001, (8,), generator=g)
        mask = torch.arange(int(lens.max())) < lens[:, None]
        rewards = torch.tensor([1.0, 0.0] * 4)
        groups.append(RolloutGroup(prompt_id=f"p{k}", prompt_ids=torch.ones(int(torch.randint(200, 1_001, (1,),
                                                                                              generator=g))),
                                   completion_ids=mask.long(), completion_mask=mask, rewards=rewards,
                                   advantages=rewards - 0.5, behaviour_logp=torch.zeros(0), success_rate=0.5,
                                   n_generated=8, step=0))
    return groups


@pytest.mark.parametrize("n,budget", [(64, 16_384), (64, 8_192), (56, 12_000), (64, 20_000), (48, 7_000)])
def test_no_rank_micro_batch_exceeds_the_budget_on_8_ranks(n, budget):
    """Rows of up to 7,000 tokens, 8 ranks, each with its own DataShard: every rank runs as many micro-batches,
    every row is computed by one rank once, and no rank's micro-batch pads to more than 1.1x the budget."""
    from tasks.update.distributed import DataShard
    from tasks.update.minibatch import batch_rows, cut_minibatches

    rows = batch_rows(_long_rows(n, seed=n + budget), kl_coef=0.0, kl_rows="all", kl_sample=1.0, seed=0)
    plans = [cut_minibatches(rows, count=1, aggregation="token", skip=False, micro_batch_tokens=budget,
                             shard=DataShard(r, 8))[0] for r in range(8)]
    assert len({len(p.micro) for p in plans}) == 1
    done = torch.cat([part for p in plans for part in p.micro])
    assert sorted(done.tolist()) == list(range(n))
    worst = 0.0
    for p in plans:
        for part in p.micro:
            assert part.numel() >= 1
            padded = part.numel() * max(rows.prompts[i].numel() + int(rows.mask[i].sum()) for i in part.tolist())
            worst = max(worst, padded / budget)
    assert worst <= 1.1, f"a rank's micro-batch pads to {worst:.2f}x the budget"


def _group(k: int, prompt: int, lengths: list[int], width: int) -> RolloutGroup:
    mask = torch.arange(width) < torch.tensor(lengths)[:, None]
    rewards = torch.tensor([1.0, 0.0])
    return RolloutGroup(prompt_id=f"p{k}", prompt_ids=torch.arange(4, 4 + prompt),
                        completion_ids=torch.where(mask, 7, 0), completion_mask=mask, rewards=rewards,
                        advantages=rewards - 0.5, behaviour_logp=torch.zeros(0), success_rate=0.5, n_generated=2,
                        step=0)


@pytest.mark.parametrize("budget, padded", [(16, 31), (0, 40)])
def test_the_update_counts_the_tokens_its_passes_compute(budget, padded):
    """A hand count. Rows (prompt + real completion): group A's prompt of 3 with completions of 5 and 2 (8, 5),
    group B's prompt of 4 with 6 and 1 (10, 5): 28 real tokens. At 16 padded tokens a pass the rows go longest
    first into [B0] (10), [A0, A1] (2 x 8) and [B1] (5): 31 padded tokens; in one pass, 4 x 10 = 40. The old
    count, each row as its prompt plus its group's longest completion, said 2 x 8 + 2 x 10 = 36 for both."""
    model = h.tiny_model()
    groups = [_group(0, 3, [5, 2], 6), _group(1, 4, [6, 1], 8)]
    result = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), groups,
                           LossSettings(**{**h.SETTINGS, "minibatches": 1}, aggregation="token", kl_coef=0.0,
                                        micro_batch_tokens=budget))
    assert result.metrics["train/micro_batches"] == (3 if budget else 1)
    assert (result.tokens.real, result.tokens.padded) == (28, padded)
    assert result.metrics["train/update_tokens"] == 28
