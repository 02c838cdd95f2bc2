"""Every config file loads and validates; bad keys and values are errors that name the key; every field is
described, conf/base.yaml states every default, and rlcore repeats none of them."""

import inspect
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from rlcore import (
    advantages,
    angle,
    curriculum,
    difficulty,
    downsample,
    gain_sampler,
    grpo_loss,
    replay_buffer,
    selection,
)
from tasks.config import Config, ConfigError
from tasks.config.load import load_config
from tasks.config.model import is_gguf_name

CONF = Path(__file__).resolve().parents[1] / "conf"
FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent.name != "data") + [
    Path(__file__).resolve().parent / "fixtures" / "tiny.yaml"]  # the tests' own budget
DATA = sorted((CONF / "data").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name if CONF not in p.parents else str(p.relative_to(CONF)))
def test_every_config_file_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.model_config["frozen"]


@pytest.mark.parametrize("path", DATA, ids=lambda p: p.stem)
def test_every_data_group_validates(path, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    cfg = load_config(None, [f"data={path.stem}"])
    assert cfg.data.sources, path


def test_presets_switch_what_their_names_say():
    get = lambda name: load_config(CONF / "presets" / f"{name}.yaml")  # noqa: E731
    assert sorted(p.stem for p in (CONF / "presets").glob("*.yaml")) == [
        "all", "auto", "dapo", "dots", "gain", "grpo", "pods", "scalingrl"], "the presets a user chooses from"
    assert get("grpo").select.method == "uniform" and not get("grpo").pods.enabled and not get("grpo").plan.auto
    assert get("auto").plan.auto and get("auto").model_copy(update={"plan": get("grpo").plan}) == get("grpo")
    d = get("dots")  # DOTS with Rollout Replay, as published
    assert d.select.method == "dots" and d.replay.enabled and d.replay.fresh_frac == 0.5
    assert (d.select.weighting, d.calibrate.reference) == ("target", "fresh")
    assert get("pods").pods.enabled and get("dapo").dynamic.enabled
    assert get("gain").gain.enabled and get("scalingrl").curriculum.enabled
    a = get("all")
    assert (a.select.method, a.pods.enabled, a.replay.enabled, a.curriculum.enabled, a.gain.enabled) == \
        ("dots", True, True, True, True)
    assert (a.select.weighting, a.calibrate.reference) == ("observed", "trained")
    assert (get("grpo").guard.share, get("grpo").guard.anchor) == (0.0, 0.0)


def test_bench_arms_switch_what_their_names_say():
    get = lambda name: load_config(CONF / "bench" / f"{name}.yaml")  # noqa: E731
    assert get("dots_noreplay").select.method == "dots" and not get("dots_noreplay").replay.enabled
    inf = get("dots_informative")
    assert (inf.select.method, inf.select.weighting, inf.calibrate.reference) == ("dots", "observed", "trained")
    n4 = get("dots_n4")
    assert (n4.rollout.n, n4.train.prompts_per_step, n4.select.weighting) == (4, 32, "observed")
    screen = get("dots_screen")
    assert (screen.select.screen, screen.rollout.n, screen.train.prompts_per_step, screen.select.method) == \
        (2, 4, 20, "dots") and n4.select.screen == 1, "the screen is dots_screen's one addition"
    assert get("dots_screen_24") == screen.model_copy(update={"train": screen.train.model_copy(
        update={"prompts_per_step": 24})}), "a bigger screened batch is its one change"
    assert screen.select.screen_ahead and not screen.select.round_ahead
    assert get("dots_screen_inline") == screen.model_copy(update={"select": screen.select.model_copy(
        update={"screen_ahead": False})}), "the look-ahead's control"
    assert get("dots_screen_round_ahead") == screen.model_copy(update={"select": screen.select.model_copy(
        update={"round_ahead": True})}), "rounds started ahead are its one change"
    g4 = get("grpo_n4")
    assert (g4.rollout.n, g4.select.method, get("dots_noreplay").rollout.n) == (4, "uniform", 8)
    uniform_screen = get("grpo_screen")  # the screen on grpo_n4's uniform draw: no DOTS, 4 candidates a prompt
    assert uniform_screen.model_copy(update={"select": g4.select, "train": g4.train}) == g4
    assert (uniform_screen.select.method, uniform_screen.select.screen, uniform_screen.select.screen_ahead,
            uniform_screen.train.prompts_per_step) == ("uniform", 4, True, 20)
    for size in (24, 28):  # the sizes the plan takes where 20 screened prompts fall short of GRPO's signal
        assert get(f"grpo_screen_{size}") == uniform_screen.model_copy(update={"train": uniform_screen.train.model_copy(
            update={"prompts_per_step": size})}), "a bigger screened batch is its one change"
    wider = get("grpo_screen6_16")  # a wider screen on fewer prompts: 6 candidates for each of 16
    assert wider == uniform_screen.model_copy(update={
        "select": uniform_screen.select.model_copy(update={"screen": 6}),
        "train": uniform_screen.train.model_copy(update={"prompts_per_step": 16})})
    pre = get("grpo_prescreen")  # the wider screen scoring 3 of its 6 candidates a prompt, each round started ahead
    assert pre == wider.model_copy(update={"select": wider.select.model_copy(update={"prescreen": 3,
                                                                                     "round_ahead": True})})
    for size in (18, 20):
        assert get(f"grpo_prescreen_{size}") == pre.model_copy(update={"train": pre.train.model_copy(
            update={"prompts_per_step": size})}), "a bigger batch its one change"
    for name, prompts in (("grpo_prescreen_n6", 12), ("grpo_prescreen_n6_11", 11), ("grpo_prescreen_n6_14", 14)):
        assert get(name) == pre.model_copy(update={"rollout": pre.rollout.model_copy(update={"n": 6}),
                                                   "train": pre.train.model_copy(update={"prompts_per_step": prompts})})
    screen_waves = get("grpo_screen_waves")  # grpo_screen's draw with carried waves, no skip
    assert screen_waves.model_copy(update={"waves": uniform_screen.waves}) == uniform_screen
    assert (screen_waves.waves.enabled, screen_waves.waves.first, screen_waves.waves.candidates,
            screen_waves.waves.carry, screen_waves.skip.enabled) == (True, 2, 1.5, True, False)
    drop = get("drop_solved")
    assert drop.select.drop_solved and drop.select.method == "uniform"
    waves = get("dots_screen_waves")  # dots_screen's draw, its rollouts in two waves, and the skip
    assert waves.model_copy(update={"waves": screen.waves, "skip": screen.skip}) == screen
    assert (waves.waves.enabled, waves.waves.first, waves.waves.carry, waves.skip.enabled) == (True, 2, False, True)
    carried = get("dots_screen_waves_carry")
    assert carried == waves.model_copy(update={"waves": waves.waves.model_copy(update={"carry": True})})
    assert get("dots_screen_waves_1x") == carried.model_copy(update={"waves": carried.waves.model_copy(
        update={"candidates": 1.0})}), "one candidate a budgeted group is the lean arm's one change"
    assert get("dots_screen_skip").model_copy(update={"skip": screen.skip}) == screen
    gw = get("grpo_waves")
    assert gw.model_copy(update={"waves": g4.waves, "skip": g4.skip}) == load_config(CONF / "presets" / "grpo.yaml")


def test_plan_candidates_are_known_names():
    from tasks.config.load import named_config

    for name in (*Config().plan.candidates, Config().plan.baseline):
        assert named_config(name).is_file()
    with pytest.raises(ConfigError, match="unknown preset or benchmark arm 'nope'"):
        named_config("nope")


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "train.lr=3e-4", "replay.enabled=true", "data.sources=[]"])
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-4 and cfg.replay.enabled and cfg.data.sources == ()


@pytest.mark.parametrize("override, expect", [
    ("train.stepz=3", "train.stepz: unknown key; allowed keys: steps"),
    ("trian.steps=3", "trian: unknown key; allowed keys: seed, paths"),
    ("train.steps=-1", "train.steps: Input should be greater than or equal to 0"),
    ("select.method=best", "select.method: Input should be 'uniform' or 'dots'"),
    ("model.hidden=100", "hidden/heads must be an integer >= 32"),
    ("train.steps", "expected key=value"),
    ("train.bucket_tokens=4096", "train.bucket_tokens: renamed train.micro_batch_tokens"),
])
def test_bad_config_names_the_key(override, expect):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert expect in str(err.value)


def test_frozen():
    cfg = load_config(None)
    with pytest.raises(ValidationError):
        cfg.train.steps = 3  # type: ignore[misc]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_flat_params_cover_every_leaf():
    flat = load_config(None).flat()
    assert flat["train.steps"] == 150 and flat["select.predictor.hidden"] == 64
    assert all(not isinstance(v, dict) for v in flat.values())


# ---------------------------------------------------------------- one home for every default


def _fields(model: type[BaseModel], prefix: str = ""):
    """(dotted name, FieldInfo, nested model or None) of every field, recursing into sections and into the
    model inside a tuple (data.sources holds SourceConfig items)."""
    for name, info in model.model_fields.items():
        options = (info.annotation, *getattr(info.annotation, "__args__", ()))
        nested = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        yield prefix + name, info, nested
        if nested is not None:
            yield from _fields(nested, f"{prefix}{name}.")


def test_every_config_field_is_described():
    names = [name for name, _, _ in _fields(Config)]
    assert len(names) > 120 and "data.sources.format" in names and "select.predictor.lr" in names
    bare = [name for name, info, _ in _fields(Config) if not (info.description or "").strip()]
    assert not bare, f"config fields without a description: {bare}"


def _yaml_leaves(model: type[BaseModel], tree: dict, prefix: str = ""):
    """Dotted names of ``model``'s leaf fields that ``tree`` (a YAML mapping) states."""
    for name, info in model.model_fields.items():
        if name not in tree:
            continue
        nested = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) \
            else None
        if nested is not None and isinstance(tree[name], dict):
            yield from _yaml_leaves(nested, tree[name], f"{prefix}{name}.")
        else:
            yield prefix + name


def test_base_yaml_states_every_default():
    tree = yaml.safe_load((CONF / "base.yaml").read_text())
    stated = set(_yaml_leaves(Config, tree))
    leaves = {name for name, _, nested in _fields(Config) if nested is None and not name.startswith("data.sources.")}
    leaves.add("data.sources")  # a list of sources is one value
    assert leaves - stated == set(), f"conf/base.yaml does not state: {sorted(leaves - stated)}"
    loaded, default = load_config(CONF / "base.yaml").flat(), Config().flat()
    differ = {k: (loaded.get(k), v) for k, v in default.items() if loaded.get(k) != v}
    assert not differ, f"conf/base.yaml differs from Config() (yaml, built-in): {differ}"
    assert load_config(CONF / "base.yaml") == Config()


# rlcore takes every knob the config sets as a required keyword, so no default is written twice:
# (callable, parameter) -> the config field that holds its default.
RLCORE_KNOBS = {
    (advantages.group_advantages, "scale_by_std"): "train.scale_std",
    (grpo_loss.clipped_policy_loss, "clip_eps"): "train.clip_eps",
    (grpo_loss.clipped_policy_loss, "aggregation"): "train.aggregation",
    (grpo_loss.clipped_policy_loss, "kl_coef"): "train.kl_coef",
    (grpo_loss.masked_aggregate, "aggregation"): "train.aggregation",
    (downsample.downsample, "rule"): "pods.rule",
    (replay_buffer.ReplayBuffer, "max_age"): "replay.max_age",
    (selection.dots_weights, "alpha"): "select.alpha",
    (selection.dots_weights, "tau"): "select.tau",
    (selection.sample_prompts, "method"): "select.sampler",
    (angle.angle_concentration, "inter_weight"): "gain.inter_weight",
    **{(difficulty.AttentionDifficultyPredictor, k): f"select.predictor.{k}"
       for k in ("hidden", "layers", "dropout", "tau_att", "calibration", "linear_recalibration", "min_labels", "lr")},
    (difficulty.AttentionDifficultyPredictor, "seed"): "seed",
    **{(curriculum.CurriculumScheduler, k): f"curriculum.{k}"
       for k in ("kappa", "theta_lo", "theta_hi", "theta_learned", "rho0", "rho_step")},
    (curriculum.data_effectiveness_score, "weights"): "curriculum.weights",
    (curriculum.data_effectiveness_score, "difficulty_form"): "curriculum.difficulty_form",
    **{(gain_sampler.GaussianWindowSampler, k): f"gain.{k}"
       for k in ("sigma_frac", "step_frac", "alpha", "beta", "gamma")},
}


@pytest.mark.parametrize("target, param", list(RLCORE_KNOBS), ids=lambda x: getattr(x, "__name__", x))
def test_rlcore_has_no_second_default(target, param):
    assert RLCORE_KNOBS[(target, param)] in Config().flat()
    p = inspect.signature(target).parameters[param]
    assert p.default is inspect.Parameter.empty, f"{target.__name__}({param}=...) repeats a default of the config"


def test_rlsift_root_is_the_root_over_the_file_and_under_the_overrides(monkeypatch):
    monkeypatch.setenv("RLSIFT_ROOT", "/data/rlsift")
    assert load_config(None, []).paths.root == "/data/rlsift"
    assert load_config("conf/smoke.yaml", []).paths.root == "/data/rlsift"
    assert load_config(None, ["paths.root=/elsewhere"]).paths.root == "/elsewhere"
    monkeypatch.setenv("RLSIFT_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("RLSIFT_ROOT", "")  # empty: not set
    cfg = load_config(None, [])
    assert cfg.tracking.uri == "http://127.0.0.1:5000" and cfg.paths.root == "./rlsift-runs"


# ---------------------------------------------------------------- paths: relative to the file that writes them


@pytest.mark.parametrize("path", [*FILES, *DATA],
                         ids=lambda p: p.name if CONF not in p.parents else str(p.relative_to(CONF)))
def test_every_path_in_a_config_file_resolves_from_any_folder(path, tmp_path, monkeypatch):
    """Loaded from another folder, each file's paths are absolute and point where the file means: the shipped warm
    start, the data folder beside the repository (``shared/``). conf/smoke.yaml's ``model.path`` once named
    ``assets/tiny-warmstart`` against the shell's folder: a run from anywhere else failed 17 s in."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path) if path not in DATA else load_config(None, [f"data={path.stem}"])
    if is_gguf_name(cfg.model.path):  # a packaged model's name (conf/real/smollm2.yaml) stays a name
        assert cfg.model.path.startswith("gguf:"), cfg.model.path
    elif cfg.model.path is not None:
        assert Path(cfg.model.path).is_absolute() and (Path(cfg.model.path) / "config.json").is_file(), cfg.model.path
    for source in cfg.data.sources:
        if source.kind == "file":
            assert Path(source.path).is_absolute() and Path(source.path).is_relative_to(CONF.parent.parent / "shared")
    assert cfg.paths.root == "./rlsift-runs" and cfg.paths.cache is None  # the default: the current folder's


def test_an_unknown_config_group_lists_the_groups():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data=nosuch"])
    assert str(err.value) == (f"data=nosuch: no config group 'nosuch' in {CONF / 'data'}; the groups: balanced, easy, "
                              "gsm8k, humaneval, math (or set the section's keys, e.g. data.KEY=VALUE)")
