"""Per-prompt rollout budgets in two waves (tasks/training/waves.py, rlcore/rollout_budget.py) and the pre-rollout
skip (rlcore/silent_skip.py) in the training loop: unequal groups through the advantages, the loss and its gradient
(hand-worked), the draw against a slow loop, the ledger and metrics, a run that would fail if the waves did nothing,
and a resume that is bit-identical to an uninterrupted run.

The reward is a deterministic function of the completion text (even length -> 1), except that level-1 prompts are
always right: a pool with solved prompts, whose first waves agree."""

import json
import math

import pytest
import torch

from rlcore.advantages import group_advantages
from rlcore.grpo_loss import clipped_policy_loss
from rlcore.types import RolloutGroup
from tasks.config import ConfigError
from tasks.data import arith
from tasks.generation.rollout import Generation
from tasks.run import open_run
from tasks.selection.features import compute_features
from tasks.training.draw import make_groups
from tasks.training.waves import join_waves, rows_of
from tasks.update.minibatch import batch_rows, cut_minibatches
from tests.tasks.test_train import PRESETS, SMALL, make_policy, run_train

WAVES = ["waves.enabled=true", "waves.first=2", "waves.candidates=1.5", "skip.enabled=true"]


def solved_or_parity(records, completions, workers=1):
    return [1.0 if r.level == 1 else float(len(c) % 2 == 0) for r, c in zip(records, completions, strict=True)]


@pytest.fixture(autouse=True)
def _reward(monkeypatch):
    monkeypatch.setattr("tasks.calibration.reference.batch_rewards", solved_or_parity)


@pytest.fixture(scope="module")
def pool():
    return arith.generate(0, 40, "train", "default")


def group(rewards: list[float], lengths: list[int], width: int = 3) -> RolloutGroup:
    r = torch.tensor(rewards)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return RolloutGroup(prompt_id=f"p{len(rewards)}", prompt_ids=torch.tensor([1, 2]),
                        completion_ids=torch.ones(len(rewards), width, dtype=torch.long), completion_mask=mask,
                        rewards=r, advantages=group_advantages(r.unsqueeze(0), scale_by_std=False)[0],
                        behaviour_logp=torch.zeros(0), success_rate=float(r.mean()), n_generated=len(rewards), step=0)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_unequal_groups_advantages_loss_and_gradient_hand_worked(aggregation):
    """A completed group of 4 (1 right), a pair (1 right) and a silent pair, rows of 2 or 1 tokens:

    advantages (Dr. GRPO, each on its own rollouts): [3/4, -1/4, -1/4, -1/4], [1/2, -1/2], [0, 0];
    at pi_theta = pi_old every ratio is 1, so the loss is -sum_i A_i w_i and d loss / d logp_(i,t) = -A_i w_i
    per token, with w_i = 1 / (valid tokens of the batch) = 1/11 (token) or 1 / (L_i x 8 rows) (sequence); the
    silent pair counts in the normaliser (2 of the 11 tokens), as a silent group of equal groups does, and the
    update's skip leaves its rows out with share 9/11 of the units (token) or 6/8 (sequence)."""
    lengths = [[2, 1, 2, 1], [2, 1], [1, 1]]
    groups = [group([1.0, 0, 0, 0], lengths[0]), group([1.0, 0], lengths[1]), group([1.0, 1.0], lengths[2])]
    assert [g.advantages.tolist() for g in groups] == [[0.75, -0.25, -0.25, -0.25], [0.5, -0.5], [0.0, 0.0]]
    rows = batch_rows(groups, kl_coef=0.0, kl_rows="all", kl_sample=1.0, seed=0)
    assert rows.n == 8 and rows.silent.tolist() == [False] * 6 + [True] * 2
    adv = [0.75, -0.25, -0.25, -0.25, 0.5, -0.5, 0.0, 0.0]
    flat_len = [x for ls in lengths for x in ls]
    assert rows.advantages.tolist() == adv
    logp = torch.full((8, 3), -1.0, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, logp.detach(), rows.advantages, rows.mask, clip_eps=0.2,
                                  aggregation=aggregation, kl_coef=0.0)
    loss.backward()
    w = [1 / 11] * 8 if aggregation == "token" else [1 / (L * 8) for L in flat_len]
    want = torch.tensor([[-a * wi if t < L else 0.0 for t in range(3)]
                         for a, wi, L in zip(adv, w, flat_len, strict=True)])
    assert torch.allclose(logp.grad, want, atol=1e-7)
    assert float(loss.detach()) == pytest.approx(-sum(a * wi * L for a, wi, L in zip(adv, w, flat_len, strict=True)),
                                                abs=1e-7)
    (mb,) = cut_minibatches(rows, count=1, aggregation=aggregation, skip=True, micro_batch_tokens=0, shard=None)
    assert mb.computed.tolist() == list(range(6))
    assert mb.units == (11.0 if aggregation == "token" else 8.0)


def test_groups_of_two_sizes_match_a_slow_loop():
    """make_groups on each size's rows (what sample_waves does) gives every group what the configured estimator gives
    its own rollouts alone; join_waves puts each prompt's first-wave rows before its second-wave rows."""
    g = torch.Generator().manual_seed(0)
    recs = arith.generate(0, 5, "train", "default")
    w, rest = 2, 2

    def gen(b, n, tag):
        ids = torch.arange(b * n * 3).view(b * n, 3) + tag
        return Generation(prompt_ids=[torch.tensor([i]) for i in range(b)], completion_ids=ids,
                          completion_mask=torch.rand(b * n, 3, generator=g) > 0.2, texts=[str(x) for x in range(b * n)],
                          n=n, logprobs=-torch.rand(b * n, 3, generator=g))

    first, r1 = gen(5, w, 0), torch.tensor([[1.0, 0], [1, 1], [0, 0], [0, 1], [1, 1]])
    topped = [0, 1, 3]
    second, r2 = gen(3, rest, 1000), torch.tensor([[0.0, 0], [1, 0], [1, 1]])
    full = join_waves(rows_of(first, topped), second)
    for k, j in enumerate(topped):  # slow loop: rows of prompt j, then its second wave's rows
        want = torch.cat([first.completion_ids[j * w:(j + 1) * w], second.completion_ids[k * rest:(k + 1) * rest]])
        assert torch.equal(full.completion_ids[k * 4:(k + 1) * 4], want)
        assert full.texts[k * 4:(k + 1) * 4] == first.texts[j * w:(j + 1) * w] + second.texts[k * rest:(k + 1) * rest]
    for scale in (False, True):
        for neg in (1.0, 0.5):
            kw = dict(rule="max_variance", scale_std=scale, negative_weight=neg, anchor=0.0)
            done, _ = make_groups(full, torch.cat([r1[topped], r2], 1), [recs[j] for j in topped], 0, m=None,
                                  generator=torch.Generator(), **kw)
            part, _ = make_groups(rows_of(first, [4]), r1[[4]], [recs[4]], 0, m=None, generator=torch.Generator(), **kw)
            for grp, r in zip(done + part, [torch.cat([r1[j], r2[k]]) for k, j in enumerate(topped)] + [r1[4]],
                              strict=True):
                a = group_advantages(r.unsqueeze(0), scale_by_std=scale)[0]
                a = torch.where(a < 0, a * neg, a)
                assert torch.allclose(grp.advantages, a) and grp.n_generated == len(r) and grp.size == len(r)
                assert grp.success_rate == pytest.approx(float(r.mean()))


def test_waves_spend_fewer_rollouts_where_prompts_are_solved(smoke_cfg, pool):
    """Would fail if the waves did nothing: on a pool whose level-1 prompts are solved, a step draws 1.5 x 6 = 9
    candidates of 2 rollouts and completes to 4 only the mixed pairs and those likely mixed, so it generates fewer
    than 9 x 4 rollouts, never trains a solved prompt's group, counts every rollout and records groups of 4 and 2."""
    cfg = smoke_cfg(*SMALL, *WAVES, "train.steps=6", "waves.min_chance=0.6", "waves.carry=false",
                    path=PRESETS.format("grpo"))
    _, summary, groups, sel, logged = run_train(cfg, pool)
    level = {r.id: r.level for r in pool}
    assert summary.steps == 6 and len(sel) == 6 * 9
    for m in logged:
        done, part = m["waves/completed"], m["waves/partial"]
        assert m["rollout/generated"] == 9 * 2 + done * 2 < 9 * 4
        assert m["train/groups"] == done + part and done <= 6
        assert m["waves/candidates"] == 9 and m["waves/dropped"] == 9 - done - part
    assert {g["n"] for g in groups} <= {2, 4} and any(g["n"] == 4 for g in groups)
    assert all(0 < g["successes"] < 2 for g in groups if g["n"] == 2), "only mixed pairs are trained as pairs"
    assert not any(level[g["prompt_id"]] == 1 for g in groups), "a solved prompt's pair agrees: never completed"
    assert sum(m["rollout/generated"] for m in logged) < 6 * 9 * 4
    eff = sum(m["train/effective_ratio"] * m["train/groups"] for m in logged) / sum(m["train/groups"] for m in logged)
    assert eff > 0.8
    assert any(m["skip/skipped"] > 0 for m in logged), "solved prompts come back less often"


def test_rollout_parts_against_a_slow_loop(pool):
    """One call for three prompts of 4 rollouts and two of 2 (each asked 2 or 1 times for 2 rollouts): each set's
    rows, log-probs, rewards and prompts are those of its prompts' copies in the call, in order; a single set is
    ``rollout_rewards`` itself (the same seeds)."""
    from tasks.calibration.reference import rollout_rewards
    from tasks.training.waves import rollout_parts

    policy = make_policy()
    a, b = pool[:3], pool[3:5]
    parts = rollout_parts(policy, [(a, 4), (b, 2)], 7)
    asked = [a[0], a[0], a[1], a[1], a[2], a[2], b[0], b[1]]
    whole, rewards = rollout_rewards(policy, asked, 2, 7)
    row = 0
    for (recs, r), (gen, rr) in zip([(a, 4), (b, 2)], parts, strict=True):
        assert gen.n == r and rr.shape == (len(recs), r) and len(gen.prompt_ids) == len(recs)
        for i in range(len(recs)):
            assert torch.equal(gen.prompt_ids[i], whole.prompt_ids[row // 2])
            for j in range(r):
                for field in ("completion_ids", "completion_mask", "logprobs"):
                    assert torch.equal(getattr(gen, field)[i * r + j], getattr(whole, field)[row]), field
                assert gen.texts[i * r + j] == whole.texts[row] and rr[i, j] == rewards.flatten()[row]
                row += 1
    assert row == 16
    (single, r1), = rollout_parts(policy, [(a, 4)], 7)
    ref, r_ref = rollout_rewards(policy, a, 4, 7)
    assert torch.equal(single.completion_ids, ref.completion_ids) and torch.equal(r1, r_ref)


def test_carried_waves_complete_the_last_steps_groups_in_one_call_a_step(smoke_cfg, pool, monkeypatch):
    """Would fail if carrying did nothing: each step makes one generate call, its 9 first pairs beside the pairs that
    complete the last step's groups, which it trains (groups of 4 of prompts selected a step earlier) with its own
    mixed pairs; the last step completes its own in a second call. Every rollout counts in the step that drew it."""
    import tasks.training.waves as waves_module
    from tasks.training.draw import use_sampler_behaviour

    calls = []
    real = waves_module.rollout_rewards

    def counted(policy, records, n, seed, *args, **kwargs):
        calls.append(len(records) * n)
        return real(policy, records, n, seed, *args, **kwargs)

    monkeypatch.setattr(waves_module, "rollout_rewards", counted)
    cfg = smoke_cfg(*SMALL, *WAVES, "train.steps=6", "waves.min_chance=0.6", "overlap.lag=0", "waves.carry=true",
                    path=PRESETS.format("grpo"))
    assert cfg.waves.carry and use_sampler_behaviour(cfg, 0), "a carried first wave is one update old"
    _, summary, groups, sel, logged = run_train(cfg, pool)
    steps = [m for m in logged if "waves/carried" in m]
    assert summary.steps == 6 and len(steps) == 6
    last = steps[-1]["waves/completed"]
    assert len(calls) == 6 + (last > 0)
    for t, m in enumerate(steps):
        carried = steps[t - 1]["waves/completed"] if t else 0
        own = last if t == 5 else 0
        assert m["waves/carried"] == carried
        assert m["rollout/generated"] == 9 * 2 + 2 * carried + 2 * own
        trained = carried + m["waves/partial"] + own
        assert m["train/groups"] == (trained if trained else 9 - m["waves/mixed_first"])  # no pair trained twice
    assert sum(m["waves/carried"] for m in steps) > 0
    selected = {(s["step"], s["prompt_id"]) for s in sel}
    fours = [g for g in groups if g["n"] == 4]
    assert fours and all((g["step"] - 1, g["prompt_id"]) in selected for g in fours if g["step"] < 5)


def test_waves_and_skip_off_are_plain_grpo_bit_for_bit(smoke_cfg, pool):
    """The sections off (their defaults) and their other knobs moved: the run is plain GRPO's."""
    base, *_ = run_train(smoke_cfg(*SMALL, path=PRESETS.format("grpo")), pool)
    moved, *_ = run_train(smoke_cfg(*SMALL, "waves.first=3", "waves.min_chance=0.1", "skip.explore=0.2",
                                    "waves.carry=true", path=PRESETS.format("grpo")), pool)
    assert all(torch.equal(base[k], moved[k]) for k in base)


def test_the_waves_config_is_checked():
    from tasks.config.load import load_config

    with pytest.raises(ConfigError, match="waves.first"):
        load_config(None, ["waves.enabled=true", "rollout.n=4", "waves.first=4"])
    with pytest.raises(ConfigError, match="dynamic.enabled"):
        load_config(None, ["waves.enabled=true", "dynamic.enabled=true"])
    with pytest.raises(ConfigError, match="skip.cap"):
        load_config(None, ["skip.cap=1.0"])


SCREEN = ("select.screen=2", "train.round_steps=5")  # one round: the screen runs ahead at every step but the first
ROUNDS = ("select.screen=2", "train.round_steps=3", "calibrate.reference=trained",  # round 1 starts ahead at step 2
          "select.round_ahead=true")


@pytest.mark.parametrize(("lag", "carry", "extra"),
                         [(0, False, ()), (1, False, ()), (0, True, ()), (1, True, ()), (1, False, SCREEN),
                          (1, False, ROUNDS)])
def test_a_resume_mid_run_with_waves_equals_an_uninterrupted_run(smoke_cfg, pool, lag, carry, extra):
    """Waves, the skip and DOTS's predictor (the estimates the waves read), killed after step 2's update (before its
    checkpoint) and resumed from step 2: the same ledger, metrics and final weights, bit for bit (CPU, one thread;
    with lag 1 the checkpoint holds step 2's draw, both waves, made beside step 1's update; carried, it also holds
    the first waves the latest draw left for the next one to complete; with the screen, one round, it also holds the
    likelihoods that draw scored ahead for the next step, select.screen_ahead; in rounds of 3 steps with a trained
    reference, the start of round 1 made beside step 2's generate call, select.round_ahead)."""
    from tasks.training.entry import decided_lag, training
    from tasks.training.step_records import HeldoutEval

    cfg = smoke_cfg(*SMALL, *WAVES, "select.method=dots", "train.steps=5", "train.checkpoint_every=1",
                    "eval.every=1", f"overlap.lag={lag}", f"waves.carry={str(carry).lower()}",
                    *extra, path=PRESETS.format("grpo"))

    def play(run, policy, evaluate):
        feats = compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu")
        with training(run, policy, pool, feats, decided_lag(run, policy, pool, None), evaluate=evaluate) as trainer:
            for round_ in trainer.rounds():
                trainer.play_round(round_)
            return trainer.finish()

    def record(run, policy):
        groups = run.ledger.query("SELECT * EXCLUDE (run_id) FROM groups WHERE run_id = ? "
                                  "ORDER BY step, prompt_id", [run.run_id])
        logged = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "cost/", "perf/",
                                                                                     "overlap/", "memory/",
                                                                                     "rollout/tokens_per_s"))}
                  for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
        return groups, logged, {k: v.clone() for k, v in policy.model.state_dict().items()}

    fine = lambda step: HeldoutEval(0.5, {})  # noqa: E731
    run_a, policy_a = open_run(cfg, track=False), make_policy()
    try:
        play(run_a, policy_a, fine)
        want = record(run_a, policy_a)
    finally:
        run_a.close("completed", {})

    def dies(step):  # after step 2's update, before its checkpoint
        if step == 3:
            raise RuntimeError("killed")
        return HeldoutEval(0.5, {})

    run_b = open_run(cfg, track=False)  # the same root: every record is the run's own
    with pytest.raises(RuntimeError, match="killed"):
        play(run_b, make_policy(), dies)
    run_b.close("failed", {})
    resumed, policy_b = open_run(cfg, run_id=run_b.run_id, track=False), make_policy()
    try:
        play(resumed, policy_b, lambda step: HeldoutEval(0.5, {}))
        got = record(resumed, policy_b)
    finally:
        resumed.close("completed", {})
    assert got[0] == want[0], "ledger groups"
    assert got[1] == want[1]
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2])
    assert any(g["n"] == 2 for g in got[0]) or any(m["waves/dropped"] > 0 for m in got[1]), "the waves acted"
    assert any(m["waves/carried"] > 0 for m in got[1]) == carry
    assert any(m.get("select/screen_ahead_share", 0) > 0 for m in got[1]) == bool(extra), "the screen ran ahead"
    assert any(m.get("select/round_ahead", 0) == 1 for m in got[1]) == (extra == ROUNDS), "a round started ahead"
    assert math.isfinite(got[1][-1]["train/reward_mean"])
