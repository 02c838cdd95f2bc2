"""The final model's registration in MLflow's model registry: whether the quality gate lets it register
(:func:`refusal`), the registered version's tags (with those the champion rule reads: :func:`champion_tags`) and
description, and what became of it in words
(:func:`registration`). The report stage (tasks/stages.py) registers through the run's tracker
(tasks/records/tracking/); this module computes what it sends, without MLflow.
"""

from __future__ import annotations

import hashlib
import json

from tasks.evaluation.heldout import EvalResult
from tasks.records.tracking import pending_registration
from tasks.run import Run
from tasks.training.step_records import TrainSummary


def refusal(start_acc: float, end_acc: float, tolerance: float | None) -> str | None:
    """Why the quality gate refuses to register a trained model (``tracking.register_tolerance``), or None."""
    if tolerance is None or end_acc >= start_acc - tolerance:
        return None
    return (f"held-out greedy accuracy {end_acc:.3f} is below the starting model's {start_acc:.3f} by more than "
            f"tracking.register_tolerance={tolerance}")


def registration(name: str, register: bool, version: str | None, refused: str | None) -> str:
    """What became of the final model, in words: ``registered <name> version <v>`` or why not (``register``:
    ``tracking.register_model``; ``refused``: the quality gate's reason, :func:`refusal`)."""
    return (f"registered {name} version {version}" if version is not None
            else "not registered: tracking.register_model=false" if not register
            else f"not registered: {refused}" if refused
            else pending_registration(name))  # the tracker says it registered once it has sent it


def config_tags(cfg) -> dict[str, str]:
    """A model version's config tag: the resolved config's hash (the config itself is the run's
    ``config.json`` artifact; as a tag it would push the lineage tags out of the registry's view)."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return {"config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def version_tags(run: Run, end: EvalResult, summary: TrainSummary) -> dict[str, str]:
    """A registered version's tags: the run, its lineage (``parent_version`` only when it continues one; the data's
    fingerprint), its steps, config hash, held-out greedy accuracy (``heldout_accuracy``, 4 decimals), the
    precision it trained in and its weights' dtype (``weights_dtype``: the compute dtype, bf16 under bf16-mixed)."""
    info = run.info
    precision = run.precision
    return {"rlsift.run_id": run.run_id, **({"parent_version": info.parent_version} if info.parent_version else {}),
            **({"data_fingerprint": info.data_fingerprint} if info.data_fingerprint else {}),
            "steps": str(summary.steps), "heldout_accuracy": f"{end.overall.greedy_acc:.4f}",
            "precision": precision.name, "weights_dtype": str(precision.compute).removeprefix("torch."),
            **config_tags(run.cfg)}


def version_description(run: Run, start: EvalResult, end: EvalResult, summary: TrainSummary) -> str:
    """A registered version's description: what trained it, what it started from and its held-out accuracy."""
    name = f" ({run.tracker.name})" if run.tracker.name else ""
    origin = (f"continues version {run.info.parent_version}" if run.info.parent_version
              else f"started from {run.info.policy_path}" if run.info.policy_path else "")
    return (f"Trained by rlsift run {run.run_id}{name}, {summary.steps} steps{'; ' + origin if origin else ''}. "
            f"Held-out greedy accuracy {start.overall.greedy_acc:.3f} -> {end.overall.greedy_acc:.3f} "
            f"on {end.overall.n} prompts.")


def eval_fingerprint(end: EvalResult, cfg) -> str:
    """sha256 of what a held-out greedy accuracy depends on besides the model: the evaluated prompts (sorted ids),
    the longest completion and the system prompt. Two versions with equal fingerprints were evaluated alike."""
    what = {"prompts": sorted(end.prompt_ids), "max_new_tokens": cfg.rollout.max_new_tokens,
            "system_prompt": cfg.model.system_prompt}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def champion_tags(run: Run, start: EvalResult, end: EvalResult, summary: TrainSummary) -> dict[str, str]:
    """The tags the champion rule reads (tasks/records/tracking/champion.py): the evaluation's fingerprint
    (:func:`eval_fingerprint`) and size, the held-out accuracy at the run's start (a retrain's: its parent's on the
    same prompts), and ``rlsift.short_run``: ``true`` for fewer than ``tracking.champion_min_steps`` steps (a short
    run is never champion)."""
    short = summary.steps < run.cfg.tracking.champion_min_steps
    return {"eval_fingerprint": eval_fingerprint(end, run.cfg), "eval_n": str(end.overall.n),
            "heldout_accuracy_start": f"{start.overall.greedy_acc:.4f}", "rlsift.short_run": str(short).lower()}
