"""The overlap where it pays (``overlap.lag`` auto): the config, where the sampler and the trainer run, the probe on a
shared device and the loop's use of the choice; the generator process's shutdown order (its shared weights released
before it says it stopped, no process and no warning left).

rlcore.overlap_lag.choose_lag's cases are tested in tests/rlcore/test_plan.py; the pipeline's record of the choice (run
summary, ``overlap.json``, MLflow tags) in tests/flows/test_plan.py.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaForCausalLM

from tasks.config import ConfigError
from tasks.config.load import load_config
from tasks.generation.rollout import HFEngine
from tasks.generation.server_pool import ServerPool
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.overlap.concurrent import SamplerHandover, separate_devices, thread_split
from tasks.overlap.generator_process import GeneratorProcess, _serve
from tasks.overlap.lag import decide_lag, lag_from_json, lag_to_json
from tasks.policy import Policy
from tests.conftest import ROOT
from tests.tasks.test_train import PRESETS, SMALL, run_train, text_reward

CORES = len(os.sched_getaffinity(0))
#: generator threads that, with the trainer's one, do not fit this machine's cores: a shared device on any machine
CROWDED = f"overlap.generator_threads={CORES + 1}"


@pytest.fixture(autouse=True)
def _reward(monkeypatch):
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)


def tiny_policy(device: str = "cpu") -> Policy:
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    return Policy(model=model, tokenizer=tok, engine=HFEngine(model, tok, max_new_tokens=12, temperature=1.0,
                                                              top_p=1.0, top_k=0, chunk=512, device=device))


@pytest.mark.parametrize("value", ["auto", 0, 1])
def test_the_lag_is_auto_0_or_1(value):
    assert load_config(None, [f"overlap.lag={value}"]).overlap.lag == value
    assert load_config(None).overlap.lag == "auto" and load_config(None).overlap.min_gain == 0.05


@pytest.mark.parametrize("value", ["2", "-1", "true", "'1'", "0.5", "sometimes", "null"])
def test_any_other_lag_is_a_clear_error(value):
    with pytest.raises(ConfigError, match=r"overlap.lag: .*must be auto, 0 \(sequential\) or 1 \(one step off\)"):
        load_config(None, [f"overlap.lag={value}"])
    with pytest.raises(ConfigError, match="overlap.min_gain"):
        load_config(None, ["overlap.min_gain=1"])


def test_where_the_sampler_and_the_trainer_run():
    assert thread_split(2, None) == (1, 1) and thread_split(8, 2) == (2, 6) and thread_split(1, None) == (1, 1)
    assert thread_split(2, 4) == (4, 1)
    tok = build_tokenizer()
    rc = load_config(None, ["rollout.engine=vllm", "rollout.vllm_url=http://127.0.0.1:9"]).rollout
    assert "the sampler is ServerPool, outside this process" == separate_devices(
        ServerPool.from_config(rc, tok, (tok.eos_token_id,)), "cpu", None)
    policy = tiny_policy()
    assert separate_devices(tiny_policy("cuda").engine, "cpu", None) == "the sampler on cuda, the trainer on cpu"
    assert separate_devices(tiny_policy("cuda").engine, "cuda:0", None) is None  # one GPU: shared
    assert separate_devices(policy.engine, "cpu", CORES + 1) is None  # more threads than cores: shared
    gen, rest = thread_split(torch.get_num_threads(), None)
    fits = separate_devices(policy.engine, "cpu", None)
    assert (fits is not None) == (gen + rest <= CORES)
    if fits is not None:
        assert fits.startswith(f"CPU cores for each: {gen} generator and {rest} trainer thread")


def test_an_explicit_lag_wins_without_a_probe(smoke_cfg):
    policy = tiny_policy()
    for lag in (0, 1):  # where auto would probe (a shared device)
        c = decide_lag(smoke_cfg(f"overlap.lag={lag}", CROWDED), policy, [], "cpu")
        assert (c.lag, c.basis, c.probe) == (lag, "config", None)
        assert c.reason == f"lag {lag}: overlap.lag={lag} in the config"
    vllm = decide_lag(smoke_cfg("rollout.engine=vllm", "rollout.vllm_url=http://127.0.0.1:9"),
                      Policy(model=policy.model, tokenizer=policy.tokenizer, engine=ServerPool.from_config(
                          smoke_cfg("rollout.engine=vllm", "rollout.vllm_url=http://127.0.0.1:9").rollout,
                          policy.tokenizer, policy.engine.stop_ids)), [], "cpu")
    assert (vllm.lag, vllm.basis) == (1, "devices")


#: steps enough for any probe to pay for itself (lag 1 could save min(draw, update) each)
MANY = "train.steps=1000000"


@pytest.fixture
def starts(monkeypatch) -> list[int]:
    """The pid of every generator process started from now on: the generator module's own class, counted as it
    starts each (tasks/overlap/generator_process.py ``GeneratorProcess``)."""
    pids: list[int] = []
    real = GeneratorProcess.__init__

    def counted(self, *args, **kwargs):
        real(self, *args, **kwargs)
        pids.append(self.pid)

    monkeypatch.setattr(GeneratorProcess, "__init__", counted)
    return pids


def test_auto_on_a_shared_device_probes_a_draw_and_an_update_alone_and_at_once(smoke_cfg, pool, starts):
    """The real probe on the tiny model: it times all three, decides by its own ratio, leaves no process behind
    (none is kept without a handover), gives the trainer its threads back, and changes no weight."""
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    threads = torch.get_num_threads()
    c = decide_lag(smoke_cfg(CROWDED, MANY), policy, pool[:4], "cpu")
    p = c.probe
    assert c.basis == "probe" and p is not None and 1 <= p.repeats <= 5 and len(starts) == 1
    assert p.draw_s > 0 and p.update_s > 0 and p.at_once_s > 0 and p.start_s > 0
    assert c.worth is not None and c.worth.pays and c.worth.steps == 1_000_000
    assert c.lag == int(p.ratio <= 0.95), c.reason
    assert c.reason.startswith(f"lag {c.lag}: a draw and an update at once took")
    assert lag_from_json(lag_to_json(c)) == c
    assert torch.get_num_threads() == threads and not mp.active_children()
    assert all(torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())
    assert all(p.grad is None for p in policy.model.parameters())


def test_the_probe_times_the_childs_draws_not_those_made_while_it_starts(smoke_cfg, pool, starts, monkeypatch):
    """One core, one thread each: the generator and the trainer share the core, so auto probes. The child's draws
    and one made here while it starts have the same bits, but not the same cost: the probe waits for the child
    before it times anything, so none of its draws is made in the trainer's process."""
    monkeypatch.setattr("tasks.overlap.concurrent.os.sched_getaffinity", lambda pid: {0})
    # spawned, the child takes seconds to start (a forked one is ready at once): what the probe must wait for
    monkeypatch.setattr("tasks.overlap.generator_process.start_method", lambda device, threads: "spawn")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    handover = SamplerHandover()
    try:
        c = decide_lag(smoke_cfg("overlap.generator_threads=1", MANY), tiny_policy(), pool[:4], "cpu",
                       handover=handover)
        assert c.basis == "probe" and len(starts) == 1
        process = handover.kept.process if handover.kept is not None else None
        if process is not None:  # lag 1: the process is kept; else the probe closed it
            assert process.drawn_here == 0
        assert c.probe.start_s > 0.5, "the child's start (imports) is the probe's first cost"
    finally:
        handover.close()
        torch.set_num_threads(threads)


def test_the_probe_is_skipped_where_it_cannot_pay_for_itself(smoke_cfg, pool, starts):
    """Two planned steps of the tiny model cannot earn back a process's start: lag 0, no process started, and the
    reason says why (the summary, overlap.json and the MLflow tags carry it). With the plan's prediction of a step
    (draw 0.05 s, update 0.06 s, as the smoke on one GPU) over 10 steps nothing is even timed; over a million steps
    the probe runs."""
    policy = tiny_policy()
    c = decide_lag(smoke_cfg(CROWDED, "train.steps=2"), policy, pool[:4], "cpu")
    assert (c.lag, c.basis, c.probe) == (0, "cost", None) and not starts
    assert c.worth is not None and not c.worth.pays and c.worth.steps == 2 and c.worth.start_s == 5.0
    assert c.reason.startswith("lag 0 without the overlap probe: the probe, predicted at ")
    assert c.reason.endswith("x 2 steps); the probe could not pay for itself")
    assert lag_from_json(lag_to_json(c)) == c
    planned = decide_lag(smoke_cfg(CROWDED, "train.steps=10"), policy, [], "cpu", expected=(0.05, 0.06))
    assert planned.basis == "cost" and planned.worth.saving_s == pytest.approx(0.5)
    assert planned.worth.probe_s == pytest.approx(5.85) and not starts  # 5 s start + 5 x 0.17 s (test_plan.py)
    paying = decide_lag(smoke_cfg(CROWDED, MANY), policy, pool[:4], "cpu", expected=(0.05, 0.06))
    assert paying.basis == "probe" and paying.worth.pays and len(starts) == 1


def test_the_predicted_start_is_the_configs_or_the_devices(smoke_cfg):
    """``overlap.start_s`` unset: on a CPU 5 s where the child is spawned (two generator threads) and 1 s where it
    is forked (one), 20 s on an accelerator (an H200 took 17.5-18.4 s). A step drawing in 0.05 s and updating in
    0.06 s over 150 steps could save 7.5 s: the probe (start, then 5 repeats of 0.17 s) pays on a CPU (5.85 s) and
    not on a GPU (20.85 s); a start set in the config wins on either."""
    from tasks.overlap.lag import START_S, predicted_start_s, probe_worth

    cfg = smoke_cfg("train.steps=150", "overlap.generator_threads=2")
    assert load_config(None).overlap.start_s is None
    assert START_S == {"cpu-fork": 1.0, "cpu": 5.0, "accelerator": 20.0}
    assert predicted_start_s(cfg, "cpu") == 5.0 and predicted_start_s(cfg, torch.device("cuda", 1)) == 20.0
    assert predicted_start_s(smoke_cfg("overlap.generator_threads=1"), "cpu") == 1.0
    cpu, gpu = probe_worth(0.05, 0.06, cfg, "cpu"), probe_worth(0.05, 0.06, cfg, "cuda")
    assert cpu.pays and cpu.probe_s == pytest.approx(5.85) and cpu.saving_s == pytest.approx(7.5)
    assert not gpu.pays and gpu.probe_s == pytest.approx(20.85) and gpu.start_s == 20.0
    assert probe_worth(0.05, 0.06, smoke_cfg("train.steps=150", "overlap.start_s=2"), "cuda").start_s == 2.0


def test_a_lag_1_run_starts_one_generator_process(smoke_cfg, pool, starts, monkeypatch):
    """auto on a shared device, where the probe pays and chooses lag 1: the probe's process is kept in the run's
    handover, idle with the trainer's threads back, and the training samples from that same process: one process
    started in all, closed at the end. The probe's real timing is read as if at once took half of one after the
    other, so that it chooses lag 1 on a machine of any load (how the timing decides: tests/rlcore/test_plan.py);
    what is counted are the real process starts."""
    from rlcore import overlap_lag
    from tasks.calibration.record import Calibration
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.stages import overlap_stage
    from tasks.training.entry import train

    def faster(separate, probe, min_gain, worth=None):
        fast = None if probe is None else dataclasses.replace(probe, at_once_s=probe.sequential_s / 2)
        return overlap_lag.choose_lag(separate, fast, min_gain, worth)

    monkeypatch.setattr("tasks.overlap.lag.choose_lag", faster)
    small = [o for o in SMALL if not o.startswith("overlap.")]
    policy = tiny_policy()
    threads = torch.get_num_threads()
    run = open_run(smoke_cfg(*small, CROWDED, MANY, path=PRESETS.format("grpo")), track=False)
    calibration = Calibration(indices=tuple(range(8)), success=torch.full((8,), 0.5))
    try:
        choice = overlap_stage.fn(run, policy, pool, calibration)
        assert (choice.lag, choice.basis) == (1, "probe") and len(starts) == 1, choice.reason
        kept = run.handover.kept.process
        assert kept.pid == starts[0] and kept.alive
        assert kept.drawn_here == 0, "the probe timed draws made in the trainer's process while the child started"
        assert torch.get_num_threads() == threads  # the stages before the training keep every thread
        run.cfg = smoke_cfg(*small, CROWDED, "train.steps=3", path=PRESETS.format("grpo"))
        feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
        summary = train(run, policy, pool, feats, calibration, lag=choice)
        assert summary.steps == 3 and summary.overlap and len(starts) == 1 and run.handover.kept is None
        assert not kept.alive  # the training sampled from the probe's process and closed it when it ended
    finally:
        run.close("completed", {})
    assert not mp.active_children() and torch.get_num_threads() == threads


def test_a_kept_process_is_closed_with_the_run_and_not_taken_by_another_trainer(smoke_cfg, pool, starts):
    """The handover closes what no training took (a stage failing after the probe: the run closes it), and gives
    a training of another policy or another thread count none of it."""
    from tasks.overlap.concurrent import Sampler, open_sampler

    policy, other = tiny_policy(), tiny_policy()
    threads = torch.get_num_threads()
    handover = SamplerHandover()
    handover.keep(Sampler(policy, 1, threads=CORES + 1))
    first = handover.kept.process
    assert handover.kept.fits(policy, 1, CORES + 1)
    assert not handover.kept.fits(policy, 1, CORES + 2) and not handover.kept.fits(policy, 0, CORES + 1)
    second = open_sampler(other, 1, threads=CORES + 1, handover=handover)  # another policy: a second start
    assert second.process is not first and not first.alive and handover.kept is None and len(starts) == 2
    handover.keep(second)
    process = second.process
    handover.close(now=True)  # as Run.close does with what no training took
    assert not process.alive and handover.kept is None
    torch.set_num_threads(threads)


def test_the_loop_trains_with_the_lag_it_decides(smoke_cfg, pool):
    """train() without a decision decides: auto on a shared device with a margin no probe can meet (at once 100x
    faster) trains sequentially, where lag 1 would have every fresh group after the first step one update old."""
    small = [o for o in SMALL if not o.startswith("overlap.")]
    _, summary, groups, _, logged = run_train(smoke_cfg(*small, "train.steps=3", CROWDED, "overlap.min_gain=0.99",
                                                        path=PRESETS.format("grpo")), pool)
    assert summary.steps == 3 and summary.overlap == {}  # sequential: no overlap totals
    assert all(m["train/policy_lag"] == 0 for m in logged) and all(g["lag"] == 0 for g in groups)
    assert not any(k.startswith("overlap/") for m in logged for k in m)


def test_the_overlap_stage_keeps_its_choice_for_a_resume_and_takes_the_plans(smoke_cfg, pool):
    from rlcore.overlap_lag import LagChoice
    from tasks.calibration.record import Calibration
    from tasks.run import open_run
    from tasks.stages import overlap_stage
    from tests.tasks.test_plan_config import plan_choosing

    run = open_run(smoke_cfg("overlap.lag=0"), track=False)
    calibration = Calibration(indices=(0, 1), success=torch.tensor([0.5, 0.25]))
    try:
        first = overlap_stage.fn(run, tiny_policy(), pool, calibration)
        assert first == LagChoice(0, "config", "lag 0: overlap.lag=0 in the config")
        stored = run.dir / "overlap.json"
        assert lag_from_json(json.loads(stored.read_text())) == first
        run.cfg = smoke_cfg("overlap.lag=1")  # a resumed run trains with the lag it started with
        assert overlap_stage.fn(run, tiny_policy(), pool, calibration) == first
        stored.unlink()
        planned = LagChoice(1, "devices", "lag 1: the plan's")
        plan = dataclasses.replace(plan_choosing("grpo"), overlap=planned)
        assert overlap_stage.fn(run, tiny_policy(), pool, calibration, plan) == planned
    finally:
        run.close("completed", {})


@pytest.fixture(scope="module")
def pool():
    from tasks.data import arith

    return arith.generate(0, 40, "train", "default")


class Recorded(LlamaForCausalLM):
    """The tiny model's class, whose instances are recorded (weakly) as they are built."""

    built: list = []

    def __init__(self, config):
        super().__init__(config)
        Recorded.built.append(weakref.ref(self))


def test_the_generator_drops_the_shared_weights_before_it_says_it_stopped():
    """The child's loop, run here on a thread: when ``("stopped",)`` arrives, its model is gone and the weights it
    was started with are no longer held by its arguments (on a GPU: every CUDA IPC reference released, so the
    parent outlives them; tasks/overlap/generator_process.py)."""
    policy = tiny_policy()
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    ours, theirs = mp.Pipe()
    settings = policy.engine.settings()
    Recorded.built.clear()
    serve = threading.Thread(target=_serve, args=(Recorded, policy.model.config, weights, policy.tokenizer, settings,
                                                   theirs, 1))
    threads = torch.get_num_threads()
    serve.start()
    try:
        assert ours.recv() == ("ready",)
        ours.send(("generate", ["Q: 1+2=?\n"], 2, 0, False, 0))
        status, (gen, *_) = ours.recv()
        assert status == "ok" and gen.completion_ids.shape[0] == 2
        assert not weights and len(Recorded.built) == 1 and Recorded.built[0]() is not None
        ours.send(("stop",))
        assert ours.poll(30) and ours.recv() == ("stopped",)
        assert Recorded.built[0]() is None, "the child's model outlived its stop"
    finally:
        serve.join(30)
        torch.set_num_threads(threads)
    assert not serve.is_alive()


SHUTDOWN = """
import sys
import warnings
warnings.simplefilter("always")
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.policy import Policy
from tasks.generation.rollout import HFEngine
from tasks.overlap.concurrent import Sampler

if __name__ == "__main__":
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    policy = Policy(model=model, tokenizer=tok, engine=HFEngine(model, tok, max_new_tokens=4, temperature=1.0,
                                                               top_p=1.0, top_k=0, chunk=8))
    sampling = Sampler(policy, 1, threads=1)
    process = sampling._process
    if sys.argv[1] == "ready":
        process.ready(wait=True)
        sampling.policy.engine.generate(["Q: 1+1=?\\n"], 1, 0)  # made by the child
    sampling.close()
    print(process.pid, process._proc.exitcode, int(process._ready), flush=True)
"""


@pytest.mark.parametrize("when", ["ready", "starting"])
def test_shutdown_leaves_no_process_and_no_warning(tmp_path, when):
    """The trainer closes its sampler and exits: a child that has started stopped on request (exit code 0, not
    terminated); one still starting (a run of a few steps ends before its imports do) was terminated at once,
    never said ready, and left no temporary folder. Either is gone, and neither process wrote a warning (on a GPU,
    PyTorch's "Producer process has been terminated before all shared CUDA tensors released" would be one)."""
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="always", TMPDIR=str(temp))
    out = subprocess.run([sys.executable, str(script), when], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    pid, code, ready = (int(x) for x in out.stdout.split())
    if when == "ready":
        assert code == 0 and ready == 1
    else:
        assert code != 0 and ready == 0
        assert not any(temp.glob("pymp-*")), list(temp.iterdir())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not any(w in out.stderr.lower() for w in ("warn", "leaked", "producer process")), out.stderr[-3000:]
