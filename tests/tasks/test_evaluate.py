"""Evaluation results: hand-worked greedy accuracy, avg@k and pass@k, paired comparison (exact McNemar, hand-worked
p-values), JSON that round-trips, the ledger rows, tracker metrics and table of one evaluation."""

import json

import pytest
import torch

from tasks.data.prompts import PromptRecord, prompt_id
from tasks.evaluation.heldout import EvalCell, EvalResult, evaluate, flat_metrics, paired_change, table_rows
from tasks.evaluation.report import eval_table
from tasks.generation.rollout import Generation
from tasks.model.loading import build_tokenizer
from tasks.policy import Policy


def ev(correct: list[int], ids: list[str] | None = None) -> EvalResult:
    cell = EvalCell(n=len(correct), greedy_acc=sum(correct) / len(correct))
    return EvalResult(overall=cell, by_level={}, by_source={}, k=0,
                      prompt_ids=tuple(ids or [f"p{i}" for i in range(len(correct))]),
                      greedy_correct=tuple(correct))


def result() -> EvalResult:
    """Levels 1, 3 and None (records without a level), two sources, avg@4."""
    return EvalResult(
        overall=EvalCell(n=6, greedy_acc=0.5, avg_at_k=0.375, pass_at_k=0.5),
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
    assert rows[0].pass_at_k == 0.5 and rows[1].pass_at_k is None
    m = flat_metrics(result(), "eval_end")
    assert m == {"eval_end/accuracy": 0.5, "eval_end/avg_at_k": 0.375, "eval_end/pass_at_k": 0.5,
                 "eval_end/level_1/accuracy": 1.0, "eval_end/level_3/accuracy": 1 / 3}


class ScriptedEngine:
    """A rollout engine that answers from a script: prompt b's greedy answer and its k sampled answers."""

    def __init__(self, greedy: list[str], sampled: list[list[str]]):
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> Generation:
        texts = [f"\\boxed{{{a}}}" for a in (self.greedy if greedy else [x for row in self.sampled for x in row])]
        assert len(texts) == len(prompts) * n
        ids = torch.zeros(len(texts), 1, dtype=torch.long)
        return Generation(prompt_ids=[torch.zeros(1, dtype=torch.long)] * len(prompts), completion_ids=ids,
                          completion_mask=torch.ones_like(ids, dtype=torch.bool), texts=texts, n=n,
                          logprobs=torch.zeros(ids.shape))

    def sync_weights(self, model, tokenizer, folder) -> float:
        return 0.0


def test_evaluate_hand_worked_greedy_avg_and_pass_at_k():
    """Three prompts (answers 1, 2, 3), k = 4 samples each. Right samples 2/4, 0/4 and 4/4: avg@4 = (0.5 + 0 + 1) / 3
    = 0.5; at least one right on prompts 1 and 3: pass@4 = 2/3. Greedy right on prompt 2 only: 1/3."""
    recs = [PromptRecord(id=prompt_id(f"q{a}", str(a)), source="t", split="test", question=f"q{a}", answer=str(a),
                         level=lv) for a, lv in ((1, 1), (2, 1), (3, 2))]
    engine = ScriptedEngine(greedy=["9", "2", "9"], sampled=[["1", "0", "1", "0"], ["0"] * 4, ["3"] * 4])
    res = evaluate(Policy(model=None, tokenizer=build_tokenizer(), engine=engine), recs, samples=4, seed=0, workers=1)
    assert res.overall == EvalCell(n=3, greedy_acc=pytest.approx(1 / 3), avg_at_k=0.5, pass_at_k=pytest.approx(2 / 3))
    assert res.by_level[1] == EvalCell(n=2, greedy_acc=0.5, avg_at_k=0.25, pass_at_k=0.5)
    assert res.by_level[2] == EvalCell(n=1, greedy_acc=0.0, avg_at_k=1.0, pass_at_k=1.0)
    assert res.greedy_correct == (0, 1, 0)
    greedy_only = evaluate(Policy(model=None, tokenizer=build_tokenizer(), engine=engine), recs, samples=0, seed=0,
                           workers=1)
    assert greedy_only.overall == EvalCell(n=3, greedy_acc=pytest.approx(1 / 3))


def test_eval_table_shows_avg_and_pass_at_k_before_and_after():
    table = eval_table(result(), result()).splitlines()
    assert table[0] == ("| group | n | greedy before | greedy after | avg@4 before | avg@4 after | pass@4 before | "
                        "pass@4 after |")
    assert table[2] == "| overall | 6 | 0.500 | 0.500 | 0.375 | 0.375 | 0.500 | 0.500 |"
    assert table[3].endswith("| 0.875 | 0.875 | nan | nan |")  # a cell without pass@k (an older file) shows nan


def test_eval_table_lists_levels_only_where_the_prompts_have_them():
    """Mixed levels (1, 3 and None) get a row each; a set without levels (GSM8K alone) gets none, rather than a
    "level None" row that repeats the overall one."""
    groups = [line.split(" | ")[0] for line in eval_table(result(), result()).splitlines()[2:]]
    assert groups == ["| overall", "| level 1", "| level 3", "| level None", "| source arith", "| source gsm8k"]
    cell = EvalCell(n=1, greedy_acc=0.0, avg_at_k=0.0)
    flat = EvalResult(overall=cell, by_level={None: cell}, by_source={"gsm8k": cell}, k=4, prompt_ids=("f",),
                      greedy_correct=(0,), levels=(None,))
    assert [line.split(" | ")[0] for line in eval_table(flat, flat).splitlines()[2:]] == ["| overall", "| source gsm8k"]
