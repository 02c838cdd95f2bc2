"""The retrain flow: ingest only what is new, continue from the champion model, register its child.

Three retrains in one temporary root with a tiny smoke config: the first has no registered model and trains
on every prompt (version 1, champion: the first full run's); the second sees a second source and trains only on its
prompts, starting from the champion, version 1 (version 2, parent 1); the third finds nothing new and skips.
"""

import json
from pathlib import Path

import pytest
import torch

from flows.retrain import run_retrain
from tasks.records.ledger import Ledger
from tasks.records.tracking import default_uri, model_version_tags, run_info

TINY = ["model.warmstart.steps=2", "model.hidden=64", "model.heads=2", "model.layers=1", "rollout.n=2",
        "rollout.max_new_tokens=6", "train.steps=1", "train.prompts_per_step=4", "train.round_steps=1",
        "calibrate.k=4", "calibrate.g=2", "eval.samples=0",
        "tracking.champion_min_steps=1"]  # one step is a full run here: its version may be champion
FIRST = "data.sources=[{kind: bundled, n_train: 12, n_test: 4, seed: 0}]"
SECOND = ("data.sources=[{kind: bundled, n_train: 12, n_test: 4, seed: 0}, "
          "{kind: bundled, n_train: 6, n_test: 2, seed: 1}]")


def test_retrain_continues_from_the_registered_model_on_new_prompts(smoke_cfg, prefect_harness, tmp_path):
    torch.set_num_threads(1)
    first = run_retrain(smoke_cfg(*TINY, FIRST))
    assert first.status == "completed" and first.model_version == "1"
    assert first.parent_version == ""
    assert first.ingest["new"] == 16 and first.ingest["train"] == 12  # 12 train + 4 test prompts, all new

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=default_uri(smoke_cfg().paths.root))
    assert str(client.get_model_version_by_alias("rlsift-policy", "champion").version) == "1"
    assert model_version_tags(default_uri(smoke_cfg().paths.root), "rlsift-policy", "1")["rlsift.short_run"] == "false"
    cfg = smoke_cfg(*TINY, SECOND)
    second = run_retrain(cfg)
    assert second.status == "completed", second.to_dict()
    assert second.model_version == "2" and second.parent_version == "1"
    # only the second source's prompts are new; its 6 train prompts are the whole pool
    assert second.ingest["new"] == 8 and second.ingest["train"] == 6
    uri = default_uri(cfg.paths.root)
    tags = model_version_tags(uri, cfg.tracking.model_name, "2")
    assert tags["parent_version"] == "1" and "parent_version" not in model_version_tags(uri, "rlsift-policy", "1")
    assert tags["heldout_accuracy_start"] == f"{second.eval_accuracy_start:.4f}"  # v1 on this run's prompts
    assert tags["rlsift.champion"].startswith(("champion: held-out accuracy", "candidate: held-out accuracy"))
    assert tags["heldout_accuracy"] == f"{second.eval_accuracy_end:.4f}"
    described = MlflowClient(tracking_uri=uri).get_model_version("rlsift-policy", "2").description
    assert f"Trained by rlsift run {second.run_id} (retrain from v1 grpo " in described
    assert "continues version 1" in described and f"{second.eval_accuracy_end:.3f} on 6 prompts" in described
    assert tags["data_fingerprint"] == second.data_fingerprint != first.data_fingerprint
    assert "config" not in tags and len(tags["config_sha256"]) == 64  # the config itself: the run's artifact
    assert "config.json" in run_info(uri, second.mlflow_run_id)["artifacts"]
    saved = json.loads((Path(second.run_dir) / "config.json").read_text())
    assert saved["model"]["path"].endswith("/models/rlsift-policy/v1/model")  # the MLflow Model's checkpoint
    assert run_info(uri, second.mlflow_run_id)["tags"]["mlflow.runName"].startswith("retrain from v1 grpo ")
    with Ledger(f"{cfg.paths.root}/ledger.duckdb", read_only=True) as ledger:
        trained = {r["prompt_id"] for r in ledger.query("SELECT prompt_id FROM groups WHERE run_id = ?",
                                                        [second.run_id])}
        new_ids = {r["prompt_id"] for r in ledger.query(
            "SELECT prompt_id FROM prompts WHERE first_run_id = ? AND split = 'train'", [second.run_id])}
    assert trained and trained <= new_ids
    # the second run started from version 1's weights: its starting evaluation used them
    info = run_info(uri, second.mlflow_run_id)
    assert info["tags"]["rlsift.parent_version"] == "1" and info["status"] == "FINISHED"
    # cost accounting reaches MLflow and the ledger (the training loop's phases add up to the train stage)
    assert info["metrics"]["cost/usd"] == pytest.approx(second.cost_usd) and second.cost_usd > 0
    from mlflow.artifacts import download_artifacts

    table = json.loads(Path(download_artifacts(run_id=second.mlflow_run_id, artifact_path="cost_by_stage.json",
                                               tracking_uri=uri, dst_path=str(tmp_path / "got"))).read_text())
    costs = {r[0]: dict(zip(table["columns"], r, strict=True)) for r in table["data"]}  # one table, not a chart each
    assert costs["rollout"]["device_hours"] > 0 and costs["total"]["usd"] == pytest.approx(second.cost_usd, abs=1e-5)
    with Ledger(f"{cfg.paths.root}/ledger.duckdb", read_only=True) as ledger:
        stages = {r["stage"]: r for r in ledger.query("SELECT * FROM stages WHERE run_id = ?", [second.run_id])}
    assert {"ingest", "prepare", "eval_start", "calibrate", "train", "eval_end"} <= set(stages)
    assert "score" not in stages  # plain GRPO reads no embedding or angle: its pool is not scored
    assert stages["train"]["wall_s"] > 0 and stages["train"]["device"] == second.device

    third = run_retrain(cfg)
    assert third.status == "skipped" and third.model_version is None
    assert third.ingest["new"] == 0
    with Ledger(f"{cfg.paths.root}/ledger.duckdb", read_only=True) as ledger:
        status = ledger.query("SELECT status FROM runs WHERE run_id = ?", [third.run_id])[0]["status"]
    assert status == "skipped"


def test_retrain_rejects_an_unknown_pool(smoke_cfg):
    with pytest.raises(ValueError, match="pool must be 'new' or 'all'"):
        run_retrain(smoke_cfg(*TINY), pool="everything")
