"""Every run ends as the stored fingerprint says (tests/golden.py, tests/fixtures/golden.json): the smoke config's
ledger step tables, clock-free step metrics and final weights, for plain GRPO, ``auto`` and a run with every
technique whose state the trainer keeps. Ids, counts and decisions exactly; floats to the tolerance measured between
CPU kernel paths (AVX512, AVX2, none), so the check passes on any x86-64 machine and fails on a changed computation.
A change meant to change what a run computes regenerates it with ``python -m tests.golden --write``."""

import copy
import os
import subprocess
import sys

import pytest

from tests.golden import ATOL, RTOL, differences, overrides, run_case, stored

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(got: dict, case: str) -> None:
    found = differences(got, stored()[case])
    if found:
        pytest.fail(f"golden case {case} differs from tests/fixtures/golden.json beyond RTOL {RTOL} / ATOL {ATOL} "
                    f"(regenerate with python -m tests.golden --write only if the change is meant to):\n  "
                    + "\n  ".join(found[:60]))


@pytest.mark.parametrize("case", ["grpo", "auto", pytest.param("stateful", marks=pytest.mark.slow)])
def test_a_run_ends_as_the_fingerprint_says(case, tmp_path, prefect_harness):
    _check(run_case(case, tmp_path / "root"), case)


# ---------------------------------------------------------------- the check is strict enough to catch a change


def test_a_changed_selection_count_or_flag_fails_however_small():
    want = stored()["grpo"]
    for table, row, key, change in (("selections", 3, "prompt_id", lambda v: v[:-1] + ("0" if v[-1] != "0" else "1")),
                                    ("groups", 0, "successes", lambda v: v + 1),
                                    ("groups", 1, "replayed", lambda v: not v)):
        got = copy.deepcopy(want)
        got["tables"][table][row][key] = change(got["tables"][table][row][key])
        assert differences(got, want) == [f"/tables/{table}[{row}]/{key}: {want['tables'][table][row][key]!r} -> "
                                          f"{got['tables'][table][row][key]!r}"]
    got = copy.deepcopy(want)
    got["tables"]["selections"].pop()
    assert differences(got, want) == [f"/tables/selections: {len(want['tables']['selections'])} items -> "
                                      f"{len(got['tables']['selections'])}"]


def test_floats_pass_kernel_drift_and_fail_a_real_change():
    want = stored()["grpo"]
    name = sorted(want["weights"])[0]
    drift, change = copy.deepcopy(want), copy.deepcopy(want)
    # drift: the largest measured between kernel paths (9e-5 relative, 3e-6 absolute near zero)
    drift["metrics"][1]["train/grad_norm"] *= 1 + 9e-5
    drift["metrics"][0]["train/loss"] += 3e-6
    drift["weights"][name]["delta_norm"] *= 1 + 9e-5
    assert differences(drift, want) == []
    # a real change: the update 1 % larger (a learning rate 1 % higher), a loss 1 % off
    change["weights"][name]["delta_norm"] *= 1.01
    change["metrics"][1]["train/grad_norm"] *= 1.01
    assert [d.split(":")[0] for d in differences(change, want)] == [
        "/metrics[1]/train/grad_norm", f"/weights/{name}/delta_norm"]


@pytest.mark.slow
def test_a_changed_learning_rate_fails_the_golden_check(tmp_path, prefect_harness, monkeypatch):
    """The run itself, with ``train.lr`` 20 % higher: the check must fail, on the weights' change at least."""
    import tests.golden as golden
    from tasks.config.load import load_config

    base_lr = load_config(golden.SMOKE, overrides("grpo", tmp_path)).train.lr
    monkeypatch.setitem(golden.CASES, "grpo", (golden.CASES["grpo"][0],
                                               [*golden.CASES["grpo"][1], f"train.lr={base_lr * 1.2}"]))
    found = differences(run_case("grpo", tmp_path / "root"), stored()["grpo"])
    assert any(d.startswith("/weights/") and "delta_norm" in d for d in found), found


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_golden_run_passes_on_another_kernel_path(capability):
    """``python -m tests.golden`` with torch's CPU kernels forced to AVX2 or to none (``ATEN_CPU_CAPABILITY``): the
    same check as the default test run, on what another machine's CPU would compute."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "tests.golden", "--case", "grpo", "--case", "auto"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert f"kernels: {capability.upper()}" in out.stdout, out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
