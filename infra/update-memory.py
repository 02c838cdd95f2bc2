"""Memory and time of one update, full weights against LoRA (``model.lora``), with and without activation
checkpointing (``train.gradient_checkpointing``): a table.

The model is a randomly initialised Qwen2 of hidden 256, 8 layers, 4 heads (2 key-value heads), MLP 1024, a
400-token vocabulary with tied embeddings (the tiny Qwen2 of tests/tiny_qwen.py, deeper and wider), on 16 rows of
32 prompt + 512 completion tokens, CPU float32, 2 threads. Each arm runs in its own process (so the peak resident
set is its own): 1 warm-up step, then 3 timed steps of the real update (``tasks.update.policy_update.policy_update``:
forward, backward, AdamW), LoRA rank 16 / alpha 32 on every linear layer.

Columns: trainable parameters; AdamW's state after the steps (bytes of its tensors, measured); the process's peak
resident set during the timed steps, and that peak above its size when they started (what the step itself
allocates: activations, gradients); seconds a step.

Usage: .venv/bin/python infra/update-memory.py [--hidden 256] [--layers 8]   (every arm, one after the other)
       .venv/bin/python infra/update-memory.py ARM                          (full, full+ckpt, lora or lora+ckpt)
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("full", "full+ckpt", "lora", "lora+ckpt")


def rss_peak_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def one(arm: str, hidden: int, layers: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcore.types import RolloutGroup
    from tasks.config import LoraConfig
    from tasks.model.attention import guard_attention
    from tasks.model.lora import apply_lora, base_model, trainable_parameters
    from tasks.update.policy_update import gradient_checkpointing, policy_update
    from tasks.update.updater import LossSettings

    torch.set_num_threads(2)
    guard_attention("cpu")  # the run's kernel choice (nothing to turn off on a CPU)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=400, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, tie_word_embeddings=True))
    if arm.startswith("lora"):
        model = apply_lora(model, LoraConfig(enabled=True, rank=16, alpha=32.0), seed=0)
    gradient_checkpointing(base_model(model), arm.endswith("+ckpt"))
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    groups = []
    for k in range(4):  # 4 groups of 4 rollouts, rewards mixed so every row carries a gradient
        rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
        groups.append(RolloutGroup(prompt_id=f"p{k}", prompt_ids=torch.randint(4, 400, (32,), generator=g),
                                   completion_ids=torch.randint(4, 400, (4, 512), generator=g),
                                   completion_mask=torch.ones(4, 512, dtype=torch.bool), rewards=rewards,
                                   advantages=rewards - rewards.mean(), behaviour_logp=torch.zeros(0),
                                   success_rate=0.5, n_generated=4, step=0))
    settings = LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0,
                            minibatches=1, kl_coef=0.0)
    policy_update(model, optimizer, groups, settings)  # warm-up: allocates what later steps reuse
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_peak_mib()
    t0 = time.perf_counter()
    for _ in range(3):
        policy_update(model, optimizer, groups, settings)
    step_s = (time.perf_counter() - t0) / 3
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    peak = rss_peak_mib()
    return {"arm": arm, "trainable": sum(p.numel() for p in params), "optimizer_mib": state / 2**20,
            "peak_mib": peak, "step_peak_mib": peak - before, "step_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arm", nargs="?", choices=ARMS, help="one arm (default: every arm, each in its own process)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (the MLP is 4x)")
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    if args.arm:
        print(json.dumps(one(args.arm, args.hidden, args.layers)))  # noqa: T201 - read by the parent
        return
    rows = []
    for arm in ARMS:
        out = subprocess.run([sys.executable, __file__, arm, f"--hidden={args.hidden}", f"--layers={args.layers}"],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print("| arm | trainable parameters | AdamW state | peak resident set | of which the step | s a step |")  # noqa: T201
    print("|---|---|---|---|---|---|")  # noqa: T201
    for r in rows:
        print(f"| {r['arm']} | {r['trainable']:,} ({r['trainable'] / full['trainable']:.1%}) | "  # noqa: T201
              f"{r['optimizer_mib']:.2f} MiB ({r['optimizer_mib'] / full['optimizer_mib']:.1%}) | "
              f"{r['peak_mib']:.0f} MiB | {r['step_peak_mib']:.0f} MiB | {r['step_s']:.2f} |")


if __name__ == "__main__":
    main()
