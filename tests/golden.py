"""The golden fingerprint: what a short run of the smoke config (conf/smoke.yaml) computes, for plain GRPO and for
``auto``, stored in tests/fixtures/golden.json so that a change meant to rearrange the code, not what a run does,
can show that every run still ends the same (tests/flows/test_golden.py).

A fingerprint holds the ledger's step tables (selections, groups, reference rows, in-training evaluations), the
step metrics of ``metrics.jsonl`` that do not depend on the clock, and each final weight tensor's norm and the norm
of its change from the starting model. Each case runs the ``pipeline`` flow in this process (CPU, one thread, every
random draw seeded from the config's seed) with the overlap's lag set, not measured, and an ``auto`` plan whose
choice does not hang on the probe's timings (one candidate generating half of plain GRPO's rollouts, no signal
floor). A third case, ``stateful``, turns on every technique whose state the trainer keeps.

What must match (:func:`differences`): every id, count, flag and string exactly (which prompts were selected, how
many rollouts succeeded, what the plan chose), and every float to :data:`RTOL` and :data:`ATOL`. Float bits are not
the same on every x86-64 CPU: torch picks AVX512 or AVX2 kernels by the CPU (``ATEN_CPU_CAPABILITY`` forces one),
and their sums round differently. The tolerances are set from the drift measured between those kernel paths on the
three cases, with a margin, far below what a change of the computation moves (tests/flows/test_golden.py shows a
changed learning rate and a changed selection failing).

Regenerate after a change that is meant to change what a run computes::

    PYTHONPATH=$PWD .venv/bin/python -m tests.golden --write

Check this machine against it on another kernel path (the default test run must pass on each)::

    ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$PWD .venv/bin/python -m tests.golden
"""

from __future__ import annotations

import argparse
import json
import math
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
    """The plan chooses, and prunes its probe, as if it had cost nothing (rlcore/plan_choice.py ``choose`` and
    ``out_of_reach`` with ``plan_s`` 0): what a short run spent before its first step is measured on the clock, so
    whether a candidate earns it back would hang on the machine's load; the rule itself is tested in
    tests/rlcore/test_plan.py."""
    from rlcore.plan_choice import choose, out_of_reach

    with mock.patch("tasks.plan.planner.choose", lambda base, preds, min_signal, plan_s=0.0, work=None: choose(
            base, preds, min_signal, 0.0, work)), \
            mock.patch("tasks.plan.planner.out_of_reach", lambda p, base, min_signal, plan_s: out_of_reach(
                p, base, min_signal, 0.0)):
        yield


# The tolerances, from the three cases run on four kernel paths: this AMD EPYC's AVX512 kernels, the same CPU with
# ATEN_CPU_CAPABILITY=avx2 and =default (no vector unit), and the machine the fingerprint was first written on. Every
# id, count and flag was the same on all four; the floats drifted by at most the figures below (the weights' norms:
# the first three, the first fingerprint held a hash).
#: Float tolerance, relative: |got - want| <= max(ATOL, RTOL * max(|got|, |want|)). Largest drift measured on values
#: above ATOL: 1.0e-4 (a DOTS selection weight: the exp of a difference); tenfold margin.
RTOL = 1e-3
#: Float tolerance, absolute: the noise floor of quantities that are zero up to rounding (a step-0 loss of 1e-9,
#: the sampler-trainer log-prob gap of 1e-6 when both hold the same weights). Largest measured: 3.9e-6.
ATOL = 2e-5
#: The weights' norms, relative only (no norm is near zero): largest drift measured 9.2e-6 (the change of a layer
#: norm's weights, norm 8.5e-4); tenfold margin. A learning rate 1 % higher moves the changes' norms about 1 %.
WEIGHTS_RTOL = 1e-4


def fingerprint(root: Path, run_dir: Path, model_path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The ledger's step tables, the clock-free step metrics, the final weights' norms and the plan's choice."""
    from tasks.records.ledger import Ledger

    with Ledger(root / "ledger.duckdb", read_only=True) as led:
        tables = {t: [_plain(r)
                      for r in led.query(f"SELECT * EXCLUDE (run_id) FROM {t} ORDER BY ALL")] for t in TABLES}
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(CLOCK)}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = json.loads((run_dir / "config.json").read_text())["model"]["path"]
    return {"tables": tables, "metrics": metrics, "weights": weight_norms(model_path, start and Path(start)),
            "plan": (summary.get("plan") or {}).get("choice"), "steps": summary["steps"]}


def weight_norms(model_path: Path, start: Path | None) -> dict[str, dict[str, Any]]:
    """Each tensor of the final model by name: its dtype and shape, its L2 norm and the L2 norm of its change from
    the model the run started from (``start``; None: from zero). The change's norm moves with what training did
    (a learning rate 10 % higher moves it about 10 %); the tensor's norm, with which model it is."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    final, first = tensors(model_path), tensors(start) if start is not None else {}
    out = {}
    for name in sorted(final):
        t = final[name].double()
        before = first[name].double() if name in first and first[name].shape == t.shape else torch.zeros_like(t)
        out[name] = {"dtype": str(final[name].dtype), "shape": list(t.shape), "norm": t.norm().item(),
                     "delta_norm": (t - before).norm().item()}
    return out


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where fingerprint ``got`` departs from ``want``: a key, length, id, count, flag or string that differs, or a
    float outside :data:`RTOL` / :data:`ATOL` (a weight norm: :data:`WEIGHTS_RTOL`; NaN equals NaN); one line each,
    ``path: want -> got``."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}/{k}: {'missing' if k not in got else 'not in the stored fingerprint'}"
               for k in sorted(set(want) ^ set(got))]
        return out + [d for k in sorted(set(want) & set(got)) for d in differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} items -> {len(got)}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, float):
        close = (math.isclose(got, want, rel_tol=WEIGHTS_RTOL) if where.startswith("/weights/") else
                 math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL))
        return [] if close or (math.isnan(want) and math.isnan(got)) else [f"{where}: {want!r} -> {got!r}"]
    if type(want) is not type(got) or want != got:  # ints, strings, bools, None: exact (1 is not 1.0 either)
        return [f"{where}: {want!r} -> {got!r}"]
    return []


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
    import torch

    bad = {c: differences(got[c], want.get(c, {})) for c in cases}
    for c, found in bad.items():
        print(f"{c}: " + ("as stored" if not found else f"{len(found)} differences (RTOL {RTOL}, ATOL {ATOL}, "
                          f"WEIGHTS_RTOL {WEIGHTS_RTOL})\n  "
                          + "\n  ".join(found[:40])))
    print(f"kernels: {torch.backends.cpu.get_cpu_capability()}")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
