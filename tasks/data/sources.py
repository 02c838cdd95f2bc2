"""Source adapters: read a data file or folder into ``PromptRecord`` rows plus ``Rejected`` rows.

Formats (``FORMATS``):

* ``gsm8k`` (Cobbe et al. 2021): ``question``, ``answer`` whose last ``#### N`` is the final answer
  (commas stripped); the text before it is the solution. Reward ``numeric``.
* ``math`` (Hendrycks et al. 2021): ``problem``, ``solution``; the answer is the content of the
  solution's last ``\\boxed{...}`` (nested braces handled); ``level`` from ``"Level N"``. Reward ``math``.
* ``math500`` (Lightman et al. 2023 subset): ``problem``, ``solution``, ``answer``, ``level``. Reward ``math``.
* ``humaneval`` (Chen et al. 2021; ``.jsonl`` or ``.jsonl.gz``): question = ``prompt``, answer = the
  ``test`` code; meta holds ``entry_point``, ``task_id`` and ``canonical_solution`` (also the solution).
  Reward ``code``.
* ``jsonl``, ``parquet`` and ``hf`` (a folder written by ``datasets``' ``save_to_disk``): generic rows
  whose field names are mapped by ``fields`` (keys ``question``, ``answer``, ``solution``, ``level``,
  ``entry_point``; defaults: the same names); reward kind from ``reward`` (default ``math``).

Robustness: JSON lines are read as bytes and decoded line by line, so a bad line (malformed JSON,
non-UTF-8 bytes, not an object, a missing/empty/non-text field, a row over ``max_row_bytes``, an
answer the reward's verifier cannot parse) becomes one ``Rejected`` with a reason naming file and line
(``train.jsonl:17: missing field 'answer'``) while the other rows are kept. Blank lines are not rows.
Choices: the split comes from the file name (``train``/``test`` in it) unless given, else ``test``
for the test-only benchmarks (math500, humaneval) and ``train`` otherwise; a level outside 1..5 is
None; numbers in text fields are accepted and turned into text; oversized rows keep only the first
``RAW_KEEP`` characters in ``raw``. Deduplication is the caller's (``dedupe`` helps).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tasks.data.prompts import REWARD_KINDS, PromptRecord, Rejected, prompt_id
from tasks.data.rewards import can_parse, last_boxed

FORMATS = ("gsm8k", "math", "math500", "humaneval", "jsonl", "parquet", "hf")
FIELD_KEYS = ("question", "answer", "solution", "level", "entry_point")
#: characters of an oversized row kept in its quarantine ``raw``
RAW_KEEP = 10_000

_DEFAULT_REWARD = {"gsm8k": "numeric", "math": "math", "math500": "math", "humaneval": "code"}
_TEST_ONLY = ("math500", "humaneval")


class _Bad(Exception):
    """A row problem; the message becomes the Rejected reason (after the ``file:line:`` prefix)."""


def check_paths(paths: Iterable[str | Path]) -> None:
    """Raise FileNotFoundError naming every path that does not exist (call before any work)."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} source path(s) not found: {', '.join(missing)}")


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _lines(path: Path, max_row_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """Yield (line number, bytes or None when oversized, size) for each non-blank line, streaming."""
    with _open(path) as fh:
        n = 0
        while True:
            line = fh.readline(max_row_bytes + 2)
            if not line:
                return
            n += 1
            size = len(line)
            if not line.endswith(b"\n") and size > max_row_bytes:
                head = line
                while True:  # skip the rest of an oversized line without holding it
                    more = fh.readline(1 << 20)
                    size += len(more)
                    if not more or more.endswith(b"\n"):
                        break
                yield n, head[:RAW_KEEP], size
                continue
            body = line.rstrip(b"\r\n")
            if len(body) > max_row_bytes:
                yield n, body[:RAW_KEEP], len(body)
            elif body.strip():
                yield n, body, -1


def _json_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[int, str, dict | None, str | None]]:
    """(line, raw text, row or None, problem or None) per non-blank line of a JSON-lines file."""
    for n, data, oversize in _lines(path, max_row_bytes):
        raw = data.decode("utf-8", errors="backslashreplace")
        if oversize >= 0:
            yield n, raw, None, f"oversized row ({oversize} bytes > max_row_bytes={max_row_bytes})"
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            yield n, raw, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            yield n, raw, None, f"malformed JSON ({e.msg} at column {e.colno})"
            continue
        if not isinstance(row, dict):
            yield n, raw, None, f"not a JSON object (got {type(row).__name__})"
            continue
        yield n, raw, row, None


def _table_rows(rows: Iterable[dict], max_row_bytes: int) -> Iterator[tuple[int, str, dict | None, str | None]]:
    for n, row in enumerate(rows, start=1):
        raw = json.dumps(row, ensure_ascii=False, default=str)
        size = len(raw.encode("utf-8"))
        if size > max_row_bytes:
            yield n, raw[:RAW_KEEP], None, f"oversized row ({size} bytes > max_row_bytes={max_row_bytes})"
        else:
            yield n, raw, row, None


def _parquet_rows(path: Path) -> Iterator[dict]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _first_objects(path: Path, k: int = 5) -> list[dict]:
    out = []
    for _, _, row, _ in _json_rows(path, 10_000_000):
        if row is not None:
            out.append(row)
        if len(out) >= k:
            break
    return out


def guess_format(path: str | Path) -> str:
    """Guess a path's format from its content where possible.

    A folder is ``hf``; ``*.parquet`` is ``parquet``; JSON lines are classified by their first valid
    objects: ``task_id+prompt+test+entry_point`` is humaneval, ``problem+answer+unique_id`` math500,
    ``problem+solution`` math, ``question+answer`` with ``####`` gsm8k, anything else ``jsonl``.
    """
    p = Path(path)
    if p.is_dir():
        return "hf"
    if p.name.endswith(".parquet"):
        return "parquet"
    rows = _first_objects(p)
    if not rows:
        return "jsonl"

    def all_have(keys: set[str]) -> bool:
        return all(keys <= set(r) for r in rows)

    if all_have({"task_id", "prompt", "test", "entry_point"}):
        return "humaneval"
    if all_have({"problem", "answer", "unique_id"}):
        return "math500"
    if all_have({"problem", "solution"}):
        return "math"
    if all_have({"question", "answer"}) and all("####" in str(r["answer"]) for r in rows):
        return "gsm8k"
    return "jsonl"


def split_from_name(path: str | Path, fmt: str) -> str:
    """``train``/``test`` from the file (or folder) name, else the format's default."""
    words = set(re.split(r"[^a-z]+", Path(path).name.lower()))
    if "test" in words:
        return "test"
    if "train" in words:
        return "train"
    return "test" if fmt in _TEST_ONLY else "train"


def _text(row: dict, field: str, required: bool = True) -> str:
    if field not in row or row[field] is None:
        if required:
            raise _Bad(f"missing field {field!r}")
        return ""
    value = row[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _Bad(f"field {field!r} is not text (got {type(value).__name__})")
    value = value if isinstance(value, str) else str(value)
    if required and not value.strip():
        raise _Bad(f"empty field {field!r}")
    return value


def _level(value) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    m = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", str(value), re.IGNORECASE)
    level = int(m.group(1)) if m else None
    return level if level is not None and 1 <= level <= 5 else None


def _normalise(fmt: str, row: dict, fields: dict) -> tuple[str, str, str, int | None, dict]:
    """(question, answer, solution, level, meta) for one row, or raise _Bad."""
    if fmt == "gsm8k":
        question, full = _text(row, "question"), _text(row, "answer")
        if "####" not in full:
            raise _Bad("no '####' final answer in field 'answer'")
        reasoning, final = full.rsplit("####", 1)
        answer = final.strip().replace(",", "")
        if not answer:
            raise _Bad("empty final answer after '####'")
        return question, answer, reasoning.strip(), None, {}
    if fmt == "math":
        question, solution = _text(row, "problem"), _text(row, "solution")
        answer = last_boxed(solution)
        if answer is None or not answer.strip():
            raise _Bad("no \\boxed{...} answer in field 'solution'")
        meta = {k: row[k] for k in ("type", "source") if isinstance(row.get(k), str)}
        return question, answer.strip(), solution, _level(row.get("level")), meta
    if fmt == "math500":
        question, answer = _text(row, "problem"), _text(row, "answer")
        meta = {k: row[k] for k in ("subject", "unique_id") if isinstance(row.get(k), str)}
        return question, answer.strip(), _text(row, "solution", False), _level(row.get("level")), meta
    if fmt == "humaneval":
        question, test = _text(row, "prompt"), _text(row, "test")
        entry, canonical = _text(row, "entry_point"), _text(row, "canonical_solution", False)
        meta = {"entry_point": entry, "task_id": _text(row, "task_id", False), "canonical_solution": canonical}
        return question, test, canonical, None, meta
    question, answer = _text(row, fields["question"]), _text(row, fields["answer"])
    entry = _text(row, fields["entry_point"], False).strip()
    meta = {"entry_point": entry} if entry else {}
    solution = _text(row, fields["solution"], False)
    level = _level(row.get(fields["level"]))
    return question, answer.strip(), solution, level, meta


def read_source(path: str | Path, fmt: str | None = None, split: str | None = None,
                fields: dict | None = None, reward: str | None = None,
                max_row_bytes: int = 1_000_000, until_usable: bool = False
                ) -> tuple[list[PromptRecord], list[Rejected]]:
    """Read one file or saved ``datasets`` folder into records and rejects.

    Args:
        path: the file (``.jsonl``, ``.jsonl.gz``, ``.parquet``) or folder.
        fmt: one of ``FORMATS``; guessed from the content when None.
        split: ``train``/``test``; from the file name when None (see module docstring). A saved
            ``DatasetDict`` uses its own split names unless this is given (then only that split).
        fields: generic formats only: ``{question, answer, solution, level, entry_point}`` to row
            field names; missing keys keep their own name (solution/level/entry_point optional).
        reward: reward kind (one of ``REWARD_KINDS``); default per format, ``math`` for generic ones.
        max_row_bytes: rows larger than this are rejected.
        until_usable: stop at the first usable row (a cheap check that a file can be used at all).

    Returns:
        ``(records, rejected)``; every non-blank row read is in exactly one of them.
    """
    check_paths([path])
    p = Path(path)
    fmt = fmt or guess_format(p)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
    kind = reward or _DEFAULT_REWARD.get(fmt, "math")
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; allowed: {', '.join(REWARD_KINDS)}")
    if fields is not None and fmt in _DEFAULT_REWARD:
        raise ValueError(f"fields= maps generic formats (jsonl, parquet, hf), not {fmt!r}")
    bad_keys = set(fields or {}) - set(FIELD_KEYS)
    if bad_keys:
        raise ValueError(f"unknown fields keys {sorted(bad_keys)}; allowed: {', '.join(FIELD_KEYS)}")
    mapped = {k: k for k in FIELD_KEYS} | dict(fields or {})
    if max_row_bytes < 1:
        raise ValueError(f"max_row_bytes must be >= 1, got {max_row_bytes}")
    if p.is_dir() != (fmt == "hf"):
        raise ValueError(f"format {fmt!r} does not fit {'folder' if p.is_dir() else 'file'} {p}")

    if fmt == "hf":
        import datasets

        loaded = datasets.load_from_disk(str(p))
        parts = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {None: loaded}
        if split is not None and None not in parts:
            if split not in parts:
                raise ValueError(f"split {split!r} not in {p}; it has: {', '.join(parts)}")
            parts = {split: parts[split]}
        streams = [(f"{p.name}/{name}" if name else p.name, split or name or split_from_name(p, fmt),
                    _table_rows(ds, max_row_bytes)) for name, ds in parts.items()]
    elif fmt == "parquet":
        streams = [(p.name, split or split_from_name(p, fmt), _table_rows(_parquet_rows(p), max_row_bytes))]
    else:
        streams = [(p.name, split or split_from_name(p, fmt), _json_rows(p, max_row_bytes))]

    records: list[PromptRecord] = []
    rejected: list[Rejected] = []
    for label, part_split, rows in streams:
        for line, raw, row, problem in rows:
            try:
                if problem is not None:
                    raise _Bad(problem)
                question, answer, solution, level, meta = _normalise(fmt, row, mapped)
                if kind == "code" and not meta.get("entry_point"):
                    raise _Bad(f"reward 'code' needs an entry point (field {mapped['entry_point']!r})")
                if not can_parse(kind, answer):
                    raise _Bad(f"answer the {kind!r} verifier cannot parse: {answer[:200]!r}")
            except _Bad as e:
                rejected.append(Rejected(source=str(path), line=line, reason=f"{label}:{line}: {e}", raw=raw))
                continue
            records.append(PromptRecord(id=prompt_id(question, answer), source=str(path), split=part_split,
                                        question=question, answer=answer, solution=solution, level=level,
                                        reward=kind, meta={**meta, "line": line}))
            if until_usable:
                return records, rejected
    return records, rejected


def dedupe(records: Iterable[PromptRecord]) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Keep the first record of each id; return ``(unique, duplicates)`` in input order."""
    seen: set[str] = set()
    unique, dups = [], []
    for r in records:
        (dups if r.id in seen else unique).append(r)
        seen.add(r.id)
    return unique, dups
