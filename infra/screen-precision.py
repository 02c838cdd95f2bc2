"""The likelihood screen's pass in each ``select.screen_precision``: its seconds over a step's candidates and how far
its log q moves from the float32 pass, arms interleaved in one process on one torch thread (as the screen runs
beside the update on the 2-core machine). A third arm, ``torch.autocast`` to bf16 around the float32 model, is the
way not taken (docs/performance.md, "The screen's pass in bf16").

The policy is the embedded default's (``model.*`` defaults: the warm-started tiny Llama, trained and cached under
``paths.cache`` on first use). Run it on an idle machine:

    PYTHONPATH=. .venv/bin/python infra/screen-precision.py    # 48 candidates (grpo_prescreen's), 10 repeats
    PYTHONPATH=. .venv/bin/python infra/screen-precision.py --candidates 96 --mix balanced
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from tasks.data import arith  # noqa: E402
from tasks.model.bf16_copy import native_bf16  # noqa: E402
from tasks.selection.screen import policy_likelihood  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", type=int, default=48, help="candidates a pass (default 48)")
    p.add_argument("--repeats", type=int, default=10, help="passes of each arm (default 10)")
    p.add_argument("--mix", default="default", help="the bundled task's level mix (default: default)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.temperature=0.7")
    args = p.parse_args(argv)
    from tasks.config.load import load_config
    from tasks.generation.rollout import HFEngine
    from tasks.model.attention import guard_attention
    from tasks.model.loading import load_policy
    from tasks.model.source import policy_source
    from tasks.policy import Policy

    torch.set_num_threads(1)
    cfg = load_config(None, args.overrides)
    model, tok = load_policy(policy_source(cfg))
    guard_attention(next(model.parameters()).device)  # the run's kernel choice (cuDNN SDPA off on CUDA)
    policy = Policy(model=model, tokenizer=tok, engine=HFEngine.from_config(model, tok, cfg.rollout, "cpu"))
    rc = cfg.rollout
    kw = dict(temperature=rc.temperature, max_new_tokens=rc.max_new_tokens, micro_batch_tokens=0)
    fp32 = policy_likelihood(policy, **kw, precision="model")
    bf16 = policy_likelihood(policy, **kw, precision="bf16")

    def autocast(records):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fp32(records)

    arms = {"model (float32)": fp32, "bf16 copy": bf16, "autocast to bf16": autocast}
    c = args.candidates
    records = arith.generate(cfg.seed, c * (args.repeats + 1), "train", args.mix, unique=False)
    for fn in arms.values():  # warm-up, not timed
        fn(records[:c])
    secs: dict[str, list[float]] = {name: [] for name in arms}
    moved: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.repeats):
        batch = records[(rep + 1) * c:(rep + 2) * c]
        logq = {}
        for name in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
            t0 = time.perf_counter()
            logq[name] = arms[name](batch).log()
            secs[name].append(time.perf_counter() - t0)
        for name in arms:
            fin = torch.isfinite(logq[name]) & torch.isfinite(logq["model (float32)"])
            moved[name].append(float((logq[name] - logq["model (float32)"])[fin].abs().max()))
    print(f"{c} candidates of the {args.mix} mix, {args.repeats} repeats, 1 thread; native bf16 matrix "
          f"products: {native_bf16()}")
    print("| pass | median s | min | max | / float32's | largest change in log q (nats) |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(secs["model (float32)"])
    for name, xs in secs.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.4f} | {min(xs):.4f} | {max(xs):.4f} | {med / base:.2f}x | {max(moved[name]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
