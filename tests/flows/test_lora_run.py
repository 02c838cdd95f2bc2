"""LoRA end to end (``model.lora``): a LoRA run learns the bundled task; its registered version loads from MLflow's
registry as a full model; ``retrain`` continues from that version with new adapters; a crash mid-run resumes to
the uninterrupted run's adapters."""

import json
from pathlib import Path

import pytest
import torch

from tests.flows.conftest import ROOT, cli_env, rlsift

LORA = ["model.lora.enabled=true", "model.lora.rank=8", "train.lr=2e-3"]


def test_a_lora_run_learns_the_bundled_task_and_registers_a_full_model(tmp_path):
    """From the shipped warm start (level 3, a+b*c, at about 2 %), 10 LoRA steps lift level 3: a run whose adapters
    never trained would end exactly where it started (greedy evaluation)."""
    import mlflow
    from safetensors.torch import load_file

    root = tmp_path / "root"
    out = rlsift("run", "-c", str(ROOT / "conf" / "smoke.yaml"), *LORA, "train.steps=10", "eval.every=0",
                 f"paths.root={root}", "--json", env=cli_env(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout)
    assert s["status"] == "completed" and s["model_version"] == "1"
    assert s["eval_by_level_start"]["3"] < 0.05 and s["eval_by_level_end"]["3"] >= 0.1
    assert s["eval_paired"]["turned_right"] > 10
    metrics = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 10 and metrics[0]["train/grad_norm"] > 0
    # the saved and registered model is the full merged model, loadable by models:/ URI
    weights = load_file(Path(s["model_path"]) / "model.safetensors")
    assert not any("lora" in k for k in weights)
    mlflow.set_tracking_uri(s["tracking_uri"])
    pipe = mlflow.transformers.load_model("models:/rlsift-policy/1")
    assert type(pipe.model).__name__ == "LlamaForCausalLM"
    for k, v in pipe.model.state_dict().items():
        if k in weights:
            assert torch.equal(v.cpu(), weights[k]), k
    start = load_file(ROOT / "assets" / "tiny-warmstart" / "model.safetensors")
    assert any(not torch.equal(start[k], weights[k]) for k in start)  # the merged adapters moved the weights


def test_retrain_continues_from_a_lora_version_with_new_adapters(smoke_cfg, prefect_harness):
    from flows.retrain import run_retrain
    from tests.flows.test_retrain import FIRST, SECOND, TINY

    lora = ["model.lora.enabled=true", "model.lora.rank=2"]
    first = run_retrain(smoke_cfg(*TINY, *lora, FIRST))
    assert first.status == "completed" and first.model_version == "1"
    second = run_retrain(smoke_cfg(*TINY, *lora, SECOND))
    assert second.status == "completed" and second.model_version == "2" and second.parent_version == "1"
    saved = json.loads((Path(second.run_dir) / "config.json").read_text())
    assert saved["model"]["path"].endswith("/models/rlsift-policy/v1/model") and saved["model"]["lora"]["enabled"]


def test_a_lora_run_killed_mid_run_resumes_to_the_uninterrupted_adapters(smoke_cfg, monkeypatch):
    """The update fails at step 3 (after the checkpoint of step 2); the resume loads the adapters and their AdamW
    state from it and ends with the uninterrupted run's weights, bit for bit (CPU, in process)."""
    from tasks.model.lora import apply_lora
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training import checkpoint
    from tasks.training.entry import train
    from tasks.update.policy_update import LocalUpdater
    from tests.tasks.test_train import SMALL, make_policy, text_reward

    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)
    from tasks.data import arith

    prompts = arith.generate(0, 40, "train", "default")
    cfg = smoke_cfg(*SMALL, "train.checkpoint_every=1", "model.lora.enabled=true", "model.lora.rank=4",
                    "train.lr=1e-2", "train.kl_coef=0.05")

    def lora_policy():
        policy = make_policy()
        policy.model = apply_lora(policy.model, cfg.model.lora, 0)
        policy.engine.model = policy.model
        return policy

    def run(fail_at: int | None, run_id: str | None = None):
        policy = lora_policy()
        feats = compute_features(policy, prompts, inter_weight=1.0, batch_size=64, device="cpu")
        r = open_run(cfg, run_id=run_id, track=False)
        real, calls = LocalUpdater.step, [0]

        def step(self, groups):
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("killed")
            return real(self, groups)

        monkeypatch.setattr(LocalUpdater, "step", step)
        try:
            train(r, policy, prompts, feats)
        except RuntimeError:
            r.close("failed", {})
            return r, None
        r.close("completed", {})
        return r, {k: v.clone() for k, v in policy.model.state_dict().items()}

    _, want = run(None)
    crashed, _ = run(4)
    assert checkpoint.latest(crashed).name == "step-000003.pt"
    saved = torch.load(checkpoint.latest(crashed), weights_only=False)
    assert saved["model"] and all(".lora_" in k for k in saved["model"])  # the adapters, not the frozen base
    assert saved["optimizer"]["state"]
    _, got = run(None, crashed.run_id)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    moved = [k for k in want if "lora_B" in k and want[k].abs().max() > 0]
    assert moved


@pytest.mark.parametrize("lag", [0, 1])
def test_the_sampler_gets_the_merged_adapters(smoke_cfg, lag):
    """Overlapped, the generator process samples from merged weights equal to the adapted policy's; sequential,
    the in-process engine samples the adapted policy itself."""
    from tasks.model.lora import apply_lora, plain_state_dict
    from tasks.overlap.concurrent import Sampler
    from tests.tasks.test_train import make_policy

    policy = make_policy()
    policy.model = apply_lora(policy.model, smoke_cfg("model.lora.enabled=true").model.lora, 0)
    policy.engine.model = policy.model
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
    sampler = Sampler(policy, lag)
    try:
        sampler.sync(Path("/nonexistent"))
        if lag:
            merged = plain_state_dict(policy.model)
            for k, v in sampler.policy.model.state_dict().items():
                torch.testing.assert_close(v, merged[k], rtol=0, atol=0)
        else:
            assert sampler.policy.engine.model is policy.model
        gen = sampler.policy.engine.generate(["Q: 1+2=?\n"], n=2, seed=0)
        assert gen.completion_ids.shape[0] == 2
    finally:
        sampler.close()
