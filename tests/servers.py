"""Start and stop real local servers (Prefect, MLflow, workers) for tests: free loopback ports, health polls,
and stopping exactly the processes a test started (each in its own process group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict[str, str], log: Path, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new process group, stdout and stderr to ``log``."""
    out = open(log, "ab")
    try:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Poll ``url`` until it answers 200; fail early with the log tail when ``proc`` exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Send ``sig`` to the process group ``proc`` leads; SIGKILL it after ``timeout`` s. Returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
    try:  # children that outlived their leader (uvicorn workers, job runners)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


def wait_port_free(port: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} still in use")


def torchrun_two_ranks(helper: Path, out: Path, *args: str) -> object:
    """Run ``helper out *args`` as 2 gloo CPU ranks under ``torchrun``; the object rank 0 saved to ``out``.
    DeepSpeed's CPU ops build into the repository's ``.cache/torch_extensions`` (once)."""
    import sys

    import torch

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(root),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(root / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(helper), str(out), *args]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)
