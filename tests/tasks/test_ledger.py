"""The ledger: schema, typed row writes read back, idempotent truncation for resume, and the audit questions."""

import pytest

from tasks.data.ingest import IngestRow
from tasks.data.prompts import PromptRecord, prompt_id
from tasks.records.ledger import (
    EvalRow,
    FeatureRow,
    GroupRow,
    Ledger,
    ReferenceRow,
    SelectionRow,
    SkippedUpdateRow,
    StageRow,
    StepRows,
)


def rec(q, a="1"):
    return PromptRecord(id=prompt_id(q, a), source="t", split="train", question=q, answer=a, level=2, reward="arith")


def sel(pid: str, pred: float | None = 0.4) -> SelectionRow:
    return SelectionRow(prompt_id=pid, selector="dots", weight=0.5, pred_success=pred, angle_score=0.1, gain_rank=3)


def group(pid: str, step: int) -> GroupRow:
    return GroupRow(prompt_id=pid, n=8, successes=3, mean_reward=0.375, kept=8, kept_mean_reward=0.375,
                    replayed=False, from_step=step)


def test_why_and_round_and_truncate(tmp_path):
    with Ledger(tmp_path / "l.duckdb") as led:
        r1, r2 = rec("1+0=?"), rec("2-1=?")
        assert led.add_prompts("run", [r1, r2]) == 2
        assert led.add_prompts("run", [r1]) == 0
        for step in range(4):
            led.add_selections("run", step // 2, step, [sel(r1.id)])
            led.add_groups("run", step, [group(r1.id, step)])
        why = led.why("run", r1.id[:6], step=2)
        assert len(why) == 1 and why[0]["pred_success"] == 0.4 and why[0]["successes"] == 3
        assert why[0]["question"] == "1+0=?"
        assert [r["step"] for r in led.round_selection("run", 1)] == [2, 3]
        assert led.selected_levels("run") == [{"round": s // 2, "level": 2, "pred_success": 0.4} for s in range(4)]
        led.truncate_after("run", 1)
        assert [r["step"] for r in led.query("SELECT step FROM groups ORDER BY step")] == [0, 1]
    with Ledger(tmp_path / "l.duckdb", read_only=True) as led:
        assert len(led.prompts()) == 2


def test_typed_rows_are_written_column_for_field_and_read_back(tmp_path):
    with Ledger(tmp_path / "l.duckdb") as led:
        led.start_run("run", {"seed": 0}, "mlf-1")
        led.add_ingest("run", IngestRow(source="s", rows=5, accepted=3, duplicates=1, quarantined=1, new=3))
        ref = [ReferenceRow(round=-1, step=-1, prompt_id="p0", n=4, successes=1, success_rate=0.25, predicted=None),
               ReferenceRow(round=0, step=0, prompt_id="p1", n=4, successes=4, success_rate=1.0, predicted=0.75)]
        led.add_reference("run", ref)
        assert not led.has_features("run")
        feats = [FeatureRow(prompt_id="p0", prompt_tokens=7, level=3, cot_tokens=11, angle_intra=0.5, angle_inter=0.25,
                            angle_score=0.75)]
        led.add_features("run", feats)
        assert led.has_features("run") and not led.has_features("other")
        led.add_selections("run", 2, 7, [sel("p0", None)])
        led.add_groups("run", 7, [GroupRow(prompt_id="p0", n=8, successes=2, mean_reward=0.25, kept=4,
                                           kept_mean_reward=0.5, replayed=True, from_step=5)])
        led.add_stage("run", StageRow(stage="train", wall_s=2.5, device="cpu", device_hours=0.001, cost=0.02))

        def table(name: str) -> list[dict]:
            return [{k: v for k, v in r.items() if k not in ("run_id", "logged_at")}
                    for r in led.query(f"SELECT * FROM {name} WHERE run_id = 'run' ORDER BY ALL")]

        assert table("ingests") == [{"source": "s", "rows": 5, "accepted": 3, "duplicates": 1, "quarantined": 1,
                                     "new": 3}]
        assert table("reference") == [vars(r) for r in ref]
        assert table("features") == [vars(f) for f in feats]
        assert table("selections") == [{"round": 2, "step": 7, **vars(sel("p0", None)), "des": None,
                                        "des_difficulty": None, "des_cot": None, "des_adaptability": None}]
        assert table("groups")[0]["replayed"] is True and table("groups")[0]["from_step"] == 5
        assert table("stages") == [{"stage": "train", "wall_s": 2.5, "device": "cpu", "device_hours": 0.001,
                                    "cost": 0.02}]
        assert led.mlflow_run_id("run") == "mlf-1" and led.mlflow_run_id("nope") is None
        assert [r["run_id"] for r in led.runs()] == ["run"]


def test_the_rows_of_several_steps_at_once_are_those_of_each_step_written_alone(tmp_path):
    """``add_steps`` (the training stage's writes, held until a checkpoint) against the per-table writes, step by
    step: the same rows in every step table."""
    steps = [StepRows(round=s // 2, step=s,
                      references=(ReferenceRow(round=s // 2, step=s, prompt_id="r", n=4, successes=s,
                                               success_rate=s / 4, predicted=0.5),) if s % 2 == 0 else (),
                      selections=(sel(f"p{s}"), sel(f"q{s}", None)), groups=(group(f"p{s}", s),),
                      skipped=(SkippedUpdateRow(minibatch=0, cause="loss", detail="nan", site="lm_head"),) if s == 3
                      else ()) for s in range(4)]

    def tables(led: Ledger) -> dict[str, list[dict]]:
        return {t: [{k: v for k, v in r.items() if k != "logged_at"}
                    for r in led.query(f"SELECT * FROM {t} ORDER BY ALL")]
                for t in ("reference", "selections", "groups", "skipped_updates")}

    with Ledger(tmp_path / "one.duckdb") as one, Ledger(tmp_path / "each.duckdb") as each:
        one.add_steps("run", steps)
        for s in steps:
            each.add_reference("run", list(s.references))
            each.add_selections("run", s.round, s.step, s.selections)
            each.add_groups("run", s.step, s.groups)
            each.add_skipped_updates("run", s.step, s.skipped)
        got, want = tables(one), tables(each)
        assert got == want and [len(got[t]) for t in got] == [2, 8, 4, 1]
        one.add_steps("run", [])  # nothing held: nothing written, no error
        assert tables(one) == want


def test_a_sigterm_while_duckdb_reads_an_insert_stops_the_run_after_it(tmp_path, monkeypatch):
    """duckdb reads an insert's Arrow table through Python calls and turns an exception raised in one (the SIGTERM's
    ``TerminationSignal``) into its own error: the run ended "failed", not "cancelled". The signal now waits for the
    insert's end: the rows are written, then the stop is raised as itself."""
    import signal

    import pyarrow as pa

    from tasks.records.stopping import sigterm_raises, stop_signal

    table = pa.table

    class SignalledRead:  # the Arrow table, with a SIGTERM arriving while duckdb reads it
        def __init__(self, t):
            self.t = t

        def __arrow_c_stream__(self, requested_schema=None):
            signal.raise_signal(signal.SIGTERM)
            return self.t.__arrow_c_stream__(requested_schema)

    monkeypatch.setattr(pa, "table", lambda *a, **k: SignalledRead(table(*a, **k)))
    with Ledger(tmp_path / "l.duckdb") as led, sigterm_raises():
        with pytest.raises(BaseException) as stopped:
            led.add_groups("run", 3, [group("p1", 3)])
        assert stop_signal(stopped.value) == signal.SIGTERM, repr(stopped.value)
        monkeypatch.setattr(pa, "table", table)
        assert led.query("SELECT prompt_id FROM groups") == [{"prompt_id": "p1"}]


def test_a_sigterm_during_a_transaction_stops_the_run_after_its_commit(tmp_path):
    """duckdb checks for a signal while it runs a statement (a commit among them) and turns it into ``RuntimeError:
    Query interrupted``: the run ended "failed". The signal now waits for the transaction's end, and a run's
    single-statement writes (its status) are transactions too."""
    import signal

    from tasks.records.stopping import sigterm_raises, stop_signal

    with Ledger(tmp_path / "l.duckdb") as led, sigterm_raises():
        with pytest.raises(BaseException) as stopped:
            with led.transaction():
                led.add_groups("run", 3, [group("p1", 3)])
                signal.raise_signal(signal.SIGTERM)  # pending when duckdb commits
                led.add_groups("run", 4, [group("p1", 4)])
        assert stop_signal(stopped.value) == signal.SIGTERM, repr(stopped.value)
        assert [r["step"] for r in led.query("SELECT step FROM groups ORDER BY step")] == [3, 4]
        with pytest.raises(BaseException) as stopped:
            with led.transaction():
                signal.raise_signal(signal.SIGTERM)
                led.finish_run("run", "cancelled", {})  # joins the transaction: one commit
        assert stop_signal(stopped.value) == signal.SIGTERM


def test_replace_evals_replaces_only_that_phase(tmp_path):
    def rows(phase: str, acc: float) -> list[EvalRow]:
        return [EvalRow(phase=phase, step=3, grp="overall", n=10, greedy_acc=acc, avg_at_k=None),
                EvalRow(phase=phase, step=3, grp="level_1", n=4, greedy_acc=acc, avg_at_k=0.5)]

    with Ledger(tmp_path / "l.duckdb") as led:
        led.add_evals("run", rows("start", 0.1))
        led.replace_evals("run", "end", rows("end", 0.2))
        led.replace_evals("run", "end", rows("end", 0.3))  # a resumed run redoes its final evaluation
        got = led.query("SELECT phase, grp, greedy_acc, avg_at_k FROM evals ORDER BY phase, grp")
        assert got == [{"phase": "end", "grp": "level_1", "greedy_acc": 0.3, "avg_at_k": 0.5},
                       {"phase": "end", "grp": "overall", "greedy_acc": 0.3, "avg_at_k": None},
                       {"phase": "start", "grp": "level_1", "greedy_acc": 0.1, "avg_at_k": 0.5},
                       {"phase": "start", "grp": "overall", "greedy_acc": 0.1, "avg_at_k": None}]
        with pytest.raises(ValueError, match="phases"):
            led.replace_evals("run", "end", rows("start", 0.4))


def test_a_ledger_from_before_pass_at_k_gains_the_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "l.duckdb"
    with Ledger(path) as led:
        led.add_evals("old", [EvalRow(phase="end", step=3, grp="overall", n=10, greedy_acc=0.4, avg_at_k=0.3)])
        led.con.execute("ALTER TABLE evals DROP COLUMN pass_at_k")  # the file as the previous version wrote it
    with Ledger(path) as led:
        led.add_evals("new", [EvalRow(phase="end", step=3, grp="overall", n=10, greedy_acc=0.5, avg_at_k=0.3,
                                      pass_at_k=0.7)])
        got = led.query("SELECT run_id, greedy_acc, pass_at_k FROM evals ORDER BY run_id")
        assert got == [{"run_id": "new", "greedy_acc": 0.5, "pass_at_k": 0.7},
                       {"run_id": "old", "greedy_acc": 0.4, "pass_at_k": None}]


def test_a_ledger_from_before_the_screen_gains_its_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "l.duckdb"
    with Ledger(path) as led:
        led.add_selections("old", 0, 0, [SelectionRow(prompt_id="p", selector="dots", weight=0.5)])
        led.con.execute("ALTER TABLE selections DROP COLUMN screen_success")  # as the previous version wrote it
    with Ledger(path) as led:
        led.add_selections("new", 0, 0, [SelectionRow(prompt_id="p", selector="dots", weight=0.5, screen_success=0.4)])
        got = led.query("SELECT run_id, weight, screen_success FROM selections ORDER BY run_id")
        assert got == [{"run_id": "new", "weight": 0.5, "screen_success": 0.4},
                       {"run_id": "old", "weight": 0.5, "screen_success": None}]


def test_why_and_round_leave_out_the_signals_no_technique_used():
    """A uniform draw records GAIN-RL's angle and rank without using them: ``ledger why``/``round`` drop such
    columns; a technique that chose any of the rows keeps its columns."""
    from tasks.records.ledger import used_signals

    row = {"prompt_id": "p", "selector": "uniform", "weight": 0.5, "pred_success": None, "angle_score": 0.1234,
           "gain_rank": 7, "des": None, "screen_success": None}
    assert set(used_signals([row])[0]) == {"prompt_id", "selector", "weight"}
    both = used_signals([{**row, "selector": "guard"}, {**row, "selector": "scalingrl+gain"}])
    assert [set(r) for r in both] == [{"prompt_id", "selector", "weight", "angle_score", "gain_rank", "des"}] * 2
    assert used_signals([]) == []


def test_a_closed_ledger_lets_go_of_its_connection(tmp_path):
    """A run's traceback or a Prefect task context may hold a closed ledger until exit; its duckdb connection must
    not live that long (duckdb then prints "nanobind: leaked ... instances!" at exit)."""
    import duckdb

    led = Ledger(tmp_path / "l.duckdb")
    con = led.con
    led.close()
    assert led.con is not con
    with pytest.raises(duckdb.ConnectionException, match="is closed"):
        led.query("SELECT 1")
    led.close()  # twice: harmless


READ = """
import sys
from tasks.records.ledger import Ledger

with Ledger(sys.argv[1], read_only=True) as led:
    print(led.snapshot, ",".join(r["run_id"] + ":" + r["status"] for r in led.runs()), len(led.why("run", "p")))
"""

HOLD = """
import sys, time
from pathlib import Path
from tasks.records.ledger import Ledger

def hold():
    Path(sys.argv[2]).touch()
    time.sleep(1.5)

with Ledger(sys.argv[1], read_only=sys.argv[3] == "read") as led:
    if sys.argv[3] == "write":
        led.start_run("committed", {}, None)
        with led.transaction():  # open while the other process reads
            led.start_run("uncommitted", {}, None)
            hold()
    else:
        hold()
"""


def _python(code: str, *args: str):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _holding(code: str, path, mode: str, tmp_path):
    """A process that opens the ledger ``mode`` (read, write) and holds it for 1.5 s; returned once it holds it."""
    import time

    flag = tmp_path / f"holding-{mode}"
    proc = _python(code, str(path), str(flag), mode)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    return proc


def test_another_process_reads_the_ledger_a_run_holds_open(tmp_path):
    """A run keeps its ledger open from start to end; `rlsift ledger` in another process reads a snapshot of it
    meanwhile, with everything the run committed, and reads the file itself once the run let go."""
    path = tmp_path / "l.duckdb"
    with Ledger(path) as led:
        led.start_run("run", {"seed": 0}, None)
        led.add_selections("run", 0, 0, [sel("p0")])
        out, err = _python(READ, str(path)).communicate(timeout=120)
        assert out.split() == ["True", "run:running", "1"], err[-2000:]
        led.add_groups("run", 0, [group("p0", 0)])  # the writer goes on after the read
    out, err = _python(READ, str(path)).communicate(timeout=120)
    assert out.split() == ["False", "run:running", "1"], err[-2000:]


def test_a_snapshot_shows_what_was_committed_and_leaves_nothing_behind(tmp_path):
    import tempfile
    from pathlib import Path

    path = tmp_path / "l.duckdb"
    Ledger(path).close()
    before = set(Path(tempfile.gettempdir()).glob("rlsift-ledger-*"))
    writer = _holding(HOLD, path, "write", tmp_path)
    with Ledger(path, read_only=True) as led:
        assert led.snapshot and led.run_ids() == ["committed"]  # not the open transaction's run
    assert set(Path(tempfile.gettempdir()).glob("rlsift-ledger-*")) <= before
    assert writer.wait(timeout=60) == 0


def test_a_writer_waits_for_a_reader(tmp_path):
    path = tmp_path / "l.duckdb"
    Ledger(path).close()
    reader = _holding(HOLD, path, "read", tmp_path)
    with Ledger(path) as led:  # opens once the reader let go
        led.start_run("run", {}, None)
    assert reader.wait(timeout=60) == 0


WRITE_STEPS = """
import sys, time
from pathlib import Path
from tasks.records.ledger import GroupRow, Ledger, SelectionRow

with Ledger(sys.argv[1]) as led:
    Path(sys.argv[2]).touch()
    end, step = time.monotonic() + 4, 0
    while time.monotonic() < end:
        with led.transaction():
            led.add_selections("run", 0, step, [SelectionRow(prompt_id=f"p{i}", selector="uniform", weight=0.25)
                                                for i in range(4)])
            led.add_groups("run", step, [GroupRow(prompt_id=f"p{i}", n=8, successes=3, mean_reward=0.375, kept=8,
                                                  kept_mean_reward=0.375, replayed=False, from_step=step)
                                         for i in range(4)])
        if step % 40 == 39:
            led.con.execute("CHECKPOINT")  # what a long run's log reaching duckdb's threshold does
        step += 1
"""


def test_snapshots_taken_while_a_run_writes_and_checkpoints_are_whole(tmp_path):
    """Every snapshot shows whole steps (a step's selections and groups are one transaction), never fewer steps
    than an earlier one, while the writer commits steps and rewrites the file at its checkpoints."""
    path = tmp_path / "l.duckdb"
    Ledger(path).close()
    writer = _holding(WRITE_STEPS, path, "write", tmp_path)
    seen = []
    while writer.poll() is None:
        with Ledger(path, read_only=True) as led:
            counts = led.query("SELECT (SELECT count(*) FROM selections) AS s, (SELECT count(*) FROM groups) AS g, "
                               "(SELECT coalesce(max(step), -1) FROM groups) AS last")[0]
        assert counts["s"] == counts["g"] == 4 * (counts["last"] + 1), counts
        seen.append(counts["last"])
    assert writer.returncode == 0, writer.communicate()[1][-2000:]
    assert seen == sorted(seen) and len(seen) > 5 and seen[-1] > 40, seen
