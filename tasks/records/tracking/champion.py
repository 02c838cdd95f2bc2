"""The champion rule: which registered version the ``champion`` alias (MLflow model aliases) names, the version that
``retrain`` continues (flows/retrain.py). No MLflow here: tasks/records/tracking/registry.py ``crown`` applies it.

Every registered version is a candidate. The alias moves to a new version only when

1. it is not a short run (tag ``rlsift.short_run=true``: trained fewer than ``tracking.champion_min_steps`` steps,
   tasks/report/registration.py ``champion_tags``), and
2. its held-out greedy accuracy (tag ``heldout_accuracy``) is higher than the champion's *on the same evaluation*:
   either both were evaluated on the same prompts with the same settings (equal ``eval_fingerprint``), or the new
   version was trained from the champion (``parent_version``), whose accuracy its own run measured at its start on
   its own prompts (``heldout_accuracy_start``: a retrain's test set grows with the data, so its fingerprint moves).

With no champion yet the first version that is not a short run becomes champion. Ties stay with the champion.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The alias of the version retrain continues.
CHAMPION = "champion"
#: The version tag that says what the rule decided for it, in words.
VERDICT_TAG = "rlsift.champion"


@dataclass(frozen=True)
class Verdict:
    """What the rule decided for a version: ``crown`` (the alias moves to it) and why, in words."""

    crown: bool
    reason: str


def verdict(version: str, tags: dict[str, str], champion: str | None, champion_tags: dict[str, str]) -> Verdict:
    """The rule (module docstring) for ``version`` with ``tags`` against the current ``champion`` version (None:
    none yet) with ``champion_tags``."""
    if champion == version:
        return Verdict(True, f"champion (version {version})")
    if tags.get("rlsift.short_run") == "true":
        return Verdict(False, f"candidate: a short run ({tags.get('steps', '?')} steps), never champion")
    acc = _accuracy(tags, "heldout_accuracy")
    if acc is None or not tags.get("eval_fingerprint"):
        return Verdict(False, "candidate: no held-out evaluation recorded")
    if champion is None:
        return Verdict(True, f"champion: the first full run's version (held-out accuracy {acc:.4f})")
    theirs = _accuracy(champion_tags, "heldout_accuracy")
    if theirs is not None and tags["eval_fingerprint"] == champion_tags.get("eval_fingerprint"):
        how = (f"than champion version {champion}'s {theirs:.4f} on the same evaluation "
               f"({tags.get('eval_n', '?')} prompts)")
    elif tags.get("parent_version") == champion and (theirs := _accuracy(tags, "heldout_accuracy_start")) is not None:
        how = (f"than champion version {champion}'s {theirs:.4f}, which this run trained from and evaluated on the "
               f"same prompts at its start")
    else:
        return Verdict(False, f"candidate: not comparable with champion version {champion} (evaluated on other "
                              "prompts or settings, and not trained from it)")
    if acc > theirs:
        return Verdict(True, f"champion: held-out accuracy {acc:.4f} higher {how}")
    return Verdict(False, f"candidate: held-out accuracy {acc:.4f} not higher {how}")


def _accuracy(tags: dict[str, str], key: str) -> float | None:
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None
