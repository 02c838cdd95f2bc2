"""Rollout tokens a second of the embedded task's in-process sampler: today's decode loop (tasks/generation/decode.py)
against the one before it (infra/decode_reference.py), against itself with PyTorch's SDPA in the one-token steps
(``DecodeOptions.step_attention`` off; tasks/generation/step_attention.py), against itself with the model's own
forward in the steps (``DecodeOptions.step_forward`` off; tasks/generation/step_forward.py) and against itself with
every step attending over the cache's whole width (``DecodeOptions.width_multiple`` None), arms interleaved in one
process.

The policy is the embedded default's (``model.*`` defaults: the warm-started tiny Llama, trained and cached under
``paths.cache`` on first use, about 4 minutes), or with ``--random`` the same shape with random weights (rows then
rarely end early: not the embedded task's lengths). Each repeat draws ``train.prompts_per_step`` fresh prompts of
the default mix and generates ``rollout.n`` completions of each with both arms (the order alternating from repeat to
repeat), with the run's sampling settings (``rollout.*``). Printed: each arm's median tokens a second (generated
tokens, EOS included, over the call's seconds), its spread, and the ratio new / old.

Run it on an idle machine (timings under load mean nothing):

    PYTHONPATH=. .venv/bin/python infra/decode-bench.py                  # 10 repeats, 2 torch threads
    PYTHONPATH=. .venv/bin/python infra/decode-bench.py --random --repeats 1 --prompts 4   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from infra.decode_reference import generate_reference  # noqa: E402
from tasks.data import arith  # noqa: E402
from tasks.generation.decode import Decoder  # noqa: E402
from tasks.generation.decode_options import DecodeOptions  # noqa: E402
from tasks.generation.rollout import HFEngine  # noqa: E402
from tasks.model.attention import guard_attention  # noqa: E402
from tasks.model.loading import build_tiny_model, build_tokenizer, format_prompt, load_policy  # noqa: E402


def policy(cfg, random: bool):
    if random:
        tok = build_tokenizer()
        mc = cfg.model
        return build_tiny_model(hidden=mc.hidden, layers=mc.layers, heads=mc.heads, tokenizer=tok, seed=0), tok
    from tasks.model.source import policy_source

    return load_policy(policy_source(cfg))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10, help="calls of each arm (default 10)")
    p.add_argument("--prompts", type=int, default=None, help="prompts a call (default train.prompts_per_step)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--random", action="store_true", help="random weights instead of the warm start")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.max_new_tokens=96")
    args = p.parse_args(argv)
    from tasks.config.load import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(None, args.overrides)
    model, tok = policy(cfg, args.random)
    model.eval()
    guard_attention(next(model.parameters()).device)  # the run's kernel choice (cuDNN SDPA off on CUDA)
    rc = cfg.rollout
    engine = HFEngine(model, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                      top_k=rc.top_k, chunk=rc.chunk)
    sdpa = HFEngine(model, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                    top_k=rc.top_k, chunk=rc.chunk)
    sdpa.decoder = Decoder(model, replace(DecodeOptions.for_device("cpu"), step_attention=False))
    own = HFEngine(model, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                   top_k=rc.top_k, chunk=rc.chunk)
    own.decoder = Decoder(model, replace(DecodeOptions.for_device("cpu"), step_forward=False))
    whole = HFEngine(model, tok, max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                     top_k=rc.top_k, chunk=rc.chunk)
    whole.decoder = Decoder(model, replace(DecodeOptions.for_device("cpu"), width_multiple=None))
    arms = {"old": lambda prompts, seed: generate_reference(engine, prompts, rc.n, seed),
            "new, SDPA steps": lambda prompts, seed: sdpa.generate(prompts, rc.n, seed),
            "new, the model's forward in steps": lambda prompts, seed: own.generate(prompts, rc.n, seed),
            "new, attention over the whole width": lambda prompts, seed: whole.generate(prompts, rc.n, seed),
            "new": lambda prompts, seed: engine.generate(prompts, rc.n, seed)}
    b = args.prompts or cfg.train.prompts_per_step
    records = arith.generate(cfg.seed, b * (args.repeats + 1), "train", "default", unique=False)
    texts = [format_prompt(tok, r.question) for r in records]
    for fn in arms.values():  # warm-up, not timed
        fn(texts[:b], 0)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.repeats):
        prompts = texts[(rep + 1) * b:(rep + 2) * b]
        for name in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
            t0 = time.perf_counter()
            gen = arms[name](prompts, rep)
            rates[name].append(gen.tokens / (time.perf_counter() - t0))
    print(f"{b} prompts x {rc.n} rollouts, max {rc.max_new_tokens} tokens, {args.repeats} repeats, "
          f"{args.threads} threads, {'random' if args.random else 'warm-started'} weights")
    print("| arm | median tokens/s | min | max |\n|---|---|---|---|")
    for name, xs in rates.items():
        print(f"| {name} | {statistics.median(xs):,.0f} | {min(xs):,.0f} | {max(xs):,.0f} |")
    for name in ("old", "new, SDPA steps", "new, the model's forward in steps", "new, attention over the whole width"):
        print(f"new / {name}: {statistics.median(rates['new']) / statistics.median(rates[name]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
