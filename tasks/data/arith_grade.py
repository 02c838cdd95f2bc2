"""Grading a completion of the bundled arithmetic task (:mod:`tasks.data.arith`).

``verify`` gives 1.0 when the integer after the last final-answer marker equals the reference and every operation
line written before it is true arithmetic; a completion with no marker is judged by its last ``\\boxed{...}``
instead, so a real model prompted for a boxed answer can be scored on this task too.
"""

from __future__ import annotations

import re

from tasks.data.arith import MARKER, apply_op
from tasks.data.prompts import PromptRecord


def solution_steps(record: PromptRecord | str) -> list[str]:
    """The operation lines of a worked solution (everything before the final-answer marker)."""
    text = record if isinstance(record, str) else record.solution
    lines = []
    for line in text.splitlines():
        if line.startswith(MARKER):
            break
        if line.strip():
            lines.append(line.strip())
    return lines


_INT = re.compile(r"[+-]?\d+")


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(completion: str) -> str | None:
    """The marked final answer of a completion, stripped; None if there is none.

    The text after the last final-answer marker up to the end of its line; when the completion has no
    marker, the content of its last ``\\boxed{...}`` (what real models prompted for a boxed answer write).
    """
    at = completion.rfind(MARKER)
    if at < 0:
        boxed = _BOXED.findall(completion)
        return (boxed[-1].strip() or None) if boxed else None
    answer = completion[at + len(MARKER) :].split("\n", 1)[0].strip()
    return answer or None


_STEP = re.compile(r"(\d+)(\+|-|\*|//|%)(\d+)=(-?\d+)")


def wrong_steps(completion: str) -> int:
    """How many ``a op b=c`` lines before the final-answer marker are false arithmetic (other lines: ignored)."""
    bad = 0
    for line in solution_steps(completion):
        m = _STEP.fullmatch(line)
        if m:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            bad += (op in ("//", "%") and b == 0) or apply_op(op, a, b) != c
    return bad


def verify(completion: str, answer: str) -> float:
    """1.0 when the marked final answer is exactly the reference integer (``+5``/``05`` count as 5) and every
    operation line written before it is true arithmetic, else 0.0.

    The line check removes lucky answers: from the warm-started tiny policy at temperature 1, two thirds of
    the right answers at level 5 (whose ``%`` gives small, guessable results) came from a worked solution
    with a false line; rewarding them taught false arithmetic facts and cost the solved levels accuracy
    (docs/benchmarks.md, "Every idea tried", row "Line-checked reward").
    """
    got = extract_answer(completion)
    if got is None or not _INT.fullmatch(got) or not _INT.fullmatch(answer.strip()):
        return 0.0
    return 1.0 if int(got) == int(answer.strip()) and not wrong_steps(completion) else 0.0
