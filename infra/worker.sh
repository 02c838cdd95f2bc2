#!/usr/bin/env bash
# Start a Prefect process worker for rlsift's deployments in the foreground (flow runs are subprocesses
# of it, in this repository's .venv), through `rlsift worker` (flows/worker.py). Needs PREFECT_API_URL (see
# infra/prefect-server.sh).
# Usage: bash infra/worker.sh [POOL]                (default pool rlsift-process, created if missing)
# Stop it before stopping the server: one Ctrl-C stops it, after its runs in flight have ended cancelled
# (docs/operations.md "Stopping").
set -euo pipefail
cd "$(dirname "$0")/.."
POOL="${1:-${RLSIFT_WORK_POOL:-rlsift-process}}"
: "${PREFECT_API_URL:?set PREFECT_API_URL, e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
BIN="${RLSIFT_VENV:-$PWD/.venv}/bin"
exec "$BIN/python" -m flows.cli worker --pool "$POOL"
