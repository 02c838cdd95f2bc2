#!/usr/bin/env bash
# Start a local Prefect server (API + UI) on 127.0.0.1 in the foreground; Ctrl-C (SIGINT/SIGTERM) stops it.
# State (SQLite database, logs) lives in $PREFECT_HOME (default: <root>/prefect, with root = $RLSIFT_ROOT,
# default <repo>/rlsift-runs; a relative RLSIFT_ROOT is taken from the directory the script is started in).
# Usage: bash infra/prefect-server.sh [PORT]        (default port 4200; UI at http://127.0.0.1:PORT)
# Then, in other shells: export PREFECT_API_URL=http://127.0.0.1:PORT/api; rlsift deploy; bash infra/worker.sh
# Stop workers before the server (a worker whose server is gone ignores SIGTERM; SIGINT stops it).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(mkdir -p "${RLSIFT_ROOT:-$REPO/rlsift-runs}" && cd "${RLSIFT_ROOT:-$REPO/rlsift-runs}" && pwd)"
cd "$REPO"
PORT="${1:-${PREFECT_SERVER_PORT:-4200}}"
export PREFECT_HOME="${PREFECT_HOME:-$ROOT/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_API_HOST=127.0.0.1
# The UI asks /ui-settings where the API is: name this port there (not Prefect's default 4200, nor an
# API URL exported in this shell for another server).
export PREFECT_SERVER_API_PORT="$PORT"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
export PREFECT_SERVER_UI_API_URL="$PREFECT_API_URL"
mkdir -p "$PREFECT_HOME"
BIN="${RLSIFT_VENV:-$PWD/.venv}/bin"
echo "Prefect server: UI http://127.0.0.1:$PORT  API http://127.0.0.1:$PORT/api  state $PREFECT_HOME" >&2
echo "  export PREFECT_API_URL=http://127.0.0.1:$PORT/api" >&2
exec "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT"
