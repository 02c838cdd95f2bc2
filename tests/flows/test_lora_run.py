"""LoRA end to end (``model.lora``): a LoRA run learns the bundled task; its registered version loads from MLflow's
registry as a full model; its adapter folder loads with plain PEFT to the run's log-probs; ``retrain`` continues
from that version with new adapters; a crash mid-run resumes to the uninterrupted run's adapters."""

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
    check_the_adapter_folder(s, tmp_path)


def check_the_adapter_folder(s: dict, tmp_path: Path) -> None:
    """The run's adapter folder, beside the merged model: trained (B off its zero start), naming the run's base
    folder; plain PEFT over that base gives the run's final log-probs (float32, to 1e-5): its policy's (the base
    with the final checkpoint's adapters, through the project's fused layer) and the merged model's; it is the
    MLflow run's ``final_adapter`` artifact and the registered version's ``adapter/`` folder."""
    import mlflow
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tasks.config import LoraConfig
    from tasks.data import arith
    from tasks.model.loading import load_policy
    from tasks.model.lora import apply_lora, load_checkpoint_state
    from tests.tasks.test_lora import _peft_loads

    adapter, run_dir = Path(s["adapter_path"]), Path(s["run_dir"])
    assert adapter == run_dir / "final_adapter" and adapter.parent == Path(s["model_path"]).parent
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == s["policy_path"] and (config["r"], config["lora_alpha"]) == (8, 32.0)
    trained = load_file(adapter / "adapter_model.safetensors")
    assert all(v.dtype == torch.float32 for v in trained.values())
    assert any("lora_B" in k and v.abs().max() > 1e-4 for k, v in trained.items())  # the adapters trained

    policy, tok = load_policy(s["policy_path"], dtype=torch.float32)  # the run's final policy, rebuilt
    policy = apply_lora(policy, LoraConfig(enabled=True, rank=8), 0)
    final = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    assert final.name == "step-000010.pt"
    load_checkpoint_state(policy, torch.load(final, weights_only=False)["model"])
    merged = AutoModelForCausalLM.from_pretrained(s["model_path"], dtype=torch.float32)
    batch = tok([f"{r.question} {r.answer}" for r in arith.generate(0, 6, "test", "default")], return_tensors="pt",
                padding=True)
    ids, keep = batch["input_ids"][:, 1:, None], batch["attention_mask"][:, 1:].bool()

    def token_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model.eval()(**batch).logits[:, :-1], -1).gather(-1, ids)[..., 0][keep]

    got = token_logprobs(_peft_loads(s["policy_path"], adapter))
    torch.testing.assert_close(got, token_logprobs(policy), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, token_logprobs(merged), rtol=0, atol=1e-5)
    client = MlflowClient(s["tracking_uri"])
    assert "final_adapter" in [a.path for a in client.list_artifacts(s["mlflow_run_id"])]
    mlflow.set_tracking_uri(s["tracking_uri"])
    version = Path(mlflow.artifacts.download_artifacts("models:/rlsift-policy/1", dst_path=str(tmp_path / "v1")))
    registered = load_file(version / "adapter" / "adapter_model.safetensors")
    assert registered.keys() == trained.keys() and all(torch.equal(registered[k], trained[k]) for k in trained)
    assert json.loads((version / "adapter" / "adapter_config.json").read_text()) == config


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
