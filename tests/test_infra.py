"""The service scripts under infra/, started for real on free loopback ports."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.servers import free_port, start, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_server_script_serves_its_ui_on_any_port(tmp_path):
    """The UI asks /ui-settings for the API URL: it must name the port the server listens on, even with an
    API URL for another server exported in the shell."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "RLSIFT_VENV": str(Path(sys.executable).parents[1]),
           "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    server = start(["bash", str(ROOT / "infra" / "prefect-server.sh"), str(port)], env, tmp_path / "server.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", server, tmp_path / "server.log")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
            settings = json.loads(r.read())
        assert settings["api_url"] == f"http://127.0.0.1:{port}/api"
    finally:
        stop(server)


def _stub_venv(tmp_path: Path) -> Path:
    """A venv whose ``prefect`` and ``mlflow`` print where they would keep their state, instead of serving."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("prefect", "mlflow"):
        (bin_dir / name).write_text('#!/usr/bin/env bash\necho "PREFECT_HOME=${PREFECT_HOME:-} ARGS=$*"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir.parent


def _script_says(script: str, tmp_path: Path, cwd: Path, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("RLSIFT_ROOT", "PREFECT_HOME")}
    done = subprocess.run(["bash", str(ROOT / "infra" / script), str(free_port())], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**base, "RLSIFT_VENV": str(_stub_venv(tmp_path)), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_server_scripts_keep_their_state_in_the_root(tmp_path):
    """Prefect's state is ``<root>/prefect`` and MLflow's store ``<root>/mlflow.db`` for the root RLSIFT_ROOT names
    (absolute, or relative to where the script is started), as docs/operations.md lists; PREFECT_HOME still wins."""
    root = tmp_path / "root"
    assert f"PREFECT_HOME={root / 'prefect'} " in _script_says("prefect-server.sh", tmp_path, ROOT,
                                                              RLSIFT_ROOT=str(root))
    (tmp_path / "here").mkdir()
    said = _script_says("prefect-server.sh", tmp_path / "a", tmp_path / "here", RLSIFT_ROOT="rel")
    assert f"PREFECT_HOME={tmp_path / 'here' / 'rel' / 'prefect'} " in said
    said = _script_says("prefect-server.sh", tmp_path / "b", ROOT, RLSIFT_ROOT=str(root),
                        PREFECT_HOME=str(tmp_path / "own"))
    assert f"PREFECT_HOME={tmp_path / 'own'} " in said
    said = _script_says("mlflow-server.sh", tmp_path / "c", tmp_path / "here", RLSIFT_ROOT="rel")
    assert f"--backend-store-uri sqlite:///{tmp_path / 'here' / 'rel' / 'mlflow.db'} " in said


def test_the_package_builds_without_setuptools_warnings(tmp_path):
    """infra/setup.sh installs the project (``pip install -e .``) on every call: its metadata builds without a
    warning (``project.license`` as a TOML table printed 52 lines of setuptools' deprecation notice a call). Built
    from a copy, with the venv's setuptools, so nothing is written into the checkout and nothing is downloaded."""
    import shutil

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for package in ("rlcore", "tasks", "flows"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    code = ("import setuptools.build_meta as b, sys; sys.stdout.write(b.prepare_metadata_for_build_editable('meta'))")
    (tmp_path / "meta").mkdir()
    p = subprocess.run([sys.executable, "-W", "default", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Warning" not in p.stderr and "deprecated" not in p.stderr, p.stderr[-3000:]
    meta = (tmp_path / "meta" / p.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in meta
