"""Evaluation results: paired comparison (exact McNemar, hand-worked p-values), JSON that round-trips, the
ledger rows and tracker metrics of one evaluation."""

import json

import pytest

from tasks.training.evaluate import EvalCell, EvalResult, flat_metrics, paired_change, table_rows


def ev(correct: list[int], ids: list[str] | None = None) -> EvalResult:
    cell = EvalCell(n=len(correct), greedy_acc=sum(correct) / len(correct))
    return EvalResult(overall=cell, by_level={}, by_source={}, k=0,
                      prompt_ids=tuple(ids or [f"p{i}" for i in range(len(correct))]),
                      greedy_correct=tuple(correct))


def result() -> EvalResult:
    """Levels 1, 3 and None (records without a level), two sources, avg@4."""
    return EvalResult(
        overall=EvalCell(n=6, greedy_acc=0.5, avg_at_k=0.375),
        by_level={1: EvalCell(n=2, greedy_acc=1.0, avg_at_k=0.875), 3: EvalCell(n=3, greedy_acc=1 / 3, avg_at_k=0.25),
                  None: EvalCell(n=1, greedy_acc=0.0, avg_at_k=0.0)},
        by_source={"arith": EvalCell(n=5, greedy_acc=0.6, avg_at_k=0.45), "gsm8k": EvalCell(n=1, greedy_acc=0.0,
                                                                                            avg_at_k=0.0)},
        k=4, prompt_ids=("a", "b", "c", "d", "e", "f"), greedy_correct=(1, 1, 1, 0, 0, 0),
        levels=(1, 1, 3, 3, 3, None))


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
    assert got.turned_right == right and got.turned_wrong == wrong
    assert got.mcnemar_p == pytest.approx(p)


def test_paired_change_needs_the_same_prompts():
    assert paired_change(ev([1, 0]), ev([1, 0], ["a", "b"])) is None  # other prompts


def test_eval_json_round_trip_keeps_int_and_none_levels(tmp_path):
    res = result()
    path = res.save(tmp_path / "eval_end.json")
    back = EvalResult.load(path)
    assert back == res
    assert list(back.by_level) == [1, 3, None]  # typed keys, in order
    assert back.levels == (1, 1, 3, 3, 3, None)  # each prompt's level, for the per-level comparison with the start
    saved = json.loads(path.read_text())  # what users (and MLflow) see
    assert saved["by_level"][2] == {"level": None, "n": 1, "greedy_acc": 0.0, "avg_at_k": 0.0}
    assert saved["by_source"]["arith"]["n"] == 5 and saved["overall"]["greedy_acc"] == 0.5
    greedy_only = EvalResult.from_json(ev([1, 0]).to_json())
    assert greedy_only.overall.avg_at_k is None and "avg_at_k" not in ev([1, 0]).to_json()["overall"]


def test_eval_json_in_the_old_format_is_refused_with_the_file_named(tmp_path):
    old = tmp_path / "eval_start.json"
    old.write_text(json.dumps({"overall": {"n": 1, "greedy_acc": 1.0}, "by_level": {"1": {"n": 1, "greedy_acc": 1.0}},
                               "by_source": {}, "k": 0, "prompt_ids": ["a"], "greedy_correct": [1]}))
    with pytest.raises(ValueError, match="eval_start.json"):
        EvalResult.load(old)


def test_table_rows_and_flat_metrics():
    rows = table_rows(result(), "end", 8)
    assert [r.grp for r in rows] == ["overall", "level_1", "level_3", "level_None", "source:arith", "source:gsm8k"]
    assert all(r.phase == "end" and r.step == 8 for r in rows) and rows[1].avg_at_k == 0.875
    m = flat_metrics(result(), "eval_end")
    assert m == {"eval_end/accuracy": 0.5, "eval_end/avg_at_k": 0.375, "eval_end/level_1/accuracy": 1.0,
                 "eval_end/level_3/accuracy": 1 / 3}
