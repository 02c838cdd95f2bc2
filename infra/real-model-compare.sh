#!/usr/bin/env bash
# The evidence of docs/benchmarks.md, "A real model": plain GRPO (grpo-sync, the benchmark's baseline) and `auto`
# on conf/real/smollm2.yaml, the same seed and steps, one after the other (`rlsift bench`, one seed, no TRL), then
# the one-panel learning curve against the training clock (infra/real-model-figure.py: docs/img/real-model.png and
# the bench's MLflow parent run). Needs bash infra/setup-real-model.sh first.
# Usage: bash infra/real-model-compare.sh [paths.root] [key=value ...]   (default root: rlsift-runs/real)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
ROOT="${1:-rlsift-runs/real}"
shift || true
mkdir -p "$ROOT"
"$PY" -m flows.cli bench -c conf/real/smollm2.yaml --presets auto --seeds 1 --no-trl "paths.root=$ROOT" "$@" \
  --json > "$ROOT/bench.json"
REPORT=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['report_dir'])" "$ROOT/bench.json")
"$PY" infra/real-model-figure.py "$REPORT" --out "${FIGURE:-docs/img/real-model.png}"
