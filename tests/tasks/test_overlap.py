"""Generation and update at once (overlap.lag 1) and the sampler's log-probs as the behaviour policy.

- the in-process engine's sampler log-probs equal the trainer's recomputation in float32 (<= 1e-5);
- the generator process samples exactly what the in-process engine samples from the weights synced last, and a
  generator that dies is one clear error with no process left behind;
- the update's truncated importance weight, hand-worked on one token;
- the overlapped loop: every fresh group one update old (in the ledger), deterministic, different from the
  sequential loop, with every technique on; the sequential loop measures the mismatch without correcting it.
"""

import copy
import math
import os
import signal
import sys
import time

import pytest
import torch

from rlcore.types import RolloutGroup
from tasks.data import arith
from tasks.generation.rollout import HFEngine, RolloutEngine
from tasks.model.forward import token_logprobs
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.model.lora import plain_copy
from tasks.overlap.generator_process import GeneratorDied, GeneratorProcess
from tasks.update.policy_update import mismatch_metrics, policy_update
from tasks.update.updater import LossSettings
from tests.tasks import dist_update_helper as h
from tests.tasks.test_train import ARMS, PRESETS, SMALL, run_train, text_reward

PROMPTS = ["Q: 1+2=?\n", "Q: (33*4-1)%7=?\n", "Q: 9*9=?\n"]


def engine(model, tok, **kw) -> HFEngine:
    return HFEngine(model, tok, **({"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                    "chunk": 512} | kw))


@pytest.fixture(autouse=True)
def _reward(monkeypatch):
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer()
    return build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0), tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_the_trainers_in_float32(tiny, temperature):
    model, tok = tiny
    gen = engine(model, tok, temperature=temperature).generate(PROMPTS, n=4, seed=3)
    with torch.no_grad():
        trainer = token_logprobs(model, [p for p in gen.prompt_ids for _ in range(4)], gen.completion_ids,
                                 gen.completion_mask, tok.pad_token_id, temperature)
    diff = (trainer - gen.logprobs).abs()
    assert gen.logprobs.shape == gen.completion_ids.shape and bool((gen.logprobs[~gen.completion_mask] == 0).all())
    assert float(diff[gen.completion_mask].max()) <= 1e-5
    assert bool((gen.logprobs[gen.completion_mask] < 0).all())


def test_top_k_logprobs_are_those_of_the_truncated_distribution(tiny):
    """With top-k the sampler draws from the renormalised top k, so its log-probs are above the full softmax's: the
    mismatch the correction weighs."""
    model, tok = tiny
    gen = engine(model, tok, top_k=5).generate(PROMPTS, n=2, seed=1)
    with torch.no_grad():
        full = token_logprobs(model, [p for p in gen.prompt_ids for _ in range(2)], gen.completion_ids,
                              gen.completion_mask, tok.pad_token_id, 1.0)
    assert bool((gen.logprobs[gen.completion_mask] >= full[gen.completion_mask] - 1e-6).all())
    assert float((gen.logprobs - full)[gen.completion_mask].max()) > 1e-3


def test_the_generator_process_samples_the_weights_synced_last_and_dies_loudly(tiny):
    model, tok = tiny
    trainer = copy.deepcopy(model)
    local = engine(trainer, tok)
    gp = GeneratorProcess(local, threads=1, weights=plain_copy(local.model))
    pid = gp.pid
    try:
        a, b = gp.generate(PROMPTS, 3, 5), local.generate(PROMPTS, 3, 5)
        assert torch.equal(a.completion_ids, b.completion_ids)  # the same draws; log-probs to float rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn_like(p))
        stale = gp.generate(PROMPTS, 3, 5)
        assert torch.equal(stale.completion_ids, a.completion_ids)  # nothing reaches it before a sync
        gp.sync_weights(trainer, tok, "unused")
        fresh, want = gp.generate(PROMPTS, 3, 5), local.generate(PROMPTS, 3, 5)
        assert torch.equal(fresh.completion_ids, want.completion_ids)
        torch.testing.assert_close(fresh.logprobs, want.logprobs, rtol=0, atol=1e-5)
        assert not torch.equal(fresh.logprobs, a.logprobs)
        assert gp.ready(wait=True)  # the calls so far may have been made here while it started
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(GeneratorDied, match=rf"generator process \(pid {pid}\) died \(signal 9"):
            gp.generate(PROMPTS, 3, 5)
    finally:
        gp.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_generator_processs_screen_pass_has_this_processs_bits(tiny, bf16):
    """``GeneratorProcess.solution_logp``: the likelihood screen's pass in the child, on its copy of the weights (a bf16
    copy where asked), equals tasks/model/solution_logp.py ``solution_logp`` here on the same weights and thread
    count, bit for bit, and follows a sync."""
    from tasks.model.bf16_copy import Bf16Copy
    from tasks.model.forward import right_pad
    from tasks.model.solution_logp import solution_logp

    model, tok = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gp = GeneratorProcess(engine(model, tok), 1, plain_copy(model))
    try:
        prompts = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS]
        comp, mask = right_pad([tok(a)["input_ids"] + [tok.eos_token_id] for a in ("3", "5", "81 81")],
                               tok.pad_token_id)

        def here():
            m = Bf16Copy().of(gp.model) if bf16 else gp.model
            return solution_logp(m, prompts, comp, mask, tok.pad_token_id, 0.7, 0)

        got = gp.solution_logp(prompts, comp, mask, 0.7, 0, bf16)
        assert got.dtype == torch.float64 and torch.equal(got, here())
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p in moved.parameters():
                p.mul_(1.5)
        gp.sync_weights(moved, tok, "unused")
        again = gp.solution_logp(prompts, comp, mask, 0.7, 0, bf16)
        assert not torch.equal(again, got) and torch.equal(again, here())
        assert gp.passes == 2
    finally:
        gp.close()
        torch.set_num_threads(threads)


def test_draws_asked_while_the_generator_starts_are_made_here_with_its_bits(tiny):
    """A spawned child takes seconds to start (torch and transformers to import): a call asked meanwhile is made in this
    process on the same shared weights, bit for bit what the child then draws; with another thread count than the
    child's (other sums), the call waits for the child instead."""
    model, tok = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gp = GeneratorProcess(engine(model, tok), threads=1, weights=plain_copy(model), start="spawn")
    try:
        early = gp.generate(PROMPTS, 3, 5)
        assert gp.drawn_here == 1 and not gp.ready()
        assert gp.ready(wait=True)
        late = gp.generate(PROMPTS, 3, 5)
        assert gp.drawn_here == 1
        assert torch.equal(early.completion_ids, late.completion_ids) and torch.equal(early.logprobs, late.logprobs)
    finally:
        gp.close()
        torch.set_num_threads(threads)
    other = GeneratorProcess(engine(model, tok), threads=2, weights=plain_copy(model))
    torch.set_num_threads(1)
    try:
        other.generate(PROMPTS, 3, 5)
        assert other.drawn_here == 0 and other.ready()
    finally:
        other.close()
        torch.set_num_threads(threads)


def test_the_generator_is_forked_only_on_a_cpu_with_one_thread(tiny):
    """On a CPU with one torch thread (on Linux) the child is forked, and draws; GNU OpenMP past one thread and CUDA
    are not fork-safe (a forked child's first two-thread matmul hangs), so those spawn, and asking for a fork there is
    an error."""
    from tasks.overlap.generator_process import start_method

    assert start_method("cpu", 1) == ("fork" if sys.platform.startswith("linux") else "spawn")
    assert start_method("cpu", 2) == start_method("cuda", 1) == "spawn"
    model, tok = tiny
    with pytest.raises(ValueError, match="one torch thread"):
        GeneratorProcess(engine(model, tok), threads=2, weights=plain_copy(model), start="fork")
    gp = GeneratorProcess(engine(model, tok), threads=1, weights=plain_copy(model))
    try:
        assert gp.start == "fork"
        assert gp.ready(wait=True) and gp.generate(PROMPTS, 2, 0).completion_ids.shape[0] == 2 * len(PROMPTS)
    finally:
        gp.close()


def test_the_generator_has_its_own_temporary_folder_and_a_run_never_removes_its_parents(smoke_cfg, tiny):
    """The trainer's process has a multiprocessing folder of its own (any earlier use of multiprocessing there makes
    one, as the full test suite's did) and a child, forked or spawned, inherits its name: the generator makes its
    own, so the run that removes a noted folder once its generator is gone (tasks/run.py ``remove_leftovers``)
    leaves the parent's, and the next generator still replies. Before: the child reported the parent's folder, the
    run removed it, and the next generator, unable to place its reply's listener there, left with exit code 0 at its
    first reply (the lag-1 waves resume's "died (exit code 0)", tests/tasks/test_waves.py). Then: a CPU's reply needs no
    listener (its tensors are copied in; a GPU's shared, whose failure the next test shows), and a closed generator
    is an error that says so."""
    import shutil
    from multiprocessing import util as mp_util
    from pathlib import Path

    from tasks.run import open_run

    model, tok = tiny
    parents = Path(mp_util.get_temp_dir())  # the trainer's process has its folder before the generator starts
    run = open_run(smoke_cfg(), track=False)
    try:
        first = GeneratorProcess(engine(model, tok), threads=1, weights=plain_copy(model), on_temp_dir=run.note_temp)
        try:
            first.ready(wait=True)  # a call asked while it starts is made here, with no reply from it
            first.generate(PROMPTS[:1], 2, 0)
            own = Path(first.temp_dir)
            assert own != parents and own.is_dir() and own.parent == parents.parent
        finally:
            first.close()
        assert not own.exists()  # a clean stop removes the child's own folder
    finally:
        run.close("failed", {})  # removes the noted folders whose process is gone
    assert parents.is_dir()
    second = GeneratorProcess(engine(model, tok), threads=1, weights=plain_copy(model))
    try:
        second.ready(wait=True)
        assert second.generate(PROMPTS[:1], 2, 0).completion_ids.shape[0] == 2
        shutil.rmtree(second.temp_dir)  # a GPU's replies share their tensors through its listener; a CPU's are copied
        assert second.generate(PROMPTS[:1], 2, 0).completion_ids.shape[0] == 2
    finally:
        second.close()
    assert not second.alive
    with pytest.raises(GeneratorDied, match=rf"generator process \(pid {second.pid}\) was closed"):
        second.generate(PROMPTS[:1], 2, 0)


UNSENDABLE = """
import shutil, threading
from multiprocessing import Pipe, util
from tasks.generation.rollout import HFEngine
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.model.lora import plain_copy
from tasks.overlap.generator_process import _serve
tok = build_tokenizer()
model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
settings = HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=8).settings()
shutil.rmtree(util.get_temp_dir())  # the folder the reply's listener would be placed in is gone
parent, child = Pipe()
serving = threading.Thread(target=_serve, args=(type(model), model.config, plain_copy(model).state_dict(), tok,
                                                settings, child, 1, True), daemon=True)  # shared, as on a GPU
serving.start()
assert parent.recv() == ("ready",)
parent.send(("generate", ["Q: 1+1=?\\n"], 2, 0, False, 0))
if not parent.poll(60):
    raise SystemExit("no reply")
print(parent.recv()[1].splitlines()[0])
parent.send(("stop",))
print(parent.recv()[0])
"""


def test_a_cpu_generators_reply_carries_its_tensors_and_a_gpus_shares_them():
    """:func:`_pickle`: copied in (a CPU's replies), the bytes hold every tensor's data and load anywhere; shared (a
    GPU's, and its CPU twin here), they hold a handle to each storage, a few hundred bytes whatever its size."""
    import pickle

    from tasks.overlap.generator_process import _pickle

    reply = ("ok", (torch.arange(4096, dtype=torch.int64), 1.0, "/tmp"))
    copied, shared = _pickle(reply, share=False), _pickle(reply, share=True)
    assert len(copied) > 4096 * 8 > 10 * len(shared)
    out = pickle.loads(copied)
    assert out[0] == "ok" and torch.equal(out[1][0], reply[1][0])
    assert torch.equal(pickle.loads(shared)[1][0], reply[1][0])


def test_a_reply_the_generator_cannot_send_is_an_error_that_says_why():
    """The generator's process lost its multiprocessing folder: the reply's tensors cannot be shared (as a GPU's
    are; a CPU's are copied into the reply), and the parent hears why (before: the generator left silently, with
    exit code 0), and the generator still stops."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", UNSENDABLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    said, stopped = out.stdout.splitlines()
    assert said.startswith("the reply could not be sent: FileNotFoundError") and "(temporary folder /" in said
    assert stopped == "stopped"


def _one_token_group(model, shift: float) -> RolloutGroup:
    """One group of two one-token rollouts (advantages +1/2, -1/2) whose sampler log-probs are pi_old's minus
    ``shift`` (so pi_old / mu = e^shift on every token)."""
    prompt = torch.tensor([1, 30, 31])
    comp = torch.tensor([[40], [41]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    with torch.no_grad():
        old = token_logprobs(model, [prompt, prompt], comp, mask, h.PAD)
    rewards = torch.tensor([1.0, 0.0])
    return RolloutGroup(prompt_id="p", prompt_ids=prompt, completion_ids=comp, completion_mask=mask, rewards=rewards,
                        advantages=rewards - 0.5, behaviour_logp=old - shift, success_rate=0.5, n_generated=2,
                        step=0, sampler_logp=old - shift, policy_version=0)


@pytest.mark.parametrize("cap, weight", [(2.0, 2.0), (None, 3.0), (4.0, 3.0)])
def test_truncated_importance_weight_hand_worked(cap, weight):
    """pi_old / mu = 3 on both tokens: the decoupled loss at pi_theta = pi_old is -(A_1 w + A_2 w) / 2 = 0 in value,
    its ratio pi_theta / mu' is the weight w = min(3, cap), and the gradient is w times the on-policy one."""
    shift = math.log(3.0)
    settings = dict(clip_eps=0.2, aggregation="token", grad_clip=1e9, temperature=1.0, pad_id=h.PAD, minibatches=1,
                    kl_coef=0.0)
    grads = {}
    for name, group, c in (("corrected", _one_token_group(h.tiny_model(), shift), cap),
                           ("on-policy", _one_token_group(h.tiny_model(), 0.0), None)):
        if name == "on-policy":
            group.behaviour_logp = torch.zeros(0)
        model = h.tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stats = policy_update(model, opt, [group], LossSettings(behaviour_cap=c, **settings)).metrics
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        if name == "corrected":
            assert stats["train/ratio_mean"] == pytest.approx(weight, rel=1e-5)
            assert stats["offpolicy/ratio_mean"] == pytest.approx(3.0, rel=1e-5)
            assert stats["offpolicy/truncated_frac"] == (1.0 if cap is not None and cap < 3 else 0.0)
            assert stats["offpolicy/kl"] == pytest.approx(2.0 - math.log(3.0), rel=1e-5)
    scale = float(grads["on-policy"].abs().max())
    torch.testing.assert_close(grads["corrected"], weight * grads["on-policy"], rtol=1e-3, atol=1e-5 * scale)


def test_mismatch_metrics_loop_oracle():
    g = torch.Generator().manual_seed(0)
    old, sampler = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    out = mismatch_metrics(old, sampler, mask, math.log(1.5))
    ws = [math.exp(old[i, j] - sampler[i, j]) for i in range(5) for j in range(7) if mask[i, j]]
    assert out["offpolicy/ratio_mean"] == pytest.approx(sum(ws) / len(ws))
    assert out["offpolicy/ratio_max"] == pytest.approx(max(ws))
    assert out["offpolicy/kl"] == pytest.approx(sum(w - 1 - math.log(w) for w in ws) / len(ws))
    assert out["offpolicy/truncated_frac"] == pytest.approx(sum(w > 1.5 for w in ws) / len(ws))
    assert mismatch_metrics(old, sampler, torch.zeros(5, 7, dtype=torch.bool), None) == {}


@pytest.fixture(scope="module")
def pool():
    return arith.generate(0, 40, "train", "default")


LAG1 = [*[o for o in SMALL if not o.startswith("overlap.")], "overlap.lag=1", "train.steps=5"]


def _rows(table):
    """Ledger rows without their run id: two runs' rows compared."""
    return [{k: v for k, v in r.items() if k != "run_id"} for r in table]


def test_the_overlapped_loop_trains_one_update_behind_exactly_and_deterministically(smoke_cfg, pool):
    a_state, a_sum, a_groups, a_sel, a_log = run_train(smoke_cfg(*LAG1, path=PRESETS.format("grpo")), pool)
    b_state, _, b_groups, b_sel, _ = run_train(smoke_cfg(*LAG1, path=PRESETS.format("grpo")), pool)
    s_state, _, s_groups, _, s_log = run_train(smoke_cfg(*LAG1, "overlap.lag=0", path=PRESETS.format("grpo")), pool)
    assert a_sum.steps == 5
    assert [(g["step"], g["policy_version"], g["lag"]) for g in a_groups] == \
        [(s, max(s - 1, 0), min(s, 1)) for s in range(5) for _ in range(6)]
    assert all(g["lag"] == 0 and g["policy_version"] == g["step"] for g in s_groups)
    for k in a_state:  # one seed, one result
        assert torch.equal(a_state[k], b_state[k]), k
    assert _rows(a_sel) == _rows(b_sel) and _rows(a_groups) == _rows(b_groups)
    assert any(not torch.equal(a_state[k], s_state[k]) for k in a_state), "the lag must change what is trained"
    # the first two steps sample the starting weights in both loops: same rollouts
    assert [g["successes"] for g in a_groups[:12]] == [g["successes"] for g in s_groups[:12]]
    for m in a_log[:-1]:  # each step's update overlapped the next step's draw (none after the last)
        assert m["overlap/draw_s"] > 0 and m["overlap/update_s"] > 0 and m["overlap/trainer_idle_s"] >= 0
    assert "overlap/draw_s" not in a_log[-1]
    for m in a_log[1:]:
        assert m["train/policy_lag"] == 1.0
        assert m["offpolicy/ratio_mean"] > 0 and m["offpolicy/kl"] >= 0 and "offpolicy/truncated_frac" in m
    assert a_log[0]["train/policy_lag"] == 0.0
    assert all(m["train/policy_lag"] == 0.0 for m in s_log)
    # sequential: mu = pi_old (no correction) and the sampler agrees with the trainer to float rounding
    assert all(m["offpolicy/logp_diff_max"] <= 1e-5 for m in s_log)
    assert all(m["train/behaviour_ratio_mean"] == 1.0 for m in s_log)
    assert any(m["offpolicy/logp_diff_max"] > 1e-3 for m in a_log[2:]), "lag 1 samples older weights"


def test_the_draw_launched_ahead_is_the_same_run_with_the_generator_busier(smoke_cfg, pool, monkeypatch):
    """Step t + 2's draw is launched once step t is observed (tasks/training/loop.py ``launch_ahead``), beside its
    records, not at step t + 1's update: same weights, same selection, so the same run bit for bit; also at a step
    that ends with a checkpoint (which saves the state from before the draw); not at an evaluation, nor for the
    last step, nor with replay."""
    from tasks.training.loop import Trainer

    cfg = smoke_cfg(*LAG1, "train.steps=10", "train.round_steps=4", path=ARMS.format("grpo_prescreen"))
    real = Trainer.launch_ahead
    ahead = []

    def spy(self, step):
        before = self.overlap.in_flight
        real(self, step)
        if self.overlap.in_flight and not before:
            ahead.append(step)

    monkeypatch.setattr(Trainer, "launch_ahead", spy)
    a_state, _, a_groups, a_sel, a_log = run_train(cfg, pool)
    # step t launches t + 2, so not t = 8 or 9; steps 3 and 7 end with a checkpoint (rounds of 4)
    assert ahead == list(range(8)), "launched ahead after every step but the last two"
    monkeypatch.setattr(Trainer, "launch_ahead", lambda self, step: None)
    b_state, _, b_groups, b_sel, b_log = run_train(cfg, pool)
    for k in a_state:
        assert torch.equal(a_state[k], b_state[k]), k

    assert _rows(a_sel) == _rows(b_sel) and _rows(a_groups) == _rows(b_groups)
    assert [m["train/reward_mean"] for m in a_log] == [m["train/reward_mean"] for m in b_log]
    ahead.clear()
    monkeypatch.setattr(Trainer, "launch_ahead", spy)
    run_train(smoke_cfg(*LAG1, "train.steps=10", "train.round_steps=4", path=PRESETS.format("dots")), pool)
    assert ahead == [], "replay's buffer is read by the records and pruned by a draw: nothing launched ahead"


def test_the_look_ahead_waits_for_the_update_it_runs_beside_and_the_run_is_the_same(smoke_cfg, pool, monkeypatch):
    """In the trainer's process (select.screen_process trainer), a lag-1 draw's look-ahead (the next step's screen
    pass) starts only once the update it runs beside has ended
    (tasks/overlap/concurrent.py ``Overlap.launch``), so it runs on the trainer's cores while the trainer waits, not
    as a third thread beside both: with each update's end held back 50 ms, every look-ahead of step s's draw still
    starts after updates 0..s-1 have ended. The screen reads the sampler's weights, so a run whose look-ahead does
    not wait is the same run bit for bit."""
    import threading
    import time

    from tasks.overlap.concurrent import Overlap
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*LAG1, "train.steps=8", "train.round_steps=4", "select.screen_process=trainer",
                    path=ARMS.format("grpo_prescreen"))
    lock, ended, starts = threading.Lock(), [0], []
    real_ended, real_ahead = Overlap.update_ended, Selector.lookahead

    def held_back(self):
        time.sleep(0.05)
        with lock:
            ended[0] += 1
        real_ended(self)

    def watched(self):
        work, step = real_ahead(self), self.asked[1]
        if work is None:
            return None

        def run():
            with lock:
                starts.append((step, ended[0]))
            work()
        return run

    monkeypatch.setattr(Overlap, "update_ended", held_back)
    monkeypatch.setattr(Selector, "lookahead", watched)
    a_state, _, a_groups, a_sel, a_log = run_train(cfg, pool)
    lagged = [(s, n) for s, n in starts if s > 0]  # step 0 is drawn before any update, in the trainer's thread
    assert lagged and all(n >= s for s, n in lagged), starts
    assert any(m["select/screen_ahead_share"] > 0 for m in a_log), "the screen's look-ahead was read"
    real_launch = Overlap.launch
    monkeypatch.setattr(Overlap, "launch", lambda self, draw: real_launch(self, lambda after: draw(lambda: None)))
    b_state, _, b_groups, b_sel, b_log = run_train(cfg, pool)
    for k in a_state:
        assert torch.equal(a_state[k], b_state[k]), k
    assert _rows(a_sel) == _rows(b_sel) and _rows(a_groups) == _rows(b_groups)


def test_the_screen_in_the_generator_process_is_the_same_run_and_its_passes_are_the_childs(smoke_cfg, pool,
                                                                                          monkeypatch):
    """select.screen_process sampler: every screen pass of a lag-1 run (each round's first step's own, the others'
    look-ahead, right after the generate call) is the generator process's, on its copy of the sampler's weights, so
    the trainer's process computes none; and the run is the trainer-side run bit for bit (weights, ledger rows)."""
    import tasks.selection.screen as screen

    passes = []
    real = GeneratorProcess.solution_logp
    monkeypatch.setattr(GeneratorProcess, "solution_logp", lambda self, *a, **k: passes.append(len(a[0])) or real(
        self, *a, **k))
    here = []
    real_here = screen.solution_logp
    monkeypatch.setattr(screen, "solution_logp", lambda *a, **k: here.append(1) or real_here(*a, **k))
    base = (*LAG1, "train.steps=8", "train.round_steps=4")
    a_state, _, a_groups, a_sel, a_log = run_train(smoke_cfg(*base, "select.screen_process=sampler",
                                                             path=ARMS.format("grpo_prescreen")), pool)
    assert passes and not here, (passes, here)
    assert any(m["select/screen_ahead_share"] > 0 for m in a_log), "the look-ahead's scores were read"
    b_state, _, b_groups, b_sel, _ = run_train(smoke_cfg(*base, "select.screen_process=trainer",
                                                         path=ARMS.format("grpo_prescreen")), pool)
    assert here, "the trainer-side run scores here"
    for k in a_state:
        assert torch.equal(a_state[k], b_state[k]), k
    assert _rows(a_sel) == _rows(b_sel) and _rows(a_groups) == _rows(b_groups)


def test_a_checkpoint_written_beside_a_draw_launched_ahead_resumes_the_same_run(smoke_cfg, pool, monkeypatch):
    """The checkpoint after step 3 is written while step 5's draw runs (launched ahead once step 3 was observed):
    it keeps the selector and the next step's rollouts from before that draw, so a run stopped in step 5 and
    resumed from it redraws step 5 and ends with the uninterrupted run's weights, ledger rows and rewards."""
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training import checkpoint
    from tasks.training.entry import train
    from tasks.training.loop import Trainer
    from tests.tasks.test_train import make_policy

    cfg = smoke_cfg(*LAG1, "train.steps=8", "train.round_steps=4", path=ARMS.format("grpo_prescreen"))
    want, _, want_groups, want_sel, want_log = run_train(cfg, pool)
    real = Trainer.play_step

    class Stop(Exception):
        pass

    def stopping(self, round_, step, tally):
        if step == 5:
            raise Stop
        return real(self, round_, step, tally)

    monkeypatch.setattr(Trainer, "play_step", stopping)
    policy = make_policy()
    feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
    run = open_run(cfg, track=False)
    with pytest.raises(Stop):
        train(run, policy, pool, feats)
    assert checkpoint.latest(run).name == "step-000004.pt"
    run.close("failed", {})
    monkeypatch.setattr(Trainer, "play_step", real)
    got, summary, groups, sel, logged = run_train(cfg, pool, run_id=run.run_id)
    assert summary.steps == 8
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert _rows(sel) == _rows(want_sel) and _rows(groups) == _rows(want_groups)
    assert [m["train/reward_mean"] for m in logged] == [m["train/reward_mean"] for m in want_log]


def test_every_technique_composes_with_the_overlap(smoke_cfg, pool):
    """DOTS with the screen, replay, PODS, ScalingRL, GAIN-RL and the adaptive composition, then DAPO's dynamic
    sampling, all overlapped: every step trains, fresh groups one update old, the reference rows in the ledger."""
    cfg = smoke_cfg(*LAG1, "train.steps=6", "rollout.n=6", "pods.m=4", "select.screen=2",
                    path=PRESETS.format("all"))
    assert cfg.select.method == "dots" and cfg.replay.enabled and cfg.curriculum.enabled and cfg.gain.enabled
    _, summary, groups, sel, logged = run_train(cfg, pool)
    assert summary.steps == 6 and [m["step"] for m in logged] == list(range(6))
    fresh = [g for g in groups if not g["replayed"]]
    assert all(g["lag"] == min(g["step"], 1) for g in fresh)
    assert any(g["replayed"] and g["lag"] >= 2 for g in groups)
    assert all(s["screen_success"] is not None for s in sel)
    assert all("select/ref_success" in logged[s] for s in (0, 2, 4)), "each round start ran (steps 2, 4: in a draw)"
    dapo = smoke_cfg(*LAG1, "train.steps=3", path=PRESETS.format("dapo"))
    assert dapo.dynamic.enabled
    _, summary, _, _, logged = run_train(dapo, pool)
    assert summary.steps == 3 and all("dynamic/rounds" in m for m in logged)


ORPHAN = """
import sys, torch
from tasks.overlap.generator_process import GeneratorProcess
from tasks.model.lora import plain_copy
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.generation.rollout import HFEngine
tok = build_tokenizer()
model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
gp = GeneratorProcess(HFEngine(model, tok, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, chunk=8), 1,
                      plain_copy(model), start=sys.argv[1])
gp.ready(wait=True)
gp.generate(["Q: 1+1=?\\n"], 1, 0)
print(gp.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_killed_trainer_leaves_no_generator_behind(start):
    """SIGKILL the trainer alone (not its process group): the generator sees its pipe close and leaves; a forked one
    too, which inherited the trainer's end of the pipe and closed it."""
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, start], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # alive while the trainer is
        proc.kill()
        proc.wait()
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":  # exited; waiting for init to reap it
                    return
            time.sleep(0.2)
        raise AssertionError(f"generator {child} outlived its trainer")
    finally:
        proc.kill()


class ScriptedServer(RolloutEngine):
    """A rollout engine outside the trainer (as the vLLM server is): it samples from its own copy of the weights,
    loaded only by ``sync_weights``, and returns log-probs ``shift`` nats below its own (as a bf16 server's differ)."""

    def __init__(self, model, tok, shift: float):
        self.copy = copy.deepcopy(model)
        self.local = engine(self.copy, tok, max_new_tokens=12)
        self.shift, self.syncs, self.sampled_from = shift, 0, []

    def generate(self, prompts, n, seed, greedy=False):
        self.sampled_from.append(self.syncs)
        gen = self.local.generate(prompts, n, seed, greedy)
        gen.logprobs = torch.where(gen.completion_mask, gen.logprobs - self.shift, 0.0)
        return gen

    @torch.no_grad()
    def sync_weights(self, model, tokenizer, folder) -> float:
        self.copy.load_state_dict(model.state_dict())
        self.syncs += 1
        return 0.0


@pytest.mark.parametrize("lag", [0, 1])
def test_a_servers_logprobs_are_the_behaviour_policy_and_it_gets_the_weights_every_step(smoke_cfg, pool, lag,
                                                                                       monkeypatch):
    """``rollout.engine=vllm``: the server's own log-probs are mu, sequential or overlapped (pi_old / mu = e^0.1
    where it samples the trainer's weights); overlapped, the weights reach it before every draw."""
    from tasks.policy import Policy
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training.entry import train

    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    server = ScriptedServer(model, tok, shift=0.1)
    policy = Policy(model=model, tokenizer=tok, engine=server)
    cfg = smoke_cfg(*LAG1, f"overlap.lag={lag}", "rollout.engine=vllm", "train.round_steps=5", "train.lr=1e-2",
                    path=PRESETS.format("grpo"))
    run = open_run(cfg, track=False)
    try:
        feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
        train(run, policy, pool, feats)
        logged = [__import__("json").loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        run.close("completed", {})
    if lag:  # a sync at the start and before each later draw (steps 1..4), one after training
        assert server.sampled_from == [1, 2, 3, 4, 5] and server.syncs == 6
    else:  # the round's start (one round of 5 steps) and after training
        assert server.sampled_from == [1] * 5 and server.syncs == 2
    # step 0 samples the trainer's own step-start weights: pi_old / mu = e^0.1 exactly, and it is the loss's weight
    assert logged[0]["offpolicy/ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert logged[0]["train/behaviour_ratio_mean"] == pytest.approx(math.exp(0.1), rel=1e-4)
    for m in logged[1:]:  # older weights: the staleness adds to the shift, and the loss weighs tokens by it
        assert abs(m["offpolicy/logp_diff_max"] - 0.1) > 1e-2
        assert m["train/behaviour_ratio_mean"] != 1.0


def test_a_generator_that_dies_stops_the_run_at_its_checkpoint_and_a_resume_finishes_it(smoke_cfg, pool, monkeypatch):
    """The generator is killed during its fourth draw (step 3's, during update 2): the run raises GeneratorDied naming
    it, the child is gone, the last checkpoint (after steps 0-1) is intact, and resuming gives the uninterrupted
    run's weights."""
    from tasks.run import open_run
    from tasks.selection.features import compute_features
    from tasks.training import checkpoint
    from tasks.training.entry import train
    from tests.tasks.test_train import make_policy

    cfg = smoke_cfg(*LAG1, "train.checkpoint_every=1")
    want, *_ = run_train(cfg, pool)
    real, calls, pids = GeneratorProcess.generate, [0], []

    def dying(self, *a, **k):
        calls[0] += 1
        pids.append(self.pid)
        if calls[0] == 4:
            self.ready(wait=True)  # started: the draw is the child's, not one made here while it starts
            os.kill(self.pid, signal.SIGKILL)
        return real(self, *a, **k)

    monkeypatch.setattr(GeneratorProcess, "generate", dying)
    policy = make_policy()
    feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
    run = open_run(cfg, track=False)
    with pytest.raises(GeneratorDied, match=r"died \(signal 9"):
        train(run, policy, pool, feats)
    assert checkpoint.latest(run).name == "step-000002.pt"  # step 2 did not finish: its iteration waits for draw 3
    with pytest.raises(ProcessLookupError):
        os.kill(pids[-1], 0)
    run.close("failed", {})
    monkeypatch.setattr(GeneratorProcess, "generate", real)
    got, summary, *_ = run_train(cfg, pool, run_id=run.run_id)
    assert summary.steps == 5
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_a_draws_wait_for_the_update_ends_with_it_or_when_the_trainer_collects():
    """``Overlap.launch`` gives the draw a wait that returns once the trainer's next update has ended
    (``update_ended``), and never blocks a draw the trainer collects without one (no deadlock); an update that ended
    before the launch does not count; ``beside`` runs its second work only after that wait, its first at once."""
    import threading

    from tasks.overlap.concurrent import Overlap
    from tasks.training.draw import beside

    overlap, order = Overlap(), []
    overlap.update_ended()  # before the launch: the next draw still waits for its own update
    gate = threading.Event()

    def draw(after_update):
        return beside(lambda: (order.append("generate"), gate.wait(5), "rollouts")[-1],
                      lambda: order.append("look-ahead"), lambda: (after_update(), order.append("update ended")))

    overlap.launch(draw)
    gate.set()
    time.sleep(0.05)
    assert order == ["generate"], "the look-ahead waits for the update"
    overlap.update_ended()
    out, _ = overlap.collect()
    assert out == "rollouts" and order == ["generate", "update ended", "look-ahead"]
    order.clear()
    overlap.launch(draw)
    out, _ = overlap.collect()  # collected without an update: the wait returns
    assert out == "rollouts" and sorted(order) == ["generate", "look-ahead", "update ended"]
    assert order.index("update ended") < order.index("look-ahead")
    overlap.close()


def test_the_prescreened_arms_start_each_round_beside_the_last_generate_call(smoke_cfg, pool):
    """conf/bench/grpo_prescreen.yaml (and the arms built on it) turn on select.round_ahead: in a lag-1 run every round
    after the first starts ahead (``select/round_ahead`` 1), and its first step reads every score it keeps from the
    look-ahead of the round's last generate call, none scored before its own call; with the option off, that step
    scores its candidates itself."""
    base = (*LAG1, "train.steps=8", "train.round_steps=4")
    on = run_train(smoke_cfg(*base, path=ARMS.format("grpo_prescreen_n6_11")), pool)[4]
    off = run_train(smoke_cfg(*base, "select.round_ahead=false", path=ARMS.format("grpo_prescreen_n6_11")), pool)[4]
    first = {m["step"]: m for m in on}[4]
    assert first["select/round_ahead"] == 1.0 and first["select/screen_ahead_share"] == 1.0
    assert {m["step"]: m for m in off}[4]["select/screen_ahead_share"] == 0.0
