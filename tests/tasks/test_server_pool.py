"""Several rollout servers (tasks/generation/server_pool.py) against scripted vLLM servers (tests/scripted_vllm.py:
real HTTP on loopback, sampling with the tiny model), no vLLM needed.

- a call's prompts are spread over the servers, and the Generation is the one server's, exactly;
- a weight sync exports once and reaches every server;
- a server that fails mid-call (refused, HTTP 500, closed socket, timeout) is dropped with one warning and its
  prompts answered by the other, same Generation; one that fails in a sync is dropped too; an HTTP 4xx is an error,
  not a failure; with every server gone, one VLLMError naming them;
- training: one of two servers dying mid-step (overlap.lag 0 and 1) changes nothing the run computes, every step in
  the ledger once; both dying stops the run at its last checkpoint, and a resume on fresh servers finishes it;
- ``rollout.vllm_url``: a list or one URL; bad URLs, duplicates and an empty list are errors naming the key.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tasks.config import ConfigError
from tasks.config.load import load_config
from tasks.data import arith
from tasks.generation.server_pool import ServerPool, spread
from tasks.generation.vllm_engine import VLLMEngine, VLLMError
from tasks.generation.vllm_export import export_for_vllm
from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.policy import Policy
from tests.scripted_vllm import ScriptedVLLM
from tests.tasks.test_train import SMALL, text_reward

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "conf" / "presets" / "grpo.yaml"
SETTINGS = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop_ids": (2,)}  # tiny EOS
PROMPTS = [f"Q: {a}+{a * 3 % 7}=?\n" for a in range(7)]
WARNING = re.compile(r"vLLM server (http://127\.0\.0\.1:\d+) failed \((.+)\); its (\d+) prompts? go to the 1 other "
                     r"server; 1 of 2 servers left")


@pytest.fixture(autouse=True)
def _reward(monkeypatch):
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny policy, its tokenizer and an exported serving copy (the folder the servers start on)."""
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    return model, tok, export_for_vllm(model, tok, tmp_path_factory.mktemp("serve") / "init")


@pytest.fixture
def servers(tiny):
    """Start scripted servers on the initial folder: ``servers(k)`` -> k of them, all closed after the test."""
    started: list[ScriptedVLLM] = []

    def start(k: int) -> list[ScriptedVLLM]:
        started.extend(ScriptedVLLM(tiny[2]) for _ in range(k))
        return started[-k:]

    yield start
    for s in started:
        s.close()


@pytest.fixture(scope="module")
def one_server(tiny):
    """The Generation of PROMPTS (n 3, seed 5) from a single server: what every spread must give."""
    server = ScriptedVLLM(tiny[2])
    try:
        return ServerPool([server.url], tiny[1], **SETTINGS).generate(PROMPTS, 3, 5)
    finally:
        server.close()


def same(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.logprobs, b.logprobs) and a.texts == b.texts and a.n == b.n
    assert [p.tolist() for p in a.prompt_ids] == [p.tolist() for p in b.prompt_ids]


def test_spread_cuts_balanced_contiguous_slices():
    assert spread(list(range(7)), 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert spread([4, 9], 3) == [[4], [9], []]
    assert [len(s) for s in spread(list(range(10)), 4)] == [3, 3, 2, 2]


@pytest.mark.parametrize("k", [2, 3])
def test_prompts_are_spread_and_the_generation_is_the_one_servers(tiny, servers, one_server, k):
    model, tok, _ = tiny
    started = servers(k)
    pool = ServerPool([s.url for s in started], tok, **SETTINGS)
    gen = pool.generate(PROMPTS, 3, 5)
    same(gen, one_server)
    ids = [p.tolist() for p in gen.prompt_ids]
    for s, share in zip(started, spread(range(7), k), strict=True):  # contiguous slices, each server its own
        assert sorted(s.prompts) == sorted(ids[b] for b in share) and s.completions == len(share)
    assert pool.metrics() == {"rollout/servers_live": float(k)} | {
        f"rollout/server{i}_prompts": float(len(share)) for i, share in enumerate(spread(range(7), k))}
    # one URL through VLLMEngine (the engine of a single server before pools) gives it too
    same(VLLMEngine(started[0].url, tok, **SETTINGS).generate(PROMPTS, 3, 5), one_server)
    with torch.no_grad():  # and the server's log-probs are the model's (the servers serve its export)
        want = token_logprobs(model, [p for p in gen.prompt_ids for _ in range(3)], gen.completion_ids,
                              gen.completion_mask, tok.pad_token_id, 1.0)
    assert float((want - gen.logprobs).abs()[gen.completion_mask].max()) <= 1e-5


def test_a_sync_exports_once_and_reaches_every_server(tiny, servers, tmp_path, monkeypatch):
    model, tok, _ = tiny
    trainer = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=1)  # other weights than the servers'
    started = servers(2)
    pool = ServerPool([s.url for s in started], tok, **SETTINGS)
    before = pool.generate(PROMPTS, 3, 5)
    exports = []
    real = export_for_vllm
    monkeypatch.setattr("tasks.generation.server_pool.export_for_vllm",
                        lambda m, t, f: exports.append(f) or real(m, t, f))
    assert pool.sync_weights(trainer, tok, tmp_path / "w") > 0
    assert exports == [tmp_path / "w"] and [s.reloads for s in started] == [1, 1]
    want = trainer.state_dict()
    for s in started:
        got = s.model.state_dict()
        assert set(got) <= set(want) and "lm_head.weight" in got
        for k, v in got.items():
            assert torch.equal(v, want[k]), k
    after = pool.generate(PROMPTS, 3, 5)
    assert not torch.equal(after.logprobs, before.logprobs)


@pytest.mark.parametrize("failure, reason", [("down", "RemoteDisconnected|Connection refused|reset"),
                                             ("500", "HTTP 500"), ("close", "RemoteDisconnected"),
                                             ("hang", "timed out")])
def test_a_server_failing_mid_call_hands_its_prompts_to_the_other(tiny, servers, one_server, caplog, failure,
                                                                    reason):
    """The second server answers one prompt, then fails: its other prompts go to the first, same seeds, so the
    Generation is the single server's; one warning line; the next call asks the first server alone."""
    _, tok, _ = tiny
    a, b = servers(2)
    pool = ServerPool([a.url, b.url], tok, **SETTINGS, timeout=1.0 if failure == "hang" else 600.0, concurrency=1)
    b.fail_after(1, failure)
    with caplog.at_level(logging.WARNING, logger="rlsift.rollout"):
        gen = pool.generate(PROMPTS, 3, 5)
    same(gen, one_server)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlsift.rollout"]
    assert len(lines) == 1, lines
    m = WARNING.fullmatch(lines[0])
    assert m and m.group(1) == b.url and re.search(reason, m.group(2)) and m.group(3) == "2", lines[0]
    assert "\n" not in lines[0]
    assert a.completions == 4 + 2 and pool.metrics()["rollout/servers_live"] == 1.0
    assert pool.metrics()["rollout/server1_prompts"] == 1.0  # its one answer is kept
    same(pool.generate(PROMPTS, 3, 5), one_server)
    assert a.completions == 6 + 7 and len(caplog.records) == 1


def test_a_server_failing_in_a_sync_is_dropped(tiny, servers, caplog, tmp_path):
    model, tok, _ = tiny
    a, b = servers(2)
    pool = ServerPool([a.url, b.url], tok, **SETTINGS)
    a.fail_after(0, "500")
    with caplog.at_level(logging.WARNING, logger="rlsift.rollout"):
        pool.sync_weights(model, tok, tmp_path / "w")
    assert [r.getMessage() for r in caplog.records] == [
        f"vLLM server {a.url} failed in the weight sync (/collective_rpc: HTTP 500: "
        '{"error": "scripted failure\\nsecond line"}); 1 of 2 servers left']
    assert [s.url for s in pool.live] == [b.url] and (a.reloads, b.reloads) == (0, 1)
    pool.generate(PROMPTS, 2, 0)
    assert (a.completions, b.completions) == (0, 7)


def test_a_refused_request_is_an_error_not_a_failed_server(tiny, servers):
    _, tok, _ = tiny
    a, b = servers(2)
    pool = ServerPool([a.url, b.url], tok, **SETTINGS)
    b.fail_after(0, "400")
    with pytest.raises(VLLMError, match="HTTP 400"):
        pool.generate(PROMPTS, 2, 0)
    assert len(pool.live) == 2


def test_with_every_server_gone_one_error_names_them(tiny, servers, caplog, tmp_path):
    model, tok, _ = tiny
    a, b = servers(2)
    pool = ServerPool([a.url, b.url], tok, **SETTINGS)
    a.fail_after(1, "close")
    b.fail_after(0, "500")
    with pytest.raises(VLLMError) as err, caplog.at_level(logging.WARNING, logger="rlsift.rollout"):
        pool.generate(PROMPTS, 2, 0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("every vLLM server failed: ")
    assert f"{a.url} (RemoteDisconnected" in msg and re.search(rf"{b.url} \(/v1/\w+: HTTP 500", msg)
    assert len(caplog.records) == 2 and all("no server left" in r.getMessage() for r in caplog.records)
    with pytest.raises(VLLMError, match="every vLLM server failed"):
        pool.sync_weights(model, tok, tmp_path / "w")
    with pytest.raises(VLLMError, match="every vLLM server failed"):
        pool.generate(PROMPTS, 2, 0)


# ---------------------------------------------------------------- training runs
@pytest.fixture(scope="module")
def pool_records():
    return arith.generate(0, 40, "train", "default")


def run_cfg(root: Path, urls: list[str], lag: int, *extra: str):
    """test_train's small GRPO run, 5 steps of 6 prompts, rollouts from ``urls`` (3 prompts a server a step)."""
    return load_config(GRPO, [f"paths.root={root}", *SMALL, "train.steps=5", f"overlap.lag={lag}",
                              "rollout.engine=vllm", f"rollout.vllm_url=[{','.join(urls)}]", *extra])


def train_on(cfg, pool_records, run_id: str | None = None) -> dict:
    """Train the tiny policy (test_train's) on ``cfg``'s servers (the pool prepare_stage builds); the run's id, final
    weights, summary, ledger groups and logged metrics. An error in training closes the run as failed and is raised."""
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training.entry import train
    from tests.tasks.test_train import make_policy

    hf = make_policy()
    engine = ServerPool.from_config(cfg.rollout, hf.tokenizer, hf.engine.stop_ids)
    policy = Policy(model=hf.model, tokenizer=hf.tokenizer, engine=engine)
    feats = compute_features(policy, pool_records, inter_weight=1.0, batch_size=64, device="cpu")
    run = open_run(cfg, run_id=run_id, track=False)
    try:
        summary = train(run, policy, pool_records, feats)
        out = {"run": run, "state": policy.model.state_dict(), "summary": summary, "engine": policy.engine,
               "groups": run.ledger.query("SELECT * FROM groups WHERE run_id = ? ORDER BY step", [run.run_id]),
               "selections": run.ledger.query("SELECT * FROM selections WHERE run_id = ? ORDER BY step",
                                              [run.run_id]),
               "logged": [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]}
    except BaseException:
        run.close("failed", {})
        raise
    run.close("completed", {})
    return out


@pytest.fixture(scope="module")
def healthy(tiny, pool_records, tmp_path_factory):
    """Per overlap.lag, the final weights of the run on two healthy servers."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # the function-scoped _reward is not active in a module fixture
        mp.setattr("tasks.calibration.reference.batch_rewards", text_reward)
        for lag in (0, 1):
            a, b = ScriptedVLLM(tiny[2]), ScriptedVLLM(tiny[2])
            try:
                out[lag] = train_on(run_cfg(tmp_path_factory.mktemp(f"healthy{lag}"), [a.url, b.url], lag),
                                    pool_records)["state"]
            finally:
                a.close()
                b.close()
    return out


@pytest.mark.parametrize("lag, after", [(0, 4), (1, 7)])
def test_a_run_that_loses_one_of_two_servers_mid_step_trains_as_if_it_had_not(tiny, servers, pool_records, healthy,
                                                                               tmp_path, caplog, lag, after):
    """The second server dies within step 1's draw (lag 0: its 5th prompt; lag 1: its 8th, step 2's draw, which runs
    during update 1): the run completes with the healthy run's weights, every step in the ledger once with its 6
    prompts, none twice, one warning line, and the step metrics show 2 servers, then 1."""
    a, b = servers(2)
    b.fail_after(after, "down")
    with caplog.at_level(logging.WARNING, logger="rlsift.rollout"):
        got = train_on(run_cfg(tmp_path, [a.url, b.url], lag), pool_records)
    assert got["summary"].steps == 5
    for k, v in healthy[lag].items():
        assert torch.equal(v, got["state"][k]), k
    steps = [g["step"] for g in got["groups"]]
    assert steps == sorted(steps) and sorted(set(steps)) == list(range(5))
    for step in range(5):
        ids = [g["prompt_id"] for g in got["groups"] if g["step"] == step]
        assert len(ids) == 6 and len(set(ids)) == 6, (step, ids)
        assert [s["prompt_id"] for s in got["selections"] if s["step"] == step] == ids
    lines = [r.getMessage() for r in caplog.records if r.name == "rlsift.rollout"]
    assert len(lines) == 1 and WARNING.fullmatch(lines[0]) and b.url in lines[0], lines
    live = [m["rollout/servers_live"] for m in got["logged"]]
    failed_in = 1 if lag == 0 else 2
    assert live == [2.0] * failed_in + [1.0] * (5 - failed_in)
    assert [m["step"] for m in got["logged"]] == list(range(5))


def test_a_run_whose_servers_all_die_stops_at_its_checkpoint_and_a_resume_finishes_it(tiny, servers, pool_records,
                                                                                      healthy, tmp_path, caplog):
    """overlap.lag 1, a checkpoint every step: both servers die within step 2's draw (running in the background during
    update 1). The run raises VLLMError naming both, the last checkpoint (after step 0, with step 1's rollouts) is
    intact, and a resume on two fresh servers (other URLs: rollout.vllm_url may change on resume) ends with the
    healthy run's weights."""
    from tasks.run import open_run
    from tasks.training import checkpoint

    a, b = servers(2)
    a.fail_after(7, "down")
    b.fail_after(7, "500")
    cfg = run_cfg(tmp_path, [a.url, b.url], 1, "train.checkpoint_every=1")
    with pytest.raises(VLLMError, match="every vLLM server failed") as err:
        train_on(cfg, pool_records)
    assert a.url in str(err.value) and b.url in str(err.value) and "\n" not in str(err.value)
    run_id = next(p.name for p in (tmp_path / "runs").iterdir())
    run = open_run(cfg, run_id=run_id, track=False)
    try:
        assert checkpoint.latest(run).name == "step-000001.pt"
        assert torch.load(checkpoint.latest(run), weights_only=False)["step"] == 1
    finally:
        run.close("failed", {})
    c, d = servers(2)
    resumed = train_on(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"vllm_url": (c.url, d.url)})}),
                       pool_records, run_id=run_id)
    assert resumed["summary"].steps == 5
    for k, v in healthy[1].items():
        assert torch.equal(v, resumed["state"][k]), k
    assert sorted({g["step"] for g in resumed["groups"]}) == list(range(5)) and len(resumed["groups"]) == 5 * 6


# ---------------------------------------------------------------- config
def test_vllm_url_takes_a_list_or_one_url():
    assert load_config(None).rollout.vllm_url == ("http://127.0.0.1:8000",)
    assert load_config(None, ["rollout.vllm_url=http://a:8000"]).rollout.vllm_url == ("http://a:8000",)
    assert load_config(None, ["rollout.vllm_url=[http://a:8000,https://b.example/v]"]).rollout.vllm_url == \
        ("http://a:8000", "https://b.example/v")


@pytest.mark.parametrize("value, error", [
    ("[]", "at least one vLLM server URL"),
    ("ftp://a:8000", "'ftp://a:8000' is not an http"),
    ("localhost:8000", "is not an http"),
    ("http://a:99999", "is not an http"),
    ("'http://a b:8000'", "is not an http"),
    ("[http://a:8000,http://b:8000,http://a:8000/]", "http://a:8000 given more than once"),
])
def test_bad_vllm_urls_are_errors_naming_the_key(value, error):
    with pytest.raises(ConfigError, match=r"rollout\.vllm_url: .*" + re.escape(error)):
        load_config(None, [f"rollout.vllm_url={value}"])


def test_a_resume_may_change_the_servers(tmp_path):
    """rollout.vllm_url is in tasks/preflight.py RESUME_MAY_CHANGE: a list or one URL replaces the stored list."""
    from tasks.config.load import to_json
    from tasks.preflight import resume_config

    stored = load_config(None, [f"paths.root={tmp_path}", "rollout.engine=vllm",
                                "rollout.vllm_url=[http://a:8000,http://b:8000]"])
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "config.json").write_text(to_json(stored))
    got = resume_config(None, [f"paths.root={tmp_path}", "rollout.vllm_url=[http://c:8000,http://d:8000]"], "r1")
    assert got.rollout.vllm_url == ("http://c:8000", "http://d:8000")
    got = resume_config(None, [f"paths.root={tmp_path}", "rollout.vllm_url=http://c:8000"], "r1")
    assert got.rollout.vllm_url == ("http://c:8000",) and got.rollout.engine == "vllm"
