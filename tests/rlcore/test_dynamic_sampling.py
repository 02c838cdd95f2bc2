"""DAPO's dynamic sampling bookkeeping (rlcore/dynamic_sampling.py): property tests against a slow loop."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.advantages import effective_mask
from rlcore.dynamic_sampling import BatchFiller, dynamic_rounds, is_informative
from rlcore.types import RolloutGroup


def group(rewards: list[float], pid: str = "p") -> RolloutGroup:
    g = len(rewards)
    return RolloutGroup(prompt_id=pid, prompt_ids=torch.tensor([1]), completion_ids=torch.zeros(g, 1, dtype=torch.long),
                        completion_mask=torch.ones(g, 1, dtype=torch.bool), rewards=torch.tensor(rewards),
                        advantages=torch.zeros(g), behaviour_logp=torch.zeros(0), success_rate=sum(rewards) / g,
                        n_generated=g, step=0)


def test_informative_matches_effective_mask():
    rows = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.25]]
    assert [is_informative(group(r)) for r in rows] == effective_mask(torch.tensor(rows)).tolist()


def test_hand_worked_filling():
    """Target 2, oversample 2: round 1 asks 4 prompts, keeps the one mixed group; round 2 asks 2, keeps one."""
    f = BatchFiller(target=2, oversample=2.0, max_rounds=3)
    assert f.request() == 4
    f.add([group([1, 1]), group([0, 1], "a"), group([0, 0]), group([1, 1])])
    assert not f.done and f.missing == 1 and f.request() == 2
    f.add([group([1, 0], "b"), group([0, 1], "c")])  # "c" is beyond the target: discarded
    assert f.done and [g.prompt_id for g in f.batch()] == ["a", "b"]
    assert f.metrics() == {"dynamic/rounds": 2.0, "dynamic/generated_groups": 6.0, "dynamic/discarded_groups": 4.0,
                           "dynamic/kept_groups": 2.0, "dynamic/discard_ratio": 4 / 6, "dynamic/filled": 1.0}


def test_cap_trains_on_last_round_when_nothing_is_informative():
    f = BatchFiller(target=3, oversample=1.0, max_rounds=2)
    f.add([group([1, 1])] * 3)
    f.add([group([0, 0], "z")] * 3)
    assert f.done and f.kept == [] and [g.prompt_id for g in f.batch()] == ["z"] * 3
    assert f.metrics()["dynamic/filled"] == 0.0


@pytest.mark.parametrize("bad", [dict(target=-1), dict(oversample=0.5), dict(max_rounds=0)])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        BatchFiller(**({"target": 2, "oversample": 1.0, "max_rounds": 1} | bad))


@settings(max_examples=200, deadline=None)
@given(target=st.integers(0, 12), oversample=st.floats(1.0, 4.0), max_rounds=st.integers(1, 5),
       outcomes=st.lists(st.lists(st.booleans(), min_size=0, max_size=40), min_size=5, max_size=5))
def test_filler_matches_a_slow_loop(target, oversample, max_rounds, outcomes):
    """Whatever the rounds bring: never more than target kept, every kept group informative, the cap holds,
    every generated group is kept or discarded, and the requests follow ceil(oversample * missing)."""
    f = BatchFiller(target, oversample, max_rounds)
    kept_oracle, rounds = [], 0
    while not f.done:
        want = f.request()
        assert want == math.ceil(oversample * (target - len(kept_oracle)))
        flags = outcomes[rounds][:want]
        groups = [group([0.0, 1.0] if inf else [1.0, 1.0], f"{rounds}-{i}") for i, inf in enumerate(flags)]
        f.add(groups)
        for g in groups:  # the slow oracle
            if len(kept_oracle) < target and is_informative(g):
                kept_oracle.append(g.prompt_id)
        rounds += 1
    assert [g.prompt_id for g in f.kept] == kept_oracle
    assert len(f.kept) <= target and all(is_informative(g) for g in f.kept)
    assert f.rounds <= max_rounds and (len(f.kept) == target or f.rounds == max_rounds)
    assert f.generated_groups == len(f.kept) + f.discarded_groups


def slow_rounds(missing: int, r: float, oversample: float, rounds: int) -> tuple[float, float]:
    """(prompts asked, groups still missing) expected, every yield of every round enumerated."""
    if missing == 0 or rounds == 0:
        return 0.0, float(missing)
    ask = math.ceil(oversample * missing - 1e-9)
    asked, left = float(ask), 0.0
    for y in range(ask + 1):
        p = math.comb(ask, y) * r ** y * (1 - r) ** (ask - y)
        a, m = slow_rounds(max(missing - y, 0), r, oversample, rounds - 1)
        asked, left = asked + p * a, left + p * m
    return asked, left


def test_dapo_rounds_hand_worked_and_against_every_yield():
    # one group wanted, a coin a prompt, one prompt a round, two rounds: 1 + 1/2 asked, 3/4 found
    assert dynamic_rounds(1, 0.5, 1.0, 2) == pytest.approx((1.5, 0.75, 0.0))
    # two prompts a round, three rounds: 2 + 2/4 + 2/16 asked; each round misses with 1/4
    asked, kept, seconds = dynamic_rounds(1, 0.5, 2.0, 3, round_s=lambda ask: 10.0 + ask)
    assert (asked, kept) == pytest.approx((2.625, 1 - 0.25 ** 3))
    assert seconds == pytest.approx(12.0 + 0.25 * 12.0 + 0.0625 * 12.0)  # a round's seconds as often as it runs
    assert dynamic_rounds(4, 1.0, 2.0, 3) == pytest.approx((8.0, 4.0, 0.0))  # every group informative: one round
    assert dynamic_rounds(4, 0.0, 2.0, 3) == pytest.approx((24.0, 0.0, 0.0))  # none: every round in vain
    for b, r, o, rounds in ((4, 0.3, 2.0, 3), (6, 0.7, 1.5, 2), (3, 0.45, 1.0, 4)):
        asked, left = slow_rounds(b, r, o, rounds)
        assert dynamic_rounds(b, r, o, rounds)[:2] == pytest.approx((asked, b - left), rel=1e-12)
