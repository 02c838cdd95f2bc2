#!/usr/bin/env bash
# Create .venv with the pinned dependency set (CPU torch via the constraints file) and install rlsift.
# Idempotent: a second call only checks. Usage: bash infra/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1  # no cache: a clean machine may have little disk
# bubblewrap isolates sandboxed code (tasks/data/sandbox.py; README "Code rewards"): Debian's package, where we can.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; } >/dev/null 2>&1 \
      || echo "warning: could not install bubblewrap; code rewards run without OS isolation" >&2
  else
    echo "note: install bubblewrap (Debian: sudo apt-get install bubblewrap) to isolate code rewards" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import torch; assert torch.version.cuda is None or torch.cuda.is_available(), 'CUDA torch on a CPU machine'"
