"""LoRA against full weights on the same batch: seconds a step, and where one micro-batch's time goes.

Both arms run rlsift's own update (``tasks.update.policy_update.policy_update``: the micro-batches, the chunked LM
head, the mixed-precision optimizer of ``tasks.update.precision.build_optimizer``) on infra/gpu-bench.py's model
shapes (random weights, nothing downloaded) and batches (groups of 8 rollouts of varied length), on one device,
both arms built first and alive together, their steps interleaved, so their ratio is the figure to read: LoRA
(rank 16 on every linear layer, the frozen base gets no weight gradient) should be faster than full weights by
about the FLOPs ratio, 6N / 4N a token without checkpointing (8N / 6N with it), less LoRA's own cost.

- Timing (default): one warm-up step an arm, then ``--steps`` timed steps; a row an arm and the ratio
  full / LoRA (``--target``: exit 1 when the ratio is below it, e.g. 1.3).
- ``--profile``: ``torch.profiler`` over one step of a single micro-batch (forward, backward, optimizer step) of
  each arm, self time summed by op category (matmuls, dtype casts, other elementwise, attention, the head's
  softmax, the optimizer's kernels, copies, the rest): where LoRA's extra time goes. On a GPU the device's
  self time, on a CPU the host's.

A skipped step (a non-finite gradient) fails its arm: no time is printed for an update that did not happen.

Usage:
    python infra/lora-speed.py                                     # on a GPU: 1.5B, 512 rows, bf16-mixed, ckpt
    python infra/lora-speed.py --model cpu --rows 16 --prompt 128 --completion 512 --micro-batch-tokens 2048
    python infra/lora-speed.py --model cpu --profile --rows 4 --completion 512   # the CPU profile
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402

from tasks.model.attention import guard_attention  # noqa: E402
from tasks.model.lora import trainable_parameters  # noqa: E402
from tasks.update.policy_update import LossSettings, policy_update  # noqa: E402
from tasks.update.precision import PRECISIONS, build_optimizer, resolve_precision  # noqa: E402


def _bench():
    """infra/gpu-bench.py (its shapes, model build and batches), loaded by path: its name has a hyphen."""
    spec = importlib.util.spec_from_file_location("gpu_bench", HERE / "gpu-bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bench = _bench()

#: Op-name fragments by category, first match wins (aten names; CUDA kernels are matched by their op's name).
CATEGORIES = (
    ("optimizer", ("adam", "_foreach_", "clip_grad", "norm.out", "_fused")),
    ("attention", ("attention", "sdpa", "flash", "efficient", "cudnn")),
    ("head softmax", ("log_softmax", "logsumexp", "softmax", "gather", "nll")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm",
                "gemm", "cutlass", "sm90", "sm80")),
    ("dtype casts", ("aten::to", "aten::_to_copy")),
    ("copies", ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::index", "aten::fill_",
                "aten::zero_", "aten::zeros", "aten::empty", "aten::t", "aten::transpose", "aten::view",
                "aten::reshape", "aten::expand", "aten::slice", "aten::select", "aten::permute", "aten::unsqueeze")),
    ("elementwise", ("aten::add", "aten::mul", "aten::sub", "aten::div", "aten::silu", "aten::neg", "aten::pow",
                     "aten::rsqrt", "aten::mean", "aten::sum", "aten::where", "aten::exp", "aten::sigmoid",
                     "aten::masked_fill", "aten::clamp", "aten::minimum", "aten::maximum", "aten::cos",
                     "aten::sin", "aten::threshold", "aten::embedding", "aten::dropout", "aten::bernoulli",
                     "elementwise", "vectorized", "reduce")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return "other"


def category_of(event) -> str:
    """An event's category: the optimizer's step and dtype casts (``aten::_to_copy`` and the copy inside it) by
    what encloses them, the rest by :func:`category` of its own name."""
    parent = event
    while parent is not None:
        name = parent.name
        if name.startswith("Optimizer.") or "clip_grad" in name:
            return "optimizer"
        if name in ("aten::_to_copy", "aten::to"):
            return "dtype casts"
        parent = parent.cpu_parent
    return category(event.name)


def settings(args) -> LossSettings:
    return LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0, minibatches=1,
                        kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens, skip_zero_advantage=True)


def arm(mode: str, args, device: torch.device, precision):
    """(model, optimizer, groups) of one arm (``full+ckpt``, ``lora``, ...)."""
    model, cfg = bench.build(args.model, mode, device, precision.compute)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-6)
    optimizer = build_optimizer(trainable_parameters(model), adamw, precision)
    groups = bench.batch(args.rows, args.prompt, args.completion, cfg.vocab_size)
    return model, optimizer, groups


def step(model, optimizer, groups, args, device) -> dict:
    stats = policy_update(model, optimizer, groups, settings(args), device=device).metrics
    if stats["train/skipped_updates"] or not all(math.isfinite(v) for v in stats.values()):
        raise RuntimeError(f"the step was skipped (non-finite loss or gradient): {stats}")
    return stats


class Arm:
    """One arm built once (model, optimizer, batch) and warmed up: the first backward allocates, AdamW makes its
    state."""

    def __init__(self, mode: str, args, device: torch.device, precision):
        self.mode, self.args, self.device = mode, args, device
        self.model, self.optimizer, self.groups = arm(mode, args, device, precision)
        self.stats = step(self.model, self.optimizer, self.groups, args, device)
        bench.sync(device)

    def timed(self) -> float:
        """Seconds of one step."""
        t0 = time.perf_counter()
        self.stats = step(self.model, self.optimizer, self.groups, self.args, self.device)
        bench.sync(self.device)
        return time.perf_counter() - t0

    def profiled(self) -> dict[str, float]:
        """Milliseconds of self time by category over one step, and ``total``."""
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            self.stats = step(self.model, self.optimizer, self.groups, self.args, self.device)
            bench.sync(self.device)
        if self.stats["train/micro_batches"] != 1:
            raise SystemExit(f"--profile wants one micro-batch: {int(self.stats['train/micro_batches'])} here; "
                             "raise --micro-batch-tokens or lower --rows")
        out: dict[str, float] = defaultdict(float)
        ops: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            ms = (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / 1e3
            cat = category_of(ev)
            out[cat] += ms
            ops[f"{cat}: {ev.name}"] += ms
        out["total"] = sum(out.values())
        self.top = sorted(ops.items(), key=lambda kv: -kv[1])
        return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"from {', '.join(bench.SHAPES)} (default 1.5b on a GPU, cpu else)")
    p.add_argument("--modes", nargs=2, default=None, help="the two arms (default full+ckpt lora+ckpt)")
    p.add_argument("--precision", default=None, choices=[n for n in PRECISIONS if n != "auto"],
                   help="model.precision (default bf16-mixed)")
    p.add_argument("--rows", type=int, default=None, help="rollouts a step (default 512 on a GPU, 16 else)")
    p.add_argument("--prompt", type=int, default=128, help="longest prompt, tokens")
    p.add_argument("--completion", type=int, default=None, help="longest completion (default 1024 on a GPU)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 8192 on a GPU, 4096 else")
    p.add_argument("--steps", type=int, default=2, help="timed steps an arm, interleaved (the fastest counts)")
    p.add_argument("--repeat", type=int, default=3, help="with --profile: profiled steps an arm (the fastest)")
    p.add_argument("--profile", action="store_true", help="op categories of one micro-batch's step instead")
    p.add_argument("--top", type=int, default=0, help="with --profile: also print each arm's costliest ops")
    p.add_argument("--target", type=float, default=None, help="exit 1 when full / LoRA seconds is below it")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    print(guard_attention(device).line())  # the run's kernel choice: cuDNN SDPA off on CUDA
    args.model = args.model or ("1.5b" if gpu else "cpu")
    args.rows = args.rows or (512 if gpu else 16)
    args.completion = args.completion or (1024 if gpu else 512)
    args.micro_batch_tokens = args.micro_batch_tokens or (8192 if gpu else 4096)
    modes = args.modes or ["full+ckpt", "lora+ckpt"]
    precision = resolve_precision(args.precision or "bf16-mixed", device)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU ({torch.get_num_threads()} threads)"
    head = (f"{name}, torch {torch.__version__}, {args.model}, {precision.name}, {args.rows} rows, prompts to "
            f"{args.prompt} and completions to {args.completion} tokens, micro-batches of {args.micro_batch_tokens}")
    arms = [Arm(m, args, device, precision) for m in modes]  # both alive: their steps interleave
    if args.profile:
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.repeat):
            for a in arms:
                got = a.profiled()
                if a.mode not in best or got["total"] < best[a.mode]["total"]:
                    best[a.mode] = got
        cats = [c for c, _ in CATEGORIES] + ["other", "total"]
        print(f"ms of self time by op category, one step of one micro-batch (the fastest of {args.repeat}): {head}")
        print("| category | " + " | ".join(modes) + " |")
        print("|---" * (len(modes) + 1) + "|")
        for c in cats:
            print(f"| {c} | " + " | ".join(f"{best[m].get(c, 0.0):.1f}" for m in modes) + " |")
        for a in arms[:len(arms) if args.top else 0]:
            print(f"{a.mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in a.top[:args.top]))
        first, second = (best[m] for m in modes)
        excess = sorted(((second.get(c, 0.0) - first.get(c, 0.0), c) for c in cats[:-1]), reverse=True)[:2]
        print(f"verdict: {modes[0]} {first['total']:.1f} ms, {modes[1]} {second['total']:.1f} ms a micro-batch's step "
              f"({first['total'] / second['total']:.2f}x); {modes[1]}'s largest excess: "
              + ", ".join(f"{c} {d:+.1f} ms" for d, c in excess))
        return 0
    seconds = {m: math.inf for m in modes}
    for _ in range(args.steps):
        for a in arms:
            seconds[a.mode] = min(seconds[a.mode], a.timed())
    print(f"one step an arm (the fastest of {args.steps}): {head}")
    print("| weights | tokens a step | micro-batches | s / step | tokens / s |")
    print("|---|---|---|---|---|")
    for a in arms:
        tokens = a.stats["train/update_tokens"]
        print(f"| {a.mode} | {tokens:,.0f} | {int(a.stats['train/micro_batches'])} | {seconds[a.mode]:.3f} | "
              f"{tokens / seconds[a.mode]:,.0f} |")
    ratio = seconds[modes[0]] / seconds[modes[1]]
    below = args.target is not None and ratio < args.target
    print(f"verdict: {'FAILS: ' if below else ''}{modes[0]} / {modes[1]} seconds a step: {ratio:.2f}x" +
          (f" ({'below' if below else 'at least'} the target {args.target:.2f}x)" if args.target is not None else ""))
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
