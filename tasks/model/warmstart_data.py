"""The warm start's training data (tasks/model/warmstart.py): the worked solutions it draws, their hash, and that hash
kept in the cache (and, for the shipped warm start's recipe, beside it) by the recipe that draws them, so that a run
finds its warm start (cached or shipped) without drawing the default's 76,800 records (4.5 s of a run's prepare
stage): they are drawn only to train."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from tasks.data import arith
from tasks.data.prompts import PromptRecord
from tasks.records.files import write_json

log = logging.getLogger(__name__)


def sft_records(seed: int, n: int, mix: str = "warmstart", flawed: float = 0.0) -> list[PromptRecord]:
    """The warm start's training data: ``n`` train-split worked solutions of ``mix``, repeats allowed.

    With ``n = steps * batch_size`` every step sees new draws (the small level-1 space repeats, by design).
    ``flawed`` is the share of demonstrations, among those where it changes the answer, that make the
    procedural slip of ``arith.flawed_solution`` (left to right, ignoring precedence and parentheses), with
    its wrong final answer: real supervised data carries habits like this, and removing them is the job RL
    with a verifier does well. The record keeps its question and true ``answer``; only the solution slips.
    """
    if not 0.0 <= flawed <= 1.0:
        raise ValueError(f"flawed must lie in [0, 1], got {flawed!r}")
    recs = arith.generate(seed, n, "train", mix, unique=False)
    if not flawed:
        return recs
    rng = random.Random(f"rlsift-warmstart-flawed:{seed}")
    out = []
    for r in recs:
        slip = arith.flawed_solution(r.question, r.level, int(r.answer)) if rng.random() < flawed else None
        out.append(dataclasses.replace(r, solution=slip.solution) if slip else r)
    return out


@dataclasses.dataclass(frozen=True)
class SftRecipe:
    """The warm start's data as :func:`sft_records` draws it (its arguments). Drawing the default's 76,800 records
    takes about 4.5 s on a CPU core, and a run needs only their hash to find its warm start, cached or shipped:
    :func:`recipe_data_hash` keeps that hash beside the cache, and the records are drawn again only to train."""

    seed: int
    n: int
    mix: str = "warmstart"
    flawed: float = 0.0

    def records(self) -> list[PromptRecord]:
        return sft_records(self.seed, self.n, self.mix, self.flawed)

    def key(self) -> str:
        """sha256 of the arguments and of what draws the records from them: the task's generator
        (tasks/data/arith.py) and this module (:func:`sft_records`), each file whole, and Python's version (its
        ``random`` draws them). A change of any of these is another key, so a kept hash is never one of other data
        (an edit of either file that draws the same records costs one more draw; the warm start's training code,
        tasks/model/warmstart.py, is not in the key)."""
        code = hashlib.sha256(Path(arith.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()
        blob = json.dumps({"recipe": dataclasses.asdict(self), "code": code, "python": list(sys.version_info[:2])},
                          sort_keys=True)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def data_hash(records: Sequence[PromptRecord]) -> str:
    """sha256 over the (question, solution) pairs in order: what the warm start actually trains on."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r.question, r.solution], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def kept_file(folder: str | Path, recipe: SftRecipe) -> Path:
    """Where ``folder`` (a cache, or a shipped warm start's folder) keeps the hash of ``recipe``'s records."""
    return Path(folder) / "sft-data" / f"{recipe.key()}.json"


def _kept(path: Path) -> str | None:
    try:
        kept = json.loads(path.read_text())["data_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kept if isinstance(kept, str) and len(kept) == 64 else None


def keep(recipe: SftRecipe, folder: str | Path, digest: str | None = None) -> Path:
    """Write the hash of ``recipe``'s records (``digest``, or drawn and hashed now) to ``folder``'s kept file, with
    the recipe and Python's version for a reader; the file's path."""
    path = kept_file(folder, recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"data_hash": digest or data_hash(recipe.records()), **dataclasses.asdict(recipe),
                      "python": list(sys.version_info[:2])})
    return path


def recipe_data_hash(recipe: SftRecipe, cache: str | Path,
                     shipped: Sequence[Path] = ()) -> tuple[str, list[PromptRecord] | None]:
    """:func:`data_hash` of ``recipe.records()``, kept in ``<cache>/sft-data/<recipe.key()>.json`` once computed;
    with the records where it drew them (None where the hash was kept). Where the cache keeps none, each of
    ``shipped`` (folders the repository ships, read only: the shipped warm start's keeps its recipe's) is looked
    in, so a machine's first run draws no record either. A kept file that cannot be read is computed again and
    replaced; one that cannot be written (a read-only cache) is logged and the run goes on."""
    path = kept_file(cache, recipe)
    for kept in (_kept(p) for p in (path, *(kept_file(f, recipe) for f in shipped))):
        if kept is not None:
            return kept, None
    records = recipe.records()
    digest = data_hash(records)
    try:
        keep(recipe, cache, digest)
    except OSError as err:
        log.warning("warm start: the data's hash not kept in %s (%s); the next run draws its records again",
                    path.parent, err)
    return digest, records
