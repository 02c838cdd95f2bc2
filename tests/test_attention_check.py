"""infra/attention-check.py, the GPU check that confirms or rules out pytorch#196678: its CPU twin runs every
variant, and the verdict names what the four outcomes show."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("attention_check", ROOT / "infra" / "attention-check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_cpu_twin_runs_both_layouts_with_cudnn_on_and_off(capsys):
    check = _script()
    assert check.main(["--toy"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("CPU, torch ") and "generation layout 32 columns" in lines[0]
    variants = lines[1:5]
    assert [v.split(":")[0].split() for v in variants] == [
        ["generation", "cuDNN", "SDPA", "on"], ["generation", "cuDNN", "SDPA", "off"],
        ["contiguous", "cuDNN", "SDPA", "on"], ["contiguous", "cuDNN", "SDPA", "off"]]
    assert all("loss finite" in v and "non-finite" not in v for v in variants)
    norms = {v.split("gradient norm ")[1].split(";")[0] for v in variants}
    assert len(norms) == 1  # both layouts give the same gradient (4 significant digits)
    assert lines[5] == "verdict: every variant finite: pytorch#196678 not reproduced at this shape"


def test_the_verdict_reads_the_four_outcomes():
    check = _script()

    def outcomes(bad: set) -> list:
        return [check.Outcome(lay, c, True, 1.0, "q_proj.weight" if (lay, c) in bad else None, ())
                for lay in ("generation", "contiguous") for c in (True, False)]

    assert "confirmed" in check.verdict(outcomes({("generation", True)}))
    mixed = check.verdict(outcomes({("generation", True), ("contiguous", False)}))
    assert mixed == "verdict: non-finite in generation cuDNN on, contiguous cuDNN off: not (only) pytorch#196678"
