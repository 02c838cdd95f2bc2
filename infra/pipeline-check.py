"""The GPU check's pipeline part: the tiny default (conf/smoke.yaml: plain GRPO from the shipped warm start) run end
to end on one device by ``rlsift run``, its stages timed and its held-out accuracy required to rise.

It runs ``python -m flows.cli run -c conf/smoke.yaml model.device=<device> paths.root=<root> [overrides] --json`` as
a child process (whose children die with it: the check kills the part's process group at its limit), reads the run's
summary and prints the seconds of each stage, the wall time and the held-out greedy accuracy before and after, then
one ``verdict:`` line. Exit status 1 when the run did not complete or its accuracy did not rise.

Usage:
    python infra/pipeline-check.py --device cuda --root ./gpu-check/runs
    python infra/pipeline-check.py --device cpu --root /tmp/runs train.steps=8     # the CPU twin
    python infra/pipeline-check.py --device cuda --root /tmp/runs --config conf/presets/auto.yaml  # `rlsift run`'s
                                                                                   # default: the plan, then its choice
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="model.device (default cuda)")
    p.add_argument("--root", required=True, help="paths.root of the run (ledger, MLflow store, runs)")
    p.add_argument("--config", default=str(ROOT / "conf" / "smoke.yaml"))
    p.add_argument("overrides", nargs="*", help="more dotted overrides, e.g. train.steps=8")
    args = p.parse_args(argv)
    cmd = [sys.executable, "-m", "flows.cli", "run", "-c", args.config, f"model.device={args.device}",
           f"paths.root={args.root}", "tracking.register_model=false", *args.overrides, "--json"]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # its log goes straight to stderr
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {"status": f"no summary (exit {proc.returncode})"}
    stages = summary.get("stage_seconds") or {}
    print("| stage | s |\n|---|---|")
    for name, seconds in stages.items():
        print(f"| {name} | {seconds:.1f} |")
    print(f"| the process, start to end | {wall:.1f} |")
    plan = summary.get("plan")
    if plan:  # an auto run: what it chose and why
        print(f"plan: {plan['line']}")
        overlap = (summary.get("overlap") or {}).get("reason")
        print(f"effective ratio: {summary.get('effective_ratio')}; overlap: {overlap}")
    start, end = summary.get("eval_accuracy_start"), summary.get("eval_accuracy_end")
    completed = summary.get("status") == "completed"
    rose = completed and start is not None and end is not None and end > start
    acc = f"held-out accuracy {start:.3f} -> {end:.3f}" if start is not None and end is not None else "no accuracy"
    chose = f", chose {plan['choice']}" if plan else ""
    print(f"verdict: {'ok' if rose else 'FAILS'}: {Path(args.config).name} on {args.device} {summary.get('status')} "
          f"in {wall:.0f} s, {summary.get('steps')} steps{chose}, {acc} ({'rises' if rose else 'does not rise'})")
    return 0 if rose else 1


if __name__ == "__main__":
    sys.exit(main())
