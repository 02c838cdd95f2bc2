"""The GPU check: rlsift's own update on random-weight models of real shapes, one table.

For each model shape (Qwen2.5-0.5B, 1.5B and 7B's configs, built with random weights: nothing is downloaded), full
weights and LoRA (rank 16 on every linear layer), with and without activation checkpointing, and three step sizes,
it runs ``tasks.update.policy_update.policy_update`` (every check it does: the micro-batches, the chunked LM head, the
NaN guard, the mismatch metrics) on a batch of groups of 8 rollouts of 128 prompt and 1,024 completion tokens, and
prints one row an arm: the step's tokens, its micro-batches, seconds a step, tokens a second, model-FLOPs
utilisation and the peak memory measured against tasks/update/fit.py's estimate.

- Model FLOPs: 6 N a token with full weights (forward 2N, backward 4N), 4 N under LoRA (the frozen weights get no
  gradient), N the parameters; attention's own FLOPs and checkpointing's recompute are not counted (the usual MFU
  convention). The peak is the card's dense bf16 rate (``--peak-tflops``; H100 SXM 989, H200 989).
- Peak memory: ``torch.cuda.max_memory_allocated`` over the timed step (on a CPU the process's peak resident set,
  ``VmHWM``, reset per arm where Linux allows it: the interpreter and libraries included, about 0.6 GiB).
- One warm-up step, then ``--steps`` timed steps; an arm that runs out of memory says so and the others go on.

Then the generation half (infra/gpu_bench_generation.py) on the first model: the in-process sampler against
transformers' ``generate`` and the card's floor, the bf16 sampler/trainer mismatch, and the one-GPU overlap.

It imports only torch, transformers, peft, pydantic and numpy (and rlsift's modules that need no more), so it runs
on a machine where the rest of the stack is not installed. Meant to take under 8 minutes on one H100 with the
defaults (not yet run on a GPU).

Usage:
    python infra/gpu-bench.py                      # on a GPU: the full table
    python infra/gpu-bench.py --toy                # tiny shapes on the CPU (what the default test tier runs)
    python infra/gpu-bench.py --models 1.5b --rows 512 --modes full+ckpt   # one arm: 64 prompts x 8 rollouts
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from rlcore.types import RolloutGroup  # noqa: E402
from tasks.config import LoraConfig  # noqa: E402
from tasks.model.lora import apply_lora, base_model, trainable_parameters  # noqa: E402
from tasks.records.memory import own_peak_mb, reset_own_peak  # noqa: E402
from tasks.update.fit import ModelShape, estimate  # noqa: E402
from tasks.update.policy_update import gradient_checkpointing, policy_update  # noqa: E402

#: Qwen2.5 configs (their config.json): hidden, MLP width, layers, heads, key-value heads, tied embeddings.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151_936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True, vocab_size=151_936),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False, vocab_size=152_064),
    # CPU shapes, with a vocabulary large enough that the logits matter: the default tier's check, and the
    # memory measurement of docs/performance.md
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=32_000),
    "cpu": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, vocab_size=32_000),
}
MODES = ("full", "full+ckpt", "lora", "lora+ckpt")
GROUP = 8  # rollouts a prompt


@dataclass(frozen=True)
class Arm:
    model: str
    mode: str
    rows: int


def build(name: str, mode: str, device: torch.device, dtype: torch.dtype):
    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=4096, rope_theta=1e6, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    if mode.startswith("lora"):
        model = apply_lora(model, LoraConfig(enabled=True, rank=16, alpha=32.0), seed=0)
    gradient_checkpointing(base_model(model), mode.endswith("+ckpt"))
    return model, cfg


def batch(rows: int, prompt: int, completion: int, vocab: int) -> list[RolloutGroup]:
    """``rows / 8`` groups of 8 rollouts, rewards half right so every row carries a gradient."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0] * (GROUP // 2))
    return [RolloutGroup(prompt_id=f"p{k}", prompt_ids=torch.randint(4, vocab, (prompt,), generator=g),
                         completion_ids=torch.randint(4, vocab, (GROUP, completion), generator=g),
                         completion_mask=torch.ones(GROUP, completion, dtype=torch.bool), rewards=rewards,
                         advantages=rewards - rewards.mean(), behaviour_logp=torch.zeros(0), success_rate=0.5,
                         n_generated=GROUP, step=0) for k in range(max(rows // GROUP, 1))]


def run_arm(arm: Arm, args, device: torch.device, dtype: torch.dtype) -> dict:
    model, cfg = build(arm.model, arm.mode, device, dtype)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=device.type == "cuda")
    groups = batch(arm.rows, args.prompt, args.completion, cfg.vocab_size)
    tokens = sum(g.size * (g.prompt_ids.numel() + g.completion_ids.shape[1]) for g in groups)
    settings = dict(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0, minibatches=1,
                    kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens, skip_zero_advantage=True, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    shape = ModelShape.of(model, cfg)
    est = estimate(shape, tokens=args.micro_batch_tokens or tokens, checkpointing=arm.mode.endswith("+ckpt"),
                   reference_copy=False, generator_copy=False)
    row = {"arm": arm, "tokens": tokens, "estimate_gib": est.total / 2**30}
    try:
        stats = policy_update(model, optimizer, groups, **settings)  # warm-up (and the optimizer's state)
        sync(device)
        reset_own_peak(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            stats = policy_update(model, optimizer, groups, **settings)
        sync(device)
        step_s = (time.perf_counter() - t0) / args.steps
    except torch.OutOfMemoryError:
        row["oom"] = True
        return row
    finally:
        del model, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not all(math.isfinite(v) for v in stats.values()):
        raise RuntimeError(f"{arm}: non-finite metrics {stats}")
    flops_per_token = (6 if arm.mode.startswith("full") else 4) * n_params
    row.update(micro=int(stats["train/micro_batches"]), step_s=step_s, tokens_per_s=tokens / step_s,
               mfu=flops_per_token * tokens / step_s / (args.peak_tflops * 1e12) if args.peak_tflops else float("nan"),
               peak_gib=own_peak_mb(device) / 1024)
    return row


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict], device_name: str) -> str:
    out = [f"update on {device_name}: policy_update, groups of {GROUP} rollouts",
           "| model | weights | rows | tokens a step | micro-batches | s / step | tokens / s | MFU | peak GiB | "
           "estimate GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["arm"]
        if r.get("oom"):
            out.append(f"| {a.model} | {a.mode} | {a.rows} | {r['tokens']:,} | | out of memory | | | | "
                       f"{r['estimate_gib']:.1f} |")
            continue
        mfu = "" if math.isnan(r["mfu"]) else f"{r['mfu']:.1%}"
        out.append(f"| {a.model} | {a.mode} | {a.rows} | {r['tokens']:,} | {r['micro']} | {r['step_s']:.2f} | "
                   f"{r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {r['estimate_gib']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (the default test tier's check)")
    p.add_argument("--models", nargs="+", default=None, help=f"from {', '.join(SHAPES)} (default 1.5b 7b)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rows", nargs="+", type=int, default=None, help="rollouts a step (default 16 64 512)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--completion", type=int, default=None, help="completion tokens (default 1024)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="train.micro_batch_tokens (default 8192)")
    p.add_argument("--steps", type=int, default=1, help="timed steps an arm (after one warm-up step)")
    p.add_argument("--no-generation", action="store_true", help="only the update's table")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 TFLOP/s (default: "
                   "989 on an H100/H200, none elsewhere)")
    args = p.parse_args(argv)
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    dtype = torch.float32 if toy else torch.bfloat16
    models = args.models or (["toy"] if toy else ["1.5b", "7b"])
    rows = args.rows or ([8, 32] if toy else [16, 64, 512])
    args.prompt = args.prompt or (16 if toy else 128)
    args.completion = args.completion or (48 if toy else 1024)
    args.micro_batch_tokens = args.micro_batch_tokens if args.micro_batch_tokens is not None else \
        (512 if toy else 8192)
    name = "CPU" if toy else torch.cuda.get_device_name(device)
    if args.peak_tflops is None and not toy and any(k in name for k in ("H100", "H200")):
        args.peak_tflops = 989.0
    if toy:
        torch.set_num_threads(2)
    arms = [Arm(m, mode, r) for m in models for mode in args.modes for r in rows
            if not (m == "7b" and (r > 64 or not mode.endswith("+ckpt")))]  # the 7B: what fits, in minutes
    results = []
    for i, arm in enumerate(arms, 1):
        print(f"[{i}/{len(arms)}] {arm.model} {arm.mode} {arm.rows} rows", file=sys.stderr, flush=True)
        results.append(run_arm(arm, args, device, dtype))
    print(table(results, f"{name}, torch {torch.__version__}, micro-batches of {args.micro_batch_tokens} tokens"))
    if not args.no_generation:
        generation(args, models[0], device, dtype, name)
    return 0


def generation(args, shape: str, device: torch.device, dtype: torch.dtype, name: str) -> None:
    """The sampler, the one-GPU overlap and the bf16 mismatch on ``shape`` (infra/gpu_bench_generation.py)."""
    import gpu_bench_generation as gen

    toy = device.type == "cpu"
    model, cfg = build(shape, "full", device, dtype)
    model.eval()
    rows, new = ([16, 32], 8) if toy else ([256, 512], 512)
    print(f"\nsampler on {name}: tasks.generation.decode against today's (infra/decode_reference.py), {shape}, "
          f"prompts of {gen.PROMPT} tokens")
    print("\n".join(gen.sampler_rows(model, rows, new, device, name)))
    print(f"\nsampler/trainer mismatch on {name} ({dtype}, the same weights)")
    print("\n".join(gen.mismatch_rows(model, rows[0], new, device)))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model, _ = build(shape, "full+ckpt", device, dtype)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-6)
    groups = batch(16 if toy else 64, args.prompt, args.completion, cfg.vocab_size)
    settings = dict(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0, minibatches=1,
                    kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens, device=device)
    policy_update(model, optimizer, groups, **settings)  # warm-up
    print(f"\noverlap on one {name}: the sampler in a second process beside full + checkpointing update steps")
    print("\n".join(gen.overlap_rows(SHAPES[shape], dtype, device, lambda: policy_update(model, optimizer, groups,
                                                                                         **settings),
                                      rows=rows[0], new=new if toy else 256, repeats=2 if toy else 3,
                                      steps=2 if toy else 4)))


if __name__ == "__main__":
    sys.exit(main())
