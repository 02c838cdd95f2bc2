"""Source adapters: every format on real slices, and robust ingest of messy files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.data.prompts import prompt_id
from tasks.data.sources import FORMATS, check_paths, dedupe, guess_format, read_source, split_from_name

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "sources"
DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# --- formats on real slices -------------------------------------------------------------------

def test_guess_format_from_content(tmp_path):
    assert guess_format(FIX / "gsm8k_train.jsonl") == "gsm8k"
    assert guess_format(FIX / "math_train.jsonl") == "math"
    assert guess_format(FIX / "math500_test.jsonl") == "math500"
    assert guess_format(FIX / "humaneval_slice.jsonl.gz") == "humaneval"
    # content wins over the name; a malformed first line does not hide the format
    odd = tmp_path / "data.txt"
    odd.write_text("{not json\n" + (FIX / "gsm8k_train.jsonl").read_text())
    assert guess_format(odd) == "gsm8k"
    generic = tmp_path / "g.jsonl"
    generic.write_text('{"question": "1+1?", "answer": "2"}\n')
    assert guess_format(generic) == "jsonl"
    assert guess_format(tmp_path) == "hf"
    assert set(FORMATS) == {"gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf"}


def test_gsm8k():
    records, rejected = read_source(FIX / "gsm8k_train.jsonl")
    raw = lines(FIX / "gsm8k_train.jsonl")
    assert rejected == [] and len(records) == len(raw) == 14
    first = records[0]
    assert first.answer == "72" and first.reward == "numeric" and first.split == "train"
    assert first.solution.endswith("72 clips altogether in April and May.")  # reasoning, no '####'
    assert first.id == prompt_id(raw[0]["question"], "72")
    assert records[12].answer == "1080"  # '#### 1,080', comma stripped
    assert records[13].answer == "-7"
    assert [r.meta["line"] for r in records] == list(range(1, 15))


def test_math_boxed_answer_and_level():
    records, rejected = read_source(FIX / "math_train.jsonl")
    assert rejected == [] and len(records) == 10
    assert [r.answer for r in records[:2]] == ["0", "98"]
    assert records[5].answer == "(3, -1)" and records[6].answer == "[0,3)"
    assert records[9].answer == r"k = \frac{-33}{2}"  # nested braces inside the box
    assert [r.level for r in records] == [5, 5, 3, 3, 3, 4, 5, 1, None, 4]  # "Level ?" -> None
    assert records[0].meta["type"] == "Algebra" and records[0].reward == "math"


def test_math500_and_humaneval_slices():
    records, rejected = read_source(FIX / "math500_test.jsonl")
    assert rejected == [] and len(records) == 5
    assert records[0].answer == r"\left( 3, \frac{\pi}{2} \right)" and records[0].level == 2
    assert records[0].split == "test" and records[0].meta["unique_id"] == "test/precalculus/807.json"
    records, rejected = read_source(FIX / "humaneval_slice.jsonl.gz")
    assert rejected == [] and len(records) == 3
    he = records[0]
    assert he.reward == "code" and he.split == "test" and he.meta["entry_point"] == "has_close_elements"
    assert he.answer.lstrip().startswith("METADATA") and "def check(candidate)" in he.answer
    assert he.meta["canonical_solution"] == he.solution and he.question.startswith("from typing import List")


def test_real_math500_all_rows():
    path = DATA / "math500" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    records, rejected = read_source(path)
    assert len(records) == 500 and rejected == []
    assert sorted({r.level for r in records}) == [1, 2, 3, 4, 5]
    assert len({r.id for r in records}) == 500


def test_split_from_name(tmp_path):
    assert split_from_name("gsm8k/train.jsonl", "gsm8k") == "train"
    assert split_from_name("x/my-test.jsonl", "jsonl") == "test"
    assert split_from_name("contest.jsonl", "jsonl") == "train"  # 'test' must be a word
    assert split_from_name("HumanEval.jsonl.gz", "humaneval") == "test"
    records, _ = read_source(FIX / "gsm8k_train.jsonl", split="test")
    assert {r.split for r in records} == {"test"}


# --- messy input ------------------------------------------------------------------------------

def test_messy_jsonl_keeps_good_rows_and_names_file_and_line(tmp_path):
    good = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    rows = [
        json.dumps(good[0]).encode(),                                   # 1 ok
        b'{"question": "broken", "answer": ',                           # 2 malformed JSON
        json.dumps({"question": "no answer"}).encode(),                 # 3 missing field
        json.dumps({"question": "q", "answer": "  "}).encode(),         # 4 empty field
        b'{"question": "caf\xe9?", "answer": "1"}',                     # 5 latin-1 byte, not UTF-8
        b"",                                                            # 6 blank: not a row
        json.dumps({"question": "big", "answer": "1", "pad": "x" * 5000}).encode(),  # 7 oversized
        json.dumps({"question": "q7", "answer": "seven-ish"}).encode(),  # 8 unparsable numeric
        b"[1, 2, 3]",                                                   # 9 not an object
        json.dumps(good[1]).encode(),                                   # 10 ok
        json.dumps({"question": "q", "answer": ["a", "b"]}).encode(),   # 11 not text
        json.dumps(good[2]).encode(),                                   # 12 ok, last line unterminated
    ]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(rows))
    records, rejected = read_source(path, fmt="jsonl", reward="numeric", max_row_bytes=2000)
    assert [r.meta["line"] for r in records] == [1, 10, 12]
    assert [r.answer for r in records] == ["0", "2", "4"]
    reasons = {r.line: r.reason for r in rejected}
    assert sorted(reasons) == [2, 3, 4, 5, 7, 8, 9, 11]
    assert reasons[2].startswith("train.jsonl:2: malformed JSON")
    assert reasons[3] == "train.jsonl:3: missing field 'answer'"
    assert reasons[4] == "train.jsonl:4: empty field 'answer'"
    assert reasons[5].startswith("train.jsonl:5: not valid UTF-8")
    assert reasons[7].startswith("train.jsonl:7: oversized row (") and "max_row_bytes=2000" in reasons[7]
    assert reasons[8].startswith("train.jsonl:8: answer the 'numeric' verifier cannot parse")
    assert reasons[9] == "train.jsonl:9: not a JSON object (got list)"
    assert reasons[11] == "train.jsonl:11: field 'answer' is not text (got list)"
    by_line = {r.line: r for r in rejected}
    assert by_line[5].raw == '{"question": "caf\\xe9?", "answer": "1"}'  # kept, bad byte escaped
    assert by_line[2].source == str(path)


def test_oversized_row_without_newline_is_streamed(tmp_path):
    path = tmp_path / "train.jsonl"
    huge = json.dumps({"question": "q", "answer": "1", "pad": "x" * 300_000})
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n" + huge)
    records, rejected = read_source(path, fmt="jsonl", reward="numeric", max_row_bytes=1000)
    assert len(records) == 1 and len(rejected) == 1
    assert rejected[0].line == 2 and len(rejected[0].raw) <= 10_000


def test_format_specific_rejects(tmp_path):
    gsm = tmp_path / "gsm_train.jsonl"
    gsm.write_text(json.dumps({"question": "q", "answer": "no marker 5"}) + "\n"
                   + json.dumps({"question": "q2", "answer": "so\n#### 12"}) + "\n")
    records, rejected = read_source(gsm, fmt="gsm8k")
    assert len(records) == 1 and rejected[0].reason == "gsm_train.jsonl:1: no '####' final answer in field 'answer'"
    math = tmp_path / "math_train.jsonl"
    math.write_text(json.dumps({"problem": "p", "solution": "It is 4.", "level": "Level 2"}) + "\n")
    records, rejected = read_source(math, fmt="math")
    assert records == [] and "no \\boxed{...} answer" in rejected[0].reason


# --- generic formats: jsonl, parquet, saved datasets folders -----------------------------------

ROWS = [{"prob": "Compute $1/2 + 1/4$.", "final": r"\frac{3}{4}", "work": "Add.", "lvl": 2},
        {"prob": "Compute $2^3$.", "final": "8", "work": "", "lvl": 9},
        {"prob": "Bad row", "final": None, "work": "", "lvl": 1}]
MAP = {"question": "prob", "answer": "final", "solution": "work", "level": "lvl"}


def check_generic(records, rejected, label):
    assert [r.answer for r in records] == [r"\frac{3}{4}", "8"]
    assert records[0].solution == "Add." and [r.level for r in records] == [2, None]  # 9 is out of 1..5
    assert all(r.reward == "math" for r in records)
    assert len(rejected) == 1 and rejected[0].reason == f"{label}:3: missing field 'final'"


def test_generic_jsonl_with_field_map(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    check_generic(*read_source(path, fields=MAP), "mine.jsonl")


def test_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "mine_test.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert guess_format(path) == "parquet"
    records, rejected = read_source(path, fields=MAP)
    check_generic(records, rejected, "mine_test.parquet")
    assert {r.split for r in records} == {"test"}


def test_saved_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    check_generic(*read_source(tmp_path / "single", fields=MAP), "single")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                               "test": datasets.Dataset.from_list(ROWS[1:2])})
    dd.save_to_disk(str(tmp_path / "dd"))
    records, rejected = read_source(tmp_path / "dd", fields=MAP)
    assert rejected == [] and sorted((r.split, r.answer) for r in records) == [("test", "8"), ("train", r"\frac{3}{4}")]
    records, _ = read_source(tmp_path / "dd", fields=MAP, split="test")
    assert [r.answer for r in records] == ["8"]
    with pytest.raises(ValueError, match="split 'dev' not in"):
        read_source(tmp_path / "dd", fields=MAP, split="dev")


def test_generic_code_rows_need_an_entry_point(tmp_path):
    path = tmp_path / "code.jsonl"
    row = {"question": "def f():\n", "answer": "def check(c):\n    assert c() == 1\n", "ep": "f"}
    path.write_text(json.dumps(row) + "\n")
    records, rejected = read_source(path, reward="code", fields={"entry_point": "ep"})
    assert len(records) == 1 and records[0].meta["entry_point"] == "f"
    records, rejected = read_source(path, reward="code")
    assert records == [] and "needs an entry point" in rejected[0].reason


# --- paths, arguments, dedupe -----------------------------------------------------------------

def test_check_paths_names_every_missing_path(tmp_path):
    (tmp_path / "here.jsonl").write_text("")
    with pytest.raises(FileNotFoundError) as err:
        check_paths([tmp_path / "here.jsonl", tmp_path / "a.jsonl", tmp_path / "b_dir"])
    msg = str(err.value)
    assert "2 source path(s) not found" in msg and "a.jsonl" in msg and "b_dir" in msg and "here" not in msg
    with pytest.raises(FileNotFoundError):
        read_source(tmp_path / "nope.jsonl")


def test_bad_arguments(tmp_path):
    path = FIX / "gsm8k_train.jsonl"
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        read_source(path, fmt="csv")
    with pytest.raises(ValueError, match="unknown reward kind"):
        read_source(path, reward="fuzzy")
    with pytest.raises(ValueError, match="unknown fields keys"):
        read_source(path, fmt="jsonl", fields={"prompt": "question"})
    with pytest.raises(ValueError, match="generic formats"):
        read_source(path, fields={"question": "q"})
    with pytest.raises(ValueError, match="does not fit folder"):
        read_source(tmp_path, fmt="jsonl")


def test_dedupe_within_and_across_files(tmp_path):
    a = tmp_path / "a_train.jsonl"
    b = tmp_path / "b_train.jsonl"
    row = {"question": "1+1?", "answer": "2"}
    a.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n" + json.dumps({"question": "2+2?", "answer": "4"}))
    b.write_text(json.dumps(row) + "\n")
    ra, _ = read_source(a, reward="numeric")
    rb, _ = read_source(b, reward="numeric")
    unique, dups = dedupe(ra + rb)
    assert [r.question for r in unique] == ["1+1?", "2+2?"]
    assert [(Path(r.source).name, r.meta["line"]) for r in dups] == [("a_train.jsonl", 2), ("b_train.jsonl", 1)]
    assert len(unique) + len(dups) == len(ra) + len(rb)
