#!/usr/bin/env bash
# Every GPU check of rlsift in one call that keeps its limits: each part under its own budget, killed (with every
# process it started) a grace period after it, its output in $OUT/<part>.log (default ./gpu-check) and its verdict
# line appended to $OUT/verdicts.txt the moment it ends, so what was measured survives whatever comes after.
# Prepared and run on the CPU first (`CHECK_DEVICE=cpu bash infra/gpu-check.sh` runs each part's CPU twin at small
# shapes), so that a GPU call spends its time on what only a GPU shows. Budgets on one H200 (s; the CPU twin's on
# 2 cores in brackets), each about 1.25x the longest the part took on an H200 (2026-11-29 to 2026-12-04,
# docs/performance.md); the default list's limits sum to 535 s, 565 s with every part's grace, so one lent call of
# 10 minutes holds it, and $OUT holds 7 files (6 logs and verdicts.txt, whose first line names the card and the
# versions), what one call brings back:
#
#   attention  40 (60)  infra/attention-check.py: does the cuDNN SDPA backward return NaN at the training layout of
#                       earlier releases (explicit mask, padded length 64 mod 128), and is the mask-free layout clean?
#   update    135 (150) infra/gpu-bench.py at the shape users train (random Qwen2.5-1.5B, 64 prompts x 8 rollouts,
#                       completions to 1,024 tokens, 8,192-token micro-batches, bf16-mixed), full weights and LoRA,
#                       both with activation checkpointing: s / step, MFU on the tokens the passes computed (real,
#                       padded beside), peak against the memory check's estimate; each arm's row printed as it ends;
#                       an arm whose update is skipped fails and is bisected (one model, at most 30 s).
#   learning  145 (200) infra/learning-check.py: 6 steps at lr 3e-5 on a fixed batch (64 rows to 1,152 tokens),
#                       random weights and weights with Qwen2.5-like massive activations: loss and gradient norm each
#                       step, finite, the loss falling; bf16 against float32 gradients beside plain transformers'.
#   lora       60 (90)  infra/lora-speed.py --target 1.2: LoRA against full weights on the same batch (128 rows),
#                       steps interleaved; exit 1 below 1.2x.
#   lora_profile 70 (60) not in the default list (a call of its own: `bash infra/gpu-check.sh lora_profile`):
#                       infra/lora-speed.py --profile: where each arm's step goes, by op category and costliest ops,
#                       on one micro-batch of 8 rows (why LoRA was 0.88x full weights on the H200).
#   decode     80 (90)  infra/gpu_bench_generation.py: the decoder's first call at 256 rows, a profile of one decode
#                       step by part, and 512 rows x 256 new tokens against the card's floor.
#   pipeline   75 (240) infra/pipeline-check.py: `rlsift run -c conf/smoke.yaml model.device=cuda`, the tiny default
#                       end to end: its stages timed, held-out accuracy required to rise.
#   prefix    105 (150) not in the default list (a call of its own: `bash infra/gpu-check.sh prefix`): the update
#                       part's full-weights arm with each group's prompt computed once (train.shared_prefix=true,
#                       off on a GPU by default: on an H200 it was finite but 2.2x slower, its masked attention
#                       has no flash kernel): finite, s / step and peak against `update`'s.
#   default   180 (240) not in the default list (a call of its own: `bash infra/gpu-check.sh default`): the default
#                       `rlsift run` (conf/presets/auto.yaml: calibration, the plan's probe on the GPU, its choice,
#                       150 steps) end to end on cuda: the choice, its stages timed, held-out accuracy required to rise.
#
# Usage: bash infra/gpu-check.sh [PART ...]          (default: the parts above but lora_profile, prefix and default)
#   CHECK_DEVICE=cuda|cpu   (default cuda)    OUT=./gpu-check    PY=python3    GRACE=5 (s between SIGTERM and SIGKILL)
#   RUNS=DIR                the pipeline's run root (default $OUT/runs; elsewhere, $OUT holds only the logs and verdicts)
#   LIMIT_<part>=S          a part's limit in seconds instead of its budget
#   CHECK_HANG=<part>       that part hangs on purpose (ignores SIGTERM, leaves a child in a session of its own):
#                           the check of the limits themselves (tests/test_gpu_check.py)
# Exit status: 0 when every part passed, else 1. On the offline GPU host, pack the pure-Python packages first
# (../shared/tools/gpu-bundle.sh writes .gpu/site.tar.xz): this script unpacks it when it is there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-./gpu-check}
DEVICE=${CHECK_DEVICE:-cuda}
GRACE=${GRACE:-5}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ] && [ -f .gpu/site.tar.xz ]; then  # the GPU host's packages (the CPU twin uses its venv)
  [ -d /tmp/rlsift-site ] || { mkdir -p /tmp/rlsift-site && tar -xJf .gpu/site.tar.xz -C /tmp/rlsift-site; }
  export PYTHONPATH=/tmp/rlsift-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PREFECT_UI_ENABLED=false PREFECT_HOME=${PREFECT_HOME:-/tmp/rlsift-prefect} \
  HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(attention update learning lora decode pipeline)

declare -A BUDGET
if [ "$DEVICE" = cuda ]; then
  BUDGET=([attention]=40 [update]=135 [learning]=145 [lora]=60 [lora_profile]=70 [decode]=80 [pipeline]=75
          [prefix]=105 [default]=180)
  CARD="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader); "
  ATTENTION=()
  UPDATE=(--no-generation --models 1.5b --modes full+ckpt lora+ckpt --rows 512 --bisect-seconds 30)
  PREFIX=(--no-generation --models 1.5b --modes full+ckpt --rows 512 --bisect-seconds 30 --shared-prefix)
  LEARNING=()
  LORA=(--rows 128 --target 1.2)
  LORA_PROFILE=(--profile --rows 8 --micro-batch-tokens 16384 --top 12)
  DECODE=()
  PIPELINE=(--device cuda)
  DEFAULT=(--device cuda --config conf/presets/auto.yaml)
else
  BUDGET=([attention]=60 [update]=150 [learning]=200 [lora]=90 [lora_profile]=60 [decode]=90 [pipeline]=240
          [prefix]=150 [default]=240)
  ATTENTION=(--toy)
  UPDATE=(--toy --no-generation --modes full+ckpt lora+ckpt --rows 16 --bisect-seconds 30)
  PREFIX=(--toy --no-generation --modes full+ckpt --rows 16 --bisect-seconds 30 --shared-prefix)
  LEARNING=(--toy --rows 8 --compare-rows 8 --steps 5)
  LORA=(--model toy --rows 8 --completion 64 --micro-batch-tokens 1024)
  LORA_PROFILE=(--model toy --profile --rows 8 --completion 64 --micro-batch-tokens 4096 --top 8)
  DECODE=(--rows 4 8 --new 4)
  PIPELINE=(--device cpu train.steps=8 eval.every=4 eval.limit=100)
  DEFAULT=(--device cpu --config conf/presets/auto.yaml train.steps=8 eval.every=4 eval.limit=100)
fi
VERSIONS=$("$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" 2>&1 | tail -n 1)

# A part that hangs on purpose: it ignores SIGTERM (as Prefect's events client did, retrying a closed server) and
# leaves a child in a session of its own, which no process-group signal reaches.
HANG='import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(86400)"], start_new_session=True)
print("hanging on purpose", flush=True)
time.sleep(86400)'

reap() {  # TAG PGID: SIGKILL every process whose environment still carries the part's tag; prints how many of them
          # had left the part's process group PGID (the strays). A member of the group that the group's SIGKILL has
          # reached but that has not finished exiting still shows its tag for a moment: it is killed, not counted.
  local pids p stat pgrp strays=0
  pids=$(grep -lsz "^RLSIFT_CHECK_TAG=$1\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | grep -vx "$$")
  for p in $pids; do
    stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue  # gone since: it was exiting
    read -r _ _ pgrp _ <<<"${stat##*) }"                  # after the command name: state, parent, group
    [ "$pgrp" != "$2" ] && strays=$((strays + 1))
  done
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  echo "$strays"
}

CURRENT=""
stop_current() {  # on Ctrl-C or SIGTERM of the check: the running part's group and its tagged processes go too
  [ -n "$CURRENT" ] && { kill -KILL -- "-${CURRENT%%:*}" 2>/dev/null
                         reap "${CURRENT#*:}" "${CURRENT%%:*}" >/dev/null; }
  echo "gpu-check: interrupted" | tee -a "$OUT/verdicts.txt"
  exit 130
}
trap stop_current INT TERM

FAILED=0
run_part() {  # NAME COMMAND...: the command under the part's limit, in a session of its own (timeout signals its
              # group), SIGKILL GRACE s after SIGTERM, then whatever still carries its tag; the verdict line at once
  local name=$1
  shift
  local var="LIMIT_$name"
  local limit=${!var:-${BUDGET[$name]}}
  local log="$OUT/$name.log" tag="rlsift-check-$$-$name"
  [ "${CHECK_HANG:-}" = "$name" ] && set -- "$PY" -c "$HANG"
  echo "== $name (budget ${limit} s, killed ${GRACE} s after): $*"
  local t0=$SECONDS
  RLSIFT_CHECK_TAG=$tag setsid -w timeout -k "$GRACE" "$limit" "$@" >"$log" 2>&1 </dev/null &
  local pid=$!
  CURRENT="$pid:$tag"
  tail -n +1 -f --pid="$pid" "$log" 2>/dev/null &
  local tailer=$!
  wait "$pid" 2>/dev/null
  local rc=$?
  kill -KILL -- "-$pid" 2>/dev/null  # the part's group: what timeout's signals reached, should any remain
  local stray
  stray=$(reap "$tag" "$pid")
  CURRENT=""
  wait "$tailer" 2>/dev/null
  local took=$((SECONDS - t0)) status
  case $rc in
    0) status="ok" ;;
    124 | 137) status="KILLED at its limit" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -ne 0 ] && FAILED=1
  local said
  said=$(grep -a '^verdict:' "$log" | tail -n 1 | sed 's/^verdict: *//')
  [ -z "$said" ] && said=$(grep -av '^\s*$' "$log" | tail -n 1 | cut -c1-300)
  local line="$name: $status in ${took} s of ${limit} s"
  [ "$stray" -gt 0 ] && line+=" ($stray stray process$([ "$stray" -gt 1 ] && echo es) killed)"
  echo "$line: $said" | tee -a "$OUT/verdicts.txt"
}

echo "== gpu-check on $DEVICE, $(date -u +%FT%TZ): ${CARD:-}$VERSIONS" | tee -a "$OUT/verdicts.txt"
for part in "${PARTS[@]}"; do
  case $part in
    attention) run_part attention "$PY" infra/attention-check.py "${ATTENTION[@]}" ;;
    update) run_part update "$PY" infra/gpu-bench.py "${UPDATE[@]}" ;;
    learning) run_part learning "$PY" infra/learning-check.py "${LEARNING[@]}" ;;
    lora) run_part lora "$PY" infra/lora-speed.py "${LORA[@]}" ;;
    lora_profile) run_part lora_profile "$PY" infra/lora-speed.py "${LORA_PROFILE[@]}" ;;
    decode) run_part decode "$PY" infra/gpu_bench_generation.py "${DECODE[@]}" ;;
    pipeline) run_part pipeline "$PY" infra/pipeline-check.py --root "${RUNS:-$OUT/runs}" "${PIPELINE[@]}" ;;
    prefix) run_part prefix "$PY" infra/gpu-bench.py "${PREFIX[@]}" ;;
    default) run_part default "$PY" infra/pipeline-check.py --root "${RUNS:-$OUT/runs}" "${DEFAULT[@]}" ;;
    *) echo "unknown part $part (attention, update, learning, lora, lora_profile, decode, pipeline, prefix," \
            "default)" >&2
       exit 2 ;;
  esac
done
exit $FAILED
