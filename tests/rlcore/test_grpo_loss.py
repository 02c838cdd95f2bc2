import math

import pytest
import torch

from rlcore.grpo_loss import clipped_policy_loss, masked_aggregate

F64 = torch.float64


# the knobs the config sets (tasks/config/train.py TrainConfig) are required; these tests state their own
KNOBS = {"clip_eps": 0.2, "aggregation": "token", "kl_coef": 0.0}


def _loss(*args, **kw):
    return clipped_policy_loss(*args, **(KNOBS | kw))


def _t(rows, dtype=F64, grad=False):
    return torch.tensor(rows, dtype=dtype, requires_grad=grad)


# ---------------------------------------------------------------- hand-worked values


def test_ratio_e_half_clipped_to_1_2_positive_advantage():
    # logp - old = 0.5 -> ratio e^0.5 = 1.6487; clip(1.6487, 0.8, 1.2) = 1.2; A = 1
    # loss = max(-1 * 1.6487, -1 * 1.2) = max(-1.6487, -1.2) = -1.2; clipped -> zero gradient, clip_frac 1
    logp = _t([[0.5]], grad=True)
    loss, m = _loss(logp, _t([[0.0]]), _t([1.0]), torch.tensor([[True]]))
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert m["train/clip_frac"] == 1.0
    assert m["train/ratio_mean"] == pytest.approx(math.exp(0.5))
    # approx_kl = (e^0.5 - 1) - 0.5 = 0.148721
    assert m["train/approx_kl"] == pytest.approx(math.exp(0.5) - 1 - 0.5)
    assert m["train/pg_loss"] == pytest.approx(-1.2)


def test_negative_advantage_unclipped_high_ratio():
    # ratio e^0.5 = 1.6487, A = -1: max(+1.6487, +1.2) = 1.6487 (unclipped branch, gradient flows)
    # d loss / d logp = -A * ratio = 1.6487
    logp = _t([[0.5]], grad=True)
    loss, m = _loss(logp, _t([[0.0]]), _t([-1.0]), torch.tensor([[True]]))
    assert loss.item() == pytest.approx(math.exp(0.5), abs=1e-12)
    loss.backward()
    assert logp.grad.item() == pytest.approx(math.exp(0.5), abs=1e-12)
    assert m["train/clip_frac"] == 0.0


def test_negative_advantage_low_ratio_clipped():
    # logp - old = -0.5 -> ratio e^-0.5 = 0.6065; clip -> 0.8; A = -2
    # loss = max(2 * 0.6065, 2 * 0.8) = 1.6 (clipped, zero gradient)
    logp = _t([[-0.5]], grad=True)
    loss, m = _loss(logp, _t([[0.0]]), _t([-2.0]), torch.tensor([[True]]))
    assert loss.item() == pytest.approx(1.6, abs=1e-12)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert m["train/clip_frac"] == 1.0


def test_masking_ignores_padded_tokens():
    # tokens (logp - old): [0.1, 0.0, 99(pad)], A = 1; ratios e^0.1 = 1.10517, 1, pad ignored
    # loss = mean(-1.10517, -1) = -1.052585
    logp = _t([[0.1, 0.0, 99.0]], grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, m = _loss(logp, torch.zeros(1, 3, dtype=F64), _t([1.0]), mask)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + 1) / 2, abs=1e-12)
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0
    assert m["train/ratio_mean"] == pytest.approx((math.exp(0.1) + 1) / 2)


def test_token_vs_sequence_aggregation_unequal_lengths():
    # logp == old everywhere -> ratio 1, loss_tok = -A
    # seq 0: A = 1, 3 tokens -> per-token -1; seq 1: A = -1, 1 token -> per-token +1
    # token:    (3 * -1 + 1 * 1) / 4 = -0.5
    # sequence: mean(-1, +1)         = 0.0
    logp = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = _t([1.0, -1.0])
    tok, _ = _loss(logp, logp, adv, mask, aggregation="token")
    seq, _ = _loss(logp, logp, adv, mask, aggregation="sequence")
    assert tok.item() == pytest.approx(-0.5, abs=1e-15)
    assert seq.item() == pytest.approx(0.0, abs=1e-15)


def test_sequence_aggregation_skips_empty_rows():
    # row 1 has no valid token: sequence mean is over row 0 only -> -A = -2
    logp = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[True, True], [False, False]])
    loss, _ = _loss(logp, logp, _t([2.0, 5.0]), mask, aggregation="sequence")
    assert loss.item() == -2.0


def test_replay_form_hand_worked_upper_clip():
    # mu = 0, old = 0.3, logp = 0.5 (per-token log-probs)
    # r = e^0.5 = 1.648721, r_old = e^0.3 = 1.349859, window = r_old*[0.8, 1.2] = [1.079887, 1.619831]
    # A = 1: loss = max(-1.648721, -1.619831) = -1.619831 = -1.2 e^0.3  (clipped: zero gradient)
    # plain PPO (mu = old) would give ratio e^0.2 = 1.2214 -> clipped to 1.2 -> -1.2; the replay loss differs
    logp = _t([[0.5]], grad=True)
    loss, m = _loss(
        logp, _t([[0.3]]), _t([1.0]), torch.tensor([[True]]), behaviour_logp=_t([[0.0]])
    )
    assert loss.item() == pytest.approx(-1.2 * math.exp(0.3), abs=1e-12)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert m["train/clip_frac"] == 1.0
    assert m["train/behaviour_ratio_mean"] == pytest.approx(math.exp(0.3))
    assert m["train/ratio_mean"] == pytest.approx(math.exp(0.5))


def test_replay_form_hand_worked_inside_window():
    # mu = 0, old = 0.3, logp = 0.4: r = e^0.4 = 1.491825 inside [1.079887, 1.619831]
    # A = 1: loss = -1.491825, gradient d(-A e^(logp - mu))/dlogp = -1.491825
    logp = _t([[0.4]], grad=True)
    loss, m = _loss(
        logp, _t([[0.3]]), _t([1.0]), torch.tensor([[True]]), behaviour_logp=_t([[0.0]])
    )
    assert loss.item() == pytest.approx(-math.exp(0.4), abs=1e-12)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-math.exp(0.4), abs=1e-12)
    assert m["train/clip_frac"] == 0.0


def test_replay_form_hand_worked_lower_clip_negative_advantage():
    # mu = 0, old = 0.3, logp = 0: r = 1 below the window [1.079887, 1.619831] -> clip to 0.8 e^0.3
    # A = -1: loss = max(1, 0.8 e^0.3 = 1.079887) = 1.079887 (clipped, zero gradient)
    logp = _t([[0.0]], grad=True)
    loss, _ = _loss(
        logp, _t([[0.3]]), _t([-1.0]), torch.tensor([[True]]), behaviour_logp=_t([[0.0]])
    )
    assert loss.item() == pytest.approx(0.8 * math.exp(0.3), abs=1e-12)
    loss.backward()
    assert logp.grad.item() == 0.0


def test_replay_at_step_start_is_unclipped_importance_weighted():
    # at the start of a step logp == old, so r == r_old, which is inside its own window: loss = -A r_old
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 6, generator=g, dtype=F64)
    mu = old + 0.3 * torch.randn(4, 6, generator=g, dtype=F64)
    adv = torch.randn(4, generator=g, dtype=F64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    loss, m = _loss(old.clone(), old, adv, mask, behaviour_logp=mu)
    want = (-adv[:, None] * torch.exp(old - mu)).mean()
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
    assert m["train/clip_frac"] == 0.0


def test_kl_term_hand_worked():
    # logp = 0 = old, ref = 0.5: k3 = e^0.5 - 0.5 - 1 = 0.148721; pg = -A = -1
    # loss = -1 + 0.1 * 0.148721 = -0.985128
    logp = _t([[0.0]], grad=True)
    loss, m = _loss(
        logp, _t([[0.0]]), _t([1.0]), torch.tensor([[True]]), ref_logp=_t([[0.5]]), kl_coef=0.1
    )
    k3 = math.exp(0.5) - 0.5 - 1
    assert loss.item() == pytest.approx(-1 + 0.1 * k3, abs=1e-12)
    assert m["train/kl"] == pytest.approx(k3)
    assert m["train/pg_loss"] == pytest.approx(-1.0)
    # ref given with kl_coef 0: metric only, loss unchanged
    loss0, m0 = _loss(logp, _t([[0.0]]), _t([1.0]), torch.tensor([[True]]), ref_logp=_t([[0.5]]))
    assert loss0.item() == -1.0 and m0["train/kl"] == pytest.approx(k3)


@pytest.mark.parametrize("aggregation, expected", [
    # row 0: one valid token, ref - logp = ln 2, k3 = 2 - ln 2 - 1 = 0.306853, weight 3;
    # row 1: two valid tokens, ref - logp = -ln 2, k3 = 1/2 + ln 2 - 1 = 0.193147 each, weight 1/2
    ("token", (3 * (1 - math.log(2)) + 0.5 * 2 * (math.log(2) - 0.5)) / 3),   # 0.371238: over the 3 tokens
    ("sequence", (3 * (1 - math.log(2)) + 0.5 * (math.log(2) - 0.5)) / 2),    # 0.508569: mean of the 2 rows
])
def test_kl_weight_scales_each_sequences_kl_tokens_hand_worked(aggregation, expected):
    ln2 = math.log(2)
    logp = _t([[0.0, 0.0], [0.0, 0.0]], grad=True)
    mask = torch.tensor([[True, False], [True, True]])
    ref = _t([[ln2, 5.0], [-ln2, -ln2]])  # 5.0 on a padded position: ignored
    adv = _t([0.0, 0.0])  # no policy gradient: the loss is the KL term alone
    loss, m = _loss(logp, _t([[0.0, 0.0], [0.0, 0.0]]), adv, mask, aggregation=aggregation, ref_logp=ref,
                    kl_coef=0.5, kl_weight=_t([3.0, 0.5]))
    assert m["train/kl"] == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(0.5 * expected, abs=1e-12)
    ones, _ = _loss(logp, _t([[0.0, 0.0], [0.0, 0.0]]), adv, mask, aggregation=aggregation, ref_logp=ref,
                    kl_coef=0.5, kl_weight=_t([1.0, 1.0]))
    plain, _ = _loss(logp, _t([[0.0, 0.0], [0.0, 0.0]]), adv, mask, aggregation=aggregation, ref_logp=ref,
                     kl_coef=0.5)
    assert ones.item() == plain.item()  # weight 1 is no weight, bit for bit
    with pytest.raises(ValueError, match=r"kl_weight must have shape \[N\] = \(2,\)"):
        _loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.5, kl_weight=_t([1.0]))
    with pytest.raises(ValueError, match=r"kl_weight must be finite and >= 0; rows \[0, 1\]"):
        _loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.5, kl_weight=_t([-1.0, float("nan")]))


# ---------------------------------------------------------------- reduction to PPO-clip, bit for bit


def _ppo_clip_reference(logp, old_logp, adv, mask, eps):
    """Textbook PPO-clip (torchtune/verl form), token-level masked mean."""
    ratio = torch.exp(logp - old_logp)
    l1 = -adv[:, None] * ratio
    l2 = -adv[:, None] * torch.clamp(ratio, 1 - eps, 1 + eps)
    tok = torch.maximum(l1, l2)
    return torch.where(mask, tok, torch.zeros((), dtype=tok.dtype)).sum() / mask.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_reduces_bit_for_bit_to_ppo_clip(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n, length = 6, 9
    old = torch.randn(n, length, generator=g).to(dtype) * 0.5 - 2
    base = old + 0.3 * torch.randn(n, length, generator=g).to(dtype)  # ratios spread across the window
    adv = torch.randn(n, generator=g).to(dtype)
    mask = torch.rand(n, length, generator=g) > 0.25
    mask[:, 0] = True

    results = []
    for variant in ("ref", "none", "equal"):
        logp = base.clone().requires_grad_(True)
        if variant == "ref":
            loss = _ppo_clip_reference(logp, old, adv, mask, 0.2)
        elif variant == "none":
            loss, _ = _loss(logp, old, adv, mask, clip_eps=0.2)
        else:
            loss, _ = _loss(logp, old, adv, mask, clip_eps=0.2, behaviour_logp=old.clone())
        loss.backward()
        results.append((loss.detach(), logp.grad))
    (l_ref, g_ref), (l_none, g_none), (l_eq, g_eq) = results
    assert torch.equal(l_ref, l_none) and torch.equal(l_ref, l_eq)
    assert torch.equal(g_ref, g_none) and torch.equal(g_ref, g_eq)
    assert (g_ref != 0).any() and (g_ref[mask] == 0).any()  # both branches (clipped and not) exercised


# ---------------------------------------------------------------- slow loop oracle


def _loop_oracle(logp, old, adv, mask, eps, agg, mu, ref, kl_coef):
    n, length = len(logp), len(logp[0])
    pg_rows, kl_rows, pg_all, kl_all, count = [], [], 0.0, 0.0, 0
    for i in range(n):
        pg_sum, kl_sum, c = 0.0, 0.0, 0
        for t in range(length):
            if not mask[i][t]:
                continue
            m_ = old[i][t] if mu is None else mu[i][t]
            r = math.exp(logp[i][t] - m_)
            r_old = math.exp(old[i][t] - m_)
            lo, hi = r_old * (1 - eps), r_old * (1 + eps)
            clipped = min(max(r, lo), hi)
            tok = max(-adv[i] * r, -adv[i] * clipped)
            d = ref[i][t] - logp[i][t]
            k3 = math.exp(d) - d - 1
            pg_sum, kl_sum, c = pg_sum + tok, kl_sum + k3, c + 1
        pg_all, kl_all, count = pg_all + pg_sum, kl_all + kl_sum, count + c
        if c:
            pg_rows.append(pg_sum / c)
            kl_rows.append(kl_sum / c)
    if agg == "token":
        pg, kl = pg_all / count, kl_all / count
    else:
        pg, kl = sum(pg_rows) / len(pg_rows), sum(kl_rows) / len(kl_rows)
    return pg + kl_coef * kl, pg, kl


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_matches_loop_oracle(agg, replay, seed):
    g = torch.Generator().manual_seed(seed)
    n, length = 5, 7
    old = -1 - torch.rand(n, length, generator=g, dtype=F64)
    logp = old + 0.4 * torch.randn(n, length, generator=g, dtype=F64)
    mu = old + 0.4 * torch.randn(n, length, generator=g, dtype=F64) if replay else None
    ref = old + 0.2 * torch.randn(n, length, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    mask = torch.rand(n, length, generator=g) > 0.3
    mask[0] = False  # one empty sequence
    mask[1, 0] = True
    loss, m = _loss(
        logp, old, adv, mask, clip_eps=0.2, aggregation=agg, behaviour_logp=mu, ref_logp=ref, kl_coef=0.05
    )
    want, pg, kl = _loop_oracle(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, agg,
        None if mu is None else mu.tolist(), ref.tolist(), 0.05,
    )
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert m["train/pg_loss"] == pytest.approx(pg, abs=1e-12)
    assert m["train/kl"] == pytest.approx(kl, abs=1e-12)


def test_gradient_matches_finite_differences_off_policy():
    g = torch.Generator().manual_seed(7)
    old = torch.randn(3, 4, generator=g, dtype=F64)
    logp = (old + 0.1 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_(True)
    mu = old + 0.2 * torch.randn(3, 4, generator=g, dtype=F64)
    ref = old + 0.1 * torch.randn(3, 4, generator=g, dtype=F64)
    adv = torch.randn(3, generator=g, dtype=F64)
    mask = torch.ones(3, 4, dtype=torch.bool)

    def f(x):
        return _loss(
            x, old, adv, mask, behaviour_logp=mu, ref_logp=ref, kl_coef=0.1, aggregation="sequence"
        )[0]

    assert torch.autograd.gradcheck(f, (logp,))


# ---------------------------------------------------------------- inputs


def test_masked_aggregate_hand_worked():
    v = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert masked_aggregate(v, mask, "token").item() == pytest.approx(16 / 4)  # (1+2+3+10)/4
    assert masked_aggregate(v, mask, "sequence").item() == pytest.approx((2 + 10) / 2)  # mean(6/3, 10/1)


def test_input_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.zeros(2)
    with pytest.raises(ValueError, match="valid names: token, sequence"):
        _loss(x, x, adv, mask, aggregation="seq")
    with pytest.raises(ValueError, match="old_logp"):
        _loss(x, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        _loss(x, x, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="bool"):
        _loss(x, x, adv, mask.float())
    with pytest.raises(ValueError, match="no valid"):
        _loss(x, x, adv, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="clip_eps"):
        _loss(x, x, adv, mask, clip_eps=0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        _loss(x, x, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        _loss(x, x, adv, mask, ref_logp=x, kl_coef=-1.0)


def test_non_finite_inputs_and_empty_masks_are_errors():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="no valid"):
        masked_aggregate(logp, torch.zeros(2, 3, dtype=torch.bool), "token")
    with pytest.raises(ValueError, match="no valid"):
        masked_aggregate(logp, torch.zeros(2, 3, dtype=torch.bool), "sequence")
    kw = dict(clip_eps=0.2, aggregation="token", kl_coef=0.0)
    with pytest.raises(ValueError, match=r"advantages must be finite; rows \[1\]"):
        clipped_policy_loss(logp, logp, torch.tensor([1.0, float("nan")]), mask, **kw)
    old = logp.clone()
    old[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"old_logp must be finite on valid tokens; rows \[1\]"):
        clipped_policy_loss(logp, old, adv, mask, **kw)
    old[1, 0], old[1, 2] = 0.0, float("nan")  # on a padded position: not a valid token, so allowed
    loss, _ = clipped_policy_loss(logp, old, adv, mask, **kw)
    assert torch.isfinite(loss)
    beh = logp.clone()
    beh[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="behaviour_logp"):
        clipped_policy_loss(logp, logp, adv, mask, behaviour_logp=beh, **kw)
    live = logp.clone()
    live[0, 0] = float("nan")  # the live policy's NaN is left to the training loop's skip
    loss, _ = clipped_policy_loss(live, logp, adv, mask, **kw)
    assert torch.isnan(loss)
