#!/usr/bin/env bash
# Start an MLflow tracking server (API + UI) on 127.0.0.1 in the foreground; Ctrl-C or SIGTERM stops it.
# Usage: bash infra/mlflow-server.sh [PORT]          (default port 5000; UI at http://127.0.0.1:PORT)
#
# Backend: SQLite. By default the server serves the pipeline's own store, <root>/mlflow.db with
# root = $RLSIFT_ROOT (default <repo>/rlsift-runs; a relative one is taken from the directory the script is
# started in), so the UI shows every run logged there; artifacts of runs logged through the server go to
# <root>/mlflow-artifacts (proxied). To log through the server instead
# of to the file: rlsift run tracking.uri=http://127.0.0.1:PORT ...
# Override with MLFLOW_BACKEND_STORE_URI / MLFLOW_ARTIFACTS_DESTINATION. Runs with one worker process.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(mkdir -p "${RLSIFT_ROOT:-$REPO/rlsift-runs}" && cd "${RLSIFT_ROOT:-$REPO/rlsift-runs}" && pwd)"
cd "$REPO"
PORT="${1:-${MLFLOW_PORT:-5000}}"
BACKEND="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$ROOT/mlflow.db}"
ARTIFACTS="${MLFLOW_ARTIFACTS_DESTINATION:-$ROOT/mlflow-artifacts}"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true
BIN="${RLSIFT_VENV:-$PWD/.venv}/bin"
echo "MLflow server: UI http://127.0.0.1:$PORT  backend $BACKEND  artifacts $ARTIFACTS" >&2
exec "$BIN/mlflow" server --host 127.0.0.1 --port "$PORT" --workers 1 \
  --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS"
