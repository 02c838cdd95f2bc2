"""``rollout.vllm_weight_sync=adapter`` (tasks/generation/vllm_engine.py, server_pool.py): a LoRA policy's servers get
its adapter, not its merged weights, against the scripted vLLM (tests/scripted_vllm.py: plain PEFT loads the
adapter over the served base), no vLLM needed.

- a sync writes the adapter folder, loads it by a new name through ``/v1/load_lora_adapter``, unloads the one it
  replaces and removes its folder; the requests name the adapter and the server's log-probs are the policy's;
- a pool exports once and every server loads the same adapter; its Generation is the one server's;
- a server without runtime LoRA loading, and a policy without adapters, are errors saying what to do;
- ``auto`` is ``adapter`` under ``model.lora`` and ``merged`` without; ``adapter`` without LoRA is a config error;
- a LoRA run on a scripted server trains with the adapter synced (and the server's weights never reloaded).
"""

from __future__ import annotations

import pytest
import torch

from tasks.config import ConfigError, LoraConfig
from tasks.config.load import load_config, validate
from tasks.generation.server_pool import ServerPool
from tasks.generation.vllm_engine import VLLMEngine, VLLMError
from tasks.generation.vllm_export import export_for_vllm
from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.model.lora import apply_lora
from tests.scripted_vllm import ScriptedVLLM
from tests.tasks.test_server_pool import GRPO, PROMPTS, SETTINGS, same

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tokenizer and the base model's serving copy (the folder the servers start on)."""
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    return tok, export_for_vllm(model, tok, tmp_path_factory.mktemp("serve") / "base")


def adapted(tok, seed: int):
    """The base with adapters whose B is drawn away from 0 (``seed``), so they change the model."""
    model = apply_lora(build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0), LORA, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def logprobs_of(model, tok, gen) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, [p for p in gen.prompt_ids for _ in range(gen.n)], gen.completion_ids,
                              gen.completion_mask, tok.pad_token_id, 1.0)


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask].max())


def test_an_adapter_sync_loads_the_adapter_by_name_and_the_server_samples_the_adapted_policy(base, tmp_path):
    tok, base_dir = base
    server = ScriptedVLLM(base_dir, enable_lora=True)
    try:
        engine = VLLMEngine(server.url, tok, **SETTINGS, weight_sync="adapter")
        first = adapted(tok, 1)
        assert engine.sync_weights(first, tok, tmp_path / "w") > 0
        name = engine.adapter
        assert name and list(server.adapters) == [name] and [p.name for p in (tmp_path / "w").iterdir()] == [name]
        gen = engine.generate(PROMPTS, 3, 5)
        assert {r["model"] for r in server.requests} == {name}
        assert gap(gen.logprobs, logprobs_of(first, tok, gen), gen.completion_mask) <= 1e-5
        with first.disable_adapter():  # the adapters matter: the base's log-probs are far from the server's
            assert gap(gen.logprobs, logprobs_of(first, tok, gen), gen.completion_mask) > 1e-2
        second = adapted(tok, 2)
        engine.sync_weights(second, tok, tmp_path / "w")
        assert engine.adapter != name and list(server.adapters) == [engine.adapter]  # the first one unloaded
        assert [p.name for p in (tmp_path / "w").iterdir()] == [engine.adapter]  # and its folder removed
        gen = engine.generate(PROMPTS, 3, 5)
        assert server.requests[-1]["model"] == engine.adapter
        assert gap(gen.logprobs, logprobs_of(second, tok, gen), gen.completion_mask) <= 1e-5
        assert server.adapter_loads == 2 and server.reloads == 0  # no full weights moved
    finally:
        server.close()


def test_a_pool_exports_the_adapter_once_and_every_server_loads_it(base, tmp_path, monkeypatch):
    import tasks.generation.server_pool as pool_module

    tok, base_dir = base
    servers = [ScriptedVLLM(base_dir, enable_lora=True) for _ in range(3)]
    try:
        exports = []
        real = pool_module.export_adapter
        monkeypatch.setattr(pool_module, "export_adapter", lambda m, f: exports.append(f) or real(m, f))
        pool = ServerPool([s.url for s in servers[:2]], tok, **SETTINGS, weight_sync="adapter")
        policy = adapted(tok, 3)
        pool.sync_weights(policy, tok, tmp_path / "w")
        assert exports == [tmp_path / "w"]
        names = {s.adapter for s in pool.servers}
        assert len(names) == 1 and all(list(s.adapters) == list(names) for s in servers[:2])
        one = VLLMEngine(servers[2].url, tok, **SETTINGS, weight_sync="adapter")
        one.sync_weights(policy, tok, tmp_path / "one")
        same(pool.generate(PROMPTS, 3, 5), one.generate(PROMPTS, 3, 5))
    finally:
        for s in servers:
            s.close()


def test_a_server_without_runtime_lora_and_a_policy_without_adapters_are_errors_saying_what_to_do(base, tmp_path):
    tok, base_dir = base
    server = ScriptedVLLM(base_dir)  # no --enable-lora / VLLM_ALLOW_RUNTIME_LORA_UPDATING
    try:
        engine = VLLMEngine(server.url, tok, **SETTINGS, weight_sync="adapter")
        with pytest.raises(VLLMError, match="HTTP 404.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"):
            engine.sync_weights(adapted(tok, 1), tok, tmp_path / "w")
        assert engine.adapter is None
        with pytest.raises(ValueError, match="no LoRA adapters.*vllm_weight_sync=merged"):
            engine.sync_weights(build_tiny_model(hidden=64, layers=2, heads=2, seed=0), tok, tmp_path / "x")
    finally:
        server.close()
    with pytest.raises(ValueError, match="weight_sync must be one of merged, adapter"):
        VLLMEngine("http://127.0.0.1:1", tok, **SETTINGS, weight_sync="lora")


def test_auto_sends_adapters_under_lora_and_adapter_without_lora_is_a_config_error():
    rc = validate({}).rollout
    assert rc.vllm_weight_sync == "auto" and rc.weight_sync(True) == "adapter" and rc.weight_sync(False) == "merged"
    merged = validate({"rollout": {"vllm_weight_sync": "merged"}, "model": {"lora": {"enabled": True}}}).rollout
    assert merged.weight_sync(True) == "merged"
    with pytest.raises(ConfigError, match="rollout.vllm_weight_sync=adapter .* needs model.lora.enabled=true"):
        validate({"rollout": {"vllm_weight_sync": "adapter"}})
    with pytest.raises(ConfigError, match="vllm_weight_sync"):
        validate({"rollout": {"vllm_weight_sync": "lora"}})


def test_a_lora_run_on_a_server_trains_with_the_adapter_synced(base, tmp_path, monkeypatch):
    """Three steps of a LoRA run whose rollouts come from a scripted server started on the base: each sync loads
    the adapter (none reloads weights), every training request names the adapter synced before it, and the
    adapters train."""
    from tasks.data import arith
    from tasks.policy import Policy
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training.entry import train
    from tests.tasks.test_train import SMALL, make_policy, text_reward

    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)
    hf = make_policy()
    server = ScriptedVLLM(export_for_vllm(hf.model, hf.tokenizer, tmp_path / "serve"), enable_lora=True)
    try:
        cfg = load_config(GRPO, [f"paths.root={tmp_path}", *SMALL, "train.steps=3", "train.round_steps=1",
                                 "overlap.lag=0", "rollout.engine=vllm", f"rollout.vllm_url=[{server.url}]",
                                 "model.lora.enabled=true", "model.lora.rank=4", "train.lr=1e-2"])
        model = apply_lora(hf.model, cfg.model.lora, 0)
        engine = ServerPool.from_config(cfg.rollout, hf.tokenizer, hf.engine.stop_ids, lora=True)
        policy = Policy(model=model, tokenizer=hf.tokenizer, engine=engine)
        records = arith.generate(0, 40, "train", "default")
        feats = compute_features(policy, records, inter_weight=1.0, batch_size=64, device="cpu")
        run = open_run(cfg, track=False)
        try:
            summary = train(run, policy, records, feats)
        finally:
            run.close("completed", {})
        assert summary.steps == 3 and server.reloads == 0
        loads, current = 0, None
        for kind, name in server.events:  # each request names the adapter loaded last before it
            loads += kind == "load"
            current = name if kind == "load" else current
            assert name == current and name.startswith("policy-lora-")
        assert loads >= 4  # one a round (of one step), the final one
        assert list(server.adapters) == [engine.servers[0].adapter]  # only the last one is still loaded
        assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # the adapters trained
    finally:
        server.close()
