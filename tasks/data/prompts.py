"""The normalised prompt record every source adapter produces, and the quarantine row for rejects."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

#: Reward kinds a record can ask for; ``tasks/data/rewards.py`` dispatches on this.
REWARD_KINDS = ("arith", "numeric", "math", "code")


def prompt_id(question: str, answer: str) -> str:
    """Stable id from a content hash of the question and answer (exact duplicates share it)."""
    h = hashlib.sha256(json.dumps([question, answer], ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class PromptRecord:
    """One verifiable prompt.

    Attributes:
        id: ``prompt_id(question, answer)``.
        source: where it came from (``bundled:default``, a file path, ...).
        split: ``train`` or ``test``.
        question: the prompt text shown to the policy (without chat template).
        answer: the reference final answer the verifier compares against (for code: the test code).
        solution: a worked reference solution ('' if none).
        level: difficulty level 1..5 when the source has one, else None.
        reward: one of ``REWARD_KINDS``.
        meta: small JSON-serialisable extras (entry_point for code, subject, line number, ...).
    """

    id: str
    source: str
    split: str
    question: str
    answer: str
    solution: str = ""
    level: int | None = None
    reward: str = "math"
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rejected:
    """A row that could not become a record: kept whole in the quarantine table with its reason."""

    source: str
    line: int
    reason: str
    raw: str
