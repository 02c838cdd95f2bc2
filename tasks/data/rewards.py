"""Verifiable rewards: score a completion against a prompt record's reference answer (1.0 or 0.0).

Kinds (``tasks.data.prompts.REWARD_KINDS``):

* ``math``: equivalence through the math-verify library (HuggingFace, github.com/huggingface/Math-Verify),
  the verifier used by TRL's ``accuracy_reward`` and open-r1. The reference answer is wrapped as
  ``\\boxed{answer}`` before parsing (then ``$answer$``, then the bare text, if that gives nothing); the
  candidate's final answer is the content of the completion's last ``\\boxed{...}`` (nested braces
  handled), or failing that whatever math-verify extracts from the last ``tail_chars`` characters of
  the completion (it prefers "final answer is ..." and takes the rightmost match). Equivalence of
  LaTeX, fractions, intervals, sets and numbers is entirely math-verify's ``verify``; there is no
  hand-written normalisation here.
* ``numeric`` (GSM8K): the number after the last ``####``, else the last number inside the last
  ``\\boxed{}``, else the last number in the completion; thousands commas stripped; compared exactly
  as ``fractions.Fraction`` (so ``72``, ``72.0`` and ``$72`` agree).
* ``arith``: delegated to ``tasks.data.arith_grade.verify(completion, answer)`` (imported lazily).
* ``code``: the completion is turned into a program (``program_from_completion``) and run with the
  record's test code in ``tasks.data.sandbox``; 1.0 only for the verdict ``passed``.

math-verify's timeouts use ``signal.alarm``, which only works in the main thread of the main
interpreter. We pass ``parsing_timeout``/``timeout_seconds`` = ``MATH_TIMEOUT_S`` in the main thread
and ``None`` in any other thread (a Prefect worker thread, a thread pool): there a pathological
expression is not interrupted, so run math rewards from the main thread (``batch_rewards`` does, and
only fans out code jobs to threads) when inputs are untrusted.
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache

from tasks.data.prompts import REWARD_KINDS, PromptRecord
from tasks.data.sandbox import CodeJob, run_tests, score_many
from tasks.data.sandbox_confine import Limits

#: Seconds math-verify may spend on one parse or comparison (main thread only; see module docstring).
MATH_TIMEOUT_S = 5

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\b\s*")
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``, or None.

    Nested braces are matched; an unclosed last box gives None.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(text):
        return None
    if text[start] != "{":  # "\boxed 5" form: the next token
        token = re.match(r"[^\s$.,]+", text[start:])
        return token.group(0) if token else None
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : k]
    return None


def _timeout() -> int | None:
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=8192)
def _gold(answer: str, timeout: int | None) -> tuple:
    from math_verify import parse  # sympy's half-second import only for math rewards

    for wrapped in (f"\\boxed{{{answer}}}", f"${answer}$", answer):
        parsed = parse(wrapped, parsing_timeout=timeout)
        if parsed:
            return tuple(parsed)
    return ()


def _math_candidate(completion: str, timeout: int | None, tail_chars: int) -> list:
    from math_verify import parse

    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        parsed = parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(completion[-tail_chars:], parsing_timeout=timeout)


def math_reward(completion: str, answer: str, tail_chars: int = 2000) -> float:
    """1.0 if math-verify finds the completion's final answer equivalent to ``answer``, else 0.0."""
    timeout = _timeout()
    gold = _gold(answer, timeout)
    if not gold:
        return 0.0
    cand = _math_candidate(completion, timeout, tail_chars)
    if not cand:
        return 0.0
    from math_verify import verify

    return float(verify(list(gold), cand, timeout_seconds=timeout))


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number if it is exactly one (commas, spaces, ``$`` and ``%`` ignored)."""
    s = text.strip().replace(",", "").replace("$", "").rstrip("%").strip()
    if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_number(completion: str) -> Fraction | None:
    """The completion's final number: after the last ``####``, else in the last box, else the last one."""
    if "####" in completion:
        found = _NUMBER.search(completion.rsplit("####", 1)[1])
        return Fraction(found.group(0).replace(",", "")) if found else None
    span = last_boxed(completion)
    found = _NUMBER.findall(span if span is not None else completion)
    if not found and span is not None:
        found = _NUMBER.findall(completion)
    return Fraction(found[-1].replace(",", "")) if found else None


def numeric_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals ``answer`` exactly (as fractions), else 0.0."""
    ref = parse_number(answer)
    got = extract_number(completion)
    return float(ref is not None and got is not None and got == ref)


def program_from_completion(prompt: str, completion: str, entry_point: str) -> str:
    """The program to test: a fenced code block if any, and the prompt prepended (HumanEval style).

    If the code defines ``entry_point`` itself it follows the prompt (whose docstring-only function it
    redefines, keeping the prompt's imports and helpers); otherwise it is the function body that
    continues the prompt.
    """
    blocks = _FENCE.findall(completion)
    code = completion
    if blocks:
        defining = [b for b in blocks if re.search(rf"^\s*def {re.escape(entry_point)}\s*\(", b, re.M)]
        code = defining[0] if defining else blocks[0]
    if re.search(rf"^def {re.escape(entry_point)}\s*\(", code, re.M):
        return prompt + "\n" + code
    return prompt + code


def _check(kind: str) -> None:
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; allowed: {', '.join(REWARD_KINDS)}")


def _code_job(completion: str, record: PromptRecord) -> CodeJob:
    entry = record.meta.get("entry_point")
    if not entry:
        raise ValueError(f"record {record.id} has reward 'code' but no meta['entry_point']")
    return CodeJob(program_from_completion(record.question, completion, entry), record.answer, entry,
                   context=record.question)


def reward(kind: str, completion: str, record: PromptRecord, limits: Limits | None = None) -> float:
    """Score one completion.

    Args:
        kind: one of ``REWARD_KINDS`` (usually ``record.reward``).
        completion: the policy's text.
        record: the prompt record holding the reference ``answer`` (test code for ``code``).
        limits: sandbox limits for ``code``.

    Returns:
        1.0 when verified correct, else 0.0.
    """
    _check(kind)
    if kind == "math":
        return math_reward(completion, record.answer)
    if kind == "numeric":
        return numeric_reward(completion, record.answer)
    if kind == "arith":
        from tasks.data.arith_grade import verify as arith_verify

        return float(arith_verify(completion, record.answer))
    job = _code_job(completion, record)
    return float(run_tests(job.program, job.test, job.entry_point, limits=limits, context=job.context).passed)


def batch_rewards(records: Sequence[PromptRecord], completions: Sequence[str], workers: int = 4,
                  kinds: Sequence[str] | None = None, limits: Limits | None = None) -> list[float]:
    """Score N completions; code jobs run in parallel in the sandbox, the rest in the calling thread.

    Args:
        records: N records (one per completion; repeat a record for its G rollouts).
        completions: N completions.
        workers: parallel sandbox processes for code rewards.
        kinds: N reward kinds; default each record's ``reward``.
        limits: sandbox limits for code rewards.

    Returns:
        N rewards in input order.
    """
    if len(records) != len(completions):
        raise ValueError(f"records and completions differ in length: {len(records)} vs {len(completions)}")
    kinds = [r.reward for r in records] if kinds is None else list(kinds)
    if len(kinds) != len(records):
        raise ValueError(f"kinds has length {len(kinds)}, expected {len(records)}")
    for k in set(kinds):
        _check(k)
    out = [0.0] * len(records)
    code_idx = [i for i, k in enumerate(kinds) if k == "code"]
    jobs = [_code_job(completions[i], records[i]) for i in code_idx]
    for i, k in enumerate(kinds):
        if k != "code":
            out[i] = reward(k, completions[i], records[i])
    for i, v in zip(code_idx, score_many(jobs, workers=workers, limits=limits), strict=False):
        out[i] = float(v.passed)
    return out


def can_parse(kind: str, answer: str) -> bool:
    """Whether the ``kind`` verifier can use ``answer`` as a reference (ingest rejects rows where not).

    ``math``: math-verify extracts something from it; ``numeric``/``arith``: it is one number;
    ``code``: it is valid Python defining a top-level ``check`` function.
    """
    _check(kind)
    if not isinstance(answer, str) or not answer.strip():
        return False
    if kind == "math":  # a plain number needs no sympy parse (about 1 ms a row: minutes on a million-row pool)
        return parse_number(answer) is not None or bool(_gold(answer, _timeout()))
    if kind in ("numeric", "arith"):
        return parse_number(answer) is not None
    try:
        tree = ast.parse(answer)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body)
