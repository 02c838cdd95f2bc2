"""Every run ends as the stored fingerprint says (tests/golden.py, tests/fixtures/golden.json): the smoke config's
ledger step tables, clock-free step metrics and final weights, bit for bit, for plain GRPO, ``auto`` and a run with
every technique whose state the trainer keeps. A change meant to change what a run computes regenerates it with
``python -m tests.golden --write``."""

import difflib

import pytest

from tests.golden import canonical, run_case, stored


@pytest.mark.parametrize("case", ["grpo", "auto", pytest.param("stateful", marks=pytest.mark.slow)])
def test_a_run_ends_as_the_fingerprint_says(case, tmp_path, prefect_harness):
    got, want = canonical(run_case(case, tmp_path / "root")), canonical(stored()[case])
    if got != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "stored", "this run", lineterm="",
                                              n=1))
        pytest.fail(f"golden case {case} differs from tests/fixtures/golden.json "
                    f"(regenerate with python -m tests.golden --write only if the change is meant to):\n{diff[:6000]}")
