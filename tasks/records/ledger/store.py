"""The :class:`Ledger`: the writes of each stage and step to the tables of every run (their schema:
tasks/records/ledger/schema.py ``SCHEMA``), their truncation on resume, and the questions ``rlsift ledger`` and the
reports ask. All of the ledger's queries are here.

One ledger file per run root holds all runs; rows carry their ``run_id``. Writes for a step are idempotent:
:meth:`Ledger.truncate_after` removes whatever a crashed run wrote past its last checkpoint, so a resumed run never
duplicates a step. How a reader and a writer share the file: tasks/records/ledger/connection.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import duckdb

from tasks.data.ingest import IngestRow
from tasks.data.prompts import PromptRecord, Rejected
from tasks.records.ledger.connection import connect_to_snapshot, connect_to_write, held_elsewhere
from tasks.records.ledger.rows import (
    EvalRow,
    FeatureRow,
    GroupRow,
    ReferenceRow,
    SelectionRow,
    SkippedUpdateRow,
    StageRow,
    StepRows,
    used_signals,
)
from tasks.records.ledger.schema import SCHEMA, STEP_TABLES
from tasks.records.process import ProcessMark
from tasks.records.stopping import held_signals

#: The status of a run whose row says ``running`` but whose process is gone (``kill -9``, an out-of-memory kill, a
#: lost machine): it never closed its stores; ``rlsift run --resume`` finishes it (:meth:`Ledger.stopped_runs`).
STOPPED = "stopped"


class QueryError(ValueError):
    """SQL the ledger could not run (:meth:`Ledger.ask`), with duckdb's message in one line."""


def _one_line(err: Exception) -> str:
    """duckdb's message without the echo of the query and its caret (``LINE 1: ...``), on one line."""
    lines = [ln.strip() for ln in str(err).splitlines()]
    kept = [ln for ln in lines[:next((i for i, ln in enumerate(lines) if ln.startswith("LINE ")), len(lines))] if ln]
    return " ".join(kept) or type(err).__name__


class _Closed:
    """The connection of a closed :class:`Ledger`: any use says so."""

    def __init__(self, path: Path):
        self.path = path

    def __getattr__(self, name: str):
        raise duckdb.ConnectionException(f"the ledger {self.path} is closed")


class Ledger:
    """A duckdb ledger file. Use as a context manager, or call :meth:`close` (closing twice is harmless).

    ``read_only``: a reader; while another process writes the file it reads a snapshot (``snapshot`` is then
    True; tasks/records/ledger/connection.py says how)."""

    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = Path(path)
        if read_only and not self.path.exists():
            raise FileNotFoundError(f"no ledger at {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.snapshot = False
        if read_only:
            try:
                self.con = duckdb.connect(str(self.path), read_only=True)
            except (duckdb.IOException, duckdb.ConnectionException) as err:
                if not held_elsewhere(err):
                    raise
                self.con, self.snapshot = connect_to_snapshot(self.path), True
        else:
            self.con = connect_to_write(self.path)
        self._in_transaction = False
        if not read_only:
            self.con.execute(SCHEMA)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and let go of it: a closed ledger may outlive its use (a failed run's traceback,
        a Prefect task's context hold the run and its ledger until the interpreter exits), and a duckdb
        connection object still alive at exit makes duckdb print "nanobind: leaked ... instances!"."""
        con, self.con = self.con, _Closed(self.path)
        if not isinstance(con, _Closed):
            con.close()

    # ---- writes -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[Ledger]:
        """Everything written inside is committed together, or (error, kill) not at all. Nested use joins the
        outer transaction. A stop signal (SIGINT, SIGTERM) waits for its end (:func:`held_signals`, a few
        milliseconds): duckdb checks for one while it runs a statement and turns it into its own ``RuntimeError:
        Query interrupted``, so a run stopped there would end "failed" instead of "cancelled"."""
        if self._in_transaction:
            yield self
            return
        with held_signals():
            self.con.begin()
            self._in_transaction = True
            try:
                yield self
            except BaseException:
                self.con.rollback()
                raise
            else:
                self.con.commit()
            finally:
                self._in_transaction = False

    def _insert(self, table: str, rows: Sequence[dict[str, Any]], where: str = "") -> int:
        """Bulk insert through one Arrow table (row-by-row ``executemany`` took 142 s for 200,000 prompts);
        ``where`` filters the rows (SQL over their columns). Returns the number of rows inserted.

        A transaction, so a stop signal waits for its end (:meth:`transaction`): duckdb reads the Arrow table through
        Python calls, and turns an exception raised in one (a SIGTERM's ``TerminationSignal``) into its own
        ``InvalidInputException``."""
        if not rows:
            return 0
        import pyarrow as pa  # here: a reader (``rlsift ledger``) does without its import

        cols = list(rows[0])
        with self.transaction():
            self.con.register("_rows", pa.table({c: [_cell(r[c]) for r in rows] for c in cols}))
            try:
                names = ", ".join(cols)
                return self.con.execute(
                    f"INSERT INTO {table} ({names}) SELECT {names} FROM _rows {where}").fetchone()[0]
            finally:
                self.con.unregister("_rows")

    def _insert_records(self, table: str, stamp: dict[str, Any], rows: Sequence[Any]) -> None:
        """Insert row records (dataclasses whose fields are columns), each with the ``stamp`` columns."""
        self._insert(table, [stamp | _columns(r) for r in rows])

    def start_run(self, run_id: str, config: dict, mlflow_run_id: str | None,
                  process: ProcessMark | None = None) -> None:
        """Mark a run (new, or resumed: its row exists) ``running`` in ``process`` (default: this one), so a reader
        can tell when that process is gone without closing it (:meth:`stopped_runs`)."""
        p = process or ProcessMark.current()
        with self.transaction():
            self.con.execute(
                "INSERT INTO runs (run_id, status, mlflow_run_id, config, pid, host, process_started) "
                "VALUES (?, 'running', ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET status = 'running', "
                "pid = excluded.pid, host = excluded.host, process_started = excluded.process_started",
                [run_id, mlflow_run_id, json.dumps(config), p.pid, p.host, p.started],
            )

    def stopped_runs(self) -> list[str]:
        """The runs whose row says ``running`` but whose process is gone (its pid free or another process's, on this
        host; tasks/records/process.py ``ProcessMark.gone``): they show as :data:`STOPPED`. A writer records them
        so (:meth:`mark_stopped`); rows written before rlsift kept the process, and runs of another host, stay
        ``running``."""
        return [r["run_id"] for r in self.query("SELECT * FROM runs WHERE status = 'running' ORDER BY started_at")
                if _gone(r)]

    def mark_stopped(self, run_ids: Sequence[str]) -> None:
        """Record runs found :meth:`stopped_runs` as :data:`STOPPED` (a row no longer ``running`` is left as it
        is: its process, or a resume, closed it meanwhile)."""
        with self.transaction():
            for run_id in run_ids:
                self.con.execute("UPDATE runs SET status = ? WHERE run_id = ? AND status = 'running'",
                                 [STOPPED, run_id])

    def finish_run(self, run_id: str, status: str, summary: dict) -> None:
        with self.transaction():
            self.con.execute("UPDATE runs SET status = ?, finished_at = now(), summary = ? WHERE run_id = ?",
                             [status, json.dumps(summary), run_id])

    def add_prompts(self, run_id: str, records: Iterable[PromptRecord]) -> int:
        """Insert records not yet in the ledger (ids unique among ``records``); returns how many were new."""
        return self._insert("prompts", [
            {"prompt_id": r.id, "source": r.source, "split": r.split, "question": r.question, "answer": r.answer,
             "solution": r.solution, "level": r.level, "reward": r.reward, "meta": json.dumps(r.meta),
             "first_run_id": run_id} for r in records
        ], where="WHERE prompt_id NOT IN (SELECT prompt_id FROM prompts)")

    def add_quarantine(self, run_id: str, rejected: Iterable[Rejected]) -> None:
        self._insert("quarantine", [
            {"run_id": run_id, "source": r.source, "line": r.line, "reason": r.reason, "raw": r.raw} for r in rejected
        ])

    def add_ingest(self, run_id: str, row: IngestRow) -> None:
        self._insert_records("ingests", {"run_id": run_id}, [row])

    def add_reference(self, run_id: str, rows: Sequence[ReferenceRow]) -> None:
        self._insert_records("reference", {"run_id": run_id}, rows)

    def add_features(self, run_id: str, rows: Sequence[FeatureRow]) -> None:
        self._insert_records("features", {"run_id": run_id}, rows)

    def add_selections(self, run_id: str, round_: int, step: int, rows: Sequence[SelectionRow]) -> None:
        self._insert_records("selections", {"run_id": run_id, "round": round_, "step": step}, rows)

    def add_groups(self, run_id: str, step: int, rows: Sequence[GroupRow]) -> None:
        self._insert_records("groups", {"run_id": run_id, "step": step}, rows)

    def add_skipped_updates(self, run_id: str, step: int, rows: Sequence[SkippedUpdateRow]) -> None:
        self._insert_records("skipped_updates", {"run_id": run_id, "step": step}, rows)

    def add_steps(self, run_id: str, steps: Sequence[StepRows]) -> None:
        """The rows of several training steps, one insert per table in one transaction: a step's own two inserts
        (selections, groups) took 6-9 ms on 2 idle CPU cores (duckdb's fixed cost a statement), a round's 1.4-2.0 ms
        a step."""
        tables = {
            "reference": [{"run_id": run_id} | _columns(r) for s in steps for r in s.references],
            "selections": [{"run_id": run_id, "round": s.round, "step": s.step} | _columns(r) for s in steps
                           for r in s.selections],
            "groups": [{"run_id": run_id, "step": s.step} | _columns(r) for s in steps for r in s.groups],
            "skipped_updates": [{"run_id": run_id, "step": s.step} | _columns(r) for s in steps for r in s.skipped]}
        with self.transaction():
            for table, rows in tables.items():
                self._insert(table, rows)

    def skipped_updates(self, run_id: str) -> list[dict[str, Any]]:
        """The run's skipped updates in step order: step, minibatch, cause, detail, site."""
        return self.query("SELECT step, minibatch, cause, detail, site FROM skipped_updates WHERE run_id = ? "
                          "ORDER BY step, minibatch", [run_id])

    def add_stage(self, run_id: str, row: StageRow) -> None:
        """Record a stage's cost; a stage recorded again (a resumed run redoes its last stages, with the meter's
        times carried over) replaces its row, so no cost is counted twice."""
        with self.transaction():
            self.con.execute("DELETE FROM stages WHERE run_id = ? AND stage = ?", [run_id, row.stage])
            self._insert_records("stages", {"run_id": run_id}, [row])

    def stage_seconds(self, run_id: str) -> dict[str, float]:
        """``{stage: wall seconds}`` of the run's recorded stages."""
        return {stage: float(s) for stage, s in self.con.execute(
            "SELECT stage, wall_s FROM stages WHERE run_id = ?", [run_id]).fetchall()}

    def add_evals(self, run_id: str, rows: Sequence[EvalRow]) -> None:
        self._insert_records("evals", {"run_id": run_id}, rows)

    def replace_evals(self, run_id: str, phase: str, rows: Sequence[EvalRow]) -> None:
        """A redone evaluation of ``phase`` replaces that phase's rows (a resumed run's final evaluation)."""
        if any(r.phase != phase for r in rows):
            raise ValueError(f"replace_evals({phase!r}) got rows of phases {sorted({r.phase for r in rows})}")
        with self.transaction():
            self.con.execute("DELETE FROM evals WHERE run_id = ? AND phase = ?", [run_id, phase])
            self.add_evals(run_id, rows)

    def truncate_after(self, run_id: str, step: int) -> None:
        """Remove step rows a crashed run wrote after its last checkpoint (which covers steps <= ``step``).

        In-training evaluations are stamped with the number of steps done (``step + 1``), so the one made
        at the end of the last covered step is kept.
        """
        with self.transaction():
            for table in STEP_TABLES:
                self.con.execute(f"DELETE FROM {table} WHERE run_id = ? AND step > ?", [run_id, step])
            self.con.execute("DELETE FROM evals WHERE run_id = ? AND phase = 'during' AND step > ?",
                             [run_id, step + 1])

    # ---- reads --------------------------------------------------------------------------------
    def known_ids(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT prompt_id FROM prompts").fetchall()}

    def prompts(self, ids: Sequence[str] | None = None, split: str | None = None,
                sources: Sequence[str] | None = None) -> list[PromptRecord]:
        sql, args = "SELECT * FROM prompts WHERE 1=1", []
        if split:
            sql, args = sql + " AND split = ?", [*args, split]
        if sources is not None:
            sql, args = sql + " AND list_contains(?, source)", [*args, list(sources)]
        rows = self.query(sql + " ORDER BY prompt_id", args)
        recs = [PromptRecord(id=r["prompt_id"], source=r["source"], split=r["split"], question=r["question"],
                             answer=r["answer"], solution=r["solution"], level=r["level"], reward=r["reward"],
                             meta=json.loads(r["meta"]) if r["meta"] else {}) for r in rows]
        if ids is not None:
            by_id = {r.id: r for r in recs}
            recs = [by_id[i] for i in ids if i in by_id]
        return recs

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Rows of any SQL as dicts: for tests and :meth:`ask`; code asks the named methods."""
        cur = self.con.execute(sql, list(args))
        cols = [d[0] for d in cur.description or ()]
        return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()] if cols else []

    def ask(self, sql: str) -> list[dict[str, Any]]:
        """Rows of a person's SQL (``rlsift ledger sql``). Raises :class:`QueryError` with duckdb's message in one
        line (what is wrong and, for a misspelt name, what it may have meant) for SQL that does not run."""
        try:
            return self.query(sql)
        except duckdb.Error as err:
            raise QueryError(_one_line(err)) from None

    def has_features(self, run_id: str) -> bool:
        return bool(self.query("SELECT 1 FROM features WHERE run_id = ? LIMIT 1", [run_id]))

    def mlflow_run_id(self, run_id: str) -> str | None:
        """The MLflow run a ledger run logs to (None for an unknown run or one without tracking)."""
        rows = self.query("SELECT mlflow_run_id FROM runs WHERE run_id = ?", [run_id])
        return rows[0]["mlflow_run_id"] if rows else None

    def runs(self) -> list[dict[str, Any]]:
        """Every run, oldest first: id, status (:data:`STOPPED` for a ``running`` one whose process is gone), start
        and finish times, MLflow run id, config and summary."""
        rows = self.query("SELECT * FROM runs ORDER BY started_at")
        keep = ("run_id", "status", "started_at", "finished_at", "mlflow_run_id", "config", "summary")
        return [{k: r[k] for k in keep} | {"status": _status(r)} for r in rows]

    def prompts_like(self, prefix: str) -> list[dict[str, Any]]:
        """Prompts whose id starts with ``prefix`` (id, split, level)."""
        return self.query("SELECT prompt_id, split, level FROM prompts WHERE prompt_id LIKE ? ORDER BY prompt_id",
                          [prefix + "%"])

    def run_ids(self) -> list[str]:
        """Every run's id, newest first."""
        return [r["run_id"] for r in self.query("SELECT run_id FROM runs ORDER BY started_at DESC, run_id")]

    def run_status(self, run_id: str) -> str | None:
        """A run's status (running, completed, failed, cancelled, skipped, planned; :data:`STOPPED` for a
        ``running`` one whose process is gone), or None when the ledger has no such run."""
        rows = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return _status(rows[0]) if rows else None

    def progress(self, run_id: str) -> dict[str, Any] | None:
        """Where a run is: its ``status``, its ``config`` (a dict) and ``last_step``, the last training step with
        selections in the ledger (None before the first); None when the ledger has no such run."""
        rows = self.query("SELECT r.status, r.config, (SELECT max(s.step) FROM selections s WHERE s.run_id = r.run_id) "
                          "AS last_step FROM runs r WHERE r.run_id = ?", [run_id])
        if not rows:
            return None
        row = rows[0] | {"status": self.run_status(run_id)}
        return {**row, "config": json.loads(row["config"]) if isinstance(row["config"], str) else row["config"] or {}}

    def last_run(self, status: str | None = None) -> dict[str, Any] | None:
        sql = "SELECT * FROM runs" + (" WHERE status = ?" if status else "") + " ORDER BY started_at DESC LIMIT 1"
        rows = self.query(sql, [status] if status else [])
        return rows[0] if rows else None

    def selected_levels(self, run_id: str) -> list[dict[str, Any]]:
        """Each selection of a run in step order: its ``round``, the prompt's ``level`` and DOTS's ``pred_success``."""
        return self.query(
            "SELECT s.round, p.level, s.pred_success FROM selections s LEFT JOIN prompts p USING (prompt_id) "
            "WHERE s.run_id = ? ORDER BY s.step", [run_id])

    def why(self, run_id: str, prompt_id: str, step: int | None = None) -> list[dict[str, Any]]:
        """Every selection of a prompt (at one step, or all), joined with its group's outcome; without the columns
        of signals that none of these selections used (:func:`used_signals`)."""
        sql = (
            "SELECT s.*, g.n, g.successes, g.kept, g.replayed, g.from_step, p.question, p.level "
            "FROM selections s LEFT JOIN groups g ON g.run_id = s.run_id AND g.step = s.step "
            "AND g.prompt_id = s.prompt_id AND NOT g.replayed "
            "LEFT JOIN prompts p ON p.prompt_id = s.prompt_id WHERE s.run_id = ? AND s.prompt_id LIKE ?"
        )
        args: list[Any] = [run_id, prompt_id + "%"]
        if step is not None:
            sql, args = sql + " AND s.step = ?", [*args, step]
        return used_signals(self.query(sql + " ORDER BY s.step", args))

    def round_selection(self, run_id: str, round_: int) -> list[dict[str, Any]]:
        """A round's selections, heaviest first within each step; without the columns of unused signals."""
        return used_signals(self.query(
            "SELECT s.*, p.level, p.question FROM selections s LEFT JOIN prompts p USING (prompt_id) "
            "WHERE s.run_id = ? AND s.round = ? ORDER BY s.step, s.weight DESC", [run_id, round_]))


def _gone(row: dict[str, Any]) -> bool:
    """Whether the process of a ``running`` run's row is gone (False for a row without one: written before rlsift
    kept it)."""
    if row.get("pid") is None or row.get("host") is None or row.get("process_started") is None:
        return False
    return ProcessMark(int(row["pid"]), row["host"], float(row["process_started"])).gone()


def _status(row: dict[str, Any]) -> str:
    """A run row's status as it stands: :data:`STOPPED` for a ``running`` one whose process is gone."""
    return STOPPED if row["status"] == "running" and _gone(row) else row["status"]


def _columns(row: Any) -> dict[str, Any]:
    """A row record's columns (a dataclass whose fields are a table's columns) by name."""
    return {f.name: getattr(row, f.name) for f in fields(row)}


def _cell(v: Any) -> Any:
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    if hasattr(v, "item"):  # numpy / torch scalars
        return v.item()
    return v
