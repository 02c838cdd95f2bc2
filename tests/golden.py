"""The golden fingerprint: what a short run of the smoke config (conf/smoke.yaml) computes, for plain GRPO and for
``auto``, stored in tests/fixtures/golden.json so that a change meant to rearrange the code, not what a run does,
can show that every run still ends bit-identical (tests/flows/test_golden.py).

A fingerprint holds the ledger's step tables (selections, groups, reference rows, in-training evaluations), the
step metrics of ``metrics.jsonl`` that do not depend on the clock, and a SHA-256 of the final weights. Each case
runs the ``pipeline`` flow in this process (CPU, one thread, every random draw seeded from the config's seed) with
the overlap's lag set, not measured, and an ``auto`` plan whose choice does not hang on the probe's timings (one
candidate generating half of plain GRPO's rollouts, no signal floor). A third case, ``stateful``, turns on every
technique whose state the trainer keeps.

Regenerate after a change that is meant to change what a run computes::

    PYTHONPATH=$PWD .venv/bin/python -m tests.golden --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "conf" / "smoke.yaml"
FINGERPRINT = ROOT / "tests" / "fixtures" / "golden.json"

#: The smoke config cut to a few steps: 4 steps in rounds of 2, 8 prompts of 4 rollouts each, a held-out
#: evaluation of 16 prompts every 2 steps, one thread.
SHORT = ["train.steps=4", "train.round_steps=2", "train.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=32",
         "eval.limit=16", "eval.every=2", "eval.samples=0", "model.threads=1", "tracking.register_model=false"]
#: Each case: the preset it runs, then its own overrides. ``auto`` plans among plain GRPO's 8 rollouts a prompt
#: and grpo_n4's 4 (half the generation, chosen whatever the probe measures with no signal floor), and trains
#: overlapped (lag 1: the next step drawn in the generator process during the update).
CASES: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo", ["overlap.lag=0"]),
    "auto": ("auto", ["rollout.n=8", "plan.candidates=[grpo_n4]", "plan.min_signal=0", "overlap.lag=1"]),
    # every piece of the trainer's state: DOTS with its reference rollouts, replay, PODS, ScalingRL, GAIN-RL and
    # the adaptive composition, overlapped
    "stateful": ("dots", ["pods.enabled=true", "pods.m=2", "curriculum.enabled=true", "gain.enabled=true",
                          "adapt.enabled=true", "calibrate.k=8", "calibrate.g=4", "select.predictor.min_labels=8",
                          "select.predictor.fit_steps=5", "train.round_steps=2", "overlap.lag=1"]),
}
#: metrics.jsonl keys that measure the clock or the machine, not the computation.
CLOCK = ("time/", "cost/", "rollout/tokens_per_s", "perf/", "overlap/", "memory/")
#: The ledger tables a training run writes rows to as it goes.
TABLES = ("selections", "groups", "reference", "evals")


def overrides(case: str, root: Path) -> list[str]:
    """The dotted overrides of ``case`` on conf/smoke.yaml, its run root in ``root``."""
    from tasks.config.load import preset_overrides

    preset, own = CASES[case]
    return [*preset_overrides(preset), *SHORT, *own, f"paths.root={root}"]


def run_case(case: str, root: Path) -> dict[str, Any]:
    """Run ``case`` under the calling Prefect API (a test harness) and return its fingerprint."""
    import torch

    from flows.pipeline import pipeline

    torch.set_num_threads(1)
    with plan_off_the_clock():
        summary = pipeline(config=str(SMOKE), overrides=overrides(case, root))
    if summary["status"] != "completed":
        raise RuntimeError(f"golden case {case}: the run ended {summary['status']}: {summary.get('reason')}")
    return fingerprint(root, Path(summary["run_dir"]), Path(summary["model_path"]), summary)


@contextmanager
def plan_off_the_clock():
    """The plan chooses as if it had cost nothing (rlcore/plan_choice.py ``choose`` with ``plan_s`` 0): what a short run
    spent before its first step is measured on the clock, so whether a candidate earns it back would hang on the
    machine's load; the rule itself is tested in tests/rlcore/test_plan.py."""
    from rlcore.plan_choice import choose

    with mock.patch("tasks.plan.planner.choose", lambda base, preds, min_signal, plan_s=0.0: choose(
            base, preds, min_signal, 0.0)):
        yield


def fingerprint(root: Path, run_dir: Path, model_path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The ledger's step tables, the clock-free step metrics, the final weights' hash and the plan's choice."""
    from tasks.records.ledger import Ledger

    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        tables = {t: [_plain(r)
                      for r in led.query(f"SELECT * EXCLUDE (run_id) FROM {t} ORDER BY ALL")] for t in TABLES}
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(CLOCK)}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"tables": tables, "metrics": metrics, "weights_sha256": weights_hash(model_path),
            "plan": (summary.get("plan") or {}).get("choice"), "steps": summary["steps"]}


def weights_hash(model_path: Path) -> str:
    """SHA-256 over the final model's tensors (name, dtype, shape and bytes, by name)."""
    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for f in sorted(model_path.glob("*.safetensors")):
        tensors = load_file(f)
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A ledger row as JSON values (timestamps and other non-JSON cells as their text)."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in row.items()}


def stored() -> dict[str, Any]:
    """The fingerprints in tests/fixtures/golden.json, by case."""
    return json.loads(FINGERPRINT.read_text())


def canonical(fp: dict[str, Any]) -> str:
    """A fingerprint as JSON text: equal texts are equal runs (NaN metrics too, which compare unequal as floats)."""
    return json.dumps(fp, indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the fingerprint to {FINGERPRINT}")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="only this case (default: all)")
    args = parser.parse_args(argv)
    for k, v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                 "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    from prefect.testing.utilities import prefect_test_harness

    cases = args.case or sorted(CASES)
    got = {}
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            got[case] = run_case(case, Path(tmp) / case)
    if args.write:
        table = stored() if FINGERPRINT.exists() else {}
        FINGERPRINT.write_text(canonical(table | got) + "\n")
        print(f"wrote {', '.join(cases)} to {FINGERPRINT}")
        return 0
    want = stored()
    bad = [c for c in cases if canonical(got[c]) != canonical(want.get(c, {}))]
    print("identical" if not bad else f"differs: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
