"""The training stage: plain GRPO records every step; each technique switched off is plain GRPO bit for bit;
all five together run and record their signals.

The reward here is a deterministic function of the completion text (even length -> 1), so an untrained tiny
model gets mixed rewards and real gradients; the real verifiers are tested in test_rewards.py.
"""

import json
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.config import ConfigError
from tasks.data import arith
from tasks.generation.rollout import HFEngine
from tasks.model.loading import build_tiny_model, build_tokenizer
from tasks.policy import Policy
from tasks.run import open_run
from tasks.selection.features import compute_features
from tasks.training.entry import train
from tasks.update.updater import scheduled_lr

PRESETS = "conf/presets/{}.yaml"
ARMS = "conf/bench/{}.yaml"  # the benchmark's arms: experimental variants
SMALL = ["train.steps=4", "train.prompts_per_step=6", "train.round_steps=2", "rollout.n=4",
         "rollout.max_new_tokens=12", "calibrate.k=8", "calibrate.g=4", "select.predictor.min_labels=8",
         "select.predictor.fit_steps=5", "eval.every=0", "overlap.lag=0"]


def text_reward(records, completions, workers=1):
    return [float(len(c) % 2 == 0) for c in completions]


@pytest.fixture(autouse=True)
def _reward(monkeypatch):
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", text_reward)


def make_policy():
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    engine = HFEngine(model, tok, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, chunk=512)
    return Policy(model=model, tokenizer=tok, engine=engine)


@pytest.fixture(scope="module")
def pool():
    return arith.generate(0, 40, "train", "default")


def run_train(cfg, pool, run_id=None):
    """Train a fresh policy on ``pool`` (``run_id``: resume that run from its latest checkpoint); returns its weights,
    summary, ledger groups and selections, and metrics lines."""
    policy = make_policy()
    feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
    run = open_run(cfg, run_id=run_id, track=False)
    try:
        summary = train(run, policy, pool, feats)
        groups = run.ledger.query("SELECT * FROM groups WHERE run_id = ? ORDER BY step", [run.run_id])
        sel = run.ledger.query("SELECT * FROM selections WHERE run_id = ? ORDER BY step", [run.run_id])
        logged = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        run.close("completed", {})
    return policy.model.state_dict(), summary, groups, sel, logged


def fresh_run(cfg, pool):
    """A fresh policy, its features of ``pool`` and a new run of ``cfg``, for a test that drives the trainer."""
    policy = make_policy()
    return policy, compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu"), \
        open_run(cfg, track=False)


def dies_at(at: int, before=lambda: None):
    """An in-training evaluation (called once step ``step - 1`` is updated and recorded, before its checkpoint) that
    calls ``before`` and then kills the run at step ``at``."""
    from tasks.training.step_records import HeldoutEval

    def evaluate(step):
        before()
        if step == at:
            raise RuntimeError("killed")
        return HeldoutEval(accuracy=0.5, metrics={})

    return evaluate


def test_grpo_trains_and_records_every_step(smoke_cfg, pool):
    cfg = smoke_cfg(*SMALL, path=PRESETS.format("grpo"))
    before = {k: v.clone() for k, v in make_policy().model.state_dict().items()}
    after, summary, groups, sel, _ = run_train(cfg, pool)
    assert summary.steps == 4
    assert sorted({g["step"] for g in groups}) == [0, 1, 2, 3]
    assert len(groups) == 4 * 6 and len(sel) == 4 * 6
    assert all(g["n"] == 4 and g["kept"] == 4 and not g["replayed"] for g in groups)
    assert all(s["selector"] == "uniform" for s in sel)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), "every parameter should move under a real gradient"
    last = summary.last
    assert 0 <= last["train/effective_ratio"] <= 1 and last["time/step_s"] > 0


OFF = ["select.method=uniform", "pods.enabled=false", "replay.enabled=false", "curriculum.enabled=false",
       "gain.enabled=false", "adapt.enabled=false", "rollout.n=4"]


@pytest.mark.parametrize("preset, extra", [
    ("all", []),                                    # every switch off in the composed preset
    ("dots", ["replay.enabled=true", "replay.capacity=0"]),  # a replay buffer of size 0
])
def test_techniques_off_reproduce_grpo_bit_for_bit(smoke_cfg, pool, preset, extra):
    base, _, g_base, s_base, _ = run_train(smoke_cfg(*SMALL, path=PRESETS.format("grpo")), pool)
    other, _, g_other, s_other, _ = run_train(smoke_cfg(*SMALL, *OFF, *extra, path=PRESETS.format(preset)), pool)
    assert [s["prompt_id"] for s in s_base] == [s["prompt_id"] for s in s_other]
    assert [g["successes"] for g in g_base] == [g["successes"] for g in g_other]
    assert any(0 < g["successes"] < g["n"] for g in g_base), "the comparison needs real gradients"
    for k in base:
        assert torch.equal(base[k], other[k]), k


@pytest.mark.parametrize("schedule", [["train.warmup_steps=8"], ["train.lr_schedule=linear", "train.min_lr_ratio=0.1"]])
def test_lr_schedule_changes_the_single_process_run(smoke_cfg, pool, schedule):
    """train.warmup_steps and train.lr_schedule reach the optimizer through Updater.set_lr: other weights than
    without them, and every step logs the lr it ran at (``train/lr``)."""
    base, *_ = run_train(smoke_cfg(*SMALL, path=PRESETS.format("grpo")), pool)
    cfg = smoke_cfg(*SMALL, *schedule, path=PRESETS.format("grpo"))
    other, _, _, _, logged = run_train(cfg, pool)
    assert any(not torch.equal(base[k], other[k]) for k in base)
    lrs = [m["train/lr"] for m in logged]
    assert lrs == [scheduled_lr(cfg, s) for s in range(cfg.train.steps)] and len(set(lrs)) == cfg.train.steps


def test_all_techniques_compose_and_record_signals(smoke_cfg, pool, caplog):
    cfg = smoke_cfg(*SMALL, "rollout.n=6", "pods.m=4", "replay.capacity=16", "adapt.enabled=false",
                    path=PRESETS.format("all"))
    with caplog.at_level(logging.INFO, logger="rlsift.train"):
        _, summary, groups, sel, logged = run_train(cfg, pool)
    keys = set().union(*logged)
    assert summary.steps == 4
    assert {s["selector"] for s in sel} == {"scalingrl+gain+dots"}
    assert all(s["pred_success"] is not None and s["des"] is not None for s in sel)
    fresh = [g for g in groups if not g["replayed"]]
    assert all(g["n"] == 6 and g["kept"] == 4 for g in fresh)
    replayed = [g for g in groups if g["replayed"]]
    assert all(g["from_step"] < g["step"] for g in replayed)
    assert all(0 < g["mean_reward"] < 1 for g in replayed), "only informative groups are replayed"
    for key in ("pods/var_after", "replay/size", "curriculum/scale", "gain/mu", "select/entropy",
                "time/reference_s", "cost/device_hours"):
        assert key in keys, key
    # each round's selection summary (the Prefect round task's log line) from what its steps recorded
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert len(lines) == 2 and any(g["replayed"] for g in groups if g["step"] >= 2)
    for r, line in enumerate(lines):
        steps = (2 * r, 2 * r + 1)
        rs = [s for s in sel if s["step"] in steps]
        gs = [g for g in groups if g["step"] in steps]
        effective = sum(m["train/effective_ratio"] * m["train/groups"] for m in logged if m["step"] in steps)
        assert line.startswith(f"round {r}, steps {steps[0]}-{steps[1]}: {len(rs)} prompts selected (level ")
        drawn = {st: sum(s["step"] == st for s in rs) for st in steps}  # every prompt drawn gets rollout.n rollouts
        reward = sum(m["train/reward_mean"] * drawn[m["step"]] for m in logged if m["step"] in steps) / len(rs)
        assert f"predicted success {sum(s['pred_success'] for s in rs) / len(rs):.2f}; reward mean {reward:.2f}; " \
            in line
        assert line.endswith(f"{len(gs)} groups trained, effective {effective / len(gs):.2f}, "
                             f"replayed {sum(g['replayed'] for g in gs) / len(gs):.2f}")


def test_each_round_is_one_play_round_call_and_a_resume_mid_round_starts_a_new_one(smoke_cfg, pool, caplog):
    """The caller plays the trainer's rounds (tasks/stages.py wraps each in a Prefect task: one task run a round),
    each ending with the round's summary line; a run that dies mid-round resumes the rest of that round in a new
    call, and the steps run are those of an uninterrupted run."""
    from tasks.training import checkpoint
    from tasks.training.entry import decided_lag, training
    from tasks.training.step_records import HeldoutEval

    cfg = smoke_cfg(*SMALL, "train.checkpoint_every=1", "eval.every=1", path=PRESETS.format("grpo"))
    calls: list[int] = []

    def play(run, policy, evaluate):
        with training(run, policy, pool, feats, decided_lag(run, policy, pool, None), evaluate=evaluate) as trainer:
            for round_ in trainer.rounds():
                calls.append(round_.index)
                trainer.play_round(round_)
            return trainer.finish()

    policy, feats, run = fresh_run(cfg, pool)
    with caplog.at_level(logging.INFO, logger="rlsift.train"), pytest.raises(RuntimeError, match="killed"):
        play(run, policy, dies_at(4))
    assert calls == [0, 1] and checkpoint.latest(run).name == "step-000003.pt"
    run.close("failed", {})
    resumed = open_run(cfg, run_id=run.run_id, track=False)
    try:
        with caplog.at_level(logging.INFO, logger="rlsift.train"):
            summary = play(resumed, make_policy(), lambda step: HeldoutEval(0.5, {}))
        steps = [g["step"] for g in resumed.ledger.query("SELECT step FROM groups WHERE run_id = ? ORDER BY step",
                                                         [run.run_id])]
    finally:
        resumed.close("completed", {})
    assert summary.steps == 4 and calls == [0, 1, 1] and steps == [s for s in range(4) for _ in range(6)]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 0, steps 0-1", "round 1, steps 3-3"]
    # eval.every=1: each round ended on an evaluation (the killed process's round 1 never ended)
    assert all(line.endswith("; held-out accuracy 0.500") for line in lines), lines


def test_a_steps_ledger_rows_wait_for_its_checkpoint_and_a_failing_run_writes_them(smoke_cfg, pool):
    """A step's ledger rows are written with the checkpoint that covers it (tasks/training/recorder.py: one insert
    per table for the round), a run that fails keeps the rows of its steps since that checkpoint, and its resume
    replaces them with the rerun's: every step's rows once, the same as an uninterrupted run's."""
    from tasks.training.entry import decided_lag, training

    cfg = smoke_cfg(*SMALL, "eval.every=1", path=PRESETS.format("grpo"))  # a checkpoint after steps 1 and 3
    seen: list[list[int]] = []

    def steps_in_ledger(run) -> list[int]:
        return [g["step"] for g in run.ledger.query("SELECT step FROM groups WHERE run_id = ? ORDER BY step",
                                                    [run.run_id])]

    policy, feats, run = fresh_run(cfg, pool)
    evaluate = dies_at(3, before=lambda: seen.append(sorted(set(steps_in_ledger(run)))))
    with pytest.raises(RuntimeError, match="killed"), \
            training(run, policy, pool, feats, decided_lag(run, policy, pool, None), evaluate=evaluate) as tr:
        for round_ in tr.rounds():
            tr.play_round(round_)
    assert seen == [[], [], [0, 1]]
    assert sorted(set(steps_in_ledger(run))) == [0, 1, 2]  # step 2's rows, past the checkpoint, written at the failure
    run.close("failed", {})
    _, _, groups, sel, _ = run_train(cfg, pool, run_id=run.run_id)
    _, _, whole_groups, whole_sel, _ = run_train(cfg, pool)
    assert [g["step"] for g in groups] == [s for s in range(4) for _ in range(6)]

    def drop_ids(rows):
        return [{k: v for k, v in r.items() if k not in ("run_id", "logged_at")} for r in rows]

    assert drop_ids(groups) == drop_ids(whole_groups) and drop_ids(sel) == drop_ids(whole_sel)


@pytest.mark.parametrize("replay, delta", [("replay.capacity=16", 0.5), ("replay.enabled=false", 1.0)])
def test_adaptive_composition_sets_each_steps_rollouts_and_fresh_share(smoke_cfg, pool, replay, delta):
    """``adapt.enabled``: each step generates the rollouts a prompt and replays the share that the previous step's
    fresh groups set (momentum 0), measured on groups of pods.m from the ledger's counts; and the plan moves.
    Without replay the fresh share stays 1 and PODS alone adapts."""
    cfg = smoke_cfg(*SMALL, "train.steps=6", "rollout.n=6", "pods.m=4", replay, "adapt.low=0.0",
                    "adapt.high=1.0", "adapt.momentum=0.0", path=PRESETS.format("all"))
    _, _, groups, _, logged = run_train(cfg, pool)
    m, b = 4, cfg.train.prompts_per_step
    level = 0.0  # before the first step: the configured composition
    for step, metrics in enumerate(logged):
        fresh = [g for g in groups if g["step"] == step and not g["replayed"]]
        n = 4 + math.floor(2 * (1 - level) + 0.5)
        assert metrics["adapt/level"] == pytest.approx(level), step
        assert metrics["adapt/rollouts"] == n and all(g["n"] == n for g in fresh), step
        frac = delta + (1 - delta) * level
        assert metrics["adapt/fresh_frac"] == pytest.approx(frac)
        replayed = sum(g["replayed"] for g in groups if g["step"] == step)
        assert replayed == metrics.get("replay/replayed", 0) <= b - math.floor(frac * b + 0.5)
        r = [1 - (math.comb(g["successes"], m) + math.comb(g["n"] - g["successes"], m)) / math.comb(g["n"], m)
             for g in fresh]
        level = sum(r) / len(r)  # low 0, high 1: the level is r itself
        assert metrics["adapt/informative"] == pytest.approx(level)
    assert len({m["adapt/rollouts"] for m in logged}) > 1, "the plan should move on this task"


def test_adaptive_composition_needs_pods_or_replay_and_an_ordered_range(smoke_cfg):
    with pytest.raises(ConfigError, match="needs pods.enabled or replay.enabled"):
        smoke_cfg("adapt.enabled=true")
    with pytest.raises(ConfigError, match="adapt.low"):
        smoke_cfg("adapt.low=0.6", "adapt.high=0.5")


@pytest.mark.parametrize("weighting", ["informative", "target"])
def test_dots_weighting_sets_the_selection_weights(smoke_cfg, pool, weighting):
    """select.weighting=informative: the ledger's weights of two prompts selected in one round stand in the ratio
    of their chances of a group with unequal rewards, 1 - p^n - (1 - p)^n (n = 4), which DOTS's target weights
    exp(-|(1 - p) - 0.5| / tau) do not."""
    cfg = smoke_cfg(*SMALL, f"select.weighting={weighting}", path=ARMS.format("dots_noreplay"))
    _, _, _, sel, _ = run_train(cfg, pool)

    def chance(p):
        p = min(max(p, 0.0), 1.0)
        return 1 - p ** 4 - (1 - p) ** 4

    pairs = [(a, b) for a in sel for b in sel if a["round"] == b["round"] and a["prompt_id"] < b["prompt_id"]
             and abs(a["pred_success"] - b["pred_success"]) > 0.005]
    assert pairs, "the check needs prompts with different predictions in one round"
    informative = all(a["weight"] / b["weight"] == pytest.approx(chance(a["pred_success"]) / chance(b["pred_success"]),
                                                                 rel=1e-4) for a, b in pairs)
    assert informative == (weighting == "informative")


def test_make_groups_advantages_and_negative_weight():
    """rewards [1, 0, 0, 1] -> Dr.-GRPO advantages [0.5, -0.5, -0.5, 0.5]; negative_weight 0.3 -> -0.15; a pair
    [0, 1] -> [-0.5, 0.5]."""
    from tasks.generation.rollout import Generation
    from tasks.training.draw import make_groups

    rec = arith.generate(0, 1, "train", "default")
    gen = Generation(prompt_ids=[torch.tensor([1, 5, 6])], completion_ids=torch.arange(8).view(4, 2),
                     completion_mask=torch.ones(4, 2, dtype=torch.bool), texts=["a"] * 4, n=4,
                     logprobs=torch.zeros(4, 2))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    (g,), _ = make_groups(gen, rewards, rec, 3, m=None, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=1.0, anchor=0.0)
    assert g.advantages.tolist() == [0.5, -0.5, -0.5, 0.5] and g.success_rate == 0.5 and g.step == 3
    (g,), _ = make_groups(gen, rewards, rec, 3, m=None, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=0.3, anchor=0.0)
    assert torch.allclose(g.advantages, torch.tensor([0.5, -0.15, -0.15, 0.5]))
    # PODS keeps the max-variance pair (one success, one failure) of the four
    (g,), _ = make_groups(gen, rewards, rec, 3, m=2, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=1.0, anchor=0.0)
    assert sorted(g.rewards.tolist()) == [0.0, 1.0] and g.n_generated == 4 and g.size == 2
    # the solved-skill guard: a solved group gets the anchor advantage, a mixed one keeps GRPO's
    solved = torch.ones(1, 4)
    (g,), _ = make_groups(gen, solved, rec, 3, m=None, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=1.0, anchor=0.05)
    assert g.advantages.tolist() == pytest.approx([0.05] * 4)
    (g,), _ = make_groups(gen, rewards, rec, 3, m=None, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=1.0, anchor=0.05)
    assert g.advantages.tolist() == [0.5, -0.5, -0.5, 0.5]
    # a group of 2: one wrong, one right -> -1/2, +1/2
    pair = Generation(prompt_ids=[torch.tensor([1, 5, 6])], completion_ids=torch.arange(4).view(2, 2),
                      completion_mask=torch.ones(2, 2, dtype=torch.bool), texts=["a"] * 2, n=2,
                      logprobs=torch.zeros(2, 2))
    (g,), _ = make_groups(pair, torch.tensor([[0.0, 1.0]]), rec, 3, m=None, rule="max_variance", scale_std=False,
                          generator=torch.Generator(), negative_weight=1.0, anchor=0.0)
    assert g.advantages.tolist() == [-0.5, 0.5]


def test_dynamic_sampling_trains_only_informative_groups_and_counts_every_rollout(smoke_cfg, pool):
    """DAPO's dynamic sampling with n=2 (half the groups all-equal under the text reward): the trained fresh
    groups are all mixed, the discarded prompts stay in the selection ledger and in the rollout count."""
    cfg = smoke_cfg(*SMALL, "rollout.n=2", "dynamic.enabled=true", "dynamic.max_rounds=12", "dynamic.oversample=1.5",
                    path=PRESETS.format("grpo"))
    _, summary, groups, sel, logged = run_train(cfg, pool)
    assert len(groups) == 4 * 6 and all(0 < g["successes"] < g["n"] for g in groups)
    assert len(sel) > len(groups), "discarded prompts are selections too"
    assert sum(m["rollout/generated"] for m in logged) == 2 * len(sel)
    assert any(m["dynamic/rounds"] > 1 for m in logged) and all(m["dynamic/filled"] == 1.0 for m in logged)
    assert all(m["train/effective_ratio"] == 1.0 for m in logged)


def test_drop_solved_keeps_solved_prompts_out_until_too_few_remain(smoke_cfg, pool):
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*SMALL, "select.drop_solved=true", path=PRESETS.format("grpo"))
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    sel = Selector(cfg, pool, feats)
    sel.begin_round(0, 0, None)
    solved = list(range(0, 40, 2))  # half the pool solved (pass rate 1 over all n), half not
    sel.observe(0, solved, torch.ones(len(solved), 4), 1.0, None)
    sel.observe(0, [1, 3], torch.tensor([[0.0, 1.0, 1.0, 1.0]] * 2), 0.75, None)
    sel.used[:] = False
    for step in range(1, 4):
        idx, _ = sel.choose(6, step)
        assert not set(idx) & set(solved), "a solved prompt was drawn"
    idx, _ = sel.choose(30, 4)  # more than the 20 unsolved: solved prompts come back
    assert len(idx) == 30 and set(idx) & set(solved)
    off = Selector(smoke_cfg(*SMALL, path=PRESETS.format("grpo")), pool, feats)
    off.begin_round(0, 0, None)
    off.observe(0, solved, torch.ones(len(solved), 4), 1.0, None)
    off.used[:] = False
    drawn = set().union(*(off.choose(6, s)[0] for s in range(1, 4)))
    assert drawn & set(solved), "without drop_solved, solved prompts are drawn as any other"


@settings(max_examples=25, deadline=None)
@given(share=st.sampled_from([0.0, 0.2, 0.5]), n_solved=st.integers(0, 12), k=st.integers(1, 10),
       step=st.integers(0, 50))
def test_guard_share_draws_solved_prompts_and_nothing_else_changes(guard_selectors, share, n_solved, k, step):
    """guard.share: round(share * k) distinct solved prompts (fewer when fewer are solved and unused), the rest
    selected as without the guard; share 0 draws exactly what a selector without a guard section draws."""
    sel, off, pool_size = guard_selectors(share)
    solved = list(range(0, 2 * n_solved, 2))
    for s in (sel, off):
        s.begin_round(0, 0, None)
        if solved:
            s.observe(0, solved, torch.ones(len(solved), 4), 1.0, None)
        s.used[:] = False
    idx, rows = sel.choose(k, step)
    want = min(round(share * k), n_solved)
    assert len(idx) == len(set(idx)) == min(k, pool_size)
    guard = [i for i, r in zip(idx, rows, strict=True) if r.selector == "guard"]
    assert len(guard) == want and set(guard) <= set(solved) and idx[:want] == guard
    if share == 0:
        assert idx == off.choose(k, step)[0]


@pytest.fixture(scope="module")
def guard_selectors(pool, tmp_path_factory):
    from tasks.config.load import load_config
    from tasks.selection.selector import Selector

    root = tmp_path_factory.mktemp("guard")
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")

    def cfg(*extra):
        return load_config(PRESETS.format("grpo"), [f"paths.root={root}", *SMALL, *extra])

    return lambda share: (Selector(cfg(f"guard.share={share}"), pool, feats), Selector(cfg(), pool, feats), len(pool))


def test_guard_and_drop_solved_cannot_both_be_set():
    from tasks.config.load import load_config

    with pytest.raises(ValueError, match="set one of them"):
        load_config(None, ["guard.share=0.1", "select.drop_solved=true"])


def test_trained_reference_rolls_out_nothing_and_uses_the_latest_labels(smoke_cfg, pool):
    """calibrate.reference=trained: round 0's context is the calibrate stage's prompts, round 1's every prompt
    measured since round 0 started, each with its latest success rate; no reference rollouts (``measure`` is None
    here, so one would fail), and a checkpoint keeps what the next round needs."""
    from tasks.calibration.record import Calibration
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*SMALL, "calibrate.reference=trained", "select.predictor.min_labels=1000",
                    path=ARMS.format("dots_noreplay"))
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    sel = Selector(cfg, pool, feats)
    sel.seed_labels(Calibration(indices=(0, 1, 2, 3), success=torch.tensor([0.0, 0.25, 0.5, 1.0])))
    m0 = sel.begin_round(0, 0, None)
    assert (m0["select/reference_rollouts"], m0["select/reference_size"]) == (0.0, 4.0)
    assert m0["select/ref_success"] == pytest.approx(1.75 / 4)
    sel.observe(0, [3, 5, 6], torch.tensor([[0.0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]), 0.5, None)
    sel.observe(1, [5, 7], torch.tensor([[0.0, 0, 1, 1], [1, 0, 0, 0]]), 0.4, None)
    state = sel.state_dict()
    resumed = Selector(cfg, pool, feats)
    resumed.load_state_dict(state)
    for s in (sel, resumed):
        m1 = s.begin_round(1, 2, None)
        assert (m1["select/reference_rollouts"], m1["select/reference_size"]) == (0.0, 4.0)  # prompts 3, 5, 6, 7
        assert m1["select/ref_success"] == pytest.approx((0.75 + 0.5 + 0.0 + 0.25) / 4)  # prompt 5: the latest
    ref, labels = torch.tensor([7, 5, 6, 3]), torch.tensor([0.25, 0.5, 0.0, 0.75])
    assert torch.equal(sel.pred, sel.predictor.predict(sel.emb, sel.emb[ref], labels))
    assert torch.equal(resumed.pred, sel.pred)


def test_observed_weighting_measures_the_chance_of_a_gradient_on_drawn_groups(smoke_cfg, pool):
    """select.weighting=observed: round 0 (nothing seen) weighs as `informative`; each drawn group records its
    prompt's prediction and whether its rewards were unequal, and round 1's weights are
    rlcore.selection.observed_informative_weights of exactly those, not the binomial ones."""
    from rlcore.selection import informative_weights, observed_informative_weights
    from tasks.calibration.record import Calibration
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*SMALL, "calibrate.reference=trained", "select.predictor.min_labels=1000",
                    "select.weighting=observed", "select.observed_bins=1", "select.observed_strength=0.01",
                    path=ARMS.format("dots_noreplay"))  # one bin: round 1's predictions share the seen groups' bin
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    sel = Selector(cfg, pool, feats)
    sel.seed_labels(Calibration(indices=(0, 1, 2, 3), success=torch.tensor([0.0, 0.25, 0.5, 1.0])))
    sel.begin_round(0, 0, None)
    assert torch.equal(sel.probs, informative_weights(sel.pred.clamp(0, 1), 4))
    drawn = [5, 6, 7]
    pred0 = sel.pred[drawn].clamp(0, 1)
    sel.observe(0, drawn, torch.tensor([[0.0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]), 0.5, None)
    assert sel.seen_informative == [True, False, False] and sel.seen_pred == pytest.approx(pred0.tolist())
    sel.begin_round(1, 2, None)
    want = observed_informative_weights(sel.pred.clamp(0, 1), 4, pred0, torch.tensor([True, False, False]),
                                        bins=1, strength=0.01)
    assert torch.allclose(sel.probs, want, rtol=1e-12, atol=0)
    assert not torch.allclose(sel.probs, informative_weights(sel.pred.clamp(0, 1), 4), rtol=1e-6, atol=0)


def test_the_likelihood_screen_runs_in_the_loop_and_is_recorded(smoke_cfg, pool):
    """select.screen=2 on DOTS's draw: the loop gives the selector the policy's likelihood; every selected prompt's
    ledger row carries the screened pass rate, every step logs the screen's metrics, and the selection stage's time
    includes the forward passes (a step selects B prompts from 2B candidates)."""
    cfg = smoke_cfg(*SMALL, "select.screen=2", path=ARMS.format("dots_noreplay"))
    _, summary, groups, sel, logged = run_train(cfg, pool)
    assert summary.steps == 4 and len(sel) == 4 * 6 and {s["selector"] for s in sel} == {"dots+screen"}
    assert all(s["screen_success"] is not None and 0 <= s["screen_success"] <= 1 for s in sel)
    assert all(m["select/screen_candidates"] == 12 for m in logged)
    assert all(0 <= m["select/screen_success_mean"] <= 1 for m in logged)
    assert all(m["select/screen_ahead_share"] == 0 for m in logged), "sampling in the trainer's threads: no look-ahead"


def test_the_prescreen_reaches_the_loop_through_its_registration(smoke_cfg, pool):
    """select.screen=4 with select.prescreen=2 (tasks/training/techniques.py ``screen_order``): the loop hands the
    selector the prescreen, so every step draws 4 candidates a prompt and its pass scores 2 a prompt."""
    cfg = smoke_cfg(*SMALL, "select.screen=4", "select.prescreen=2", path=ARMS.format("grpo_screen"))
    _, summary, _, sel, logged = run_train(cfg, pool)
    assert summary.steps == 4 and len(sel) == 4 * 6
    assert all((m["select/screen_drawn"], m["select/screen_candidates"]) == (24, 12) for m in logged)


def test_kl_on_the_screened_draw_anchors_every_rollout_to_the_starting_policy(smoke_cfg, pool):
    """The screened draw plus GRPO's KL term on every rollout: each step's update computes all
    rollouts, silent groups included, and logs the KL to the starting policy, 0 before the first update moves the
    policy and positive after it."""
    cfg = smoke_cfg(*SMALL, "train.kl_coef=0.04", path=ARMS.format("dots_screen"))
    _, summary, _, sel, logged = run_train(cfg, pool)
    assert summary.steps == 4 and {s["selector"] for s in sel} == {"dots+screen"}
    assert [m["train/update_rows"] for m in logged] == [6 * 4] * 4
    kl = [m["train/kl"] for m in logged]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and all(k > 0 for k in kl[1:]), kl


def test_groups_of_two_on_dots_draw(smoke_cfg, pool):
    """Groups of 2 on dots_informative's draw: the draw weighs prompts by the chance that a group of 2 differs,
    2p(1 - p) (not the chance for 4);
    every generated group has 2 rollouts, and the effective ratio is the share of mixed pairs (whose advantages,
    +1/2 and -1/2, test_make_groups_advantages_and_negative_weight works by hand)."""
    from rlcore.selection import informative_weights
    from tasks.calibration.record import Calibration
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*SMALL, "rollout.n=2", "train.prompts_per_step=8", path=ARMS.format("dots_informative"))
    assert (cfg.rollout.n, cfg.select.weighting) == (2, "observed")
    sel = Selector(cfg, pool, compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu"))
    sel.seed_labels(Calibration(indices=(0, 1, 2, 3), success=torch.tensor([0.0, 0.25, 0.5, 1.0])))
    sel.begin_round(0, 0, None)
    p = sel.pred.clamp(0, 1)
    assert torch.allclose(sel.probs, informative_weights(p, 2)) and not torch.allclose(sel.probs,
                                                                                     informative_weights(p, 4))

    _, _, groups, _, logged = run_train(cfg, pool)
    assert len(groups) == 4 * 8 and all(g["n"] == 2 for g in groups)
    assert sum(m["rollout/generated"] for m in logged) == 2 * len(groups)
    for m in logged:
        mixed = [0 < g["successes"] < 2 for g in groups if g["step"] == m["step"]]
        assert m["train/effective_ratio"] == pytest.approx(sum(mixed) / len(mixed))
    assert any(0 < g["successes"] < 2 for g in groups), "the text reward gives mixed pairs"


def test_posterior_weighting_uses_each_prompts_own_groups(smoke_cfg, pool):
    """select.weighting=posterior: every measured group adds to its prompt's evidence (times posterior_decay at each
    round start), each drawn group records its prediction and the evidence it was drawn with, and round 1's weights
    are rlcore.selection.posterior_informative_weights with the concentration fitted to exactly those groups; at one
    prediction, the prompt whose group was mixed outweighs the ones whose groups were all right or all wrong."""
    from rlcore.pass_rate_posterior import fit_concentration
    from rlcore.selection import posterior_informative_weights
    from tasks.calibration.record import Calibration
    from tasks.selection.selector import Selector

    cfg = smoke_cfg(*SMALL, "calibrate.reference=trained", "select.predictor.min_labels=1000",
                    "select.weighting=posterior", "select.posterior_decay=0.5", path=ARMS.format("dots_noreplay"))
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    sel = Selector(cfg, pool, feats)
    sel.seed_labels(Calibration(indices=(0, 1), success=torch.tensor([0.0, 0.5])))  # 0 and 2 of calibrate.g = 4
    m0 = sel.begin_round(0, 0, None)  # the round start halves the evidence
    assert m0["select/concentration"] == pytest.approx(8.0)  # no group seen: the grid's middle
    assert sel.own_trials[:2].tolist() == [2.0, 2.0] and sel.own_successes[:2].tolist() == [0.0, 1.0]
    drawn = [1, 5, 6, 7]
    pred0 = sel.pred[drawn].clamp(0, 1)
    rewards = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    sel.observe(0, drawn, rewards, 0.5, None)
    assert [g[3:] for g in sel.seen_groups] == [(3, 4), (2, 4), (4, 4), (0, 4)]
    assert [g[1:3] for g in sel.seen_groups] == [(1.0, 2.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)]
    state = sel.state_dict()
    resumed = Selector(cfg, pool, feats)
    resumed.load_state_dict(state)
    for s in (sel, resumed):
        m1 = s.begin_round(1, 2, None)
        seen = torch.tensor(sel.seen_groups, dtype=torch.float64)
        conc = fit_concentration(pred0, seen[:, 1], seen[:, 2], seen[:, 3], seen[:, 4])
        assert m1["select/concentration"] == conc
        assert s.own_successes[[1, 5, 6, 7]].tolist() == [2.0, 1.0, 2.0, 0.0]  # (1 + 3) / 2, 2 / 2, 4 / 2, 0
        assert s.own_trials[[1, 5, 6, 7]].tolist() == [3.0, 2.0, 2.0, 2.0]  # (2 + 4) / 2, 4 / 2, ...
        want = posterior_informative_weights(s.pred.clamp(0, 1), 4, s.own_successes, s.own_trials,
                                             concentration=conc)
        assert torch.allclose(s.probs, want, rtol=1e-12, atol=0)
    same = posterior_informative_weights(torch.full((3,), 0.5), 4, sel.own_successes[[5, 6, 7]],
                                         sel.own_trials[[5, 6, 7]], concentration=sel.concentration)
    assert same[0] > same[1] and same[0] > same[2]


def test_training_leaves_the_heap_before_it_out_of_the_collectors_passes_and_gives_it_back(smoke_cfg, pool):
    """tasks/training/entry.py ``frozen_heap``: every step runs with the objects alive before training frozen
    (``gc.freeze``: a full pass scans only what training made), and they are unfrozen after, also when a run fails."""
    import gc

    from tasks.training.entry import decided_lag, training

    cfg = smoke_cfg(*SMALL, "eval.every=1", path=PRESETS.format("grpo"))
    frozen: list[int] = []

    def play(evaluate) -> None:
        policy, feats, run = fresh_run(cfg, pool)
        try:
            with training(run, policy, pool, feats, decided_lag(run, policy, pool, None), evaluate=evaluate) as tr:
                for round_ in tr.rounds():
                    tr.play_round(round_)
        finally:
            run.close("completed", {})

    assert gc.get_freeze_count() == 0
    play(dies_at(-1, before=lambda: frozen.append(gc.get_freeze_count())))
    assert len(frozen) == 4 and min(frozen) > 10_000 and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="killed"):
        play(dies_at(2))
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a caller that froze its heap before training keeps it frozen after
    try:
        held = gc.get_freeze_count()
        play(dies_at(-1))
        assert gc.get_freeze_count() > held * 0.9  # still frozen (less what was freed meanwhile)
    finally:
        gc.unfreeze()
