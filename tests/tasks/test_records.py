"""The records stages hand each other (features, calibration, run info) survive their files, and files are
written atomically."""

import json
from dataclasses import asdict, replace

import pytest
import torch

from tasks.calibration.record import Calibration
from tasks.records.files import atomic_write, write_json
from tasks.run import RunInfo
from tasks.selection.features import Features


def features(m: int = 3) -> Features:
    g = torch.Generator().manual_seed(0)
    return Features(ids=[f"p{i}" for i in range(m)], emb=torch.randn(m, 4, generator=g),
                    angle_intra=torch.rand(m, generator=g), angle_inter=torch.rand(m, generator=g),
                    angle=torch.rand(m, generator=g), prompt_tokens=torch.tensor([5, 7, 9][:m]),
                    cot=torch.tensor([0.0, 12.0, 30.0][:m]), level=torch.tensor([1, 2, 0][:m]))


TENSORS = ("emb", "angle_intra", "angle_inter", "angle", "prompt_tokens", "cot", "level")


def same(a: Features, b: Features) -> bool:
    return a.ids == b.ids and all(torch.equal(getattr(a, k), getattr(b, k)) for k in TENSORS)


def test_features_save_load_round_trip_and_the_plain_dict_file_of_earlier_runs(tmp_path):
    f = features()
    back = Features.load(f.save(tmp_path / "features.pt"))
    assert same(back, f) and not (tmp_path / "features.pt.tmp").exists()
    # features.pt as runs wrote it before Features existed: a plain dict of the same keys
    torch.save({"ids": f.ids, "emb": f.emb, "angle_intra": f.angle_intra, "angle_inter": f.angle_inter,
                "angle": f.angle, "prompt_tokens": f.prompt_tokens, "cot": f.cot, "level": f.level},
               tmp_path / "old.pt")
    assert same(Features.load(tmp_path / "old.pt"), f)
    torch.save({"ids": f.ids, "emb": f.emb}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="partial.pt"):
        Features.load(tmp_path / "partial.pt")


def test_features_rows_and_shapes():
    rows = features().ledger_rows()
    assert [r.prompt_id for r in rows] == ["p0", "p1", "p2"]
    assert rows[1].prompt_tokens == 7 and rows[1].cot_tokens == 12 and rows[2].level == 0
    assert isinstance(rows[0].angle_score, float)
    with pytest.raises(ValueError, match="angle has 2 rows for 3 prompts"):
        replace(features(), angle=torch.zeros(2))


def test_calibration_json_round_trip_and_metrics(tmp_path):
    cal = Calibration(indices=(4, 0, 2, 7), success=torch.tensor([0.0, 0.25, 1.0, 0.5]))
    saved = json.loads(cal.save(tmp_path / "calibrate.json").read_text())
    assert saved["indices"] == [4, 0, 2, 7] and saved["calibrate/effective"] == 0.5
    back = Calibration.load(tmp_path / "calibrate.json")
    assert back.indices == cal.indices and torch.equal(back.success, cal.success)
    assert back.success.dtype == torch.float32
    assert cal.metrics == {"calibrate/success_mean": 0.4375, "calibrate/effective": 0.5,
                           "calibrate/solved": 0.25, "calibrate/unsolved": 0.25}
    with pytest.raises(ValueError, match="3 indices"):
        Calibration(indices=(1, 2, 3), success=torch.zeros(2))


def test_run_info_round_trip(tmp_path):
    info = replace(RunInfo(), policy_path="/m", data_fingerprint="abc", flow="retrain", parent_version="")
    write_json(tmp_path / "info.json", asdict(info))
    assert RunInfo.load(tmp_path / "info.json") == info
    assert RunInfo.load(tmp_path / "info.json").parent_version == ""  # "" (no parent yet) is not None


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "f.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}

    def torn(f):
        f.write(b'{"a": ')
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(path, torn)
    assert json.loads(path.read_text()) == {"a": 1}  # the old content, not a torn one
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temporary file left behind
    write_json(path, {"b": [1, 2]})
    assert json.loads(path.read_text()) == {"b": [1, 2]}


def test_a_full_disk_is_named_and_the_old_file_kept(tmp_path):
    """A write that runs out of space (torch.save raises "unexpected pos ..." while handling the OSError ENOSPC, as
    when the plan's probe filled a disk) raises an OSError that says so, where, and what is left; no .tmp stays."""
    import errno

    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")

    def full(f):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1600269888") from None

    with pytest.raises(OSError, match=r"no space left on the device of .* to write checkpoint.pt \(.* GiB free now; "
                                      r"the old checkpoint.pt is kept\): free some, or set paths.root") as err:
        atomic_write(path, full)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, RuntimeError)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
    with pytest.raises(OSError, match="nothing was written"):
        atomic_write(tmp_path / "new.pt", full)
    with pytest.raises(ValueError, match="other"):  # any other error passes as it is
        atomic_write(path, lambda f: (_ for _ in ()).throw(ValueError("other")))


def test_run_label_names_techniques_data_and_seed():
    from tasks.config.load import conf_dir, load_config
    from tasks.records.label import run_label

    assert run_label(load_config(None, [])) == "grpo bundled:default s0"
    assert run_label(load_config(str(conf_dir() / "presets" / "all.yaml"), ["seed=2"])) == \
        "dots+replay+pods+scalingrl+gain bundled:default s2"
    assert run_label(load_config(None, ["dynamic.enabled=true", "select.drop_solved=true",
                                        "data.sources=[{kind: bundled, mix: {3: 1.0}}]"])) == \
        "dynamic+drop-solved bundled:custom s0"
    two = "data.sources=[{kind: bundled, mix: default}, {kind: bundled, mix: easy}, {kind: bundled, mix: default}]"
    assert run_label(load_config(None, [two])) == "grpo bundled:default,bundled:easy s0"  # each name once, in order
    auto = load_config(str(conf_dir() / "presets" / "auto.yaml"), [])
    assert run_label(auto) == "auto bundled:default s0"  # before the plan has chosen
    assert run_label(auto, "dots_screen") == "auto→dots_screen bundled:default s0"  # what it trains
    assert run_label(load_config(None, []), "dots_screen") == "grpo bundled:default s0"  # no plan: no choice


def test_training_curves_start_and_end_at_the_pipelines_heldout_evaluations(tmp_path):
    """training_curves.png's held-out panel has the start (step 0) and end evaluations, as MLflow's chart does;
    metrics.jsonl holds only the in-training ones."""
    from tasks.records.plots import curve_points, training_curves

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "train/reward_mean": 0.25, "eval/accuracy": 0.40}, {"step": 1, "train/reward_mean": 0.5},
        {"step": 2, "train/reward_mean": 0.5, "eval/accuracy": 0.45}]))
    heldout = ((0, 0.36), (3, 0.5))
    points = curve_points([json.loads(x) for x in path.read_text().splitlines()], heldout)
    assert points["eval/accuracy"] == [(0, 0.36), (0, 0.40), (2, 0.45), (3, 0.5)]
    assert points["train/reward_mean"] == [(0, 0.25), (1, 0.5), (2, 0.5)] and points["time/step_s"] == []
    assert training_curves(path, tmp_path / "curves.png", heldout) == [tmp_path / "curves.png"]
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_source_commit_only_from_the_top_of_a_checkout(tmp_path):
    import subprocess

    from tasks.records.tracking.describe import GIT_COMMIT, PROJECT, SOURCE_NAME, source_tags

    head = subprocess.run(["git", "-C", str(PROJECT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: its commit, and a name so that MLflow shows the source
        assert source_tags()[GIT_COMMIT] == head.stdout.strip() and source_tags()[SOURCE_NAME] == str(PROJECT)
    else:
        assert source_tags() == {}
    assert source_tags(tmp_path) == {}  # not a checkout
    assert source_tags(PROJECT / "tasks") == {}  # inside one, but not the project's top


def test_registration_quality_gate():
    from tasks.report.registration import refusal

    assert refusal(0.60, 0.59, 0.02) is None and refusal(0.60, 0.585, 0.02) is None  # within the tolerance
    assert "0.570" in refusal(0.60, 0.57, 0.02) and "register_tolerance=0.02" in refusal(0.60, 0.57, 0.02)
    assert refusal(0.60, 0.0, None) is None  # gate off
    assert refusal(0.0, 0.0, 0.0) is None


def test_a_run_that_failed_marks_every_store_it_can_and_keeps_its_own_error(smoke_cfg, caplog, monkeypatch):
    """A full disk fails the marks of a failing run's close too (MLflow's cost table, its outbox): each store is
    still marked where it can be, each mark that fails is one line, and nothing is raised over the run's own error.
    A run that completed raises the first such error."""
    import errno

    from tasks.records.ledger import Ledger
    from tasks.run import open_run

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "no space left on the device of /r to write outbox-outages.json")

    for status in ("failed", "completed"):
        run = open_run(smoke_cfg(), track=False)
        monkeypatch.setattr(run, "log_cost_table", full)
        monkeypatch.setattr(run.tracker, "finish", full)
        with caplog.at_level("ERROR", logger="rlsift"):
            if status == "failed":
                run.close(status, {}, note="OSError: no space left")
            else:
                with pytest.raises(OSError, match="outbox"):
                    run.close(status, {})
        said = [m for m in caplog.messages if run.run_id in m and "not marked" in m]
        assert said == [f"run {run.run_id}: MLflow's cost table not marked {status}: OSError: [Errno 28] no space "
                        f"left on the device of /r to write outbox-outages.json",
                        f"run {run.run_id}: MLflow not marked {status}: OSError: [Errno 28] no space left on the "
                        f"device of /r to write outbox-outages.json"]
        with Ledger(run.ledger.path, read_only=True) as led:  # marked although the cost table was not
            assert led.run_status(run.run_id) == status
