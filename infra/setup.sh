#!/usr/bin/env bash
# Create .venv with the pinned dependency set (CPU torch via the constraints file) and install rlsift.
# Idempotent: a second call only checks. Usage: bash infra/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONSTRAINT="$PWD/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import torch; assert torch.version.cuda is None or torch.cuda.is_available(), 'CUDA torch on a CPU machine'"
