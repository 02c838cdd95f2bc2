"""infra/gpu-bench.py, the GPU check, runs at toy sizes on the CPU and imports nothing a bare GPU machine lacks."""

import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the GPU machine has (besides the standard library): these and what they require.
ALLOWED = ("torch", "transformers", "peft", "pydantic", "numpy")

PROBE = """
import json, runpy, sys
import numpy, peft, pydantic, torch, transformers  # what they import on their own is theirs
before = set(sys.modules)
sys.argv = ["gpu-bench.py", "--toy", "--modes", "full", "lora+ckpt", "--rows", "8", "24", "--prompt", "8",
            "--completion", "24", "--micro-batch-tokens", "128"]
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
    assert len(table) == 4, proc.stdout
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert "out of memory" not in line and float(cells[6].replace(",", "")) > 0  # tokens a second
    sampler = [line for line in proc.stdout.splitlines() if re.match(r"\| (16|32) \| 8 \| (today|new) \|", line)]
    assert len(sampler) == 4, proc.stdout  # the generation half: both loops at both row counts
    micro = [int(line.split("|")[5]) for line in table]
    assert micro[1] > micro[0] >= 1  # the larger batch takes more micro-batches
    ours = {"rlcore", "tasks", "infra", "gpu_bench_generation"}
    imported = set(json.loads(proc.stdout.split("MODULES ", 1)[1]))
    extra = imported - ours - _closure(ALLOWED) - set(sys.stdlib_module_names) - {"_distutils_hack"}
    assert not extra, f"the GPU check imports {sorted(extra)}, which a machine with only {ALLOWED} lacks"
