"""``train.skip_zero_advantage``: groups without a gradient are left out of the update, and nothing else changes."""

import copy

import pytest
import torch

from rlcore.grpo_loss import clipped_policy_loss
from tasks.config import ConfigError
from tasks.config.load import load_config
from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model
from tasks.update.distributed import backward_step
from tasks.update.minibatch import flatten, kl_draw, rows_with_gradient
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h


def test_rows_with_gradient_by_hand():
    rows = torch.arange(6)
    silent = torch.tensor([True, True, False, False, True, False])
    lengths = torch.tensor([4, 2, 3, 0, 5, 1])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)  # [6, 5]
    kept, share = rows_with_gradient(rows, silent, mask, "token")
    assert kept.tolist() == [2, 3, 5] and share == pytest.approx((3 + 0 + 1) / 15)
    kept, share = rows_with_gradient(rows, silent, mask, "sequence")  # row 3 has no valid token: not a unit
    assert kept.tolist() == [2, 3, 5] and share == pytest.approx(2 / 5)
    kept, share = rows_with_gradient(rows[:2], silent, mask, "token")  # nothing to learn: one row, loss 0
    assert kept.tolist() == [0] and share == pytest.approx(4 / 6)
    kept, share = rows_with_gradient(rows, silent, mask, "token", min_rows=4)  # too few rows for the ranks
    assert kept.tolist() == rows.tolist() and share == 1.0


def _batch_with_silent_groups(model):
    """dist_update_helper's batch (one replayed group) with groups 1 (all right) and 3 (all wrong) silent."""
    return h.make_batch(model, silent=True)


def _update(groups, skip: bool, **kw):
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    settings = {**h.SETTINGS, **kw.pop("settings", {})}
    ref = kw.pop("ref_model", None)
    stats = [policy_update(model, opt, copy.deepcopy(groups), LossSettings(skip_zero_advantage=skip, **settings, **kw),
                           ref_model=ref).metrics
             for _ in range(2)]  # two steps: the second sees Adam's moments of the first
    return model, stats


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_skipping_silent_groups_changes_neither_loss_nor_weights(aggregation, minibatches):
    groups = _batch_with_silent_groups(h.tiny_model())
    settings = {"minibatches": minibatches}
    full, full_stats = _update(groups, False, aggregation=aggregation, kl_coef=0.0, settings=settings)
    fast, fast_stats = _update(groups, True, aggregation=aggregation, kl_coef=0.0, settings=settings)
    assert full_stats[0]["train/update_rows"] == 16.0 and fast_stats[0]["train/update_rows"] == 8.0
    computed = [g for i, g in enumerate(groups) if i not in (1, 3)]
    assert fast_stats[0]["train/update_tokens"] == sum(g.size * g.prompt_ids.numel() + int(g.completion_mask.sum())
                                                       for g in computed)
    for a, b in zip(full_stats, fast_stats, strict=True):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for (name, p), q in zip(full.named_parameters(), fast.parameters(), strict=True):
        # 1e-5 = 1 % of one lr-sized Adam step: rounding in a gradient element near Adam's eps can move that
        # element by a few 1e-6 (one element of 12k here), a real change in what is learned would move many by ~1e-3
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)


def test_a_batch_without_gradient_still_steps_the_optimizer_as_before():
    groups = _batch_with_silent_groups(h.tiny_model())
    for g in groups:
        g.advantages = torch.zeros_like(g.advantages)
        g.replayed_from, g.behaviour_logp = None, torch.zeros(0)
    full, _ = _update(groups, False, aggregation="token", kl_coef=0.0)
    fast, stats = _update(groups, True, aggregation="token", kl_coef=0.0)
    assert stats[0]["train/update_rows"] == 2.0  # one row per minibatch
    for p, q in zip(full.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q, p)  # AdamW's weight decay applied alike


def _kl_oracle(groups, ref, kl_counts: torch.Tensor, kl_coef: float):
    """One step of the whole batch, every row computed, with each row's KL term weighted by ``kl_counts`` [N] (bool:
    1 or 0) and zeroed where it is 0: there the reference log-probs are the policy's own (detached), where k3 and
    its gradient are 0."""
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    prompts, comp, mask, adv, _ = flatten(groups)
    logp = token_logprobs(model, prompts, comp, mask, h.PAD)
    with torch.no_grad():
        ref_logp = token_logprobs(ref, prompts, comp, mask, h.PAD)
    ref_logp = torch.where(kl_counts.bool().unsqueeze(1), ref_logp, logp.detach())
    loss, _ = clipped_policy_loss(logp, logp.detach(), adv, mask, clip_eps=h.SETTINGS["clip_eps"], aggregation="token",
                                  kl_coef=kl_coef, ref_logp=ref_logp, kl_weight=kl_counts.float())
    backward_step(model, opt, loss, h.SETTINGS["grad_clip"])
    return model, float(loss.detach())


@pytest.mark.parametrize("kl_rows, counted, rows", [
    ("all", [0, 1, 2, 3], 16.0),                     # the KL-regularised objective: every row
    ("informative", [0, 2], 8.0),                    # only where the policy gradient is
    ("informative_and_solved", [0, 1, 2], 12.0),     # and the all-right group 1, not the all-wrong group 3
])
def test_kl_rows_choose_where_the_kl_term_counts(kl_rows, counted, rows):
    groups = _batch_with_silent_groups(h.tiny_model())
    for g in groups:
        g.replayed_from, g.behaviour_logp = None, torch.zeros(0)  # all fresh: the oracle needs no behaviour log-probs
    ref = build_tiny_model(hidden=64, layers=2, heads=2, seed=1)  # another policy: the KL term is not 0
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    settings = {**h.SETTINGS, "minibatches": 1}
    stats = policy_update(model, opt, copy.deepcopy(groups), LossSettings(skip_zero_advantage=True,
                          aggregation="token", kl_coef=0.5, kl_rows=kl_rows, **settings), ref_model=ref).metrics
    assert stats["train/update_rows"] == rows
    counts = torch.cat([torch.full((g.size,), i in counted) for i, g in enumerate(groups)])
    oracle, oracle_loss = _kl_oracle(groups, ref, counts, kl_coef=0.5)
    _, no_kl = _kl_oracle(groups, ref, counts, kl_coef=0.0)
    assert stats["train/loss"] == pytest.approx(oracle_loss, rel=1e-5) and abs(oracle_loss - no_kl) > 1e-3
    for (name, p), q in zip(oracle.named_parameters(), model.parameters(), strict=True):  # Adam's first step is
        # lr-sized (1e-3) wherever the gradient is not ~0: a KL term counted on other rows would move many elements
        # by that much; float rounding in an element near Adam's eps moves one by ~1e-5
        torch.testing.assert_close(q, p, rtol=1e-5, atol=3e-5, msg=name)


def test_kl_sample_computes_a_drawn_share_of_the_silent_groups_weighted_by_its_inverse():
    """train.kl_sample = 1/2: of the silent groups 1 and 3, the one drawn is computed with its KL term doubled, the
    other is skipped; loss and step equal the whole batch's with those KL weights (2, 0) and 1 elsewhere."""
    groups = _batch_with_silent_groups(h.tiny_model())
    for g in groups:
        g.replayed_from, g.behaviour_logp = None, torch.zeros(0)
    ref = build_tiny_model(hidden=64, layers=2, heads=2, seed=1)
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    stats = policy_update(model, opt, copy.deepcopy(groups), LossSettings(
        aggregation="token", kl_coef=0.5, kl_rows="all", **h.sampled_kl(groups), **{**h.SETTINGS, "minibatches": 1}),
        ref_model=ref).metrics
    assert stats["train/update_rows"] == 12.0  # groups 0 and 2 for their gradient, group 1 for its KL term
    weights = torch.cat([torch.full((g.size,), w) for g, w in zip(groups, (1.0, 2.0, 1.0, 0.0), strict=True)])
    oracle, oracle_loss = _kl_oracle(groups, ref, weights, kl_coef=0.5)
    _, unweighted = _kl_oracle(groups, ref, weights.clamp(max=1.0), kl_coef=0.5)
    assert stats["train/loss"] == pytest.approx(oracle_loss, rel=1e-5) and abs(oracle_loss - unweighted) > 1e-4
    for (name, p), q in zip(oracle.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=3e-5, msg=name)


def test_kl_draw_is_uniform_so_the_sampled_kl_term_is_unbiased():
    """Each silent group enters with chance kl_sample and weight 1 / kl_sample: its expected weight is 1."""
    group = _batch_with_silent_groups(h.tiny_model())[1]
    draws = torch.tensor([kl_draw(seed, group, position) for seed in range(50) for position in range(80)])
    assert float(draws.min()) >= 0 and float(draws.max()) < 1
    for share in (0.1, 0.25, 0.5, 0.9):  # 4000 draws: the binomial standard error is at most 0.008
        assert float((draws < share).float().mean() / share) == pytest.approx(1.0, abs=0.03 / share)
    assert kl_draw(3, group, 1) == kl_draw(3, group, 1)  # every rank and a resumed run draw alike
    assert len({kl_draw(3, group, p) for p in range(10)}) == 10


def test_kl_sample_needs_the_kl_term_and_the_skip():
    groups = _batch_with_silent_groups(h.tiny_model())
    with pytest.raises(ValueError, match="kl_sample=0.5 leaves silent groups out of the KL term"):
        _update(groups, False, aggregation="token", kl_coef=0.5, kl_sample=0.5, ref_model=h.tiny_model())
    with pytest.raises(ValueError, match=r"kl_sample must be in \(0, 1\]"):
        _update(groups, True, aggregation="token", kl_coef=0.5, kl_sample=0.0, ref_model=h.tiny_model())
    for overrides in (["train.kl_sample=0.5"], ["train.kl_coef=0.04", "train.kl_sample=0.5",
                                                "train.skip_zero_advantage=false"]):
        with pytest.raises(ConfigError, match="train.kl_sample=0.5 samples the silent groups' KL term"):
            load_config(None, overrides)


def test_an_unknown_kl_rows_is_an_error():
    groups = _batch_with_silent_groups(h.tiny_model())
    with pytest.raises(ValueError, match="kl_rows must be one of all, informative, informative_and_solved"):
        _update(groups, True, aggregation="token", kl_coef=0.5, kl_rows="solved", ref_model=h.tiny_model())


def test_kl_rows_without_the_skip_is_an_error():
    """kl_rows leaves rollouts out of the KL term by not computing them: without the skip it would do nothing."""
    groups = _batch_with_silent_groups(h.tiny_model())
    with pytest.raises(ValueError, match="kl_rows='informative' leaves rollouts out of the KL term"):
        _update(groups, False, aggregation="token", kl_coef=0.5, kl_rows="informative", ref_model=h.tiny_model())
    with pytest.raises(ConfigError, match="train.kl_rows=informative_and_solved .* needs train.skip_zero_advantage"):
        load_config(None, ["train.kl_coef=0.04", "train.kl_rows=informative_and_solved",
                           "train.skip_zero_advantage=false"])
    assert load_config(None, ["train.kl_rows=informative", "train.skip_zero_advantage=false"]).train.kl_coef == 0


def test_gain_rl_angle_still_sees_the_skipped_rows():
    groups = _batch_with_silent_groups(h.tiny_model())
    kw = {"aggregation": "token", "kl_coef": 0.0, "angle": True}
    full, full_stats = _update(groups, False, **kw)
    fast, fast_stats = _update(groups, True, **kw)
    assert fast_stats[0]["train/update_rows"] == 8.0  # the skipped rows had only a pass without autograd
    for a, b in zip(full_stats, fast_stats, strict=True):
        assert b["gain/angle_online"] == pytest.approx(a["gain/angle_online"], rel=1e-5)
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    for p, q in zip(full.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
