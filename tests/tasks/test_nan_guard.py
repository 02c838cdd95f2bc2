"""NaN never reaches the weights: an update whose loss or gradient is not finite is skipped, logged and counted."""

import copy
import logging

import torch

from tasks.update.distributed import backward_step
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h


def _nan_logits(model, minibatch_calls: set[int]):
    """A forward hook that turns the LM head's output into NaN on the given forward calls (0-based)."""
    calls = {"n": 0}

    def hook(_module, _inputs, output):
        i = calls["n"]
        calls["n"] += 1
        return output * float("nan") if i in minibatch_calls else output

    return model.lm_head.register_forward_hook(hook)


def test_a_nan_update_is_skipped_logged_and_never_applied(caplog):
    """Skipped, logged with the site the locator finds (tasks/update/nan_locator.py), never applied."""
    model = h.tiny_model()
    batch = h.make_batch(model)
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    before = copy.deepcopy(model.state_dict())
    # both minibatches and the locator's re-run of each (calls 0 and 1 are the no-grad passes for pi_old)
    handle = _nan_logits(model, {2, 3, 4, 5})
    with caplog.at_level(logging.WARNING, logger="tasks.update.policy_update"):
        stats = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                              **h.SETTINGS)).metrics
    handle.remove()
    assert stats["train/skipped_updates"] == 2.0
    assert "update skipped, not applied" in caplog.text
    assert caplog.text.count("non-finite loss (loss nan); forward of lm_head: nan in the output") == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights untouched
    assert not opt.state  # AdamW's moments were never touched either

    # One poisoned minibatch of two: the other one is applied; its metrics are finite and are the average.
    handle = _nan_logits(model, {3})
    stats = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                          **h.SETTINGS)).metrics
    handle.remove()
    assert stats["train/skipped_updates"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_non_finite_pi_old_pass_skips_its_minibatch_too():
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    before = copy.deepcopy(model.state_dict())
    batch = h.make_batch(model)
    handle = _nan_logits(model, {0, 1})  # the no-grad passes that give pi_old's log-probs, one a minibatch
    result = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                           **h.SETTINGS))
    stats, skips = result.metrics, result.skipped
    handle.remove()
    assert stats["train/skipped_updates"] == 2.0
    # the surrogate is finite, its pi_old input is not: said so, and the re-run finds every module finite
    assert [(s.minibatch, s.cause, s.site.phase) for s in skips] == [(0, "inputs", "loss"), (1, "inputs", "loss")]
    assert "non-finite log-probs feeding the loss" in skips[0].describe()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    handle = _nan_logits(model, {1})  # only the second minibatch's pi_old: the first is applied
    stats = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                          **h.SETTINGS)).metrics
    handle.remove()
    assert stats["train/skipped_updates"] == 1.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_backward_step_skips_a_non_finite_gradient_with_a_finite_loss():
    model = h.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    w = model.lm_head.weight
    loss = torch.sqrt(w[0, 0] * 0.0) + 1.0  # finite (1.0); its gradient is 0 * 1/(2 sqrt 0) = NaN
    assert torch.isfinite(loss)
    gnorm = backward_step(model, opt, loss, grad_clip=1.0)
    assert gnorm != gnorm  # NaN
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # A finite step goes through as before.
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    assert backward_step(model, opt, loss, grad_clip=1.0) > 0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_skipped_micro_batch_frees_its_graph_before_the_next_forward():
    """A non-finite micro-batch's graph (never backpropagated) must not live on through the next forward pass:
    every tensor a forward with grad saved for its backward is dead when the next forward starts (weak
    references to what a saved-tensor hook hands the graph; the model's own parameters and buffers left out)."""
    import weakref

    model = h.tiny_model()
    batch = h.make_batch(model)
    opt = torch.optim.AdamW(model.parameters(), **h.OPTIM)
    own = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    calls, saved, alive_at = {"n": 0}, [], {}

    def pre_forward(_module, _args):
        alive_at[calls["n"]] = sum(ref() is not None for call, ref in saved if call < calls["n"])
        calls["n"] += 1

    def pack(t):  # the graph keeps a detached alias (no cycle through an output's own node), watched weakly
        if id(t) in own:
            return t
        alias = t.detach()
        saved.append((calls["n"] - 1, weakref.ref(alias)))
        return alias

    handles = [model.register_forward_pre_hook(pre_forward), _nan_logits(model, {2})]  # minibatch 1's pass
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = policy_update(model, opt, copy.deepcopy(batch), LossSettings(aggregation="token", kl_coef=0.0,
                              **h.SETTINGS)).metrics
    for handle in handles:
        handle.remove()
    assert stats["train/skipped_updates"] == 1.0
    # 2 no-grad passes, one a minibatch and the locator's re-run of the skipped one (call 3)
    assert calls["n"] == 5 and any(call == 2 for call, _ in saved)
    assert alive_at[3] == 0, f"{alive_at[3]} tensors of the skipped micro-batch's graph alive at the next forward"
