"""The real-model path end to end: ``rlsift run model.path=<HF folder> data=gsm8k`` with a tiny model that
looks like a real one (Qwen2, byte-level BPE, ChatML template; tests/tiny_qwen.py), on a slice of GSM8K."""

import json
from pathlib import Path

import pytest
import torch

from tasks.records.ledger import Ledger
from tests import tiny_qwen
from tests.flows.conftest import ROOT, cli_env, rlsift

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"{GSM8K} not present")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_real_looking_model_runs_the_whole_pipeline_on_gsm8k(tmp_path, lora):
    """Every weight, or LoRA adapters on every linear layer (``model.lora``), trained end to end. The random model
    rarely earns a reward: seed 3's first step has one right rollout of 8 (seeds 0-2, 4 and 5 none, with today's
    per-prompt noise), so the update has a gradient and the weights must move."""
    from transformers import AutoTokenizer

    model = tiny_qwen.build(tmp_path / "qwen", GSM8K / "test.jsonl")
    tok = AutoTokenizer.from_pretrained(model)
    root = tmp_path / "root"
    sources = (f"data.sources=[{{kind: file, path: {GSM8K / 'train.jsonl'}, format: gsm8k, reward: math, limit: 24}},"
               f" {{kind: file, path: {GSM8K / 'test.jsonl'}, format: gsm8k, reward: math, limit: 8}}]")
    out = rlsift("run", "-c", str(ROOT / "tests" / "fixtures" / "tiny.yaml"), f"model.path={model}", sources,
                 f"paths.root={root}", "select.method=dots", "calibrate.k=8", "calibrate.g=2", "rollout.n=2",
                 "rollout.max_new_tokens=24", "train.steps=2", "train.prompts_per_step=4", "train.round_steps=1",
                 "eval.samples=0", "seed=3", *(["model.lora.enabled=true", "model.lora.rank=4"] if lora else []),
                 "--json",
                 env=cli_env(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout)
    assert s["status"] == "completed" and s["steps"] == 2 and s["model_version"] == "1"

    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        prompts = led.prompts()
        assert {p.reward for p in prompts} == {"math"} and len(prompts) == 32
        ref = led.query("SELECT * FROM reference WHERE run_id = ? AND round = -1", [s["run_id"]])
        assert len(ref) == 8  # DOTS's calibration on the reference set
        sel = led.query("SELECT * FROM selections WHERE run_id = ?", [s["run_id"]])
        assert sel and all(r["selector"] == "dots" and r["pred_success"] is not None for r in sel)
    # EOS: the model's end-of-turn token is what generation stops at and what the rollout mask cuts at
    from tasks.model.loading import load_policy

    policy, ptok = load_policy(s["model_path"])
    assert ptok.eos_token == "<|im_end|>" and policy.generation_config.eos_token_id == tok.convert_tokens_to_ids(
        "<|im_end|>")
    assert (Path(s["model_path"]) / "tokenizer_config.json").exists()
    # chat formatting: the run's prompts are ChatML with the configured system prompt, open at the assistant turn
    from tasks.config import Config
    from tasks.model.loading import format_prompt

    text = format_prompt(ptok, prompts[0].question, Config().model.system_prompt)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    # the final model: a full Qwen2 (adapters merged under LoRA) whose weights moved from the starting ones
    from safetensors.torch import load_file

    start, end = load_file(Path(model) / "model.safetensors"), load_file(Path(s["model_path"]) / "model.safetensors")
    assert type(policy).__name__ == "Qwen2ForCausalLM" and start.keys() == end.keys()
    assert any(not torch.equal(start[k], end[k]) for k in start)
    from tasks.records.tracking import run_info

    metrics = run_info(s["tracking_uri"], s["mlflow_run_id"])["metrics"]
    assert (metrics["model/trainable_params"] < metrics["model/params"] / 10) == lora
