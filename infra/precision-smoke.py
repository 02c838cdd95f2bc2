"""The smoke run under each ``model.precision`` on the CPU: does bf16-mixed learn what float32 learns?

Runs ``rlsift run -c conf/smoke.yaml model.precision=P`` for P in fp32 and bf16-mixed (and bf16-true with
``--true``), side by side (one thread each), and prints a table: held-out greedy accuracy at the start and the end,
the final weights' change from the warm start (float32 norm; the start rounded to the run's compute dtype, as the
run loaded it) and its ratio to the float32 run's, and the wall time. The target (issue 44): bf16-mixed ends within
2 points of the float32 run's held-out accuracy, and its change is within 10 % of the float32 run's in norm.

bf16 matmuls are slow on a CPU (the bf16 run takes about 10x the float32 one: 20-25 minutes on 2 idle cores), so
this is a benchmark to run by hand, not a test: ``.venv/bin/python infra/precision-smoke.py [--root DIR] [--true]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "assets" / "tiny-warmstart"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out |= load_file(f)
    return out


def change(final: Path, compute: torch.dtype) -> float:
    """Norm of the final weights less the warm start's (rounded to ``compute``, as the run loaded it)."""
    start, end = weights(START), weights(final)
    return float(torch.sqrt(sum(((end[k].float() - start[k].to(compute).float()) ** 2).sum() for k in end)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT / "rlsift-runs" / "precision"), help="run roots go under it")
    ap.add_argument("--true", action="store_true", help="also run bf16-true (weights and AdamW state in bf16)")
    ap.add_argument("overrides", nargs="*", help="more dotted overrides for every run")
    args = ap.parse_args()
    names = ["fp32", "bf16-mixed", *(["bf16-true"] if args.true else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs, t0 = {}, time.perf_counter()
    for name in names:
        root = Path(args.root) / name
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "flows.cli", "run", "-c", "conf/smoke.yaml", f"model.precision={name}",
               "model.threads=1", f"paths.root={root}", *args.overrides, "--json"]
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=open(root / "stderr.log", "w"), text=True)
        print(f"started {name}: {' '.join(cmd[2:])} (log {root / 'stderr.log'})", flush=True)
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            sys.exit(f"{name} failed ({proc.returncode}); see {Path(args.root) / name / 'stderr.log'}")
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name} done after {time.perf_counter() - t0:.0f} s", flush=True)
    moved = {n: change(Path(r["model_path"]), torch.float32 if n == "fp32" else torch.bfloat16)
             for n, r in results.items()}
    print("\n| model.precision | held-out start | held-out end | end - fp32's (points) | weights' change (norm) "
          "| / fp32's | wall s |")
    print("|---|---|---|---|---|---|---|")
    ref = results["fp32"]
    for n, r in results.items():
        print(f"| {n} | {r['eval_accuracy_start']:.3f} | {r['eval_accuracy_end']:.3f} | "
              f"{100 * (r['eval_accuracy_end'] - ref['eval_accuracy_end']):+.1f} | {moved[n]:.4f} | "
              f"{moved[n] / moved['fp32']:.3f} | {r['wall_s']:.0f} |")
    mixed = results["bf16-mixed"]
    gap = abs(mixed["eval_accuracy_end"] - ref["eval_accuracy_end"])
    ratio = moved["bf16-mixed"] / moved["fp32"]
    print(f"\ntarget: bf16-mixed within 2 points of fp32's held-out accuracy ({100 * gap:.1f}: "
          f"{'met' if gap <= 0.02 else 'MISSED'}), its change within 10 % in norm ({ratio:.3f}: "
          f"{'met' if abs(ratio - 1) <= 0.10 else 'MISSED'})")


if __name__ == "__main__":
    main()
