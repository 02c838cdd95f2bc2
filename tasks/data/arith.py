"""The bundled task: generated multi-step integer arithmetic with worked solutions and graded difficulty.

The embedded default of rlsift (README.md, "Two commands") needs a verifiable task
that runs offline, has difficulty levels a tiny character-level policy can partly master, and a reference
solution for the supervised warm start. This module is that task. It is our own construction (no paper); its choices:

- A problem is a flat expression of non-negative integers and the operators ``+ - * // %``, with at most
  one pair of parentheses, e.g. ``Q: 12+(40-7)*3=?``. The worked solution performs one operation per line
  in the usual order (the parenthesised group first, then ``* // %`` left to right, then ``+ -`` left to
  right) and ends with the final-answer marker, GSM8K style::

      40-7=33
      33*3=99
      12+99=111
      #### 111

- Every intermediate value lies in ``[0, LevelSpec.max_value]`` (subtraction never goes negative, the
  divisor of ``//`` and ``%`` lies between 2 and the dividend), so Python's floor semantics never
  surprise; an expression that breaks a rule is drawn again. Parentheses are only kept when they change
  which operations are done.
- Levels 1..5 (``LEVELS``) add operations, larger operands and harder operators. Prompt plus solution stay
  within ``MAX_CHARS`` characters, so a character-level model with a 256-token context fits every problem.
- Splits are disjoint by construction: a question belongs to ``test`` when a hash of its text falls in the
  first ``TEST_PERCENT`` percent, else to ``train``; ``generate`` draws until it has ``n`` questions of the
  requested split. Each level draws from its own seeded stream, so the problems of one level do not depend
  on the weights of the others. Within one call the questions are unique unless ``unique=False``.
- Level counts follow the mix exactly (largest-remainder rounding of ``n * weight``); the order is shuffled.
- Completions are graded in :mod:`tasks.data.arith_grade`.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tasks.data.prompts import PromptRecord, prompt_id

#: The final-answer marker; the answer is the rest of its line.
MARKER = "####"
#: Percent of the question space (by hash of the question text) that belongs to the ``test`` split.
TEST_PERCENT = 20
#: Upper bound on ``len(question) + len(solution)``; with the plain prompt format, BOS and EOS a problem
#: takes at most ``MAX_CHARS + 7`` tokens of a character-level model.
MAX_CHARS = 120
#: An instruction for policies with a chat template (the tiny default model does not use it).
INSTRUCTION = (
    "Compute the expression step by step, one operation per line, then give the final integer "
    f"on a last line that starts with '{MARKER} '."
)

_HIGH = ("*", "//", "%")  # evaluated before + and -


@dataclass(frozen=True)
class LevelSpec:
    """How one difficulty level draws its expressions.

    Attributes:
        n_ops: inclusive range of the number of operators.
        ops: operators to draw from (uniformly).
        need: at least one of these operators appears (one position is forced when none was drawn).
        add_max: operands that touch only ``+``/``-`` are drawn from ``[1, add_max]``.
        mul_max: operands next to ``*`` are drawn from ``[2, mul_max]``.
        div_max: the right operand of ``//``/``%`` is drawn from ``[2, div_max]``.
        paren: probability of drawing one parenthesised group (a draw whose parentheses change no operation
            is rejected, so fewer questions end up with parentheses).
        max_value: every intermediate result must lie in ``[0, max_value]``.
        slip_prone: keep only questions whose left-to-right reading (``flawed_solution``) gives another
            value, so that the level measures the warm start's habit rather than its arithmetic.
    """

    n_ops: tuple[int, int]
    ops: tuple[str, ...]
    need: tuple[str, ...] = ()
    add_max: int = 50
    mul_max: int = 9
    div_max: int = 9
    paren: float = 0.0
    max_value: int = 999
    slip_prone: bool = False


#: Difficulty levels 1..5. Tuned on the tiny default (0.86M-parameter Llama, ``tasks.model.warmstart`` defaults:
#: 1200 steps of 64 worked solutions of the ``warmstart`` mix, 70 percent of those that can slip worked left to
#: right): greedy accuracy on the test split 95 / 96 / 0.3 / 14 / 4 percent at the start, and after 100 steps of
#: plain GRPO 94 / 94 / 83 / 19 / 3 (docs/benchmarks.md, "Conventions", the task). Level 3 is
#: slip-prone (``a+b*c``, ``a-b*c``): its errors are the warm start's habit, which RL removes, not arithmetic facts,
#: which it does not teach a policy this small.
#: Level 1 has 2420 distinct questions (about 480 in ``test``), level 2 about 160k; levels 3-5 more.
LEVELS: dict[int, LevelSpec] = {
    1: LevelSpec(n_ops=(1, 1), ops=("+", "-"), add_max=40),
    2: LevelSpec(n_ops=(2, 2), ops=("+", "-"), add_max=40),
    3: LevelSpec(n_ops=(2, 2), ops=("+", "-", "*"), need=("*",), add_max=50, mul_max=12, slip_prone=True),
    4: LevelSpec(n_ops=(3, 3), ops=("+", "-", "*"), need=("*",), add_max=50, mul_max=12, paren=0.5),
    5: LevelSpec(
        n_ops=(3, 4), ops=("+", "-", "*", "//", "%"), need=("//", "%"), add_max=99, mul_max=30, div_max=19,
        paren=0.5, max_value=9999,
    ),
}

#: Named level mixes (weights need not sum to 1). ``default`` imitates a real RL pool: at the start about a third of
#: its prompts are nearly always solved (levels 1-2, 35 percent, 95 percent greedy), a third nearly never (levels
#: 4-5, 35 percent, 4-14 percent) and a third is where RL learns (level 3, 30 percent); plain GRPO's effective-group
#: ratio over 100 steps is 0.39, so it wastes most of its rollouts.
#: ``balanced`` puts 80 percent of the prompts at the partly solved levels 3-4.
#: ``warmstart`` is the supervised warm start's data (weighted to the easy levels, which it must master).
#: ``easy`` is a pool the policy has mostly learned: 80 percent at the solved levels 1-2, the rest at level 3.
MIXES: dict[str, dict[int, float]] = {
    "default": {1: 0.25, 2: 0.1, 3: 0.3, 4: 0.05, 5: 0.3},
    "balanced": {1: 0.0, 2: 0.1, 3: 0.4, 4: 0.4, 5: 0.1},
    "uniform": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0},
    "warmstart": {1: 0.3, 2: 0.3, 3: 0.2, 4: 0.1, 5: 0.1},
    "easy": {1: 0.45, 2: 0.35, 3: 0.2, 4: 0.0, 5: 0.0},
}

_SPLITS = ("train", "test")
_MAX_MISSES = 100_000  # consecutive rejected draws before a level is declared exhausted


@dataclass(frozen=True)
class Problem:
    """One generated problem: question text, worked solution lines and the final value."""

    question: str
    steps: tuple[str, ...]
    value: int

    @property
    def solution(self) -> str:
        return "\n".join((*self.steps, f"{MARKER} {self.value}"))


def apply_op(op: str, a: int, b: int) -> int:
    """``a op b`` for one of the task's operators (``+ - * // %``, Python's floor semantics)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "//":
        return a // b
    return a % b


def _reduce(nums: list[int], ops: list[str], steps: list[str], max_value: int, left_to_right: bool = False
            ) -> int | None:
    """Evaluates ``nums``/``ops`` in precedence order (or strictly left to right: the slip of
    ``flawed_solution``), appending one ``a op b=c`` line per operation.

    Returns the value, or None when an intermediate result leaves ``[0, max_value]`` or a division
    is degenerate (divisor below 2 or above the dividend).
    """
    nums, ops = list(nums), list(ops)
    while ops:
        i = 0 if left_to_right else next((k for k, op in enumerate(ops) if op in _HIGH), 0)
        a, op, b = nums[i], ops[i], nums[i + 1]
        if op in ("//", "%") and not 2 <= b <= a:
            return None
        c = apply_op(op, a, b)
        if not 0 <= c <= max_value:
            return None
        steps.append(f"{a}{op}{b}={c}")
        nums[i : i + 2] = [c]
        del ops[i]
    return nums[0]


def _evaluate(nums: list[int], ops: list[str], group: tuple[int, int] | None, max_value: int) -> Problem | None:
    """Builds the problem for an expression; ``group=(i, j)`` parenthesises ``nums[i..j]``."""
    steps: list[str] = []
    if group is None:
        text = str(nums[0]) + "".join(f"{op}{x}" for op, x in zip(ops, nums[1:], strict=True))
        value = _reduce(nums, ops, steps, max_value)
    else:
        i, j = group
        inner = _reduce(nums[i : j + 1], ops[i:j], steps, max_value)
        if inner is None:
            return None
        value = _reduce(nums[:i] + [inner] + nums[j + 1 :], ops[:i] + ops[j:], steps, max_value)
        parts = [str(x) for x in nums]
        parts[i], parts[j] = "(" + parts[i], parts[j] + ")"
        text = parts[0] + "".join(f"{op}{x}" for op, x in zip(ops, parts[1:], strict=True))
    if value is None:
        return None
    return Problem(question=f"{text}=?", steps=tuple(steps), value=value)


def _operand(rng: random.Random, spec: LevelSpec, left: str | None, right: str | None) -> int:
    if left in ("//", "%"):
        return rng.randint(2, spec.div_max)
    if "*" in (left, right):
        return rng.randint(2, spec.mul_max)
    return rng.randint(1, spec.add_max)


def draw_problem(rng: random.Random, level: int) -> Problem | None:
    """Draws one expression of ``level``; None when it breaks a rule (the caller draws again)."""
    spec = LEVELS[level]
    k = rng.randint(*spec.n_ops)
    ops = [rng.choice(spec.ops) for _ in range(k)]
    if spec.need and not any(op in spec.need for op in ops):
        ops[rng.randrange(k)] = rng.choice(spec.need)
    nums = [_operand(rng, spec, ops[i - 1] if i > 0 else None, ops[i] if i < k else None) for i in range(k + 1)]
    group = None
    if k >= 2 and rng.random() < spec.paren:
        i = rng.randrange(k)  # a group of at least two numbers that is not the whole expression
        j = rng.randint(i + 1, k - 1 if i == 0 else k)
        group = (i, j)
    problem = _evaluate(nums, ops, group, spec.max_value)
    if problem is not None and group is not None:
        flat = _evaluate(nums, ops, None, spec.max_value)
        if flat is not None and sorted(flat.steps) == sorted(problem.steps):
            return None  # redundant parentheses: the same operations, at most in another order
    if problem is None or len(problem.question) + len(problem.solution) > MAX_CHARS:
        return None
    if spec.slip_prone and _reduce(nums, ops, [], spec.max_value, left_to_right=True) in (None, problem.value):
        return None
    return problem


_TOKEN = re.compile(r"\d+|//|[-+*%]")


def flawed_solution(question: str, level: int, answer: int) -> Problem | None:
    """The worked solution of the commonest procedural slip: left to right, ignoring precedence and parentheses.

    The warm start imitates such slips when its demonstrations contain them (``tasks.model.warmstart``), the way a
    real policy copies its supervised data's habits; RL with the verifier is then what removes them.

    Args:
        question, level, answer: a generated problem's question text, level and right value.

    Returns:
        The slipped problem (same question, its own steps and wrong final value), or None when left-to-right
        order gives the right value anyway, or an intermediate leaves the level's range.
    """
    parts = _TOKEN.findall(question.split("=", 1)[0])
    nums, ops = [int(x) for x in parts[0::2]], parts[1::2]
    steps: list[str] = []
    acc = _reduce(nums, ops, steps, LEVELS[level].max_value, left_to_right=True)
    if acc is None or acc == answer:
        return None
    return Problem(question=question, steps=tuple(steps), value=acc)


def split_of(question: str) -> str:
    """The split a question belongs to, from a hash of its text (so splits never overlap)."""
    h = int(hashlib.sha256(("rlsift-arith\0" + question).encode("utf-8")).hexdigest()[:8], 16)
    return "test" if h % 100 < TEST_PERCENT else "train"


def resolve_mix(mix: str | Mapping) -> tuple[str, dict[int, float]]:
    """Validates a mix name or a ``{level: weight}`` mapping; returns (name, weights for levels 1..5).

    Raises:
        ValueError: unknown name, a key that is not a level 1..5, a negative or non-numeric weight, or all
            weights zero.
    """
    if isinstance(mix, str):
        if mix not in MIXES:
            raise ValueError(f"unknown arithmetic mix {mix!r}; allowed: {sorted(MIXES)} or a {{level: weight}} dict")
        return mix, dict(MIXES[mix])
    if not isinstance(mix, Mapping):
        raise ValueError(f"mix must be a name {sorted(MIXES)} or a {{level: weight}} dict, got {type(mix).__name__}")
    weights = dict.fromkeys(LEVELS, 0.0)
    for key, w in mix.items():
        level = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(level, bool) or level not in LEVELS:
            raise ValueError(f"mix key {key!r} is not a difficulty level; allowed keys: 1..{max(LEVELS)}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or w < 0:
            raise ValueError(f"mix weight for level {key!r} must be a non-negative number, got {w!r}")
        weights[level] = float(w)
    if sum(weights.values()) <= 0:
        raise ValueError(f"mix weights are all zero ({dict(mix)!r}); give at least one level a positive weight")
    return "custom", weights


def level_counts(n: int, weights: Mapping[int, float]) -> dict[int, int]:
    """Splits ``n`` over levels in proportion to ``weights`` (largest remainder; ties to the lower level)."""
    total = sum(weights.values())
    exact = {lv: n * w / total for lv, w in weights.items()}
    counts = {lv: int(x) for lv, x in exact.items()}
    by_remainder = sorted(exact, key=lambda lv: (-(exact[lv] - counts[lv]), lv))
    for lv in by_remainder[: n - sum(counts.values())]:
        counts[lv] += 1
    return counts


def generate(
    seed: int, n: int, split: str, mix: str | Mapping = "default", *, unique: bool = True
) -> list[PromptRecord]:
    """Generates ``n`` arithmetic prompt records of one split, deterministically for ``seed``.

    Args:
        seed: any integer; the same seed, split and mix give identical records.
        n: number of records (>= 0).
        split: ``train`` or ``test``; the two splits never share a question.
        mix: a name in ``MIXES`` or a ``{level: weight}`` dict (see ``resolve_mix``).
        unique: no repeated question within the result (a level with too small a question space raises).

    Returns:
        ``n`` records with ``reward="arith"``, ``source=f"bundled:{name}"`` (``custom`` for a dict), the level,
        the worked solution and the final integer as ``answer``; ``meta["steps"]`` is the number of operations.

    Raises:
        ValueError: bad ``n``, ``split`` or ``mix``, or a level that cannot supply enough unique questions.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    name, weights = resolve_mix(mix)
    records: list[PromptRecord] = []
    for level, count in level_counts(n, weights).items():
        rng = random.Random(f"rlsift-arith:{seed}:{split}:{level}")
        seen: set[str] = set()
        misses = 0
        while count > 0:
            p = draw_problem(rng, level)
            if p is None or split_of(p.question) != split or (unique and p.question in seen):
                misses += 1
                if misses > _MAX_MISSES:
                    raise ValueError(
                        f"level {level} ran out of distinct {split} questions after {len(seen)}; "
                        f"ask for fewer, lower its mix weight, or pass unique=False"
                    )
                continue
            misses = 0
            seen.add(p.question)
            count -= 1
            records.append(
                PromptRecord(
                    id=prompt_id(p.question, str(p.value)),
                    source=f"bundled:{name}",
                    split=split,
                    question=p.question,
                    answer=str(p.value),
                    solution=p.solution,
                    level=level,
                    reward="arith",
                    meta={"steps": len(p.steps)},
                )
            )
    random.Random(f"rlsift-arith:{seed}:{split}:order").shuffle(records)
    return records
