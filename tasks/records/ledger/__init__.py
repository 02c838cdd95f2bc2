"""The selection ledger: every prompt, reject, measurement and decision of every run, in duckdb.

This package is the only code that imports duckdb or holds SQL (tests/test_architecture.py): ``rows`` (the frozen
row records, one per table a run appends to; no SQL), ``schema`` (the tables: ``SCHEMA``, ``STEP_TABLES``), ``store``
(the :class:`~tasks.records.ledger.store.Ledger`: every write and question) and ``connection`` (opening the file
while another process writes or reads it). Import what you need from here.
"""

from tasks.records.ledger.rows import (
    SIGNALS,
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
from tasks.records.ledger.store import STOPPED, Ledger, QueryError

__all__ = ["SCHEMA", "SIGNALS", "STEP_TABLES", "STOPPED", "EvalRow", "FeatureRow", "GroupRow", "Ledger", "QueryError",
           "ReferenceRow",
           "SelectionRow", "SkippedUpdateRow", "StageRow", "StepRows", "used_signals"]
