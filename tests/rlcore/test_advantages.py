import math

import pytest
import torch

from rlcore.advantages import effective_mask, group_advantages


def test_mean_only_hand_worked():
    # group 0: rewards 1,0,0,1 -> mean 0.5 -> A = +0.5,-0.5,-0.5,+0.5
    # group 1: rewards 1,0,0,0 -> mean 0.25 -> A = 0.75,-0.25,-0.25,-0.25
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]])
    assert torch.equal(group_advantages(r, scale_by_std=False), expected)


def test_scaled_by_population_std_hand_worked():
    # rewards 1,0,0,0: mean 0.25, population var = 0.25*0.75 = 0.1875, std = sqrt(0.1875) = 0.4330127
    # A = (r - 0.25) / (0.4330127 + eps)
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    std = math.sqrt(0.1875)
    a = group_advantages(r, scale_by_std=True, eps=1e-6)
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]], dtype=torch.float64) / (std + 1e-6)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)


def test_scaled_unbiased_std_option():
    # unbiased var of 1,0,0,0 = (0.5625 + 3*0.0625) / 3 = 0.25 -> std 0.5; A = (r - 0.25) / (0.5 + 1e-4)
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    a = group_advantages(r, scale_by_std=True, eps=1e-4, unbiased_std=True)
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]], dtype=torch.float64) / 0.5001
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)


def test_equal_rewards_give_zero_advantage_both_forms():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]])
    assert torch.all(group_advantages(r, scale_by_std=False) == 0)
    assert torch.all(group_advantages(r, scale_by_std=True) == 0)


def test_group_of_one_is_zero_and_finite():
    r = torch.tensor([[1.0], [0.0]])
    assert torch.equal(group_advantages(r, scale_by_std=True), torch.zeros(2, 1))


def test_integer_rewards_cast_to_float():
    a = group_advantages(torch.tensor([[1, 0]]), scale_by_std=False)
    assert a.is_floating_point()
    assert torch.equal(a, torch.tensor([[0.5, -0.5]]))


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_oracle(scale, seed):
    g = torch.Generator().manual_seed(seed)
    b, n = 7, 5
    r = torch.randint(0, 3, (b, n), generator=g).double() / 2
    out = group_advantages(r, scale_by_std=scale, eps=1e-6)
    for i in range(b):
        row = r[i].tolist()
        mean = sum(row) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / n)
        for j in range(n):
            want = (row[j] - mean) / (std + 1e-6) if scale else row[j] - mean
            assert abs(out[i, j].item() - want) < 1e-12


def test_effective_mask_hand_worked():
    r = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.6]])
    assert effective_mask(r).tolist() == [True, False, False, True]
    assert effective_mask(r).dtype == torch.bool


def test_effective_mask_loop_oracle():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 2, (50, 4), generator=g).float()
    want = [len(set(row)) > 1 for row in r.tolist()]
    assert effective_mask(r).tolist() == want


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(2, 3, 4), torch.zeros(2, 0)])
def test_bad_shapes_raise(bad):
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(bad, scale_by_std=False)


def test_bad_eps_and_unbiased_single_raise():
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 3), scale_by_std=True, eps=0.0)
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.zeros(2, 1), scale_by_std=True, unbiased_std=True)


def test_equal_but_unrepresentable_rewards_give_exactly_zero():
    r = torch.full((2, 8), 1.075, dtype=torch.float32)  # the float32 mean of eight 1.075s is not 1.075
    r[1] = torch.tensor([1.075] * 4 + [0.0] * 4)
    assert r[0].mean() != r[0, 0]  # the rounding the fix is about
    for scale in (True, False):
        adv = group_advantages(r, scale_by_std=scale)
        assert torch.equal(adv[0], torch.zeros(8))
        assert adv[1].abs().min() > 0.4  # a real spread is untouched


@pytest.mark.parametrize("fn", [lambda r: group_advantages(r, scale_by_std=True), effective_mask])
def test_non_finite_rewards_are_an_error_naming_the_place(fn):
    r = torch.zeros(3, 4)
    r[2] = float("nan")  # an all-NaN group: neither effective nor not
    with pytest.raises(ValueError, match="group 2, rollout 0"):
        fn(r)
    r[2] = torch.tensor([0.0, 1.0, float("inf"), 0.0])
    with pytest.raises(ValueError, match="1 are not, the first at group 2, rollout 2"):
        fn(r)


def test_solved_anchor_by_hand():
    from rlcore.advantages import solved_anchor

    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale_by_std=False)
    out = solved_anchor(rewards, adv, 0.1)
    # only the all-correct group changes: 0 -> 0.1 for each rollout; all-wrong stays 0, mixed keeps r - mean
    torch.testing.assert_close(out, torch.tensor([[0.1, 0.1, 0.1], [1 / 3, -2 / 3, 1 / 3], [0.0, 0.0, 0.0]]))
    assert solved_anchor(rewards, adv, 0.0) is adv  # off: GRPO's advantages, untouched
    with pytest.raises(ValueError, match="differ in shape"):
        solved_anchor(rewards, adv[:2], 0.1)


def test_solved_mask_by_hand():
    from rlcore.advantages import solved_mask

    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    assert solved_mask(rewards).tolist() == [True, False, False, False]
    assert solved_mask(rewards, solved_reward=0.5).tolist() == [False, False, False, True]
