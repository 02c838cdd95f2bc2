"""The ``retrain`` flow: continue the champion model on the prompts that arrived since the last run.

One retrain (scheduled nightly by the ``retrain`` deployment, infra/prefect.yaml):

1. **Parent.** The champion of ``tracking.model_name`` in the MLflow model registry (``models:/<name>@champion``:
   the version with the best held-out accuracy on a like evaluation, never a short run;
   tasks/records/tracking/champion.py) is downloaded to ``<paths.root>/models/<name>/v<version>`` and becomes the
   run's starting policy (``model.path``). With no champion yet (no version, or only short runs), the run starts
   like the pipeline (the configured policy), and says so.
2. **Ingest.** Every configured source is read; the ledger keeps prompts by content id, so only prompts
   it did not know are new (``IngestResult.new_ids``). With ``pool="new"`` (default) training uses only
   those; with ``pool="all"`` every train prompt of the sources. No new train prompt: the run is recorded
   with status ``skipped`` and nothing is trained or registered.
3. **Train, evaluate, register** exactly as the pipeline (flows/pipeline.py ``execute``); the new model
   version is tagged with ``parent_version``, ``data_fingerprint`` (sha256 of the sorted train and test
   prompt ids) and the config's hash (``config_sha256``; the config is the run's ``config.json`` artifact).

The evaluation uses the sources' whole test split (old and new prompts), so versions stay comparable.
A crashed retrain resumes with ``rlsift run --resume RUN_ID`` like any run (the lineage is kept in the
run folder's ``info.json``). Retrains of one root must not overlap (the ledger has one writer): the
deployment's concurrency limit is 1.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger

from flows.pipeline import claim_flow_run, execute
from flows.summary import RunSummary
from tasks.config import Config
from tasks.config.load import load_config, validate
from tasks.records.label import run_label
from tasks.records.tracking import CHAMPION, champion_model, default_uri
from tasks.run import open_run

log = logging.getLogger("rlsift")


def parent_model(cfg: Config) -> tuple[str, str] | None:
    """(version, local folder) of the champion of ``cfg.tracking.model_name`` (``models:/<name>@champion``), or
    None when it has none."""
    root = Path(cfg.paths.root).resolve()
    uri = cfg.tracking.uri or default_uri(root)
    name = cfg.tracking.model_name
    return champion_model(uri, name, dst=root / "models" / name)


def run_retrain(cfg: Config, pool: Literal["new", "all"] = "new") -> RunSummary:
    """One retrain on ``cfg`` (see the module docstring). Returns the run summary (``status`` ``completed``
    or ``skipped``; ``model_version`` and ``parent_version`` of what was registered)."""
    if pool not in ("new", "all"):
        raise ValueError(f"pool must be 'new' or 'all'; got {pool!r}")
    parent = parent_model(cfg)
    if parent is not None:
        tree = cfg.model_dump(mode="json")
        tree["model"]["path"] = parent[1]
        cfg = validate(tree)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    run = open_run(cfg, run_name=f"retrain {'from v' + parent[0] if parent else 'first'} {run_label(cfg)} {stamp}")
    run.info = replace(run.info, flow="retrain", parent_version=parent[0] if parent else "",
                       parent_path=parent[1] if parent else "")
    run.save_info()
    run.tracker.set_tags({"rlsift.flow": "retrain", "rlsift.parent_version": run.info.parent_version})
    claim_flow_run(run)
    log.info("retrain %s: starting from %s", run.run_id,
             f"models:/{cfg.tracking.model_name}@{CHAMPION} (version {parent[0]})" if parent else
             f"the configured policy ({cfg.model.path or 'the built-in tiny policy'}): {cfg.tracking.model_name} has "
             f"no {CHAMPION} yet (no version, or only short runs and versions not comparable)")
    return execute(run, only_new=pool == "new")


@flow(name="retrain", log_prints=True)
def retrain(config: str | None = None, overrides: list[str] | None = None,
            pool: Literal["new", "all"] = "new") -> dict:
    """Continue the champion model (``models:/<name>@champion``) on the new prompts of the configured sources. Returns
    :meth:`~flows.summary.RunSummary.to_dict`."""
    cfg = load_config(config, list(overrides or []))
    summary = run_retrain(cfg, pool=pool)
    logger = get_run_logger()
    if summary.status == "skipped":
        logger.info("retrain %s: %s; nothing trained", summary.run_id, summary.reason)
    else:
        logger.info("retrain %s %s: v%s -> v%s, accuracy %.3f -> %.3f", summary.run_id, summary.status,
                    summary.parent_version or "-", summary.model_version,
                    summary.eval_accuracy_start, summary.eval_accuracy_end)
    return summary.to_dict()
