"""Ingest stage: sources -> prompt records in the ledger, duplicates dropped, bad rows quarantined.

Each source is written in one ledger transaction (its prompts, quarantine rows and ``ingests`` row): a kill
mid-ingest leaves a source either fully recorded or not at all, so a rerun counts it right.

The invariant, per source and in total: rows in = accepted + duplicates + quarantined. A duplicate is a
row whose content id (question + answer) was already accepted earlier in the same ingest, within or
across files. Accepted rows already in the ledger from an earlier run count as accepted (``new`` counts
the ones the ledger did not know yet; the retrain flow ingests only those).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace

from tasks.config import SourceConfig
from tasks.data import arith
from tasks.data.prompts import PromptRecord, Rejected
from tasks.data.sources import check_paths, read_source

log = logging.getLogger("rlsift.ingest")


@dataclass(frozen=True)
class IngestRow:
    """One source of one ingest (table ``ingests``): row counts, ``rows = accepted + duplicates + quarantined``."""

    source: str
    rows: int
    accepted: int
    duplicates: int
    quarantined: int
    new: int


@dataclass
class IngestResult:
    train: list[PromptRecord] = field(default_factory=list)
    test: list[PromptRecord] = field(default_factory=list)
    new_ids: set[str] = field(default_factory=set)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        keys = ("rows", "accepted", "duplicates", "quarantined", "new")
        return {k: sum(s[k] for s in self.sources.values()) for k in keys}

    def summary(self) -> dict:
        t = self.totals
        return {"accepted": t["accepted"], "duplicates": t["duplicates"], "quarantined": t["quarantined"],
                "new": t["new"], "rows": t["rows"], "train": len(self.train), "test": len(self.test),
                "sources": self.sources}


def read(src: SourceConfig) -> tuple[str, list[PromptRecord], list[Rejected]]:
    """One configured source -> (its name, records, rejects)."""
    if src.kind == "bundled":
        recs = arith.generate(src.seed, src.n_train, "train", src.mix)
        recs += arith.generate(src.seed, src.n_test, "test", src.mix) if src.n_test else []
        if src.reward and src.reward != "arith":  # numeric: the final number alone
            recs = [replace(r, reward=src.reward) for r in recs]
        name = recs[0].source if recs else f"bundled:{src.mix}"
        return name, recs, []
    recs, rejected = read_source(src.path, src.format, split=src.split, fields=src.fields, reward=src.reward)
    if src.limit:
        per: dict[str, int] = {}
        kept = []
        for r in recs:
            per[r.split] = per.get(r.split, 0) + 1
            if per[r.split] <= src.limit:
                kept.append(r)
        recs = kept
    return str(src.path), recs, rejected


def ingest(ledger, run_id: str, sources: list[SourceConfig]) -> IngestResult:
    """Read every source, dedupe by content id, write prompts and quarantine to the ledger."""
    check_paths([s.path for s in sources if s.kind == "file"])
    known = ledger.known_ids()
    seen: set[str] = set()
    out = IngestResult()
    for src in sources:
        name, recs, rejected = read(src)
        accepted, dups = [], 0
        for r in recs:
            if r.id in seen:
                dups += 1
                continue
            seen.add(r.id)
            accepted.append(r)
        with ledger.transaction():  # a source's prompts, rejects and counts land together or not at all
            new = ledger.add_prompts(run_id, accepted)
            ledger.add_quarantine(run_id, rejected)
            counts = {"rows": len(recs) + len(rejected), "accepted": len(accepted), "duplicates": dups,
                      "quarantined": len(rejected), "new": new}
            assert counts["rows"] == counts["accepted"] + counts["duplicates"] + counts["quarantined"]
            ledger.add_ingest(run_id, IngestRow(source=name, **counts))
        out.sources[name] = counts
        out.new_ids |= {r.id for r in accepted if r.id not in known}
        out.train += [r for r in accepted if r.split == "train"]
        out.test += [r for r in accepted if r.split == "test"]
        if rejected:
            log.warning("%s: %d rows quarantined (first: %s)", name, len(rejected), rejected[0].reason)
    return out


def split_holdout(result: IngestResult, share: float, seed: int) -> None:
    """When no source has a test split, hold out ``share`` of train prompts (by id hash: stable)."""
    if result.test or share <= 0:
        return
    def frac(pid: str) -> float:
        return int(hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

    result.test = [r for r in result.train if frac(r.id) < share]
    test_ids = {r.id for r in result.test}
    result.train = [r for r in result.train if r.id not in test_ids]
