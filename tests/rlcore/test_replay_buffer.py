import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.replay_buffer import ReplayBuffer, mix_counts
from rlcore.types import RolloutGroup


def make_group(pid: str, success_rate: float = 0.5, step: int = 0, g: int = 2, length: int = 3) -> RolloutGroup:
    seed = sum(map(ord, pid)) * 1000 + step
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(g, generator=gen) < 0.5).float()
    return RolloutGroup(
        prompt_id=pid,
        prompt_ids=torch.tensor([1, 2, 3]),
        completion_ids=torch.randint(0, 50, (g, length), generator=gen),
        completion_mask=torch.ones(g, length, dtype=torch.bool),
        rewards=rewards,
        advantages=rewards - rewards.mean(),
        behaviour_logp=-torch.rand(g, length, generator=gen),
        success_rate=success_rate,
        n_generated=4,
        step=step,
        extras={"note": [pid]},
    )


def same_group(a: RolloutGroup, b: RolloutGroup) -> bool:
    sa, sb = a.state(), b.state()
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        x, y = sa[k], sb[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


# ---------------------------------------------------------------- examples


def test_admission_filter_and_fifo_hand_worked():
    buf = ReplayBuffer(capacity=2, max_age=None)
    assert not buf.admit(make_group("solved", 1.0))
    assert not buf.admit(make_group("unsolved", 0.0))
    assert buf.admit(make_group("a", 0.25, step=0))
    assert buf.admit(make_group("b", 0.5, step=1))
    assert buf.admit(make_group("c", 0.75, step=2))  # evicts "a", the oldest
    assert buf.prompt_ids() == ["b", "c"] and len(buf) == 2
    assert buf.admit(make_group("b", 0.5, step=3))  # dedup: new "b" replaces old and becomes newest
    assert buf.prompt_ids() == ["c", "b"]
    assert buf.admit(make_group("d", 0.5, step=4))  # evicts "c"
    assert buf.prompt_ids() == ["b", "d"]
    assert "b" in buf and "c" not in buf


def test_sample_marks_copies_as_replayed():
    buf = ReplayBuffer(capacity=4, max_age=None)
    original = make_group("a", 0.5, step=3)
    buf.admit(original)
    (got,) = buf.sample(5, step=4, generator=torch.Generator().manual_seed(0))
    assert got.replayed_from == 3 and got.step == 3 and got.prompt_id == "a"
    assert torch.equal(got.behaviour_logp, original.behaviour_logp)
    got.behaviour_logp.add_(1.0)  # a copy: the stored group is not touched
    got.extras["note"].append("x")
    (again,) = buf.sample(1, step=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.behaviour_logp, original.behaviour_logp) and again.extras == {"note": ["a"]}
    original.rewards.add_(5.0)  # admit stored a copy too
    assert not torch.equal(again.rewards, original.rewards)


def test_max_age_drops_old_groups():
    # ages at step 5: a 5, b 3, c 2; max_age 3 -> "a" is dropped (5 > 3), b and c stay (3 and 2 <= 3)
    buf = ReplayBuffer(capacity=8, max_age=3)
    for pid, step in [("a", 0), ("b", 2), ("c", 3)]:
        buf.admit(make_group(pid, 0.5, step=step))
    assert buf.stats(5) == {"replay/size": 3.0, "replay/mean_age": (5 + 3 + 2) / 3, "replay/eligible": 2.0}
    got = buf.sample(10, step=5, generator=torch.Generator().manual_seed(0))
    assert sorted(g.prompt_id for g in got) == ["b", "c"]
    assert buf.prompt_ids() == ["b", "c"]


def test_capacity_zero_never_replays():
    buf = ReplayBuffer(capacity=0, max_age=None)
    assert not buf.admit(make_group("a", 0.5))
    assert len(buf) == 0
    assert buf.sample(4, step=1, generator=torch.Generator().manual_seed(0)) == []
    assert mix_counts(8, 0.5, available=len(buf)) == (8, 0)  # plain GRPO: every group fresh
    assert buf.stats(3) == {"replay/size": 0.0, "replay/mean_age": 0.0, "replay/eligible": 0.0}


def test_admit_refuses_replayed_group():
    buf = ReplayBuffer(capacity=2, max_age=None)
    buf.admit(make_group("a", 0.5, step=0))
    (rep,) = buf.sample(1, step=1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="fresh group"):
        buf.admit(rep)


def test_state_dict_survives_torch_save():
    buf = ReplayBuffer(capacity=3, max_age=5)
    for i in range(4):
        buf.admit(make_group(f"p{i}", 0.5, step=i))
    blob = io.BytesIO()
    torch.save(buf.state_dict(), blob)
    blob.seek(0)
    other = ReplayBuffer(capacity=3, max_age=5)
    other.load_state_dict(torch.load(blob, weights_only=False))
    assert other.prompt_ids() == buf.prompt_ids() == ["p1", "p2", "p3"]
    a = buf.sample(2, step=4, generator=torch.Generator().manual_seed(9))
    b = other.sample(2, step=4, generator=torch.Generator().manual_seed(9))
    assert all(same_group(x, y) for x, y in zip(a, b, strict=True))


def test_load_state_dict_checks_config():
    state = ReplayBuffer(capacity=3, max_age=None).state_dict()
    with pytest.raises(ValueError, match="capacity=3"):
        ReplayBuffer(capacity=4, max_age=None).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        ReplayBuffer(capacity=3, max_age=None).load_state_dict({**state, "version": 99})


@pytest.mark.parametrize(
    "kwargs",
    [{"capacity": -1, "max_age": None}, {"capacity": 1.5, "max_age": None}, {"capacity": 2, "max_age": -1},
     {"capacity": True, "max_age": None}],
)
def test_constructor_errors(kwargs):
    with pytest.raises(ValueError):
        ReplayBuffer(**kwargs)


# ---------------------------------------------------------------- mix_counts


def test_mix_counts_hand_worked():
    assert mix_counts(8, 0.5, available=0) == (8, 0)  # round 0 / empty buffer: all fresh
    assert mix_counts(8, 0.5, available=100) == (4, 4)
    assert mix_counts(8, 0.5, available=3) == (5, 3)  # short buffer refilled with fresh
    assert mix_counts(8, 0.5, available=3, refill=False) == (4, 3)  # official code: short batch
    assert mix_counts(5, 0.5, available=10) == (3, 2)  # round(2.5) = 3 fresh (halves up)
    assert mix_counts(8, 1.0, available=10) == (8, 0)
    with pytest.raises(ValueError, match="fresh_frac"):
        mix_counts(8, 0.0, available=1)
    with pytest.raises(ValueError, match="available"):
        mix_counts(8, 0.5, available=-1)


@given(st.integers(0, 64), st.floats(0.01, 1.0), st.integers(0, 100), st.booleans())
def test_mix_counts_properties(b, frac, available, refill):
    n_fresh, n_replay = mix_counts(b, frac, available, refill=refill)
    assert 0 <= n_replay <= available and n_fresh >= 0
    if refill or available == 0:
        assert n_fresh + n_replay == b
    else:
        assert n_fresh + n_replay <= b
    if available == 0:
        assert (n_fresh, n_replay) == (b, 0)


# ---------------------------------------------------------------- property tests against a list model

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 7), st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])),
        st.tuples(st.just("sample"), st.integers(0, 6), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5), st.one_of(st.none(), st.integers(0, 4)), ops)
def test_buffer_properties(capacity, max_age, operations):
    buf = ReplayBuffer(capacity, max_age=max_age)
    model: list[tuple[str, int]] = []  # (prompt id, step), oldest first
    step = 0
    for op, a, b in operations:
        if op == "step":
            step += a
        elif op == "admit":
            pid = f"p{a}"
            admitted = buf.admit(make_group(pid, b, step=step))
            should = capacity > 0 and 0.0 < b < 1.0
            assert admitted == should
            if should:
                model = [e for e in model if e[0] != pid] + [(pid, step)]
                model = model[-capacity:]
        else:
            gen = torch.Generator().manual_seed(b)
            got = buf.sample(a, step=step, generator=gen)
            if max_age is not None:
                model = [e for e in model if step - e[1] <= max_age]
            ids = [g.prompt_id for g in got]
            assert len(ids) == len(set(ids)) == min(a, len(model))  # no duplicates, as many as asked/can
            assert all(max_age is None or step - g.step <= max_age for g in got)  # no over-age group
            assert all(g.replayed_from == g.step for g in got)
            assert set(ids) <= {e[0] for e in model}
        assert len(buf) <= capacity
        # FIFO order
        assert [(pid, s) for pid, s in zip(buf.prompt_ids(), [e[1] for e in model], strict=False)] == model
        assert len(buf) == len(model)
        sd = buf.state_dict()
        assert all(0.0 < g["success_rate"] < 1.0 for g in sd["groups"])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 9), st.sampled_from([0.0, 0.3, 0.6, 1.0])), max_size=20),
    st.integers(0, 2**31 - 1),
    st.integers(0, 6),
)
def test_state_round_trip_gives_identical_samples(capacity, admits, seed, k):
    buf = ReplayBuffer(capacity, max_age=None)
    for i, (p, rate) in enumerate(admits):
        buf.admit(make_group(f"p{p}", rate, step=i))
    other = ReplayBuffer(capacity, max_age=None)
    other.load_state_dict(buf.state_dict())
    assert other.prompt_ids() == buf.prompt_ids()
    assert other.stats(30) == buf.stats(30)
    a = buf.sample(k, step=30, generator=torch.Generator().manual_seed(seed))
    b = other.sample(k, step=30, generator=torch.Generator().manual_seed(seed))
    assert len(a) == len(b) and all(same_group(x, y) for x, y in zip(a, b, strict=False))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(0, 8), st.integers(0, 2**31 - 1))
def test_sample_is_uniform_permutation_prefix(size, k, seed):
    # the draw is exactly randperm(size)[:k] over the FIFO order, so it is reproducible from the seed alone
    buf = ReplayBuffer(capacity=size, max_age=None)
    for i in range(size):
        buf.admit(make_group(f"p{i}", 0.5, step=i))
    got = [g.prompt_id for g in buf.sample(k, step=size, generator=torch.Generator().manual_seed(seed))]
    order = buf.prompt_ids()
    want = [order[i] for i in torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:k].tolist()]
    assert got == want
