"""Tests of the reconstructed ScalingRL DES and curriculum scheduler (rlcore/curriculum.py)."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.curriculum import (
    CurriculumScheduler,
    data_effectiveness_score,
    minmax_normalise,
    rank_normalise,
    reward_adaptability,
)

unit = st.floats(0.0, 1.0)
# the knobs the config sets (tasks/config/techniques.py CurriculumConfig) are required; these tests state their own
KNOBS = {"kappa": 0.1, "theta_lo": 0.3, "theta_hi": 0.7, "theta_learned": 0.9, "rho0": 0.2, "rho_step": 0.05}
DES = {"weights": (1 / 3, 1 / 3, 1 / 3), "difficulty_form": "peak"}


def _scheduler(pool_size, **kw):
    return CurriculumScheduler(pool_size, **(KNOBS | kw))


def _des(*args, **kw):
    return data_effectiveness_score(*args, **(DES | kw))


def _rank_oracle(x):
    n = len(x)
    if n == 1:
        return [0.5]
    return [(sum(v < xi for v in x) + (sum(v == xi for v in x) - 1) / 2) / (n - 1) for xi in x]


def test_rank_normalise_hand_worked_ties():
    # sorted [1, 2, 3, 3]: ranks 0, 1, and (2 + 3) / 2 = 2.5 for the tie; / (4 - 1)
    assert rank_normalise(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == pytest.approx([5 / 6, 0, 5 / 6, 1 / 3])
    assert rank_normalise(torch.tensor([7.0, 7.0])).tolist() == [0.5, 0.5]
    assert minmax_normalise(torch.tensor([2.0, 2.0])).tolist() == [0.5, 0.5]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5).map(float), min_size=1, max_size=30))
def test_rank_normalise_matches_loop(x):
    assert rank_normalise(torch.tensor(x)).tolist() == pytest.approx(_rank_oracle(x))


def test_des_hand_worked_minmax():
    p = torch.tensor([0.5, 0.9, 0.1], dtype=torch.float64)
    cot = torch.tensor([math.e - 1, 0.0, math.e**2 - 1], dtype=torch.float64)  # log1p -> [1, 0, 2]
    ada = torch.tensor([0.1, 0.3, 0.5], dtype=torch.float64)
    des, parts = _des(p, cot, ada, weights=(1, 1, 2), normalise="minmax")
    # peak D = 1 - 2|p - 0.5| = [1, 0.2, 0.2] -> [1, 0, 0]; C: [1, 0, 2] -> [0.5, 0, 1]; R -> [0, 0.5, 1]
    # weights / 4 = (0.25, 0.25, 0.5): DES = [0.25 * 1 + 0.25 * 0.5, 0.5 * 0.5, 0.25 * 1 + 0.5 * 1]
    #                                      = [0.375, 0.25, 0.75]
    assert parts["difficulty"].tolist() == pytest.approx([1, 0, 0])
    assert parts["cot_complexity"].tolist() == pytest.approx([0.5, 0, 1])
    assert parts["adaptability"].tolist() == pytest.approx([0, 0.5, 1])
    assert des.tolist() == pytest.approx([0.375, 0.25, 0.75])
    # monotone form 1 - p = [0.5, 0.1, 0.9] -> [0.5, 0, 1]
    _, parts_m = _des(p, cot, ada, difficulty_form="monotone", normalise="minmax")
    assert parts_m["difficulty"].tolist() == pytest.approx([0.5, 0, 1])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(unit, st.integers(0, 4000), st.floats(0, 0.5)), min_size=1, max_size=30),
    st.sampled_from(["rank", "minmax"]),
    st.sampled_from(["peak", "monotone"]),
)
def test_des_in_unit_interval(rows, normalise, form):
    p, cot, ada = (torch.tensor([r[i] for r in rows], dtype=torch.float64) for i in range(3))
    des, parts = _des(p, cot, ada, difficulty_form=form, normalise=normalise)
    assert des.shape == (len(rows),) and ((des >= 0) & (des <= 1 + 1e-12)).all()
    assert all(((v >= 0) & (v <= 1)).all() for v in parts.values())


def test_reward_adaptability_hand_worked():
    out = reward_adaptability([[], [0.5], [1.0], [0.2, 0.6], [0.0, 0.5, 1.0]])
    # []: 0.5 (unseen); [0.5]: sqrt(0.25) = 0.5; [1.0]: 0
    # [0.2, 0.6]: spread sqrt(0.6 * 0.4) = 0.489898, slope 0.4 -> 0.5 * 0.489898 + 0.5 * 0.4 = 0.444949
    # [0, 0.5, 1]: spread sqrt(1 * 0) = 0, slope 0.5 -> 0.5 * 0 + 0.5 * 0.5 = 0.25
    assert out.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.444949, 0.25], abs=1e-6)
    with pytest.raises(ValueError, match=r"history\[0\]"):
        reward_adaptability([[1.5]])


def test_scheduler_hand_worked():
    s = _scheduler(100, s_min=10, s_max=50, scale0=20, kappa=0.5, rho0=0.2, rho_step=0.1, window=2)
    assert s.update(0.9)["curriculum/scale"] == pytest.approx(30)  # mean 0.9 > 0.7: 20 * 1.5
    assert s.update(0.4)["curriculum/scale"] == pytest.approx(30)  # mean (0.9 + 0.4) / 2 = 0.65: hold
    assert s.update(0.1)["curriculum/scale"] == pytest.approx(15)  # mean 0.25 < 0.3: 30 * 0.5
    assert s.update(0.0)["curriculum/scale"] == pytest.approx(10)  # mean 0.05: 7.5, clipped to s_min
    assert s.update(0.5, heldout_accuracy=0.5)["curriculum/rho"] == pytest.approx(0.2)  # first held-out value
    assert s.update(0.5, heldout_accuracy=0.4)["curriculum/rho"] == pytest.approx(0.3)  # dropped: exploit more
    assert s.update(0.5, heldout_accuracy=0.6)["curriculum/rho"] == pytest.approx(0.2)  # rose: exploit less


def test_select_pool_hand_worked():
    s = _scheduler(6, s_min=1, s_max=6, scale0=4, rho0=0.5, theta_learned=0.9)
    des = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    seen = torch.tensor([True, False, True, False, False, True])
    success = torch.tensor([0.5, float("nan"), 0.95, float("nan"), float("nan"), 0.2])
    idx = s.select_pool(des, seen, success, torch.Generator().manual_seed(0))
    # n = 4, exploit = round(0.5 * 4) = 2 of the eligible {0, 5} (2 is learned: 0.95 >= 0.9);
    # explore = the 2 unseen with the highest DES: [1, 3]
    assert idx[:2].tolist() == [1, 3] and sorted(idx[2:].tolist()) == [0, 5]
    m = s.metrics()
    assert (m["curriculum/explore"], m["curriculum/exploit"]) == (2.0, 2.0)
    # rho = 0 but only one unseen prompt left: exploit fills the gap, then DES fills the rest
    s0 = _scheduler(6, s_min=1, s_max=6, scale0=4, rho0=0.0)
    seen1 = torch.tensor([True, True, True, False, True, True])
    succ1 = torch.tensor([0.95, 0.99, 0.1, 0.0, 1.0, 1.0])
    idx = s0.select_pool(des, seen1, succ1, torch.Generator().manual_seed(0))
    # explore [3]; exploit: eligible {2}; rest by DES among {0, 1, 4, 5}: [0, 1]
    assert idx.tolist() == [3, 2, 0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(unit, max_size=6), unit, unit, st.floats(10, 200), st.floats(0, 1))
def test_scale_monotone_in_accuracy_and_bounded(history, a1, a2, scale0, kappa):
    base = _scheduler(500, s_min=10, s_max=200, scale0=scale0, kappa=kappa, window=3)
    for a in history:
        base.update(a)
    lo, hi = copy.deepcopy(base), copy.deepcopy(base)
    lo.update(min(a1, a2))
    hi.update(max(a1, a2))
    assert lo.scale <= hi.scale
    assert 10 <= lo.scale <= 200 and 10 <= hi.scale <= 200


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.data())
def test_pool_distinct_in_range_and_respects_roles(m, seed, data):
    gen = torch.Generator().manual_seed(seed)
    s_max = data.draw(st.integers(1, 60))
    s = _scheduler(
        m, s_min=1, s_max=s_max, scale0=data.draw(st.integers(1, s_max)), rho0=data.draw(unit), theta_learned=0.8
    )
    des = torch.rand(m, generator=gen)
    seen = torch.rand(m, generator=gen) < 0.5
    success = torch.rand(m, generator=gen)
    idx = s.select_pool(des, seen, success, gen)
    assert idx.dtype == torch.long and len(idx) == min(m, round(s.scale))
    assert len(set(idx.tolist())) == len(idx) and all(0 <= i < m for i in idx.tolist())
    n_explore, n_exploit = s.last_explore, s.last_exploit
    assert not seen[idx[:n_explore]].any()
    exploit = idx[n_explore : n_explore + n_exploit]
    assert seen[exploit].all() and (success[exploit] < 0.8).all()


def test_state_round_trip():
    s = _scheduler(50, s_min=5, s_max=40, scale0=10, kappa=0.3, window=2)
    for acc, held in [(0.8, 0.5), (0.9, 0.4), (0.2, None)]:
        s.update(acc, held)
    des, seen, success = torch.rand(50), torch.arange(50) % 3 == 0, torch.rand(50)
    s.select_pool(des, seen, success, torch.Generator().manual_seed(0))
    t = _scheduler(50, s_min=5, s_max=40, scale0=20, kappa=0.3, window=2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() and t.metrics() == s.metrics()
    assert t.update(0.75, 0.45) == s.update(0.75, 0.45)
    assert torch.equal(
        t.select_pool(des, seen, success, torch.Generator().manual_seed(1)),
        s.select_pool(des, seen, success, torch.Generator().manual_seed(1)),
    )
    with pytest.raises(ValueError, match="pool"):
        _scheduler(10, s_min=1, s_max=5, scale0=2).load_state_dict(s.state_dict())


def test_errors():
    with pytest.raises(ValueError, match="s_min"):
        _scheduler(10, s_min=5, s_max=4, scale0=4)
    with pytest.raises(ValueError, match="train_accuracy"):
        _scheduler(10, s_min=1, s_max=5, scale0=2).update(1.5)
    with pytest.raises(ValueError, match="difficulty_form"):
        _des(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([0.1]), difficulty_form="x")
    with pytest.raises(ValueError, match="length 2"):
        _des(torch.tensor([0.5, 0.2]), torch.tensor([1.0]), torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="weights"):
        _des(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([0.1]), weights=(0, 0, 0))

