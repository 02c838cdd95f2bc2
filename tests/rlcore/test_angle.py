"""Tests of GAIN-RL angle concentration (rlcore/angle.py)."""

import math

import pytest
import torch

from rlcore.angle import angle_concentration, angle_order, online_angle_signal


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def _oracle(hidden, mask, prefix_len, suffix_len, inter_weight, include_diagonal):
    """Slow per-token double loop over the real tokens of each prompt."""
    intra, inter, score = [], [], []
    for b in range(hidden.shape[0]):
        toks = [hidden[b, t].double() for t in range(hidden.shape[1]) if mask[b, t]]
        n, m, s = int(prefix_len[b]), len(toks), int(suffix_len[b])
        question, prefix = list(range(n, m - s)), list(range(n))
        pairs = [(i, j) for i in question for j in question if include_diagonal or i != j]
        ci = sum(_cos(toks[i], toks[j]) for i, j in pairs) / len(pairs) if pairs else 0.0
        cross = [(i, j) for i in question for j in prefix]
        ce = sum(_cos(toks[i], toks[j]) for i, j in cross) / len(cross) if cross else 0.0
        intra.append(ci)
        inter.append(ce)
        score.append(ci + inter_weight * ce)
    return intra, inter, score


def _random_batch(seed: int, bsz: int = 4, t: int = 12, h: int = 6):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bsz, t, h, generator=gen)
    mask = torch.zeros(bsz, t, dtype=torch.bool)
    lengths = torch.randint(5, t + 1, (bsz,), generator=gen)
    for b in range(bsz):
        if b % 2:  # left padding
            mask[b, t - lengths[b] :] = True
        else:  # right padding
            mask[b, : lengths[b]] = True
    prefix = torch.tensor([int(torch.randint(0, int(lengths[b]) - 2, (1,), generator=gen)) for b in range(bsz)])
    suffix = torch.tensor([int(torch.randint(0, int(lengths[b] - prefix[b]), (1,), generator=gen)) for b in range(bsz)])
    return hidden, mask, prefix, suffix


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("include_diagonal", [True, False])
@pytest.mark.parametrize("inter_weight", [1.0, 8.0])
def test_matches_double_loop_oracle(seed, include_diagonal, inter_weight):
    hidden, mask, prefix, suffix = _random_batch(seed)
    out = angle_concentration(
        hidden, mask, prefix, suffix, inter_weight=inter_weight, include_diagonal=include_diagonal
    )
    intra, inter, score = _oracle(hidden, mask, prefix, suffix, inter_weight, include_diagonal)
    assert out.intra.tolist() == pytest.approx(intra, abs=1e-5)
    assert out.inter.tolist() == pytest.approx(inter, abs=1e-5)
    assert out.score.tolist() == pytest.approx(score, abs=1e-5)


def test_hand_worked():
    # tokens: prefix p = [1, 0]; question q1 = [1, 0], q2 = [0, 1]; then one pad token
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    mask = torch.tensor([[True, True, True, False]])
    out = angle_concentration(hidden, mask, prefix_len=1, inter_weight=1.0)
    # C_intra = (cos(q1,q1) + cos(q1,q2) + cos(q2,q1) + cos(q2,q2)) / 4 = (1 + 0 + 0 + 1) / 4 = 0.5
    # C_inter = (cos(q1,p) + cos(q2,p)) / 2 = (1 + 0) / 2 = 0.5; score = 0.5 + 1 * 0.5 = 1.0
    assert (out.intra.item(), out.inter.item(), out.score.item()) == pytest.approx((0.5, 0.5, 1.0))
    # official weight 8: 0.5 + 8 * 0.5 = 4.5; without the diagonal: (0 + 0) / 2 = 0
    assert angle_concentration(hidden, mask, 1, inter_weight=8.0).score.item() == pytest.approx(4.5)
    no_diag = angle_concentration(hidden, mask, 1, inter_weight=1.0, include_diagonal=False)
    assert no_diag.intra.item() == pytest.approx(0.0)


def test_identical_maximal_orthogonal_minimal_and_no_prefix():
    same = torch.ones(1, 4, 3)
    ortho = torch.eye(3).unsqueeze(0)
    full = torch.ones(1, 4, dtype=torch.bool)
    assert angle_concentration(same, full, inter_weight=1.0).intra.item() == pytest.approx(1.0)
    assert angle_concentration(same, full, inter_weight=1.0).inter.item() == 0.0  # no prefix -> C_inter = 0
    out = angle_concentration(ortho, torch.ones(1, 3, dtype=torch.bool), inter_weight=1.0, include_diagonal=False)
    assert out.intra.item() == pytest.approx(0.0)


def test_normalises_over_hidden_axis_scale_invariant():
    # rescaling one token's vector changes nothing (verl normalised over tokens, which would change it)
    hidden, mask, prefix, suffix = _random_batch(7)
    scaled = hidden.clone()
    scaled[:, 3] *= 10.0
    torch.testing.assert_close(
        angle_concentration(scaled, mask, prefix, suffix, inter_weight=1.0).score,
        angle_concentration(hidden, mask, prefix, suffix, inter_weight=1.0).score
    )


def test_padding_side_does_not_matter_and_bf16_works():
    gen = torch.Generator().manual_seed(1)
    seq = torch.randn(5, 8, generator=gen)
    right = torch.zeros(1, 7, 8)
    right[0, :5] = seq
    left = torch.zeros(1, 7, 8)
    left[0, 2:] = seq
    mr = torch.tensor([[True] * 5 + [False] * 2])
    ml = torch.tensor([[False] * 2 + [True] * 5])
    a = angle_concentration(right, mr, 2, 1, inter_weight=1.0)
    b = angle_concentration(left, ml, 2, 1, inter_weight=1.0)
    torch.testing.assert_close(a.score, b.score)
    c = angle_concentration(right.bfloat16(), mr, 2, 1, inter_weight=1.0)
    assert c.score.dtype == torch.float32 and c.score.item() == pytest.approx(a.score.item(), abs=2e-2)


def test_no_question_token_is_an_error():
    hidden, mask = torch.randn(2, 4, 3), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"prompts \[1\]"):
        angle_concentration(hidden, mask, torch.tensor([1, 3]), torch.tensor([0, 1]), inter_weight=1.0)
    with pytest.raises(ValueError, match="prefix_len"):
        angle_concentration(hidden, mask, torch.tensor([1, 1, 1]), inter_weight=1.0)
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        angle_concentration(torch.randn(4, 3), mask, inter_weight=1.0)


def test_angle_order_descending_ties_by_index():
    assert angle_order(torch.tensor([0.2, 0.9, 0.2, 0.5])).tolist() == [1, 3, 0, 2]


def test_online_signal_hand_worked():
    # real tokens [1,0], [1,0], [0,1] (+ one pad): lower-triangle pairs (1,0)=1, (2,0)=0, (2,1)=0 -> 1/3
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 3.0]]])
    mask = torch.tensor([[True, True, True, False]])
    assert online_angle_signal(hidden, mask).item() == pytest.approx(1 / 3)
    assert online_angle_signal(hidden[:, :1], mask[:, :1]).item() == 0.0  # one token: no pair


@pytest.mark.parametrize("seed", range(4))
def test_online_signal_matches_loop(seed):
    hidden, mask, _, _ = _random_batch(seed, bsz=3, t=10, h=5)
    out = online_angle_signal(hidden, mask)
    for b in range(3):
        toks = [hidden[b, t] for t in range(10) if mask[b, t]]
        vals = [_cos(toks[i], toks[j]) for i in range(len(toks)) for j in range(i)]
        assert out[b].item() == pytest.approx(sum(vals) / len(vals), abs=1e-5)
    assert not math.isnan(out.sum().item())


def test_non_finite_or_zero_hidden_states_are_refused_at_entry():
    """A NaN hidden state (bf16 overflow upstream) and an all-zero one (no direction, so no cosine, not even the
    diagonal's 1) are errors naming the row; the same values on padding are ignored."""
    hidden = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 0] = False
    nan, zero = hidden.clone(), hidden.clone()
    nan[1, 3, 2] = float("nan")
    zero[1, 2] = 0.0
    for fn in (lambda h: angle_concentration(h, mask, inter_weight=1.0), lambda h: online_angle_signal(h, mask)):
        with pytest.raises(ValueError, match=r"rows \[1\] are not finite"):
            fn(nan)
        with pytest.raises(ValueError, match=r"rows \[1\] have an all-zero hidden state"):
            fn(zero)
        padded = hidden.clone()
        padded[2, 0] = float("nan")
        out = fn(padded)
        assert bool(torch.isfinite(getattr(out, "score", out)).all())
