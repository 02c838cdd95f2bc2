"""Tests of the supervised warm start: masking, batching, fingerprint cache, greedy accuracy."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.data import arith, arith_grade
from tasks.model import loading as policy
from tasks.model import warmstart, warmstart_data

TINY = dict(hidden=64, layers=1, heads=2, batch_size=8, lr=1e-2, seed=0, progress=False)


@pytest.fixture(scope="module")
def records():
    return arith.generate(0, 40, "train", "uniform")


@pytest.fixture(scope="module")
def tok():
    return policy.build_tokenizer()


def test_sft_records_are_the_warmstart_mix_of_the_train_split():
    recs = warmstart_data.sft_records(5, 1000)
    assert len(recs) == 1000 and {r.split for r in recs} == {"train"} and recs == warmstart_data.sft_records(5, 1000)
    counts = arith.level_counts(1000, arith.MIXES["warmstart"])
    assert all(sum(r.level == lv for r in recs) == c for lv, c in counts.items())


def test_flawed_share_slips_only_where_it_changes_the_answer():
    clean = warmstart_data.sft_records(5, 2000)
    assert warmstart_data.sft_records(5, 2000, flawed=0.0) == clean
    slipped = warmstart_data.sft_records(5, 2000, flawed=0.5)
    assert slipped == warmstart_data.sft_records(5, 2000, flawed=0.5)  # deterministic
    eligible = changed = 0
    for c, f in zip(clean, slipped, strict=True):
        assert (f.question, f.answer, f.level) == (c.question, c.answer, c.level)  # the reference stays true
        slip = arith.flawed_solution(c.question, c.level, int(c.answer))
        eligible += slip is not None
        if f.solution != c.solution:
            changed += 1
            assert f.solution == slip.solution and arith_grade.verify(f.solution, f.answer) == 0.0
    assert eligible > 300 and 0.4 < changed / eligible < 0.6
    every = warmstart_data.sft_records(5, 2000, flawed=1.0)
    assert sum(f.solution != c.solution for c, f in zip(clean, every, strict=True)) == eligible
    with pytest.raises(ValueError, match="flawed"):
        warmstart_data.sft_records(5, 10, flawed=1.5)


def test_examples_mask_everything_but_the_solution(tok):
    r = arith.generate(1, 1, "train", {1: 1})[0]
    (ids, n_prompt), = warmstart.encode_examples(tok, [r])
    prompt = "Q: " + r.question + "\n"
    assert n_prompt == 1 + len(prompt)  # <s> + one token per prompt character
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == prompt + r.solution
    short = ([1, 10, 11, 12, 2], 2)  # prompt <s> 10 | solution 11 12 </s>
    batch = warmstart.collate([(ids, n_prompt), short], pad_id=0)
    width = len(ids)
    assert batch["input_ids"].shape == (2, width)
    assert batch["input_ids"][1].tolist() == [1, 10, 11, 12, 2] + [0] * (width - 5)  # right padding
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * (width - 5)
    assert batch["labels"][1].tolist() == [-100, -100, 11, 12, 2] + [-100] * (width - 5)
    assert batch["labels"][0, :n_prompt].eq(-100).all() and batch["labels"][0, n_prompt:].tolist() == ids[n_prompt:]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), batch_size=st.integers(1, 17), seed=st.integers(0, 1000))
def test_epoch_batches_cover_every_example_once_per_epoch(n, batch_size, seed):
    batches = warmstart.epoch_batches(n, batch_size, seed)
    drawn = [next(batches) for _ in range(3 * n)]  # 3n batches: at least three epochs
    assert all(len(b) == batch_size for b in drawn)
    flat = [i for b in drawn for i in b]
    for e in range(len(flat) // n):  # the index stream is a concatenation of permutations of range(n)
        assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
    again = warmstart.epoch_batches(n, batch_size, seed)
    assert [next(again) for _ in range(3 * n)] == drawn


def test_warm_start_caches_by_fingerprint(records, tmp_path):
    t0 = time.perf_counter()
    path = warmstart.warm_start(records, tmp_path, steps=3, **TINY)
    first = time.perf_counter() - t0
    meta = json.loads((path / warmstart.META_FILE).read_text())
    assert path.parent == tmp_path and path.name == meta["fingerprint"]
    assert meta["steps"] == 3 and meta["final_loss"] > 0 and meta["code_version"] == warmstart.CODE_VERSION
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = warmstart.warm_start(records, tmp_path, steps=3, **TINY)
    assert again == path and time.perf_counter() - t0 < min(0.5, first)
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left behind
    # any change of data or settings is a different fingerprint
    assert warmstart.warm_start(records[:-1], tmp_path, steps=3, **TINY) != path
    assert warmstart.warm_start(records, tmp_path, steps=4, **TINY) != path
    model, tok = policy.load_policy(path)
    assert model.config.hidden_size == 64 and tok.padding_side == "left"


def test_a_recipes_data_hash_is_kept_and_its_records_drawn_only_to_train(tmp_path, monkeypatch):
    """A warm start asked by its recipe (the run's default) trains the weights, and names the folder, that its records
    give; the records' hash is kept in the cache, so the next call draws no record (the default's 76,800 took 4.5 s
    of every run). A kept file that cannot be read is computed again."""
    recipe = warmstart_data.SftRecipe(seed=3, n=40, mix="uniform", flawed=0.5)
    by_records = warmstart.warm_start(recipe.records(), tmp_path / "records", steps=2, **TINY)
    by_recipe = warmstart.warm_start(recipe, tmp_path / "recipe", steps=2, **TINY)
    assert by_recipe.name == by_records.name
    ma, mb = policy.load_policy(by_records)[0], policy.load_policy(by_recipe)[0]
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))
    kept = tmp_path / "recipe" / "sft-data" / f"{recipe.key()}.json"
    assert json.loads(kept.read_text())["data_hash"] == warmstart_data.data_hash(recipe.records())

    def no_draw(*_a, **_k):
        raise AssertionError("records drawn where their hash was kept")

    with monkeypatch.context() as m:
        m.setattr(warmstart_data, "sft_records", no_draw)
        assert warmstart.warm_start(recipe, tmp_path / "recipe", steps=2, **TINY) == by_recipe
        # the kept hash names a folder not trained yet: its records are drawn then, to train on
        with pytest.raises(AssertionError, match="records drawn"):
            warmstart.warm_start(recipe, tmp_path / "recipe", steps=3, **TINY)
    kept.write_text("{torn")
    assert warmstart.warm_start(recipe, tmp_path / "recipe", steps=2, **TINY) == by_recipe
    assert json.loads(kept.read_text())["data_hash"] == warmstart_data.data_hash(recipe.records())
    # a cache where the hash cannot be kept: the same folder, the hash computed each time
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "sft-data").write_text("a file where the folder would be")
    digest, drawn = warmstart_data.recipe_data_hash(recipe, tmp_path / "blocked")
    assert digest == warmstart_data.data_hash(recipe.records()) and drawn == recipe.records()


def test_a_recipes_key_changes_with_what_draws_its_records(tmp_path, monkeypatch):
    """The kept hash is keyed by the recipe, the code that draws its records and Python's version: an edit of
    tasks/data/arith.py or of tasks/model/warmstart_data.py (either could draw other records) is another key, never a
    stale hash."""
    recipe = warmstart_data.SftRecipe(seed=3, n=40)
    key = recipe.key()
    assert key == warmstart_data.SftRecipe(seed=3, n=40).key()
    assert {warmstart_data.SftRecipe(seed=4, n=40).key(), warmstart_data.SftRecipe(seed=3, n=41).key(),
            warmstart_data.SftRecipe(seed=3, n=40, flawed=0.7).key()}.isdisjoint({key})
    edited = tmp_path / "arith.py"
    edited.write_bytes(open(arith.__file__, "rb").read() + b"# an edit\n")
    monkeypatch.setattr(arith, "__file__", str(edited))
    assert recipe.key() != key
    monkeypatch.undo()
    edited.write_bytes(open(warmstart_data.__file__, "rb").read() + b"# an edit\n")
    monkeypatch.setattr(warmstart_data, "__file__", str(edited))
    assert recipe.key() != key
    monkeypatch.undo()
    monkeypatch.setattr(warmstart_data.sys, "version_info", (3, 99, 0))
    assert recipe.key() != key


def test_warm_start_is_deterministic(records, tmp_path):
    a = warmstart.warm_start(records, tmp_path / "a", steps=2, **TINY)
    b = warmstart.warm_start(records, tmp_path / "b", steps=2, **TINY)
    ma, _ = policy.load_policy(a)
    mb, _ = policy.load_policy(b)
    assert a.name == b.name
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))


def test_warm_start_rejects_bad_input(records, tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        warmstart.warm_start([], tmp_path, steps=1, **TINY)
    with pytest.raises(ValueError, match="worked solution"):
        warmstart.warm_start([arith.generate(0, 1, "train")[0].__class__(
            id="x", source="s", split="train", question="1+1=?", answer="2")], tmp_path, steps=1, **TINY)
    with pytest.raises(ValueError, match="lr > 0"):
        warmstart.warm_start(records, tmp_path, steps=1, **{**TINY, "lr": 0.0})


def test_training_lowers_the_solution_loss(records, tok):
    model = policy.build_tiny_model(hidden=64, layers=1, heads=2, seed=0, tokenizer=tok)
    ex = warmstart.encode_examples(tok, records)
    losses = warmstart._train(model, ex, tok.pad_token_id, steps=30, batch_size=8, lr=1e-2, warmup=0.1, seed=0,
                              progress=False)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_greedy_accuracy_matches_one_by_one_generation(tok):
    """Batched left-padded greedy decoding against a loop over single prompts (the oracle)."""
    recs = arith.generate(3, 6, "train", {1: 1, 2: 1})
    torch.manual_seed(0)
    model = policy.build_tiny_model(hidden=64, layers=2, heads=2, seed=0, tokenizer=tok)
    ex = warmstart.encode_examples(tok, recs)
    warmstart._train(model, ex, tok.pad_token_id, steps=120, batch_size=6, lr=1e-2, warmup=0.05, seed=0,
                     progress=False)  # memorises the six problems
    model.eval()
    got = warmstart.greedy_accuracy_by_level(model, tok, recs, batch_size=4, max_new_tokens=40)
    right: dict[int, list[float]] = {}
    with torch.inference_mode():
        for r in recs:
            ids = tok(policy.format_prompt(tok, r.question), return_tensors="pt")["input_ids"]
            out = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0, eos_token_id=2)
            text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            right.setdefault(r.level, []).append(arith_grade.verify(text, r.answer))
    expected = {lv: sum(v) / len(v) for lv, v in sorted(right.items())}
    assert got == expected
    assert sum(expected.values()) > 0  # the oracle comparison is not only zeros


def test_a_killed_writers_temporary_folder_is_cleaned_up(tmp_path):
    import shutil

    recs = arith.generate(1, 16, "train", "uniform")
    final = warmstart.warm_start(recs, tmp_path, steps=2, **TINY)
    shutil.rmtree(final)
    dead = tmp_path / f".{final.name}.tmp-999999999"  # a pid that cannot exist
    dead.mkdir()
    again = warmstart.warm_start(recs, tmp_path, steps=2, **TINY)
    assert again == final and not dead.exists() and not list(tmp_path.glob(".*.tmp-*"))
