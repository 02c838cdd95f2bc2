"""Tests of the bundled arithmetic task: determinism, disjoint splits, level mix, worked solutions, verifier."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.data import arith, arith_grade
from tasks.data.prompts import PromptRecord, prompt_id

_EXPR = re.compile(r"[0-9+\-*/%()]+")


def _python_value(question: str) -> int:
    """Oracle: Python evaluates the same expression with the same precedence and floor semantics."""
    assert question.endswith("=?")
    expr = question[:-2]
    assert _EXPR.fullmatch(expr), expr
    return eval(expr)  # noqa: S307 -- only digits, operators and parentheses (checked above)


def test_same_seed_same_records_other_seed_other_records():
    a = arith.generate(3, 300, "train")
    assert a == arith.generate(3, 300, "train")
    b = arith.generate(4, 300, "train")
    assert [r.question for r in a] != [r.question for r in b]
    assert len({r.question for r in a} & {r.question for r in b}) < 150


def test_splits_are_disjoint_and_follow_the_hash():
    train = arith.generate(0, 3000, "train", "uniform")
    test = arith.generate(0, 1000, "test", "uniform")
    assert {r.question for r in train}.isdisjoint({r.question for r in test})
    assert all(arith.split_of(r.question) == "train" and r.split == "train" for r in train)
    assert all(arith.split_of(r.question) == "test" and r.split == "test" for r in test)
    # other seeds draw other problems, but never cross the split either
    assert {r.question for r in arith.generate(9, 1000, "test")}.isdisjoint({r.question for r in train})


def test_unique_within_a_call_and_records_well_formed():
    recs = arith.generate(5, 2000, "train", "default")
    assert len({r.question for r in recs}) == 2000
    for r in recs:
        assert isinstance(r, PromptRecord)
        assert r.id == prompt_id(r.question, r.answer)
        assert r.source == "bundled:default" and r.reward == "arith" and r.level in arith.LEVELS
        assert len(r.question) + len(r.solution) <= arith.MAX_CHARS
        assert r.meta["steps"] == len(arith_grade.solution_steps(r))


def test_level_counts_largest_remainder_by_hand():
    # n=10 over weights 1,1,1: exact 3.33 each -> floors 3,3,3 (sum 9); the one left goes to the lowest level.
    assert arith.level_counts(10, {1: 1, 2: 1, 3: 1, 4: 0, 5: 0}) == {1: 4, 2: 3, 3: 3, 4: 0, 5: 0}
    # n=7 over 0.5/0.3/0.2: exact 3.5, 2.1, 1.4 -> floors 3,2,1 (sum 6); largest remainder .5 -> level 1.
    assert arith.level_counts(7, {1: 0.5, 2: 0.3, 3: 0.2}) == {1: 4, 2: 2, 3: 1}


@pytest.mark.parametrize("mix", ["default", "balanced", {1: 0.0, 2: 3, 3: 1, 4: 0, 5: 0}])
def test_level_mix_respected(mix):
    n = 1000
    recs = arith.generate(1, n, "train", mix)
    name, weights = arith.resolve_mix(mix)
    total = sum(weights.values())
    for level, w in weights.items():
        share = sum(r.level == level for r in recs) / n
        assert share == pytest.approx(w / total, abs=1 / n)
    assert {r.source for r in recs} == {f"bundled:{name}"}


def test_string_keys_from_config_files_are_accepted():
    assert arith.resolve_mix({"1": 1, "5": 2}) == ("custom", {1: 1.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 2.0})


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ({6: 1.0}, "mix key 6"),
        ({0: 1.0, 1: 1.0}, "mix key 0"),
        ({"hard": 1.0}, "mix key 'hard'"),
        ({1: -0.5}, "level 1"),
        ({2: "a lot"}, "level 2"),
        ({1: 0, 2: 0.0}, "all zero"),
        ({}, "all zero"),
        ("nope", "unknown arithmetic mix 'nope'"),
        ([1, 2], "must be a name"),
    ],
)
def test_bad_mix_is_a_clear_error(mix, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arith.generate(0, 10, "train", mix)


def test_bad_split_and_n():
    with pytest.raises(ValueError, match="split must be one of"):
        arith.generate(0, 10, "validation")
    with pytest.raises(ValueError, match="non-negative integer"):
        arith.generate(0, -1, "train")
    assert arith.generate(0, 0, "test") == []


def test_small_question_space_runs_out_when_unique():
    # level 1 is a+b or a-b with 1 <= a, b <= 40 and a >= b for a difference: 40*40 + 40*41/2 = 2420 questions
    space = [f"{a}+{b}=?" for a in range(1, 41) for b in range(1, 41)]
    space += [f"{a}-{b}=?" for a in range(1, 41) for b in range(1, a + 1)]
    assert len(set(space)) == 2420
    in_test = sum(arith.split_of(q) == "test" for q in space)
    assert 0.15 < in_test / 2420 < 0.25
    recs = arith.generate(0, in_test, "test", {1: 1})
    assert sorted(r.question for r in recs) == sorted(q for q in space if arith.split_of(q) == "test")
    with pytest.raises(ValueError, match="level 1 ran out of distinct test questions"):
        arith.generate(0, in_test + 1, "test", {1: 1})
    recs = arith.generate(0, 3000, "test", {1: 1}, unique=False)
    assert len(recs) == 3000 and len({r.question for r in recs}) <= in_test


def test_levels_get_harder_by_construction():
    recs = arith.generate(2, 2500, "train", "uniform")
    by_level = {lv: [r for r in recs if r.level == lv] for lv in arith.LEVELS}
    assert {r.meta["steps"] for r in by_level[1]} == {1}
    assert {r.meta["steps"] for r in by_level[2]} == {2}
    assert all("*" in r.question for r in by_level[3])
    assert all("//" in r.question or "%" in r.question for r in by_level[5])
    mean_len = [sum(len(r.solution) for r in by_level[lv]) / len(by_level[lv]) for lv in sorted(by_level)]
    assert mean_len[0] < mean_len[1] and mean_len[2] < mean_len[3]


def test_worked_solutions_are_correct_step_by_step():
    for r in arith.generate(8, 1500, "train", "uniform"):
        value = _python_value(r.question)
        assert r.answer == str(value) and value >= 0
        for line in arith_grade.solution_steps(r):
            lhs, rhs = line.split("=")
            assert _python_value(lhs + "=?") == int(rhs) >= 0, (r.question, line)
        assert r.solution.endswith(f"{arith.MARKER} {r.answer}")


def test_parentheses_are_kept_only_when_they_change_the_work():
    recs = [r for r in arith.generate(4, 2000, "train", {4: 1, 5: 1}) if "(" in r.question]
    assert len(recs) > 100
    for r in recs:
        # the same numbers and operators without the parentheses must do different operations
        tokens = re.findall(r"\d+|//|[+\-*%]", r.question[:-2].replace("(", "").replace(")", ""))
        nums, ops = [int(t) for t in tokens[::2]], tokens[1::2]
        flat_problem = arith._evaluate(nums, ops, None, 10**9)
        assert flat_problem is None or sorted(flat_problem.steps) != sorted(arith_grade.solution_steps(r)), r.question


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=-(2**40), max_value=2**40), split=st.sampled_from(["train", "test"]))
def test_any_seed_gives_verifiable_problems(seed, split):
    for r in arith.generate(seed, 15, split, "uniform"):
        assert r.split == split == arith.split_of(r.question)
        assert _python_value(r.question) == int(r.answer)
        assert arith_grade.verify(r.solution, r.answer) == 1.0
        assert arith_grade.verify(r.solution, str(int(r.answer) + 1)) == 0.0


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), level=st.sampled_from(sorted(arith.LEVELS)))
def test_draws_respect_the_level_rules(seed, level):
    spec = arith.LEVELS[level]
    p = arith.draw_problem(random.Random(seed), level)
    if p is None:  # a rejected draw: the generator draws again
        return
    assert spec.n_ops[0] <= len(p.steps) <= spec.n_ops[1]
    assert all(0 <= int(line.split("=")[1]) <= spec.max_value for line in p.steps)
    assert p.question.count("(") <= 1


def test_own_solutions_verify_and_wrong_answers_do_not():
    recs = arith.generate(6, 500, "test", "uniform")
    assert all(arith_grade.verify(r.solution, r.answer) == 1.0 for r in recs)
    assert all(arith_grade.verify(r.solution, str(int(r.answer) + 7)) == 0.0 for r in recs)


@pytest.mark.parametrize(
    ("completion", "extracted", "reward"),
    [
        ("7*3=21\n12+21=33\n#### 33", "33", 1.0),
        ("7*3=20\n13+20=33\n#### 33", "33", 0.0),  # a lucky answer: right, from a false line
        ("7*3=21\nso 12 and 21 make\n12+21=33\n#### 33", "33", 1.0),  # other lines are not checked
        ("7%0=1\n32+1=33\n#### 33", "33", 0.0),
        ("#### 33\n", "33", 1.0),
        ("####33", "33", 1.0),
        ("#### +33", "+33", 1.0),  # the same integer
        ("#### 033", "033", 1.0),
        ("#### 34", "34", 0.0),
        ("#### 33.0", "33.0", 0.0),  # not an integer literal
        ("#### 3 3", "3 3", 0.0),
        ("#### 12\n#### 33", "33", 1.0),  # the last marker counts
        ("#### 33\nQ: 1+1=?\n#### 2", "2", 0.0),
        ("12+21=33", None, 0.0),  # no marker
        ("so the answer is \\boxed{33}.", "33", 1.0),  # no marker: the last \\boxed{} counts
        ("\\boxed{12} then \\boxed{ 33 }", "33", 1.0),
        ("\\boxed{33}\n#### 34", "34", 0.0),  # the marker wins over a box
        ("\\boxed{}", None, 0.0),
        ("#### ", None, 0.0),
        ("", None, 0.0),
    ],
)
def test_extract_and_verify_by_hand(completion, extracted, reward):
    assert arith_grade.extract_answer(completion) == extracted
    assert arith_grade.verify(completion, "33") == reward


def test_verify_negative_reference():
    assert arith_grade.verify("#### -4", "-4") == 1.0
    assert arith_grade.verify("#### 4", "-4") == 0.0


def test_wrong_steps_counts_false_operation_lines_before_the_marker():
    assert arith_grade.wrong_steps("26*11=276\n276+34=310\n310//16=20\n#### 20") == 2  # 26*11 is 286, 310//16 is 19
    assert arith_grade.wrong_steps("26*11=286\n286+34=320\n320//16=20\n#### 20") == 0
    assert arith_grade.wrong_steps("9%4=1\n25-3=22\n#### 22\n2+2=5") == 0  # after the marker: not part of the work
    assert arith_grade.wrong_steps("\\boxed{33}") == 0


def test_solution_steps():
    assert arith_grade.solution_steps("7*3=21\n12+21=33\n#### 33") == ["7*3=21", "12+21=33"]
    assert arith_grade.solution_steps("#### 5") == []


@pytest.mark.parametrize(("question", "level", "answer", "steps", "value"), [
    ("50+2*11=?", 3, 72, ("50+2=52", "52*11=572"), 572),  # precedence ignored
    ("13+(7*5+42)=?", 4, 90, ("13+7=20", "20*5=100", "100+42=142"), 142),  # parentheses ignored too
])
def test_flawed_solution_goes_left_to_right(question, level, answer, steps, value):
    slip = arith.flawed_solution(question, level, answer)
    assert slip.question == question and slip.steps == steps and slip.value == value
    assert slip.solution.endswith(f"#### {value}")


@pytest.mark.parametrize(("question", "level", "answer"), [
    ("2*11+50=?", 3, 72),  # left to right is the right order
    ("12+7-3=?", 2, 16),  # only + and -: no slip possible
    ("5-9*1=?", 3, -4),  # the slip leaves the range (negative)
])
def test_flawed_solution_is_none_when_it_cannot_slip(question, level, answer):
    assert arith.flawed_solution(question, level, answer) is None


def test_flawed_solutions_always_give_a_wrong_answer():
    for r in arith.generate(3, 1500, "train", "uniform"):
        slip = arith.flawed_solution(r.question, r.level, int(r.answer))
        if r.level <= 2:
            assert slip is None
        elif slip is not None:
            assert slip.value != int(r.answer) and arith_grade.verify(slip.solution, r.answer) == 0.0
