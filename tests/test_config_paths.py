"""One rule for relative paths (README, "How it works"): a path written in a config file is relative to that file,
also in a file reached through ``base:`` or a config group; one on the command line or in ``RLSIFT_ROOT``, to the
current folder. Every path is checked in the preflight (one line naming the key, the path and where it was set,
exit 2, before any stage) and stored absolute, so a resume works from any folder (tests/test_cli.py resumes one)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.config import ConfigError
from tasks.config.load import load_config, path_origins
from tasks.preflight import RunRequest, checked_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "conf" / "smoke.yaml"


def user_config(folder: Path, text: str = "") -> Path:
    """``folder/user.yaml``: conf/smoke.yaml (named relative to the file) with ``text`` over it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "user.yaml"
    path.write_text(f"base: {os.path.relpath(SMOKE, folder)}\n{text}")
    return path


def test_a_user_config_extending_smoke_resolves_its_paths_against_the_files(tmp_path, monkeypatch):
    """The issue's case: a config in its own folder that extends conf/smoke.yaml, loaded from a third folder. The
    model is smoke's (``../assets/tiny-warmstart`` from conf/), the data file and MLflow store the user file's own;
    the command line's root is the current folder's."""
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    user = user_config(mine, "data: {sources: [{kind: file, path: data/train.jsonl, format: gsm8k}]}\n"
                             "tracking: {uri: 'sqlite:///store/mlflow.db'}\n")
    (tmp_path / "shell").mkdir()
    monkeypatch.chdir(tmp_path / "shell")
    monkeypatch.delenv("RLSIFT_ROOT", raising=False)
    cfg = checked_config(RunRequest.here(str(user), ["paths.root=runs"]))
    assert cfg.model.path == str(ROOT / "assets" / "tiny-warmstart")
    assert cfg.data.sources[0].path == str(mine / "data" / "train.jsonl")
    assert cfg.tracking.uri == f"sqlite:///{mine / 'store' / 'mlflow.db'}"
    assert cfg.paths.root == str(tmp_path / "shell" / "runs")
    assert path_origins(str(user), ["paths.root=runs"]) == {
        "model.path": str(SMOKE), "data.sources[0].path": str(user), "tracking.uri": str(user),
        "paths.root": "the command line"}


def test_a_config_group_and_a_preset_resolve_against_their_own_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data=gsm8k"])  # conf/data/gsm8k.yaml: ../../../shared/data/... from conf/data/
    assert cfg.data.sources[0].path == str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl")
    override = load_config(None, ["data.sources=[{kind: file, path: here.jsonl}]"])  # the command line's: as given
    assert override.data.sources[0].path == "here.jsonl"


@pytest.mark.parametrize("text, says", [
    ("model: {path: no-such-model}\n", "model.path: {mine}/no-such-model does not exist (set in {user}; a path in a "
                                       "config file is relative to that file)"),
    ("model: {path: .}\n", "model.path: {mine} holds no saved model (no config.json) (set in {user}; a path in a "
                           "config file is relative to that file)"),
    ("data: {sources: [{kind: file, path: gone.jsonl}]}\n", "data.sources[0].path: {mine}/gone.jsonl does not exist "
                                                            "(set in {user}; a path in a config file is relative to "
                                                            "that file)"),
    ("paths: {root: user.yaml/runs}\n", "paths.root: cannot create or write {mine}/user.yaml/runs ({user} is not a "
                                        "folder) (set in {user}; a path in a config file is relative to that file)"),
    ("paths: {cache: user.yaml/cache}\n", "paths.cache: cannot create or write {mine}/user.yaml/cache ({user} is not "
                                          "a folder) (set in {user}; a path in a config file is relative to that "
                                          "file)"),
    ("tracking: {uri: 'sqlite:///user.yaml/mlflow.db'}\n", "tracking.uri: cannot create or write {mine}/user.yaml "
                                                           "({user} is not a folder) (set in {user}; a path in a "
                                                           "config file is relative to that file)"),
])
def test_a_bad_path_fails_in_the_preflight_naming_the_key_and_the_file(tmp_path, monkeypatch, text, says):
    mine = tmp_path / "mine"
    user = user_config(mine, text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        checked_config(RunRequest.here(str(user), [f"paths.root={tmp_path / 'root'}"] if "root" not in text else []))
    assert str(err.value) == says.format(mine=mine, user=user)


def test_a_bad_path_on_the_command_line_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        checked_config(RunRequest.here(str(SMOKE), [f"paths.root={tmp_path}", "model.path=nowhere"]))
    assert str(err.value) == (f"model.path: {tmp_path / 'nowhere'} does not exist (given on the command line, "
                              "relative to the current folder)")


def test_the_command_line_refuses_a_bad_path_in_a_second_before_any_stage(tmp_path):
    """``rlsift run -c user.yaml`` with a model path that is wrong relative to the file: exit 2 and one line, before
    any stage (no run root made) and before the heavy imports (the run failed 17 s in, after ingest and MLflow)."""
    user = user_config(tmp_path / "mine", "model: {path: assets/tiny-warmstart}\n")  # relative to the shell's root
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flows.cli", "run", "-c", str(user), f"paths.root={tmp_path / 'root'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    took = time.monotonic() - t0
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"rlsift run: model.path: {tmp_path / 'mine' / 'assets' / 'tiny-warmstart'} does not exist (set in {user}; "
        "a path in a config file is relative to that file)"], p.stderr[-2000:]
    assert not (tmp_path / "root").exists()
    assert took < 30, f"{took:.1f} s"  # about a second idle; a loaded shared machine is slower


@pytest.mark.parametrize("path, says", [
    ("gguf:nosuch", "unknown packaged model 'nosuch'"),
    ("missing.gguf", "no such GGUF file"),
])
def test_a_gguf_model_that_is_not_there_fails_in_the_preflight(tmp_path, monkeypatch, path, says):
    """A packaged model's name is no path (it stays a name) and a .gguf file is no folder: the preflight checks each
    the way the model stage will load it, and names the key."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        checked_config(RunRequest.here(str(SMOKE), [f"paths.root={tmp_path}", f"model.path={path}"]))
    assert says in str(err.value) and "model.path" in str(err.value), str(err.value)
