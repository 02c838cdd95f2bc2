"""VLLMEngine against a real ``vllm serve`` on CPU (opt-in: ``pytest -m vllm tests/test_vllm.py``).

Skipped unless ``.venv-vllm`` exists (``bash infra/vllm-env.sh``). Starts ``infra/vllm-serve.sh`` on a free
port for a tiny Llama (head size 32, the smallest the CPU attention kernels take) in float32 with
``--enforce-eager`` (no torch.compile warm-up), which takes about 1 minute on 2 busy cores.

Checks: shapes and prompt-major layout; the server's log-probs (``processed_logprobs``, temperature 0.7)
agree with ``tasks.model.forward.token_logprobs`` on the same weights (atol 2e-4: two float32 implementations
of the same network, different kernels and summation order); seeded sampling repeats; greedy picks the
arg-max token; ``reload_weights`` from a second model's folder makes the log-probs follow the new weights; a LoRA
adapter loaded at runtime (``rollout.vllm_weight_sync=adapter``) makes them follow the adapted policy.
Two servers at once (tasks/generation/server_pool.py): spread over both, a call returns what one server returns, and an
overlapped training run completes when one of them is killed mid-step (each server about 1 minute to start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model, build_tokenizer, format_prompt
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="no .venv-vllm (infra/vllm-env.sh)")]
TEMPERATURE = 0.7
ATOL = 2e-4


def sharp_model(seed: int):
    """A tiny random Llama whose next-token distributions are far from uniform (embeddings scaled up), so
    that log-prob comparisons and greedy picks are meaningful."""
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=seed)
    with torch.no_grad():
        # tied with lm_head, so the logits scale up too: entropy ~2.4 nats at T=0.7 (4.6 unscaled)
        model.model.embed_tokens.weight.mul_(3.0)
    return model.eval()



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tasks.generation.vllm_engine import VLLMEngine
    from tasks.generation.vllm_export import export_for_vllm

    tmp = tmp_path_factory.mktemp("vllm")
    tok = build_tokenizer()
    models = {name: sharp_model(seed) for name, seed in (("a", 0), ("b", 1))}
    for name, m in models.items():
        export_for_vllm(m, tok, tmp / name)  # the head untied, as the pipeline serves it
    port = free_port()
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(["bash", str(ROOT / "infra" / "vllm-serve.sh"), str(tmp / "a"), str(port), "--dtype",
                             "float32", "--enforce-eager", "--max-num-seqs", "64"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = VLLMEngine(f"http://127.0.0.1:{port}", tok, max_new_tokens=12, temperature=TEMPERATURE,
                        top_p=1.0, top_k=0, stop_ids=(tok.eos_token_id,))
    try:
        t0 = time.perf_counter()
        while True:
            try:
                engine.wait_ready(timeout=5)
                break
            except Exception:
                if proc.poll() is not None or time.perf_counter() - t0 > 600:
                    log.flush()
                    pytest.fail("vLLM server did not start:\n" + (tmp / "server.log").read_text()[-4000:])
        print(f"vLLM server ready in {time.perf_counter() - t0:.1f} s")
        yield engine, models, tok, tmp
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


PROMPTS = ["12+7=?", "3*4-5=?", "what is 8+8?"]


def _hf_logprobs(model, gen, tok, temperature):
    prompts = [p for p in gen.prompt_ids for _ in range(gen.n)]
    with torch.no_grad():
        return token_logprobs(model, prompts, gen.completion_ids, gen.completion_mask, tok.pad_token_id, temperature)


def test_generate_layout_and_logprobs_match_hf(served):
    engine, models, tok, _ = served
    texts = [format_prompt(tok, q) for q in PROMPTS]
    gen = engine.generate(texts, n=4, seed=11)
    lp = gen.logprobs
    assert gen.completion_ids.shape[0] == len(PROMPTS) * 4 == lp.shape[0]
    assert gen.completion_ids.shape == gen.completion_mask.shape == lp.shape
    assert [p.tolist() for p in gen.prompt_ids] == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert len(gen.texts) == 12 and gen.tokens > 0
    lens = gen.completion_mask.sum(1)
    for i, n_tok in enumerate(lens.tolist()):  # ends at EOS or at max_new_tokens; padding is pad_id
        ids = gen.completion_ids[i, :n_tok].tolist()
        assert n_tok == 12 or ids[-1] == tok.eos_token_id
        assert (gen.completion_ids[i, n_tok:] == tok.pad_token_id).all()
    hf = _hf_logprobs(models["a"], gen, tok, TEMPERATURE)
    diff = (hf - lp).abs()[gen.completion_mask]
    print(f"max |vLLM - HF| log-prob over {int(gen.tokens)} tokens: {float(diff.max()):.2e}")
    assert float(diff.max()) < ATOL
    assert float(lp[gen.completion_mask].std()) > 0.1  # not a flat distribution: the check has teeth


def test_seeded_sampling_repeats(served):
    engine, _, tok, _ = served
    texts = [format_prompt(tok, q) for q in PROMPTS]
    a, b, c = (engine.generate(texts, n=3, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_greedy_picks_argmax(served):
    engine, models, tok, _ = served
    texts = [format_prompt(tok, q) for q in PROMPTS]
    gen = engine.generate(texts, n=1, seed=0, greedy=True)
    lp_chosen = _hf_logprobs(models["a"], gen, tok, 1.0)
    # the arg-max's log-prob is the max over the vocabulary: compare with a full forward per row
    from tasks.model.forward import pack

    ids, am, pos, width = pack(gen.prompt_ids, gen.completion_ids, gen.completion_mask, tok.pad_token_id)
    with torch.no_grad():
        logits = models["a"](input_ids=ids, attention_mask=am, position_ids=pos).logits[:, width - 1:-1].float()
    best = torch.log_softmax(logits, -1).max(-1).values
    assert float(((best - lp_chosen).abs() * gen.completion_mask).max()) < ATOL


def test_reload_weights_takes_effect(served):
    engine, models, tok, tmp = served
    texts = [format_prompt(tok, q) for q in PROMPTS]
    seconds = engine.reload_weights(tmp / "b")
    print(f"reload_weights: {seconds:.3f} s")
    try:
        gen = engine.generate(texts, n=4, seed=11)
        lp = gen.logprobs
        on_b = (_hf_logprobs(models["b"], gen, tok, TEMPERATURE) - lp).abs()[gen.completion_mask]
        on_a = (_hf_logprobs(models["a"], gen, tok, TEMPERATURE) - lp).abs()[gen.completion_mask]
        assert float(on_b.max()) < ATOL
        assert float(on_a.max()) > 0.1  # and no longer the old weights
    finally:
        engine.reload_weights(tmp / "a")
    with pytest.raises(ValueError, match="no config.json"):
        engine.reload_weights(tmp)


# ---------------------------------------------------------------- several servers (tasks/generation/server_pool.py)
def _launch(folder: Path, tmp: Path, name: str, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """Start ``infra/vllm-serve.sh`` on ``folder`` at a free port, in its own process group, with ``env`` added
    to the environment; (process, URL, log)."""
    port = free_port()
    log = tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "infra" / "vllm-serve.sh"), str(folder), str(port), "--dtype",
                                 "float32", "--enforce-eager", "--max-num-seqs", "64"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env})
    return proc, f"http://127.0.0.1:{port}", log


def _ready(proc: subprocess.Popen, url: str, log: Path, tok) -> None:
    from tasks.generation.vllm_engine import VLLMEngine

    engine = VLLMEngine(url, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(tok.eos_token_id,))
    t0 = time.perf_counter()
    while True:
        try:
            engine.wait_ready(timeout=5)
            return
        except Exception:
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                pytest.fail(f"vLLM server {url} did not start:\n" + log.read_text()[-4000:])


def test_an_adapter_sync_makes_the_logprobs_follow_the_adapted_policy(tmp_path):
    """``rollout.vllm_weight_sync=adapter``: a server started with ``VLLM_LORA_RANK=8`` on the base model; a sync
    loads the policy's LoRA adapter by name (``/v1/load_lora_adapter``), and the server's log-probs are the
    adapted policy's (ATOL) and no longer the base's; a second sync replaces it."""
    from tasks.config import LoraConfig
    from tasks.generation.vllm_engine import VLLMEngine
    from tasks.generation.vllm_export import export_for_vllm
    from tasks.model.lora import apply_lora

    tok = build_tokenizer()
    export_for_vllm(sharp_model(0), tok, tmp_path / "base")
    proc, url, log = _launch(tmp_path / "base", tmp_path, "lora", VLLM_LORA_RANK="8")
    try:
        _ready(proc, url, log, tok)
        engine = VLLMEngine(url, tok, max_new_tokens=12, temperature=TEMPERATURE, top_p=1.0, top_k=0,
                            stop_ids=(tok.eos_token_id,), weight_sync="adapter")
        texts = [format_prompt(tok, q) for q in PROMPTS]
        for seed in (1, 2):
            policy = apply_lora(sharp_model(0), LoraConfig(enabled=True, rank=8, alpha=16.0), 0).eval()
            gen_b = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen_b) * 0.2)
            print(f"load_lora_adapter: {engine.sync_weights(policy, tok, tmp_path / 'adapters'):.3f} s")
            gen = engine.generate(texts, n=4, seed=11)
            on_policy = (_hf_logprobs(policy, gen, tok, TEMPERATURE) - gen.logprobs).abs()[gen.completion_mask]
            with policy.disable_adapter():
                on_base = (_hf_logprobs(policy, gen, tok, TEMPERATURE) - gen.logprobs).abs()[gen.completion_mask]
            assert float(on_policy.max()) < ATOL and float(on_base.max()) > 0.1
        assert [p.name for p in (tmp_path / "adapters").iterdir()] == [engine.adapter]
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def two_served(tmp_path_factory):
    """Two vLLM servers on the tiny training policy (tests/tasks/test_train.py ``make_policy``), started at once:
    [(process, URL, log)] and the tokenizer."""
    from tasks.generation.vllm_engine import VLLMEngine
    from tasks.generation.vllm_export import export_for_vllm
    from tests.tasks.test_train import make_policy

    tmp = tmp_path_factory.mktemp("vllm-pool")
    policy = make_policy()
    folder = export_for_vllm(policy.model, policy.tokenizer, tmp / "init")
    servers = [_launch(folder, tmp, f"server{i}") for i in range(2)]
    try:
        t0 = time.perf_counter()
        for proc, url, log in servers:
            engine = VLLMEngine(url, policy.tokenizer, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                                stop_ids=(policy.tokenizer.eos_token_id,))
            while True:
                try:
                    engine.wait_ready(timeout=5)
                    break
                except Exception:
                    if proc.poll() is not None or time.perf_counter() - t0 > 900:
                        pytest.fail(f"vLLM server {url} did not start:\n" + log.read_text()[-4000:])
        print(f"two vLLM servers ready in {time.perf_counter() - t0:.1f} s")
        yield servers, policy.tokenizer
    finally:
        for proc, _, _ in servers:
            _stop(proc)


def test_two_servers_give_the_one_servers_generation(two_served):
    """The same seeds on the same weights: spreading the prompts over two servers returns what one returns."""
    from tasks.generation.server_pool import ServerPool

    servers, tok = two_served
    urls = [url for _, url, _ in servers]
    texts = [format_prompt(tok, q) for q in [*PROMPTS, "5+5=?", "9-2=?"]]
    settings = {"max_new_tokens": 12, "temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0,
                "stop_ids": (tok.eos_token_id,)}
    one = ServerPool(urls[:1], tok, **settings).generate(texts, n=3, seed=11)
    two = ServerPool(urls, tok, **settings)
    both = two.generate(texts, n=3, seed=11)
    assert torch.equal(one.completion_ids, both.completion_ids)
    torch.testing.assert_close(one.logprobs, both.logprobs, rtol=0, atol=ATOL)
    assert two.metrics() == {"rollout/servers_live": 2.0, "rollout/server0_prompts": 3.0,
                             "rollout/server1_prompts": 2.0}


def test_a_run_that_loses_one_of_two_servers_mid_step_completes(two_served, tmp_path, monkeypatch, caplog):
    """The overlapped run (overlap.lag 1, 5 steps of 6 prompts, 3 per server) with the second server SIGKILLed as it
    is sent its 5th prompt (step 1's draw): the run completes on the first server, every step in the ledger once with
    its 6 prompts, none twice, and one warning line names the dead server. Runs last: it kills a server of the
    module's fixture."""
    import logging

    from tasks.data import arith
    from tasks.generation.vllm_engine import VLLMEngine
    from tests.tasks.test_server_pool import WARNING, run_cfg, train_on
    from tests.tasks.test_train import text_reward

    servers, _ = two_served
    (_, first, _), (victim, second, _) = servers
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)
    real, calls = VLLMEngine.complete, [0]

    def dying(self, *args, **kwargs):
        if self.url == second:
            calls[0] += 1
            if calls[0] == 5:
                os.killpg(victim.pid, signal.SIGKILL)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(VLLMEngine, "complete", dying)
    with caplog.at_level(logging.WARNING, logger="rlsift.rollout"):
        got = train_on(run_cfg(tmp_path, [first, second], 1), arith.generate(0, 40, "train", "default"))
    assert victim.wait(timeout=30) is not None
    assert got["summary"].steps == 5
    for step in range(5):
        ids = [g["prompt_id"] for g in got["groups"] if g["step"] == step]
        assert len(ids) == 6 and len(set(ids)) == 6, (step, ids)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlsift.rollout"]
    assert len(lines) == 1 and WARNING.fullmatch(lines[0]) and second in lines[0], lines
    assert [m["rollout/servers_live"] for m in got["logged"]] == [2.0, 1.0, 1.0, 1.0, 1.0]
