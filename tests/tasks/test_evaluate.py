"""Paired comparison of two evaluations (exact McNemar), with hand-worked p-values."""

import pytest

from tasks.training.evaluate import paired_change


def ev(correct: list[int], ids: list[str] | None = None) -> dict:
    return {"prompt_ids": ids or [f"p{i}" for i in range(len(correct))], "greedy_correct": correct}


@pytest.mark.parametrize(("before", "after", "right", "wrong", "p"), [
    # 5 turned right, none wrong: two-sided 2 * (1/2)^5
    ([0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], 5, 0, 0.0625),
    # 3 right, 1 wrong: 2 * P(X <= 1 | n=4) = 2 * (1 + 4) / 16
    ([0, 0, 0, 1, 1], [1, 1, 1, 0, 1], 3, 1, 0.625),
    # nothing changed: no evidence either way
    ([1, 0, 1], [1, 0, 1], 0, 0, 1.0),
])
def test_paired_change_hand_worked(before, after, right, wrong, p):
    got = paired_change(ev(before), ev(after))
    assert got["turned_right"] == right and got["turned_wrong"] == wrong
    assert got["mcnemar_p"] == pytest.approx(p)


def test_paired_change_needs_the_same_prompts():
    assert paired_change(ev([1, 0]), ev([1, 0], ["a", "b"])) is None  # other prompts
    assert paired_change({"overall": {}}, ev([1])) is None  # an evaluation saved before per-prompt results
