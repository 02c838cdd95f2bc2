"""Tests of the benchmark flow (flows/benchmark.py) and its arms (flows/bench_arms.py): configuration composition
(fast) and, in the slow tier, a tiny ``rlsift bench --quick`` end to end with the TRL control, its report files
and MLflow runs."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flows.bench_arms import DEFAULTS, QUICK, configuration, preset_overrides
from flows.benchmark import clock_skips
from tasks.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "tests" / "fixtures" / "tiny.yaml")


def test_preset_overrides_are_the_preset_chain_without_base():
    dots = preset_overrides("dots")
    assert 'select.method="dots"' in dots and "calibrate.k=32" in dots
    assert not any(o.startswith(("train.", "model.", "data.", "paths.")) for o in dots)  # base.yaml's keys stay out
    assert "replay.enabled=true" in dots
    screen = preset_overrides("dots_screen")  # a bench arm: conf/bench/dots_screen.yaml -> ... -> presets/grpo.yaml
    assert "select.screen=2" in screen and 'select.weighting="observed"' in screen and 'select.method="dots"' in screen
    assert "rollout.n=4" in screen and "train.prompts_per_step=20" in screen  # the arm's own value wins
    assert "replay.enabled=true" not in screen
    assert "curriculum.weights=[0.34, 0.33, 0.33]" in preset_overrides("scalingrl")
    with pytest.raises(ConfigError, match="unknown preset or benchmark arm 'nope'; allowed: all, auto, dapo, dots"):
        preset_overrides("nope")


def test_configuration_order(tmp_path):
    root = f"paths.root={tmp_path}"
    # the smoke file sets the budget; the preset sets the technique; the command line wins over both
    cfg = configuration(SMOKE, [root, "calibrate.k=8"], "dots", 3, False, None)
    assert cfg.select.method == "dots" and cfg.calibrate.k == 8 and cfg.train.steps == 4 and cfg.seed == 3
    assert cfg.eval.every == 10 and not cfg.tracking.register_model  # DEFAULTS
    quick = configuration(SMOKE, [root], "pods", 0, True, str(tmp_path / "model"))
    assert quick.train.steps == 30 and quick.eval.limit == 300  # QUICK over the config file
    assert quick.pods.enabled and quick.rollout.n == 16 and quick.model.path == str(tmp_path / "model")
    assert set(DEFAULTS) and set(QUICK)


def test_clock_skips_only_unused_upfront_stages(tmp_path):
    def skips(preset):
        return clock_skips(configuration(SMOKE, [f"paths.root={tmp_path}"], preset, 0, False, None))

    assert skips("grpo") == ("score", "calibrate") and skips("pods") == ("score", "calibrate")
    assert skips("gain") == ("calibrate",)  # the angle needs the scoring pass, not the calibration
    assert skips("dots") == () and skips("scalingrl") == () and skips("all") == ()


@pytest.mark.parametrize("overrides, expect", [
    (["train.minibatches=2"], "train.minibatches=1 only"),
    (["train.kl_coef=0.04", "train.kl_rows=informative"], "train.kl_rows must be 'all'"),
    (["train.lr_schedule=cosine"], "constant learning rate"),
    (["train.warmup_steps=5"], "constant learning rate"),
])
def test_trl_control_refuses_what_it_cannot_mirror(tmp_path, overrides, expect):
    from tasks.bench.trl_control import grpo_args
    from tasks.config.load import load_config

    with pytest.raises(ValueError, match=expect):
        grpo_args(load_config(None, overrides), tmp_path, "cpu", None)


@pytest.mark.slow
def test_trl_prompts_tokenized_like_our_engine():
    from tasks.bench.trl_control import _trainer_class
    from tasks.model.loading import add_special, build_tokenizer, format_prompt

    tok = build_tokenizer()
    prompts = [format_prompt(tok, "12+(40-7)*3=?"), format_prompt(tok, "5%3=?")]
    ids, images, extra = _trainer_class()._tokenize_prompts(SimpleNamespace(processing_class=tok), prompts)
    # tasks.generation.rollout.HFEngine: tok(p, add_special_tokens=add_special(tok)); the plain format gets BOS, as in
    # the warm start's <s> + prompt
    assert add_special(tok)
    assert ids == [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    assert all(row[0] == tok.bos_token_id and row.count(tok.bos_token_id) == 1 for row in ids)
    assert images is None and extra == {}


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
def test_bench_quick_end_to_end(tmp_path, capsys, prefect_harness):
    from flows.cli import main
    from tasks.records.tracking import run_info

    code = main(["bench", "--quick", "--seeds", "1", "-c", SMOKE, "--presets", "dots", "--json",
                 f"paths.root={tmp_path}", "train.steps=4", "train.prompts_per_step=4", "train.round_steps=2",
                 "eval.every=2", "eval.limit=12", "calibrate.k=8", "calibrate.g=4"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["failed"] == []
    report = Path(out["report_dir"])
    assert report.parent == tmp_path / "reports" and report.name.startswith("bench-")
    for name in ("results.md", "results.json", "accuracy_curves.png", "effective_ratio.png",
                 "selected_difficulty.png"):
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    assert "| grpo-sync | 1 |" in out["table"] and "| trl | 1 |" in out["table"]

    result = json.loads((report / "results.json").read_text())
    by_name = {c["name"]: c for c in result["configurations"]}
    assert set(by_name) == {"grpo-sync", "dots", "trl"}
    # the plan predicted every arm it can before any ran, and the report sets that beside the measurements
    assert [(c["arm"], c["composition"]) for c in result["plan_check"]] == [("grpo-sync", "grpo"), ("dots", "dots")]
    assert "The plan's predictions" in out["table"] and "What the figures say" in out["table"]
    for c in by_name.values():
        assert c["curve"]["steps"] == [0, 2, 4]  # the same schedule for our runs and TRL
        assert c["budget"]["step"] == 4 and c["budget"]["wall_s"] > 0
        assert "final" in c["to_target"] and "best" in c["to_target"]
    # the baseline reaches its own final accuracy by definition, at the latest at its last step
    assert by_name["grpo-sync"]["to_target"]["final"]["mean_curve"] is not None
    # same budget: 4 steps x 4 prompts x rollout.n = 4 completions, for GRPO and TRL alike
    assert by_name["grpo-sync"]["budget"]["rollouts"] == by_name["trl"]["budget"]["rollouts"] == 64
    # same starting model and held-out set: the same starting greedy accuracy
    assert by_name["trl"]["start_accuracy"]["mean"] == by_name["grpo-sync"]["start_accuracy"]["mean"]
    assert by_name["grpo-sync"]["skipped_stages"] == ["score", "calibrate"] and by_name["dots"]["skipped_stages"] == []

    parent = run_info(out["tracking_uri"], out["mlflow_run_id"])
    assert parent["status"] == "FINISHED" and "results.md" in parent["artifacts"]
    children = {r["name"]: run_info(out["tracking_uri"], r["mlflow_run_id"]) for r in out["runs"]}
    assert set(children) == {"grpo-sync", "dots", "trl"}
    for child in children.values():
        assert child["tags"]["mlflow.parentRunId"] == out["mlflow_run_id"]
        assert child["status"] == "FINISHED"
    trl = children["trl"]["params"]
    assert trl["trl.loss_type"] == "dapo" and trl["trl.scale_rewards"] == "none"
    assert trl["trl.lr_scheduler_type"] == "constant" and trl["trl.per_device_train_batch_size"] == "16"
    assert "eval/accuracy" in children["trl"]["metrics"]


def test_leave_one_out_arms_switch_off_exactly_one_technique(tmp_path):
    from flows.bench_arms import LEAVE_ONE_OUT, configuration

    full = configuration(None, [f"paths.root={tmp_path}"], "all", 0, True, None).flat()
    for name in LEAVE_ONE_OUT:
        arm = configuration(None, [f"paths.root={tmp_path}"], name, 0, True, None).flat()
        changed = {k for k in full if full[k] != arm[k]}
        switch = {"all-dots": {"select.method"}, "all-replay": {"replay.enabled"},
                  "all-pods": {"pods.enabled", "rollout.n"}, "all-scalingrl": {"curriculum.enabled"},
                  "all-gain": {"gain.enabled"}, "all-adapt": {"adapt.enabled"}}[name]
        assert changed == switch, (name, changed)


@pytest.mark.slow  # 41 s; the default run keeps the suite under 15 minutes on 2 cores
def test_bench_jobs_run_side_by_side_in_lanes(tmp_path, capsys, prefect_harness):
    """``--jobs 2``: two lane processes, each with its own ledger, runs nested under the benchmark's MLflow run."""
    from flows.cli import main
    from tasks.records.tracking import run_info

    code = main(["bench", "--quick", "--seeds", "1", "--jobs", "2", "-c", SMOKE, "--presets", "grpo,dapo", "--json",
                 f"paths.root={tmp_path}", "train.steps=2", "train.prompts_per_step=4", "train.round_steps=2",
                 "eval.every=2", "eval.limit=8", "calibrate.k=8", "calibrate.g=4"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["failed"] == [] and [r["name"] for r in out["runs"]] == ["grpo-sync", "grpo", "dapo", "trl"]
    roots = {run_info(out["tracking_uri"], r["mlflow_run_id"])["tags"]["rlsift.root"] for r in out["runs"]
             if r["name"] != "trl"}
    assert roots and roots <= {str(tmp_path / "lanes" / "0"), str(tmp_path / "lanes" / "1")}
    assert all((Path(r) / "ledger.duckdb").is_file() for r in roots)
    for r in out["runs"]:
        child = run_info(out["tracking_uri"], r["mlflow_run_id"])
        assert child["tags"]["mlflow.parentRunId"] == out["mlflow_run_id"] and child["status"] == "FINISHED"
        if r["name"] != "trl":
            assert child["params"]["model.threads"] == str(max(1, (__import__("os").cpu_count() or 1) // 2))
    assert "| dapo | 1 |" in out["table"] and "--jobs 2" in json.loads(
        (Path(out["report_dir"]) / "results.json").read_text())["meta"]["command"]


def test_every_file_of_conf_bench_is_an_arm():
    """An arm is added by its file alone: conf/bench's files are the arms, the ablation runs them, and the plan's
    check of the arms predicts each as its own composition."""
    from flows.bench_arms import ablation, arms, composition_of

    files = sorted(p.stem for p in Path("conf/bench").glob("*.yaml"))
    assert list(arms()) == files and "grpo_prescreen_n6" in files
    assert set(files) <= set(ablation()) and composition_of("grpo_prescreen_n6") == "grpo_prescreen_n6"
    assert composition_of("grpo_prescreen_n6-sync") == "grpo_prescreen_n6" and composition_of("nope") is None
