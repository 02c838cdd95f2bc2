"""The likelihood screen (select.screen): the policy's chance of writing each worked solution, checked against a
one-sequence-at-a-time loop, and the selector keeping exactly the candidates whose groups are most likely mixed."""

import copy
import dataclasses

import pytest
import torch

from rlcore.selection import screen
from tasks.config import LoraConfig
from tasks.data import arith
from tasks.generation.rollout import HFEngine
from tasks.model.bf16_copy import Bf16Copy, native_bf16
from tasks.model.loading import build_tiny_model, build_tokenizer, format_prompt
from tasks.model.lora import apply_lora
from tasks.policy import Policy
from tasks.selection import screen as screen_module
from tasks.selection.features import compute_features, static_features
from tasks.selection.screen import in_bf16, policy_likelihood, screen_likelihood
from tasks.selection.selector import Selector

SMALL = ["train.prompts_per_step=6", "train.round_steps=2", "rollout.n=4", "eval.every=0"]


def make_policy():
    tok = build_tokenizer()
    model = build_tiny_model(hidden=64, layers=2, heads=2, tokenizer=tok, seed=0)
    return Policy(model=model, tokenizer=tok,
                  engine=HFEngine(model, tok, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, chunk=512))


@pytest.fixture(scope="module")
def pool():
    return arith.generate(0, 40, "train", "default")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_likelihood_matches_a_loop_over_single_sequences(pool, temperature):
    """Oracle: each record alone, unpadded, one forward pass; the product of softmax(logits / T) at the solution's
    tokens and EOS. Batched with padding and length buckets the screen gives the same chance."""
    policy = make_policy()
    tok, model = policy.tokenizer, policy.model
    records = pool[:7]
    got = policy_likelihood(policy, temperature=temperature, max_new_tokens=200, micro_batch_tokens=300)(records)
    want = []
    with torch.no_grad():
        for r in records:
            prompt = tok(format_prompt(tok, r.question))["input_ids"]
            sol = tok(r.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([prompt + sol])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
            want.append(float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(sol)[:, None]).sum().exp()))
    assert got.dtype == torch.float64 and got.shape == (7,)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-30)
    assert model.training, "the screen leaves the model in the mode it found it"


def test_a_prompt_is_tokenized_once_and_scores_as_before_after_the_weights_move(pool):
    """The screen tokenizes a prompt and its solution at its first score only (a pool's prompts are scored again and
    again); a later call of the same records calls no tokenizer and still reads the weights as they are then."""
    policy = make_policy()
    likelihood = policy_likelihood(policy, temperature=1.0, max_new_tokens=200, micro_batch_tokens=0)
    first = likelihood(pool[:5])
    calls = []
    real = type(policy.tokenizer).__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(policy.tokenizer), "__call__", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
        again = likelihood(pool[:5])
        assert calls == [] and torch.equal(first, again)
        likelihood(pool[4:6])
        assert len(calls) == 2, "a new record: its prompt and its solution, once each"
        with torch.no_grad():
            policy.model.lm_head.weight.mul_(0.5)
        moved = likelihood(pool[:5])
    assert len(calls) == 2 and not torch.equal(moved, first)


def test_a_solution_longer_than_the_budget_scores_zero_and_one_missing_is_an_error(pool):
    policy = make_policy()
    tok = policy.tokenizer
    short, long_ = pool[0], max(pool, key=lambda r: len(r.solution))
    budget = len(tok(short.solution, add_special_tokens=False)["input_ids"]) + 1  # the short one and its EOS fit
    assert len(long_.solution) + 1 > budget
    q = policy_likelihood(policy, temperature=1.0, max_new_tokens=budget, micro_batch_tokens=0)([short, long_])
    assert q[0] > 0 and q[1] == 0
    with pytest.raises(ValueError, match="1 of 2 prompts have none"):
        policy_likelihood(policy, temperature=1.0, max_new_tokens=99, micro_batch_tokens=0)(
            [short, dataclasses.replace(long_, solution="")])


@pytest.mark.parametrize("lora", [False, True])
def test_the_bf16_pass_ranks_like_float32_and_follows_the_weights(smoke_cfg, pool, lora):
    """select.screen_precision=bf16: the pass runs on a bf16 copy (its log q differs from float32's, so the copy
    was used) within bf16 rounding of the float32 pass, and a change of the weights reaches the next pass (the copy
    is refreshed, never stale), also under LoRA. The run's config reaches the likelihood through
    :func:`screen_likelihood`."""
    policy = make_policy()
    if lora:
        policy.model = apply_lora(policy.model, LoraConfig(enabled=True, rank=4, alpha=8.0), seed=0)
    records = pool[:8]
    fp32 = policy_likelihood(policy, temperature=1.0, max_new_tokens=200, micro_batch_tokens=0)
    bf16 = screen_likelihood(policy, smoke_cfg("select.screen_precision=bf16", "rollout.max_new_tokens=200",
                                               "rollout.temperature=1.0", "train.micro_batch_tokens=0"), "cpu")
    want, got = fp32(records).log(), bf16(records).log()
    assert not torch.equal(got, want), "computed in bf16, not float32"
    assert torch.allclose(got, want, rtol=0.02, atol=0.3)
    with torch.no_grad():  # new weights: the next bf16 pass reads them
        for p in policy.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    moved_want, moved_got = fp32(records).log(), bf16(records).log()
    assert (moved_want - want).abs().min() > 1.0
    assert torch.allclose(moved_got, moved_want, rtol=0.02, atol=0.3)
    assert next(policy.model.parameters()).dtype == torch.float32 and policy.model.training


def test_the_bf16_copy_casts_parameters_keeps_buffers_and_ties_and_refreshes_in_place():
    model = make_policy().model
    half = Bf16Copy()
    copy_ = half.of(model)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy_.parameters())
    assert {b.dtype for b in copy_.buffers()} == {b.dtype for b in model.buffers()}
    assert copy_.lm_head.weight is copy_.model.embed_tokens.weight  # the tied head stays tied
    with torch.no_grad():
        model.lm_head.weight.fill_(0.5)
    assert half.of(model) is copy_ and torch.all(copy_.model.embed_tokens.weight == 0.5)
    assert next(model.parameters()).dtype == torch.float32
    other = make_policy().model
    assert half.of(other) is not copy_


def test_screen_precision_resolves_to_bf16_only_for_float32_weights(monkeypatch):
    model = make_policy().model
    assert not in_bf16("model", model, "cpu")
    assert in_bf16("bf16", model, "cpu")
    assert not in_bf16("bf16", copy.deepcopy(model).to(torch.bfloat16), "cpu")  # already 16-bit: no copy
    for native in (True, False):
        monkeypatch.setattr(screen_module, "native_bf16", lambda n=native: n)
        assert in_bf16("auto", model, "cpu") is native
        assert not in_bf16("auto", model, "cuda")  # a GPU's weights are bf16 already; forced float32, no copy
    assert native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def scripted(rates: dict[str, float], calls: list):
    """A likelihood that returns fixed pass rates by prompt id and records each call's candidates."""
    def likelihood(records):
        calls.append([r.id for r in records])
        return torch.tensor([rates[r.id] for r in records], dtype=torch.float64)
    return likelihood


def test_the_screen_on_a_uniform_draw_needs_no_scored_pool(smoke_cfg, pool):
    """A run whose techniques read no embedding or angle (plain GRPO, the screen on a uniform draw) is not scored
    (tasks/stages.py ``score_stage``): the tokenizer's features alone give the scored ones' token counts, solution
    lengths and levels, the screened draw keeps the same prompts with the same rates, its rows record no angle, and
    DOTS, which reads the embeddings, refuses them."""
    policy = make_policy()
    scored, static = (compute_features(policy, pool, inter_weight=1.0, batch_size=64, device="cpu"),
                      static_features(policy, pool))
    assert scored.scored and not static.scored and static.emb.shape == (len(pool), 0)
    for name in ("prompt_tokens", "cot", "level"):
        assert torch.equal(getattr(static, name), getattr(scored, name)), name
    rates = {r.id: [0.0, 1.0, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    cfg = smoke_cfg(*SMALL, "select.screen=2")
    picks = []
    for feats in (scored, static):
        sel = Selector(cfg, pool, feats, scripted(rates, []))
        sel.begin_round(0, 0, None)
        picks.append(sel.choose(6, 3))
    assert picks[0][0] == picks[1][0] and [r.screen_success for r in picks[1][1]] == [
        r.screen_success for r in picks[0][1]]
    assert all(r.angle_score is None and r.gain_rank is None for r in picks[1][1])
    assert all(r.angle_score is not None and r.gain_rank is not None for r in picks[0][1])
    with pytest.raises(ValueError, match="DOTS, ScalingRL and GAIN-RL read the score stage's embeddings"):
        Selector(smoke_cfg(*SMALL, "select.method=dots"), pool, static, None)


def test_selector_keeps_the_candidates_most_likely_to_be_mixed(smoke_cfg, pool):
    """select.screen=2 draws 2k candidates exactly as a selector without the screen draws 2k, and keeps the k that
    rlcore.selection.screen ranks first by the scripted pass rates; the others stay unused for the round; each
    kept row records its rate, and observe() scores the rates against the groups' measured success."""
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    rates = {r.id: [0.0, 1.0, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    calls: list = []
    on = Selector(smoke_cfg(*SMALL, "select.screen=2"), pool, feats, scripted(rates, calls))
    off = Selector(smoke_cfg(*SMALL), pool, feats, scripted(rates, calls))
    for s in (on, off):
        s.begin_round(0, 0, None)
    candidates, _ = off.choose(12, 3)
    assert calls == [], "without the screen the likelihood is never read"
    idx, rows = on.choose(6, 3)
    q = torch.tensor([rates[pool[i].id] for i in candidates], dtype=torch.float64)
    assert calls == [[pool[i].id for i in candidates]]
    assert idx == [candidates[j] for j in screen(q, 4, 6).tolist()]
    chance = {i: 1 - rates[pool[i].id] ** 4 - (1 - rates[pool[i].id]) ** 4 for i in candidates}
    assert min(chance[i] for i in idx) >= max(chance[i] for i in candidates if i not in idx), "a likelier one was left"
    assert len({rates[pool[i].id] for i in candidates} - {rates[pool[i].id] for i in idx}) > 0
    assert [r.screen_success for r in rows] == [rates[pool[i].id] for i in idx]
    assert {r.selector for r in rows} == {"screen"} and off.choose(1, 4)[1][0].selector == "uniform"
    assert on.used.sum() == 6 and not on.used[[i for i in candidates if i not in idx]].any()
    m = on.observe(3, idx, torch.tensor([[1.0, 0, 0, 0]] * 3 + [[1.0, 1, 0, 0]] * 3), 0.4, None)
    assert m["select/screen_candidates"] == 12 and m["select/screen_success_mean"] == pytest.approx(
        sum(rates[pool[i].id] for i in idx) / 6)
    assert "select/screen_pearson" in m and on.scores.kept == {}


def test_overlapped_steps_score_their_own_picks(smoke_cfg, pool):
    """Overlapped, step 4 is drawn before step 3's outcome comes back: each step's metrics are its own picks' rates
    and candidate counts (a selector that kept one record for every step gave step 3 nothing and step 4 nothing),
    and the waves' prior reads the step's own estimates."""
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    rates = {r.id: [0.1, 0.8, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    sel = Selector(smoke_cfg(*SMALL, "select.screen=2"), pool, feats, scripted(rates, []))
    sel.begin_round(0, 0, None)
    idx3, _ = sel.choose(6, 3)
    idx4, _ = sel.choose(4, 4)
    assert sel.estimate(idx3, 3).tolist() == [rates[pool[i].id] for i in idx3]
    rewards = lambda k: torch.tensor([[1.0, 0, 0, 0]] * k)  # noqa: E731
    m3 = sel.observe(3, idx3, rewards(6), 0.4, None)
    m4 = sel.observe(4, idx4, rewards(4), 0.4, None)
    for m, idx, k in ((m3, idx3, 6), (m4, idx4, 4)):
        assert m["select/screen_candidates"] == 2 * k
        assert m["select/screen_success_mean"] == pytest.approx(sum(rates[pool[i].id] for i in idx) / k)
    assert sel.scores.kept == {} and sel.scores.counts == {}


def test_selector_refuses_a_screen_it_cannot_run(smoke_cfg, pool):
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    cfg = smoke_cfg(*SMALL, "select.screen=3")
    with pytest.raises(ValueError, match="needs the policy's likelihood"):
        Selector(cfg, pool, feats)
    bare = [dataclasses.replace(r, solution="") if i == 5 else r for i, r in enumerate(pool)]
    with pytest.raises(ValueError, match=f"1 of 40 prompts have none \\(first: {bare[5].id}"):
        Selector(cfg, bare, feats, scripted({}, []))


def test_the_screen_scores_the_next_steps_candidates_ahead_and_that_step_reads_them(smoke_cfg, pool):
    """select.screen_ahead: beside step 1's generate call the selector scores the candidates step 2 will draw, with
    the weights of then (version 0); step 2 then draws exactly those candidates and reads their scores without
    scoring again, where a selector that does not run ahead scores the same candidates at step 2 with the weights
    of step 2 (version 1). A candidate the look-ahead did not score is scored at the step; the look-ahead leaves the
    skip's state as it was; a step that starts a round, or is past the last, is not scored ahead."""
    from tasks.training.techniques import prompt_filters
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    rates = {r.id: [0.1, 0.8, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    version, calls = [0], []

    def likelihood(records):  # the pass rates of weights of version v: each rate times (1 - v / 10)
        calls.append((version[0], [r.id for r in records]))
        return torch.tensor([rates[r.id] * (1 - version[0] / 10) for r in records], dtype=torch.float64)

    cfg = smoke_cfg(*SMALL, "select.screen=2", "train.round_steps=4", "train.steps=7", "skip.enabled=true")
    made = {}
    for name, apart in (("ahead", True), ("inline", False)):
        made[name] = s = Selector(cfg, pool, feats, likelihood, filters=prompt_filters(cfg, len(pool)),
                                  apart=apart)
        s.begin_round(0, 0, None)
        s.filters[0].record(list(range(20)), [4] * 20, [True] * 20)  # half the pool silent: the skip draws
        version[0] = 0
        s.observe(1, s.choose(6, 1)[0], [torch.tensor([1.0, 0, 0, 0])] * 6, 0.4, None)
    ahead, inline = made["ahead"], made["inline"]
    assert inline.lookahead() is None, "a sampler that shares the trainer's threads never screens ahead"
    skip_state = ahead.filters[0].state_dict()
    calls.clear()
    ahead.lookahead()()
    ahead_scored = list(ahead.scores.ahead[2])
    assert [v for v, _ in calls] == [0] and len(ahead_scored) == 12
    assert torch.equal(ahead.filters[0].state_dict()["silent"], skip_state["silent"])
    assert ahead.filters[0].state_dict()["skipped"] == skip_state["skipped"], "the look-ahead's skips do not count"
    version[0] = 1
    calls.clear()
    idx, rows = ahead.choose(6, 2)
    assert calls == [], "every candidate of step 2 was scored ahead"
    inline_idx, inline_rows = inline.choose(6, 2)
    (v, candidates), = calls
    assert v == 1 and candidates == [pool[i].id for i in ahead_scored], "the same candidates, in draw order"
    assert [r.screen_success for r in rows] == [rates[pool[i].id] for i in idx], "read from version 0"
    assert [r.screen_success for r in inline_rows] == [rates[pool[i].id] * 0.9 for i in inline_idx]
    share = {n: s.observe(2, i, [torch.tensor([1.0, 0, 0, 0])] * 6, 0.4, None)["select/screen_ahead_share"]
             for n, s, i in (("ahead", ahead, idx), ("inline", inline, inline_idx))}
    assert share == {"ahead": 1.0, "inline": 0.0}
    # a candidate of step 3 the look-ahead did not score (the draw changed after it) is scored at step 3
    ahead.lookahead()()
    scored = list(ahead.scores.ahead[3])
    ahead.used[scored[0]] = True  # taken before step 3 draws: that draw takes another prompt instead
    calls.clear()
    ahead.choose(6, 3)
    (_, now), = calls
    assert 0 < len(now) < 12 and pool[scored[0]].id not in now, "scored now: only what was not scored ahead"
    assert ahead.scores.ahead == {} and ahead.lookahead() is None, "step 4 starts a round: it scores its own"
    ahead.asked = (6, 6)
    assert ahead.lookahead() is None, "step 7 is past the last"


def test_a_round_starts_ahead_beside_the_last_steps_generate_call_and_its_first_draw_reads_it(smoke_cfg, pool):
    """select.round_ahead: beside the generate call of a round's last step (step 3 of rounds of 4) the selector
    starts the next round (DOTS's predictor fitted on the labels observed so far, the round's weights) and screens
    step 4's candidates with them; step 4's begin_round returns that start's metrics without fitting again, and its
    draw reads the scores. The start is exactly the one an inline selector makes at that moment (before step 3's
    labels), not the one it makes at step 4 (after them). A round whose start takes reference rollouts
    (calibrate.reference=fresh) does not start ahead; the start survives a state_dict round trip."""
    from tasks.calibration.record import Calibration
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    rates = {r.id: [0.1, 0.8, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    calls = []

    def likelihood(records):
        calls.append([r.id for r in records])
        return torch.tensor([rates[r.id] for r in records], dtype=torch.float64)

    cal = Calibration(indices=tuple(range(0, 40, 5)), success=torch.tensor([0.0, 0.25, 0.5, 1.0] * 2))
    base = (*SMALL, "select.screen=2", "select.method=dots", "train.round_steps=4", "train.steps=9",
            "calibrate.reference=trained", "select.predictor.min_labels=4", "select.round_ahead=true")

    def selector(*extra, apart=True):
        s = Selector(smoke_cfg(*base, *extra), pool, feats, likelihood, apart=apart)
        s.seed_labels(cal)
        s.begin_round(0, 0, lambda records, g, seed: torch.tensor([[1.0, 0.0] * (g // 2)] * len(records)))
        for step in range(3):  # steps 0-2 chosen and observed; step 3 chosen, its rewards not yet observed
            s.observe(step, s.choose(6, step)[0], [torch.tensor([1.0, 0, 0, 0])] * 6, 0.4, None)
        return s, s.choose(6, 3)[0]

    rewards = [torch.tensor([1.0, 1, 0, 0])] * 6
    ahead, idx3 = selector()
    work = ahead.lookahead()
    assert work is not None and ahead.started is None
    calls.clear()
    work()
    assert ahead.started is not None and ahead.started[0] == 1 and list(ahead.scores.ahead) == [4]
    assert len(calls) == 1 and len(calls[0]) == 12, "step 4's candidates screened with the new round's weights"
    early, early_idx3 = selector("select.round_ahead=false")  # the same round start, made at that moment inline
    assert early_idx3 == idx3
    early.begin_round(1, 4, None)
    late, _ = selector("select.round_ahead=false")  # the round's own first draw: after step 3's labels
    for s in (ahead, early, late):
        s.observe(3, idx3, rewards, 0.4, None)
    late.begin_round(1, 4, None)
    assert torch.equal(ahead.probs, early.probs) and not torch.equal(ahead.probs, late.probs)

    restored, _ = selector()
    restored.load_state_dict(copy.deepcopy(ahead.state_dict()))  # as a checkpoint holds it: a copy
    for s in (ahead, restored):
        fits = s.predictor.fit
        s.predictor.fit = lambda *a, **k: pytest.fail("the round started ahead fits again")
        metrics = s.begin_round(1, 4, None)
        s.predictor.fit = fits
        assert metrics["select/round_ahead"] == 1.0 and s.started is None
        calls.clear()
        s.choose(6, 4)
        assert calls == [], "step 4's candidates were scored ahead"
    assert ahead.begin_round(2, 8, None)["select/round_ahead"] == 0.0, "a round that did not start ahead says so"
    assert "select/round_ahead" not in early.begin_round(2, 8, None), "the option off: no such metric"

    fresh, _ = selector("calibrate.reference=fresh")
    assert fresh.lookahead() is None, "a start that takes reference rollouts waits for its own draw"
    inline, _ = selector(apart=False)
    assert inline.lookahead() is None, "a sampler in the trainer's threads: nothing runs ahead"


def test_the_screens_state_round_trips_and_reads_older_checkpoints():
    """The scores ahead, the picks, the counts by step and the remembered scores come back from state_dict; a
    checkpoint written before the picks were kept by step holds the scores ahead alone, and loads with no picks."""
    from tasks.selection.screen import ScreenScores

    a = ScreenScores(lambda records: torch.zeros(len(records)), [], n=4)
    a.ahead, a.kept, a.counts, a.last = {4: {1: 0.5}}, {3: {2: 0.25}}, {3: [6, 2, 12]}, {1: (4, 0.5), 2: (2, 0.25)}
    b = ScreenScores(lambda records: torch.zeros(len(records)), [], n=4)
    b.load_state_dict(a.state_dict())
    assert (b.ahead, b.kept, b.counts, b.last) == (a.ahead, a.kept, a.counts, a.last)
    b.load_state_dict({"ahead": {4: {1: 0.5}}})
    assert (b.ahead, b.kept, b.counts, b.last) == ({4: {1: 0.5}}, {}, {}, {})


def test_the_prescreen_scores_the_candidates_the_screen_last_saw_mixed(smoke_cfg, pool):
    """select.screen=4 with select.prescreen=2: a step draws the same 4k candidates as without it, and the pass
    scores the 2k whose last scores say their groups were likeliest mixed (rlcore.selection.prescreen), in draw
    order; with nothing remembered, the first 2k drawn. The step keeps the best k of those by the new scores, and
    its metrics count 2k scored of 4k drawn. A step's look-ahead scores the same 2k, which the step then reads."""
    from tasks.training.techniques import screen_order
    feats = compute_features(make_policy(), pool, inter_weight=1.0, batch_size=64, device="cpu")
    rates = {r.id: [0.0, 1.0, 0.5, 0.3, 0.9][i % 5] for i, r in enumerate(pool)}
    chance = {i: 1 - rates[r.id] ** 4 - (1 - rates[r.id]) ** 4 for i, r in enumerate(pool)}
    full_calls, calls = [], []
    full = Selector(smoke_cfg(*SMALL, "select.screen=4"), pool, feats, scripted(rates, full_calls))
    pre_cfg = smoke_cfg(*SMALL, "select.screen=4", "select.prescreen=2")
    pre = Selector(pre_cfg, pool, feats, scripted(rates, calls), screen_order=screen_order(pre_cfg))
    for s in (full, pre):
        s.begin_round(0, 0, None)
    full.choose(6, 1)
    pre.choose(6, 1)
    assert calls == [full_calls[0][:12]], "nothing remembered: the first 12 of the same 24 candidates"
    m = pre.observe(1, [pool.index(next(r for r in pool if r.id == i)) for i in calls[0][:6]],
                    [torch.tensor([1.0, 0, 0, 0])] * 6, 0.4, None)
    assert (m["select/screen_candidates"], m["select/screen_drawn"]) == (12, 24)
    for s in (full, pre):  # every prompt remembered with its rate, two steps ago; a fresh selector at step 2
        s.scores.last = {i: (0, rates[r.id]) for i, r in enumerate(pool)}
        s.used[:] = False
    full_calls.clear()
    calls.clear()
    full.choose(6, 2)
    idx, _ = pre.choose(6, 2)
    drawn = [next(i for i, r in enumerate(pool) if r.id == c) for c in full_calls[0]]
    top = sorted(drawn, key=lambda i: -chance[i])[:12]
    (scored,), = [[next(i for i, r in enumerate(pool) if r.id == c) for c in calls[0]]],
    assert sorted(scored) == sorted(top) and scored == [i for i in drawn if i in scored], "the likeliest, in order"
    assert min(chance[i] for i in scored) >= max(chance[i] for i in drawn if i not in scored)
    assert any(chance[i] == 0 for i in drawn) and all(chance[i] > 0 for i in scored), "solved, unsolved: unscored"
    assert idx == [scored[j] for j in screen(torch.tensor([rates[pool[i].id] for i in scored]), 4, 6).tolist()]
    # overlapped: the look-ahead prescreens step 3's draw as step 3 will, and step 3 scores nothing itself
    ahead_cfg = smoke_cfg(*SMALL, "select.screen=4", "select.prescreen=2", "train.round_steps=4")
    ahead = Selector(ahead_cfg, pool, feats, scripted(rates, calls), screen_order=screen_order(ahead_cfg), apart=True)
    ahead.begin_round(0, 0, None)
    ahead.scores.last = {i: (0, rates[r.id]) for i, r in enumerate(pool)}
    ahead.choose(6, 2)
    calls.clear()
    ahead.lookahead()()
    assert len(calls) == 1 and len(calls[0]) == 12
    calls.clear()
    ahead.choose(6, 3)
    assert calls == [], "every candidate step 3 scores was scored ahead"
