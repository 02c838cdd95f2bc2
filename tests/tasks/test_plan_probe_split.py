"""The plan's probe of the overlap's split (tasks/plan/probe_split.py): the size of its generate call."""

from hypothesis import given
from hypothesis import strategies as st

from tasks.plan.probe_split import split_prompts


def test_the_splits_call_is_half_the_baselines_and_never_smaller_than_the_small_one():
    assert split_prompts((3, 32)) == 16  # the default pool: plain GRPO's 32 prompts, the smallest first call 3
    assert split_prompts((8, 12)) == 8  # half of 12 is 6, under the small call
    assert split_prompts((1, 1)) == 1


@given(st.integers(1, 512), st.integers(1, 512))
def test_the_splits_call_lies_between_the_probes_two(small, extra):
    large = small + extra - 1
    assert small <= split_prompts((small, large)) <= large
