"""infra/gpu-bench.py, the GPU check, runs at toy sizes on the CPU and imports nothing a bare GPU machine lacks."""

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the GPU machine has (besides the standard library): these and what they require.
ALLOWED = ("torch", "transformers", "peft", "pydantic", "numpy")
#: The resident set's run-to-run wobble at the toy's size (8 MiB, in GiB): the toy's estimate is not held to it.
RSS_NOISE_GIB = 8 / 1024

PROBE = """
import json, runpy, sys
import numpy, peft, pydantic, torch, transformers  # what they import on their own is theirs
before = set(sys.modules)
sys.argv = ["gpu-bench.py", "--toy", "--modes", "full", "--rows", "8", "24", "--prompt", "8",
            "--completion", "24", "--micro-batch-tokens", "128", "--precisions", "fp32", "bf16-mixed"]
try:
    runpy.run_path({bench!r}, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("MODULES " + json.dumps(sorted({{m.split(".")[0] for m in set(sys.modules) - before}})))
"""


def _closure(names) -> set[str]:
    """Top-level import names of the distributions ``names`` and everything they require."""
    seen, todo = set(), [n.lower() for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0].lower() for r in reqs if "extra ==" not in r]
    tops = set()
    for top, dists in md.packages_distributions().items():
        if any(d.lower().replace("_", "-") in {s.replace("_", "-") for s in seen} for d in dists):
            tops.add(top)
    return tops


def test_the_gpu_check_runs_on_the_cpu_and_imports_only_what_a_gpu_machine_has():
    bench = str(ROOT / "infra" / "gpu-bench.py")
    proc = subprocess.run([sys.executable, "-c", PROBE.format(bench=bench)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| toy")]
    assert len(table) == 4, proc.stdout  # 2 sizes x 2 precisions
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| model"))
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in table]
    for r in rows:
        assert "out of memory" not in r["s / step"] and float(r["tokens / s"].replace(",", "")) > 0
        # the tokens the passes computed: real ones, and the padded ones beside them (tests/tasks/test_micro_batch.py
        # holds the count to a hand count)
        assert 0 < int(r["tokens a step"].replace(",", "")) <= int(r["padded tokens"].replace(",", ""))
        # the estimate (tasks/update/memory_check.py) is not below the measured peak (the process's, less the resident
        # set before the arm). Not asserted for bf16 on a CPU: oneDNN's bf16 kernels keep reordered copies and caches
        # per shape that CUDA does not have (docs/performance.md); the default `--toy` run holds there too. The
        # toy's whole step is about 130 MiB, where the resident set's reading (allocator arenas, pages touched by
        # the interpreter) moves by a few MiB from run to run: RSS_NOISE_GIB of it is not held against the estimate.
        assert float(r["peak GiB"]) > 0
        if r["precision"] == "fp32":
            assert float(r["estimate GiB"]) >= float(r["peak GiB"]) - RSS_NOISE_GIB, r
    assert {r["precision"] for r in rows} == {"fp32", "bf16-mixed"}
    sampler = [line for line in proc.stdout.splitlines() if re.match(r"\| (16|32) \| 8 \| (today|new) \|", line)]
    assert len(sampler) == 4, proc.stdout  # the generation half: both loops at both row counts
    micro = [int(r["micro-batches"]) for r in rows[:2]]
    assert micro[1] > micro[0] >= 1  # the larger batch takes more micro-batches
    overlap = proc.stdout.split("overlap on one CPU", 1)[1].splitlines()[3]
    cells = [c.strip() for c in overlap.strip("|").split("|")]
    # one clock from a common start: "at once" is the later of the two sides' ends (not the update alone of another
    # run, which the machine's load moves: 3.64 s alone against 2.06 s at once once in CI)
    together, ends = float(cells[5].split()[0]), [float(x) for x in re.findall(r"[\d.]+", cells[5].split(" ", 1)[1])]
    assert len(ends) == 2 and min(ends) > 0 and together == pytest.approx(max(ends), abs=0.011), cells[5]
    ours = {"rlcore", "tasks", "infra", "gpu_bench_generation", "gpu_bench_overlap", "qwen_shapes", "synthetic_batch"}
    imported = set(json.loads(proc.stdout.split("MODULES ", 1)[1]))
    extra = imported - ours - _closure(ALLOWED) - set(sys.stdlib_module_names) - {"_distutils_hack"}
    assert not extra, f"the GPU check imports {sorted(extra)}, which a machine with only {ALLOWED} lacks"


sys.path.insert(0, str(ROOT / "infra"))
import gpu_bench_overlap as overlap  # noqa: E402


def test_allocation_failures_are_told_from_other_errors():
    import torch

    try:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator's own failure (a RuntimeError)
    except RuntimeError as err:
        assert overlap.is_alloc_failure(err)
    assert overlap.is_alloc_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert overlap.is_alloc_failure(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not overlap.is_alloc_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not overlap.is_alloc_failure(ValueError("out of memory"))


def test_a_dead_sampler_process_is_noticed_at_once():
    import multiprocessing as mp
    import os
    import time

    import pytest

    proc = mp.get_context("spawn").Process(target=os._exit, args=(3,))
    proc.start()
    t0 = time.perf_counter()
    with pytest.raises(overlap.ChildDied, match="exit code 3"):
        overlap._wait(proc, "drawing", lambda t: time.sleep(t), timeout_s=600)
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("inject, cause, site", [
    pytest.param("model.layers.1.mlp@28", "non-finite loss (loss nan); ",
                 "forward of model.layers.1.mlp: nan in the output", marks=pytest.mark.slow),
    ("model.layers.1.self_attn.q_proj@28:backward", "non-finite gradient (norm nan); micro-batch 1 of 2: ",
     "backward of model.layers.1.self_attn: nan in the gradient of model.layers.1.self_attn.q_proj's output")])
def test_a_skipped_arm_fails_and_is_bisected(inject, cause, site, capsys):
    """A NaN injected at position 28 of row 0 (``--inject-nan``): the arm's update is skipped, so its row says so
    with the locator's site and shows no time, MFU, peak or estimate, the script exits 1, and the bisection finds
    that rows past 24 positions (``--bisect-positions``) are what first goes non-finite."""
    import runpy

    import torch

    threads = torch.get_num_threads()
    bench = runpy.run_path(str(ROOT / "infra" / "gpu-bench.py"), run_name="gpu_bench")
    try:
        rc = bench["main"](["--toy", "--modes", "full", "--rows", "8", "--prompt", "8", "--completion", "24",
                            "--micro-batch-tokens", "128", "--precisions", "fp32", "--no-generation",
                            "--inject-nan", inject, "--bisect-positions", "24"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 1
    header = next(line for line in out.splitlines() if line.startswith("| model"))
    names = [c.strip() for c in header.strip("|").split("|")]
    (line,) = [line for line in out.splitlines() if line.startswith("| toy")]
    row = dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True))
    assert row["status"].startswith(f"skipped: {cause}{site}") and "(row, position) (0, 28)" in row["status"]
    assert "attention sdpa" in row["status"]
    for empty in ("micro-batches", "s / step", "tokens / s", "MFU", "peak GiB", "estimate GiB", "estimate / peak"):
        assert row[empty] == "", (empty, row)
    bisection = out.split("bisection of toy full fp32 8 rows", 1)[1].splitlines()
    results = [[c.strip() for c in ln.strip("|").split("|")] for ln in bisection if ln.startswith("| ")][1:]
    assert [r[-1] == "finite" for r in results] == [True, True, True, False, False]  # the last: cuDNN SDPA off
    assert [r[2] for r in results] == ["24", "24", "24", "32", "32"]
    first = next(ln for ln in bisection if ln.startswith("first non-finite"))
    assert first.startswith(f"first non-finite: + rows past 24 positions (to 32) -> skipped: {cause}{site}")


def _update_rows(*flags: str) -> list[dict]:
    """The update table's rows of a small toy run of infra/gpu-bench.py with ``flags``."""
    proc = subprocess.run([sys.executable, str(ROOT / "infra" / "gpu-bench.py"), "--toy", "--no-generation", "--modes",
                           "full", "--rows", "16", "--prompt", "16", "--completion", "16", "--precisions", "fp32",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| model"))
    names = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in proc.stdout.splitlines() if line.startswith("| toy")]


def test_the_bench_times_the_update_with_one_prompt_a_group():
    (rows,), (shared,) = _update_rows(), _update_rows("--shared-prefix")

    def count(row: dict, key: str) -> int:
        return int(row[key].replace(",", ""))

    # the packed passes compute each group's prompt once, and have no pads
    assert count(shared, "tokens a step") < count(rows, "tokens a step")
    assert count(shared, "tokens a step") == count(shared, "padded tokens")
