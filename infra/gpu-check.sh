#!/usr/bin/env bash
# Every GPU check of the update and the decoder in one call, each part under its own time limit, its output in
# $OUT (default ./gpu-check) and a one-line verdict per part at the end. Prepared and run on the CPU first
# (`CHECK_DEVICE=cpu bash infra/gpu-check.sh` runs each part's CPU twin), so that a GPU call spends its time on
# what only a GPU shows:
#
#   attention   infra/attention-check.py: does the cuDNN SDPA backward return NaN at the training layout of
#               earlier releases (explicit mask, padded length 64 mod 128), and is the mask-free layout clean?
#   update      infra/gpu-bench.py at the shape users train (random Qwen2.5-1.5B, 64 prompts x 8 rollouts,
#               completions to 1,024 tokens, 8,192-token micro-batches, bf16-mixed), full weights and LoRA, both
#               with activation checkpointing: s / step, MFU, peak against the memory check's estimate; an arm
#               whose update is skipped fails and is bisected by itself.
#   lora        infra/lora-speed.py --target 1.3: LoRA against full weights on the same batch, steps interleaved.
#   decode      infra/gpu_bench_generation.py: the decoder's first call at 256 rows, a profile of one decode step
#               by part, and 512 rows x 256 new tokens against the card's floor.
#   smoke       `flows.cli run -c conf/smoke.yaml model.device=cuda`: the tiny default's stages, timed.
#
# Usage: bash infra/gpu-check.sh [PART ...]          (default: every part, in the order above)
#   CHECK_DEVICE=cuda|cpu   (default cuda)       OUT=./gpu-check       PY=python3
# On the offline GPU host, pack the pure-Python packages first (../shared/tools/gpu-bundle.sh writes
# .gpu/site.tar.xz): this script unpacks it when it is there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-./gpu-check}
DEVICE=${CHECK_DEVICE:-cuda}
mkdir -p "$OUT"
if [ -f .gpu/site.tar.xz ] && [ ! -d /tmp/rlsift-site ]; then
  mkdir -p /tmp/rlsift-site && tar -xJf .gpu/site.tar.xz -C /tmp/rlsift-site
fi
[ -d /tmp/rlsift-site ] && export PYTHONPATH=/tmp/rlsift-site:${PYTHONPATH:-}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PREFECT_UI_ENABLED=false PREFECT_HOME=${PREFECT_HOME:-/tmp/rlsift-prefect} \
  HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(attention update lora decode smoke)

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
  TOY=()
  UPDATE=(--no-generation --models 1.5b --modes full+ckpt lora+ckpt --rows 512)
  LORA=(--target 1.3)
  SMOKE=(model.device=cuda)
else
  TOY=(--toy)
  UPDATE=(--toy --no-generation)
  LORA=(--model cpu --rows 8 --completion 256 --micro-batch-tokens 4096)
  SMOKE=(train.steps=4 eval.every=2)
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" | tee -a "$OUT/card.txt"

declare -A VERDICT
run_part() {  # NAME LIMIT_S COMMAND...: the command's output in $OUT/NAME.log, its exit status as the verdict
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  VERDICT[$name]="exit $rc in $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (timed out)')"
}

for part in "${PARTS[@]}"; do
  case $part in
    attention) run_part attention 120 "$PY" infra/attention-check.py "${TOY[@]}" ;;
    update) run_part update 240 "$PY" infra/gpu-bench.py "${UPDATE[@]}" ;;
    lora) run_part lora 180 "$PY" infra/lora-speed.py "${LORA[@]}" ;;
    decode) run_part decode 180 "$PY" infra/gpu_bench_generation.py ;;
    smoke) run_part smoke 120 "$PY" -m flows.cli run -c conf/smoke.yaml paths.root="$OUT/runs" "${SMOKE[@]}" ;;
    *) echo "unknown part $part (attention, update, lora, decode, smoke)" >&2; exit 2 ;;
  esac
done
echo "== verdicts ($DEVICE)"
for part in "${PARTS[@]}"; do echo "$part: ${VERDICT[$part]}"; done | tee "$OUT/verdicts.txt"
