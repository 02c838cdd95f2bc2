"""Ingest stage: rows in = accepted + duplicates + quarantined, per source and in total; ledger contents."""

import json

import pytest

from tasks.config import SourceConfig
from tasks.data.ingest import ingest
from tasks.records.ledger import Ledger

GOOD = {"question": "What is 2 + 3?", "answer": "Two plus three.\n#### 5"}


def write(path, lines):
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


@pytest.fixture
def files(tmp_path):
    a = write(tmp_path / "a_train.jsonl", [
        json.dumps(GOOD),
        json.dumps({"question": "What is 4 + 4?", "answer": "#### 8"}),
        json.dumps(GOOD),                                    # duplicate within the file
        "{not json",                                         # malformed
        json.dumps({"question": "", "answer": "#### 1"}),     # empty field
        b'{"question": "caf\xe9 \xff?", "answer": "#### 1"}',  # not UTF-8
        json.dumps({"question": "Unparseable?", "answer": "#### seven"}),  # verifier cannot parse
    ])
    b = write(tmp_path / "b_train.jsonl", [
        json.dumps(GOOD),                                    # duplicate across files
        json.dumps({"question": "What is 9 - 1?", "answer": "#### 8"}),
    ])
    return a, b


def test_count_invariant_and_ledger(tmp_path, files):
    sources = [SourceConfig(kind="file", path=str(f), format="gsm8k") for f in files]
    with Ledger(tmp_path / "l.duckdb") as led:
        res = ingest(led, "r1", sources)
        t = res.totals
        assert t == {"rows": 9, "accepted": 3, "duplicates": 2, "quarantined": 4, "new": 3}
        a, b = (res.sources[str(f)] for f in files)
        assert (a["rows"], a["accepted"], a["duplicates"], a["quarantined"]) == (7, 2, 1, 4)
        assert (b["rows"], b["accepted"], b["duplicates"], b["quarantined"]) == (2, 1, 1, 0)
        q = led.query("SELECT line, reason FROM quarantine ORDER BY line")
        assert [r["line"] for r in q] == [4, 5, 6, 7]
        assert all(r["reason"].startswith("a_train.jsonl:") for r in q), q
        assert len(led.prompts(split="train")) == 3
        # a second ingest of the same files finds nothing new and loses nothing
        res2 = ingest(led, "r2", sources)
        assert res2.totals["new"] == 0 and res2.totals["accepted"] == 3
        assert len(led.prompts()) == 3


def test_missing_path_is_an_error_before_any_work(tmp_path, files):
    sources = [SourceConfig(kind="file", path=str(files[0])),
               SourceConfig(kind="file", path=str(tmp_path / "no.jsonl"))]
    with Ledger(tmp_path / "l.duckdb") as led:
        with pytest.raises(FileNotFoundError, match="no.jsonl"):
            ingest(led, "r1", sources)
        assert led.prompts() == []


def test_bundled_source_splits_disjoint(tmp_path):
    with Ledger(tmp_path / "l.duckdb") as led:
        res = ingest(led, "r1", [SourceConfig(n_train=50, n_test=20)])
    assert len(res.train) == 50 and len(res.test) == 20
    assert not {r.question for r in res.train} & {r.question for r in res.test}


def test_a_bundled_source_scores_the_final_number_when_asked(tmp_path):
    """reward: numeric on the bundled task: a prose answer ending in the right number earns 1 (arith gives 0)."""
    from tasks.data.rewards import reward

    with Ledger(tmp_path / "l.duckdb") as led:
        res = ingest(led, "r1", [SourceConfig(n_train=5, n_test=0, mix={1: 1.0}, reward="numeric")])
        plain = ingest(led, "r2", [SourceConfig(n_train=5, n_test=0, mix={1: 1.0})])
    r = res.train[0]
    assert {x.reward for x in res.train} == {"numeric"} and {x.reward for x in plain.train} == {"arith"}
    prose = f"{r.question.removesuffix('=?')} = {r.answer}\n\nThe answer is {r.answer}."
    assert reward(r.reward, prose, r) == 1.0 and reward("arith", prose, r) == 0.0
    with pytest.raises(ValueError, match="bundled' source's reward is arith or numeric, got 'code'"):
        SourceConfig(reward="code")


KILLED_MID_SOURCE = """
import os, signal, sys
from tasks.config import SourceConfig
from tasks.data.ingest import ingest
from tasks.records.ledger import Ledger

def die(*a, **k):  # the prompts of the source are written; the process dies before its ingests row
    os.kill(os.getpid(), signal.SIGKILL)

Ledger.add_ingest = die
with Ledger(sys.argv[1]) as led:
    ingest(led, "r1", [SourceConfig(kind="bundled", mix="default", n_train=300, n_test=50, seed=0)])
"""


def test_a_kill_mid_source_leaves_nothing_of_it_and_the_rerun_counts_right(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    db = tmp_path / "ledger.duckdb"
    p = subprocess.run([sys.executable, "-c", KILLED_MID_SOURCE, str(db)], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    with Ledger(db) as led:
        assert led.query("SELECT count(*) AS n FROM prompts")[0]["n"] == 0  # the source's transaction rolled back
        assert led.query("SELECT count(*) AS n FROM ingests")[0]["n"] == 0
        res = ingest(led, "r2", [SourceConfig(kind="bundled", mix="default", n_train=300, n_test=50, seed=0)])
        assert res.totals["new"] == res.totals["accepted"] == 350
        again = ingest(led, "r3", [SourceConfig(kind="bundled", mix="default", n_train=300, n_test=50, seed=0)])
        assert again.totals["new"] == 0 and again.totals["accepted"] == 350


def test_a_stage_recorded_twice_is_one_row(tmp_path):
    from tasks.records.ledger import StageRow

    with Ledger(tmp_path / "ledger.duckdb") as led:
        for wall in (10.0, 12.5):  # a resumed run redoes its last stage with the meter's carried-over time
            led.add_stage("r1", StageRow(stage="train", wall_s=wall, device="cpu", device_hours=wall / 3600, cost=0.0))
        rows = led.query("SELECT stage, wall_s FROM stages WHERE run_id = 'r1'")
    assert rows == [{"stage": "train", "wall_s": 12.5}]
