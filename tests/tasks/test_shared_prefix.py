"""The shared-prefix layout (tasks/model/shared_prefix.py, ``train.shared_prefix``): each group's prompt computed once,
and every log-prob, gradient and update what the row layout gives, up to float rounding."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.plan import predict
from rlcore.plan_draw import Composition, PoolStats
from rlcore.step_costs import CallCost, FixedCosts, UnitCosts
from tasks.model.forward import token_logprobs
from tasks.model.shared_prefix import NAME, group_buckets, grouped_attention, pack_groups, prefix_attention
from tasks.update.policy_update import policy_update, uses_shared_prefix, wants_shared_prefix
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h


def _rows(seed: int = 0, vocab: int = 60):
    """Rows of 4 groups (sizes 3, 2, 4, 1; prompts of 5, 9, 3, 7 tokens) in shuffled order, completions of 0-8
    tokens (one empty), with their group labels."""
    g = torch.Generator().manual_seed(seed)
    sizes, plens = [3, 2, 4, 1], [5, 9, 3, 7]
    prompts_g = [torch.randint(4, vocab, (p,), generator=g) for p in plens]
    labels = torch.tensor([k for k, s in enumerate(sizes) for _ in range(s)])
    order = torch.randperm(len(labels), generator=g)
    labels = labels[order]
    prompts = [prompts_g[int(k)] for k in labels]
    lens = torch.randint(1, 9, (len(labels),), generator=g)
    lens[3] = 0
    comp = torch.randint(4, vocab, (len(labels), 8), generator=g)
    mask = torch.arange(8) < lens[:, None]
    return prompts, torch.where(mask, comp, torch.zeros_like(comp)), mask, labels


def test_pack_groups_by_hand():
    prompts = [torch.tensor([11, 12]), torch.tensor([21]), torch.tensor([11, 12])]
    comp = torch.tensor([[13, 14], [22, 23], [15, 0]])
    packed = pack_groups(prompts, comp, torch.tensor([2, 2, 1]), torch.tensor([0, 1, 0]))
    # group 0: its prompt once, then rows 0 and 2; group 1: its prompt, then row 1
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert packed.rows.tolist() == [0, 0, 2, 1, 1] and packed.columns.tolist() == [0, 1, 0, 0, 1]
    # each token predicted by the state before it in its own row: the prompt's last token for a first token
    assert packed.positions.tolist() == [1, 2, 1, 5, 6]
    assert packed.targets.tolist() == [13, 14, 15, 22, 23]
    lay = packed.layout
    assert lay.prompt_at.tolist() == [[0, 1], [5, 0]] and lay.prompt_real.tolist() == [[True, True], [True, False]]
    assert lay.completion_at.tolist() == [[2, 3], [6, 7], [4, 0]] and lay.row_group.tolist() == [0, 1, 0]
    # row 2's one token sees its prompt and itself (its pad column too: no query row is empty); row 1's tokens see
    # prompt 21 (group 1's prompt is 1 of 2 columns) and row 1 causally
    assert lay.completion_mask[2, 0].tolist() == [[True, True, True, False], [True, True, True, False]]
    assert lay.completion_mask[1, 0].tolist() == [[True, False, True, False], [True, False, True, True]]


def test_rows_of_one_group_must_hold_one_prompt():
    with pytest.raises(ValueError, match="rows 0 and 1 are in group 0 but hold different prompts"):
        pack_groups([torch.tensor([1, 2]), torch.tensor([1, 3])], torch.ones(2, 1, dtype=torch.long),
                    torch.tensor([1, 1]), torch.tensor([0, 0]))


def _slow_attention(q, k, v, visible, scale):
    """One packed sequence's attention, query by query over the keys it may see: q [H, T, D], visible [T, T]."""
    out = torch.zeros_like(q)
    for t in range(q.shape[1]):
        keys = visible[t].nonzero().flatten()
        w = torch.softmax((q[:, t:t + 1] @ k[:, keys].transpose(1, 2)) * scale, dim=-1)  # [H, 1, |keys|]
        out[:, t] = (w @ v[:, keys])[:, 0]
    return out


def test_grouped_attention_against_a_slow_loop_with_grouped_query_heads():
    prompts, comp, mask, labels = _rows(1)
    packed = pack_groups(prompts, comp, mask.sum(1), labels)
    t = packed.input_ids.shape[1]
    # who may see whom, from the packing alone: the same group's prompt, or earlier in one's own completion
    owner = torch.full((t,), -1)  # the row of a completion token, -1 for prompt tokens
    group_of = torch.zeros(t, dtype=torch.long)
    for r in range(len(prompts)):
        at = packed.layout.completion_at[r][packed.layout.completion_real[r]]
        owner[at], group_of[at] = r, int(packed.layout.row_group[r])
    for gi in range(packed.layout.prompt_at.shape[0]):
        group_of[packed.layout.prompt_at[gi][packed.layout.prompt_real[gi]]] = gi
    pos = torch.arange(t)
    same_group = group_of[:, None] == group_of[None, :]
    own_or_prompt = (owner[None, :] == -1) | (owner[None, :] == owner[:, None])
    visible = same_group & (pos[None, :] <= pos[:, None]) & own_or_prompt
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8,
                                                                                                       generator=g)
    out, _ = grouped_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, prefix_layout=packed.layout)
    kv = k[0].repeat_interleave(2, dim=0), v[0].repeat_interleave(2, dim=0)
    expected = _slow_attention(q[0], *kv, visible, 0.3)  # [H, T, D]
    torch.testing.assert_close(out[0], expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_tokens", [0, 20])
def test_packed_log_probs_and_gradients_equal_the_row_layouts(max_tokens):
    model = h.tiny_model()
    prompts, comp, mask, labels = _rows(0, model.config.vocab_size)
    weights = torch.randn(comp.shape, generator=torch.Generator().manual_seed(3))

    def run(**kw):
        model.zero_grad()
        lp = token_logprobs(model, prompts, comp, mask, h.PAD, temperature=0.7, **kw)
        (lp * weights).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    rows_lp, rows_grad = run()
    packed_lp, packed_grad = run(groups=labels, max_tokens=max_tokens)
    assert model.config._attn_implementation == "sdpa"  # switched back after the pass
    torch.testing.assert_close(packed_lp, rows_lp, rtol=1e-5, atol=2e-5)
    assert (packed_lp[~mask] == 0).all()
    for a, b in zip(rows_grad, packed_grad, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.lists(st.integers(0, 9), min_size=1, max_size=5)),
                min_size=1, max_size=8), st.integers(0, 40), st.randoms(use_true_random=False))
def test_group_buckets_keep_groups_whole_within_the_budget(spec, budget, rnd):
    labels, plens, clens = [], [], []
    for k, (p, comps) in enumerate(spec):
        for c in comps:
            labels.append(k)
            plens.append(p)
            clens.append(c)
    order = list(range(len(labels)))
    rnd.shuffle(order)
    labels, plens, clens = ([x[i] for i in order] for x in (labels, plens, clens))
    buckets = group_buckets(torch.tensor(labels), torch.tensor(plens), torch.tensor(clens), budget)
    flat = torch.cat(buckets).tolist()
    assert sorted(flat) == list(range(len(labels)))  # a permutation
    if budget <= 0:
        assert len(buckets) == 1
        return
    for b in buckets:
        rows = b.tolist()
        groups = {labels[i] for i in rows}
        # what the pass computes: each group's prompt once, every row's completion
        packed = sum(spec[k][0] for k in groups) + sum(clens[i] for i in rows)
        assert packed <= budget or len(rows) == 1
        for k in groups:  # a group is split only where it does not fit the budget by itself
            if spec[k][0] + sum(spec[k][1]) <= budget:
                assert {i for i in range(len(labels)) if labels[i] == k} <= set(rows)


def _update(groups, mode: bool, **extra):
    model = h.tiny_model()
    shapes = []
    model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    settings = LossSettings(**{**h.SETTINGS, "minibatches": 1}, aggregation="token", skip_zero_advantage=True,
                            shared_prefix=mode, micro_batch_tokens=extra.pop("micro", 0))
    stats = [policy_update(model, opt, copy.deepcopy(groups), settings).metrics for _ in range(2)]
    return model, stats, shapes


@pytest.mark.parametrize("micro", [60, 30])
def test_the_update_with_one_prompt_a_group_learns_what_the_row_layout_learns(micro):
    groups = h.make_batch(h.tiny_model(), silent=True)  # groups 1 and 3 silent; group 2 replayed
    rows_model, rows_stats, _ = _update(groups, False)
    shared_model, shared_stats, shapes = _update(groups, True, micro=micro)
    assert all(s[0] == 1 for s in shapes)  # packed passes, not rows: the feature acted
    computed = [g for i, g in enumerate(groups) if i not in (1, 3)]  # packed: 3 + 37 and 7 + 37 tokens
    once = sum(g.prompt_ids.numel() + int(g.completion_mask.sum()) for g in computed)
    if micro == 60:  # each computed group in a pass of its own, its prompt computed once
        assert shared_stats[0]["train/update_tokens"] == once
        assert rows_stats[0]["train/update_tokens"] - once == sum(3 * g.prompt_ids.numel() for g in computed)
        assert shared_stats[0]["train/micro_batches"] == 2.0
    else:  # each group over the budget: cut in pieces, a prompt a piece
        assert once < shared_stats[0]["train/update_tokens"] < rows_stats[0]["train/update_tokens"]
        assert shared_stats[0]["train/micro_batches"] > 2.0
    for a, b in zip(rows_stats, shared_stats, strict=True):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/update_rows"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for (name, p), q in zip(rows_model.named_parameters(), shared_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)


def test_the_update_under_activation_checkpointing_recomputes_with_the_grouped_attention():
    groups = h.make_batch(h.tiny_model(), silent=True)
    results = []
    for mode in (False, True):
        model = h.tiny_model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
        settings = LossSettings(**{**h.SETTINGS, "minibatches": 1}, aggregation="token", skip_zero_advantage=True,
                                shared_prefix=mode)
        results.append((policy_update(model, opt, copy.deepcopy(groups), settings).metrics, model))
    (a, rows_model), (b, shared_model) = results
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    for p, q in zip(rows_model.parameters(), shared_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)


def test_when_the_update_shares_prompts():
    model = h.tiny_model()
    on, auto = (LossSettings(**h.SETTINGS, aggregation="token", shared_prefix=m) for m in (True, "auto"))
    assert wants_shared_prefix("auto", "cpu", angle=False) and not wants_shared_prefix("auto", "cuda", angle=False)
    assert wants_shared_prefix(True, "cuda", angle=False) and not wants_shared_prefix(False, "cpu", angle=False)
    assert not wants_shared_prefix(True, "cpu", angle=True)  # GAIN-RL reads the rows' hidden states
    assert uses_shared_prefix(auto, model, "cpu", None) and not uses_shared_prefix(on, model, "cpu", shard=object())
    model.set_attn_implementation("eager")  # only SDPA is switched: eager keeps the row layout
    assert not uses_shared_prefix(on, model, "cpu", None)
    with prefix_attention(model) as shared:
        assert not shared and model.config._attn_implementation == "eager"


def test_prefix_attention_switches_back_on_error_and_nests():
    model = h.tiny_model()
    with pytest.raises(KeyError), prefix_attention(model):
        with prefix_attention(model) as inner:
            assert inner and model.config._attn_implementation == NAME
        assert model.config._attn_implementation == NAME  # the inner block leaves the outer one's switch
        raise KeyError("boom")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="without a prefix_layout"), prefix_attention(model):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))


def test_the_plan_counts_a_groups_prompt_once_where_the_update_does():
    pool = PoolStats(successes=(0, 4, 8, 2), g=8, levels=(1, 2, 3, 4), weights=(1.0, 1.0, 1.0, 1.0))
    costs = UnitCosts(generate=CallCost(fixed_s=0.0, token_s=1e-4, step_s=1e-3),
                      update=CallCost(fixed_s=0.0, token_s=1e-4), forward=CallCost(fixed_s=0.0, token_s=1e-5),
                      fixed=FixedCosts(), completion_tokens=30.0, prompt_tokens=10.0)
    rows, shared = (Composition(name="g", prompts=8, n=4, m=4, shared_prefix=s) for s in (False, True))
    p_rows, p_shared = predict([shared], rows, pool, costs)[0], predict([shared], rows, pool, costs)[1][0]
    # the informative groups' rows: 4 each; rows cost 30 + 10 tokens, with one prompt a group 4 x 30 + 10
    groups = p_rows.informative
    assert p_rows.updated_tokens == pytest.approx(groups * 4 * 40)
    assert p_shared.updated_tokens == pytest.approx(groups * (4 * 30 + 10))
    assert p_shared.update_s < p_rows.update_s


def test_a_pass_without_a_completion_token_keeps_a_graph():
    model = h.tiny_model()
    prompts = [torch.tensor([5, 6, 7])] * 2
    lp = token_logprobs(model, prompts, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool),
                        h.PAD, groups=torch.tensor([0, 0]))
    assert lp.shape == (2, 3) and (lp == 0).all()
    lp.sum().backward()  # a graph through the parameters, as the row layout's stand-in gives
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

