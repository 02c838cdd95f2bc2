"""tasks/update/nan_locator.py: a NaN written into one layer's output (forward) or into the gradient that reaches it
(backward) is found where it was put, and the model is left as it was."""

import copy
import logging

import pytest
import torch

from tasks.update.distributed import DataShard
from tasks.update.nan_locator import SkippedUpdate, inject_nan, locate
from tasks.update.policy_update import policy_update
from tasks.update.skips import locate_skip
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = h.tiny_model()
    group = h.make_batch(model)[0]  # 4 rows, completions of 10 tokens, a prompt of 3

    def loss_fn():
        from tasks.model.forward import token_logprobs

        lp = token_logprobs(model, [group.prompt_ids] * group.size, group.completion_ids, group.completion_mask,
                            h.PAD, 1.0)
        return -(lp * group.completion_mask).sum()

    return model, loss_fn


def test_a_finite_pass_is_none_and_the_model_is_left_as_it_was(setup):
    model, loss_fn = setup
    before = copy.deepcopy(model.state_dict())
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), sentinel, strict=True):
        p.grad = g
    assert locate(model, loss_fn) is None
    assert all(p.grad is g for p, g in zip(model.parameters(), sentinel, strict=True))  # its gradients, unchanged
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # every hook removed
    for p in model.parameters():
        p.grad = None


def test_a_forward_nan_names_the_layer_the_row_and_the_position(setup):
    model, loss_fn = setup
    with inject_nan(model, "model.layers.1.mlp", position=6, row=2):
        site = locate(model, loss_fn, rows=[40, 41, 42, 43])
    assert (site.module, site.phase, site.tensor, site.kind, site.dtype) == \
        ("model.layers.1.mlp", "forward", "output", "nan", "float32")
    assert site.cells == ((42, 6),)  # row 2 of the micro-batch is the batch's row 42; 13 positions (3 + 10)
    assert site.shape == (4, 13, 64) and site.count == 64
    assert site.attention.implementation == "sdpa" and site.attention.length == 13
    assert site.attention.kernel and site.attention.mask == "none" and site.attention.causal  # no mask: is_causal
    line = site.describe()
    assert line.startswith("forward of model.layers.1.mlp: nan in the output, float32 [4, 13, 64]")
    assert "(42, 6)" in line and "attention sdpa" in line and "SDPA backends" in line


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_backward_only_nan_names_the_layer_whose_backward_made_it(setup, checkpointing):
    """A NaN in the gradient of the query projection's output (what a bad attention kernel's backward gives):
    every forward value is finite, and the module named is the attention whose backward made it, under activation
    checkpointing too (its recompute must match its forward: the locator's checks save nothing for autograd)."""
    model, loss_fn = setup
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        with inject_nan(model, "model.layers.0.self_attn.q_proj", position=4, phase="backward", row=1):
            site = locate(model, loss_fn)
    finally:
        if checkpointing:
            model.activation_checkpointing_disable()
    assert (site.module, site.phase) == ("model.layers.0.self_attn", "backward")
    assert site.tensor == "gradient of model.layers.0.self_attn.q_proj's output"
    assert site.cells == ((1, 4),)
    # a NaN in the gradient of layer 0's output, which layer 1 takes in (its norm and its residual): layer 1's
    with inject_nan(model, "model.layers.0", position=3, phase="backward", row=0):
        site = locate(model, loss_fn)
    assert (site.module, site.phase, site.cells) == ("model.layers.1", "backward", ((0, 3),))
    assert site.tensor == "gradient of its input (the output of model.layers.0)"


def test_the_update_logs_a_backward_nan_as_a_gradient_with_its_site(caplog):
    model = h.tiny_model()
    batch = h.make_batch(model)
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    before = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="tasks.update.policy_update"), \
            inject_nan(model, "model.layers.1.self_attn.q_proj", position=2, phase="backward"):
        result = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                               **h.SETTINGS))
    stats, skips = result.metrics, result.skipped
    assert stats["train/skipped_updates"] == 2.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert [(s.minibatch, s.cause) for s in skips] == [(0, "gradient"), (1, "gradient")]
    assert skips[0].site.module == "model.layers.1.self_attn" and skips[0].site.phase == "backward"
    assert "non-finite loss" not in caplog.text  # every loss was finite
    assert caplog.text.count("non-finite gradient (norm nan); backward of model.layers.1.self_attn") == 2


def test_under_scale_out_nothing_is_re_run_and_the_record_says_why():
    def rerun(_part):
        raise AssertionError("no re-run under scale-out")

    skip = locate_skip(h.tiny_model(), DataShard(0, 2), rerun, SkippedUpdate(0, "gradient", "norm nan"),
                       [torch.arange(2)])
    assert skip.site is None and "not located under scale-out" in skip.describe()


def test_the_locator_re_runs_a_bounded_number_of_micro_batches():
    """A gradient NaN that no single micro-batch shows: the locator stops at its cap of micro-batches, and at its
    time cap on a clock that moves 30 s a re-run (an injected clock, the locator's own loop)."""
    from tasks.update.skips import LOCATE_MICRO_BATCHES

    model, calls = h.tiny_model(), []
    batch = h.make_batch(model)
    g = batch[0]

    def rerun(part):  # a finite loss through the model
        calls.append(part)
        from tasks.model.forward import token_logprobs

        return token_logprobs(model, [g.prompt_ids] * len(part), g.completion_ids[part], g.completion_mask[part],
                              h.PAD).sum()

    parts = [torch.tensor([i % 4]) for i in range(10)]
    skip = locate_skip(model, None, rerun, SkippedUpdate(0, "gradient", "norm nan"), parts)
    assert len(calls) == LOCATE_MICRO_BATCHES and skip.site is None
    assert f"re-running {LOCATE_MICRO_BATCHES} of its 10 micro-batches" in skip.describe()
    calls.clear()
    ticks = iter(range(0, 10_000, 30))
    skip = locate_skip(model, None, rerun, SkippedUpdate(0, "gradient", "norm nan"), parts, limit=10, seconds=60,
                       clock=lambda: float(next(ticks)))
    assert len(calls) == 3 and "re-running 3 of its 10" in skip.describe()  # started at 0, 30 and 60 s
