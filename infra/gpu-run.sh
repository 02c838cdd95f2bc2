#!/usr/bin/env bash
# The pipeline on a CUDA GPU, then a short benchmark of the two hot loops, printing rollout tokens/s,
# update step time and peak GPU memory (torch.cuda.max_memory_allocated).
#
# Usage: bash infra/gpu-run.sh [CONFIG] [dotted overrides...]          (default CONFIG: conf/smoke.yaml)
#   DEVICE=cuda|cpu     where to run (default cuda; cpu only to check the script itself)
#   PRECISION=auto|bf16-mixed|fp32|bf16-true   model.precision (auto: bf16-mixed on a GPU with bf16)
#   NPROC=N             also run the training with torchrun over N GPUs, BACKEND (default fsdp2)
#   BENCH_PROMPTS=64 BENCH_N=8 BENCH_TOKENS=128 BENCH_STEPS=3   benchmark sizes
#   ROOT=./rlsift-runs/gpu   run root (ledger, MLflow store, runs)
# Needs the CUDA build of torch 2.13.0 in .venv (on a GPU host `bash infra/setup.sh` installs it from PyPI;
# the constraints file pins the version, not the build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
PRECISION=${PRECISION:-auto}
ROOT=${ROOT:-./rlsift-runs/gpu}
CONFIG=${1:-conf/smoke.yaml}
[ $# -gt 0 ] && shift
mkdir -p "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false

if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; torch.cuda.is_available() or sys.exit('torch ' + torch.__version__ + ' sees no GPU (CPU build?)'); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
fi

echo "== pipeline: $CONFIG on $DEVICE ($PRECISION)"
"$PY" -m flows.cli run -c "$CONFIG" model.device="$DEVICE" model.precision="$PRECISION" paths.root="$ROOT" "$@" --json \
  > "$ROOT/summary.json"
"$PY" - "$ROOT/summary.json" <<'EOF'
import json, statistics, sys
from pathlib import Path
s = json.loads(Path(sys.argv[1]).read_text())
rows = [json.loads(l) for l in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines() if l.strip()]
tps = [r["rollout/tokens_per_s"] for r in rows if "rollout/tokens_per_s" in r]
step = [r["time/step_s"] for r in rows if "time/step_s" in r]
print(f"run {s['run_id']} {s['status']} in {s['wall_s']:.0f} s, {s['steps']} steps; accuracy "
      f"{s['eval_accuracy_start']:.3f} -> {s['eval_accuracy_end']:.3f}")
if tps:
    print(f"pipeline: rollout {statistics.median(tps):,.0f} tokens/s (median), step {statistics.median(step):.2f} s")
EOF

if [ "${NPROC:-1}" -gt 1 ]; then
  echo "== sharded training: torchrun --nproc_per_node $NPROC, scale.backend=${BACKEND:-fsdp2}"
  "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" -m flows.train_dist -c "$CONFIG" \
    model.device="$DEVICE" model.precision="$PRECISION" paths.root="$ROOT" scale.backend="${BACKEND:-fsdp2}" "$@"
fi

echo "== benchmark: generate + policy update on the run's final model"
DEVICE="$DEVICE" PRECISION="$PRECISION" "$PY" - "$ROOT/summary.json" <<'EOF'
import json, os, sys, time
from pathlib import Path

import torch

from rlcore.advantages import group_advantages
from rlcore.types import RolloutGroup
from tasks.model.loading import format_prompt, load_policy
from tasks.generation.rollout import HFEngine
from tasks.model.attention import guard_attention
from tasks.run import resolve_device
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings
from tasks.update.precision import build_optimizer, resolve_precision

summary = json.loads(Path(sys.argv[1]).read_text())
device = resolve_device(os.environ["DEVICE"])
guard_attention(device)  # the run's kernel choice: cuDNN SDPA off on CUDA
precision = resolve_precision(os.environ["PRECISION"], device)
dtype = precision.compute
B, n, L, steps = (int(os.environ.get(k, d)) for k, d in
                  (("BENCH_PROMPTS", 64), ("BENCH_N", 8), ("BENCH_TOKENS", 128), ("BENCH_STEPS", 3)))
model, tok = load_policy(summary["model_path"], dtype=dtype, device=device)
cuda = device.type == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
engine = HFEngine(model, tok, max_new_tokens=L, temperature=1.0, top_p=1.0, top_k=0, chunk=B * n, device=device)
prompts = [format_prompt(tok, f"What is {i} + {2 * i + 1}?") for i in range(B)]
engine.generate(prompts[:2], n=2, seed=0)  # warm-up (kernels, allocator)
if cuda:
    torch.cuda.reset_peak_memory_stats()
sync(); t0 = time.perf_counter()
gen = engine.generate(prompts, n=n, seed=1)
sync(); t_gen = time.perf_counter() - t0
peak_gen = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

g = torch.Generator().manual_seed(0)
rewards = (torch.rand(B, n, generator=g) < 0.5).float()  # synthetic rewards: the update's cost does not
adv = group_advantages(rewards, scale_by_std=False)                          # depend on their values, only on the shapes
groups = [RolloutGroup(prompt_id=str(b), prompt_ids=gen.prompt_ids[b], completion_ids=gen.completion_ids[b*n:(b+1)*n],
                       completion_mask=gen.completion_mask[b*n:(b+1)*n], rewards=rewards[b], advantages=adv[b],
                       behaviour_logp=torch.zeros(0), success_rate=float(rewards[b].mean()), n_generated=n, step=0)
          for b in range(B)]
opt = build_optimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-6), precision)  # bf16-mixed: float32 masters
if cuda:
    torch.cuda.reset_peak_memory_stats()
times = []
for _ in range(steps):
    sync(); t0 = time.perf_counter()
    policy_update(model, opt, groups, LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0,
                                                   minibatches=1, kl_coef=0.0, pad_id=tok.pad_token_id), device=device)
    sync(); times.append(time.perf_counter() - t0)
peak_upd = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
gib = lambda x: "n/a on CPU" if x is None else f"{x:.2f} GiB"
result = {"device": str(device), "precision": precision.name, "dtype": str(dtype).removeprefix("torch."),
          "params_M": sum(p.numel() for p in model.parameters()) / 1e6, "prompts": B, "n": n,
          "rollout_tokens": gen.tokens, "rollout_tokens_per_s": gen.tokens / t_gen, "rollout_s": t_gen,
          "update_step_s": min(times), "update_tokens_per_s": gen.tokens / min(times),
          "peak_mem_rollout_GiB": peak_gen, "peak_mem_update_GiB": peak_upd}
print(f"rollout : {result['rollout_tokens']} tokens in {t_gen:.2f} s = {result['rollout_tokens_per_s']:,.0f} tokens/s, "
      f"peak {gib(peak_gen)}")
print(f"update  : {min(times):.3f} s/step (best of {steps}) = {result['update_tokens_per_s']:,.0f} tokens/s, "
      f"peak {gib(peak_upd)}")
print(json.dumps(result))
EOF
