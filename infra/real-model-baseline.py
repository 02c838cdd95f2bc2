"""The starting greedy accuracy of a real model on the bundled arithmetic levels and on GSM8K, with the configured
answer format (the system prompt) and completion budget: what docs/benchmarks.md, "A real model", chooses its
pool from. Rewards are the pipeline's own (arith: the marked or boxed final integer with true worked lines; numeric,
the final number, for GSM8K), every set also under ``numeric``; decoding is the pipeline's engine
(tasks/generation/rollout.py HFEngine, greedy).

The table in docs/benchmarks.md: --threads 1 --per-level 24 --gsm8k 24 --max-new-tokens 48 (levels 3-5: 16 each).

Usage: python infra/real-model-baseline.py [--model gguf:smollm2-135m] [--per-level 64] [--gsm8k 64]
       [--max-new-tokens 96] [--system "..."] [--cache rlsift-runs/cache]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.config import Config  # noqa: E402
from tasks.data import arith  # noqa: E402
from tasks.data.rewards import reward  # noqa: E402
from tasks.data.sources import read_source  # noqa: E402
from tasks.generation.rollout import HFEngine  # noqa: E402
from tasks.model import gguf_source  # noqa: E402
from tasks.model.attention import guard_attention  # noqa: E402
from tasks.model.loading import format_prompt, load_policy  # noqa: E402


def accuracy(engine, tok, records, system, max_new_tokens, show=2):
    """Greedy accuracy under the record's own reward and under ``numeric`` (the final number), and the share of
    completions the token budget cut."""
    prompts = [format_prompt(tok, r.question, system) for r in records]
    gen = engine.generate(prompts, n=1, seed=0, greedy=True)
    own = [reward(r.reward, t, r) for r, t in zip(records, gen.texts, strict=True)]
    num = [reward("numeric", t, r) for r, t in zip(records, gen.texts, strict=True)]
    for r, t in list(zip(records, gen.texts, strict=True))[:show]:
        print(f"  Q {r.question[:80]!r} A {r.answer!r}\n  -> {t[:200]!r}", flush=True)
    cut = float((gen.completion_mask.sum(1) >= max_new_tokens).float().mean())
    return {"own": sum(own) / len(own), "numeric": sum(num) / len(num), "cut": cut}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gguf:smollm2-135m")
    ap.add_argument("--cache", default=str(ROOT / "rlsift-runs" / "cache"))
    ap.add_argument("--levels", default="1,2,3,4,5")
    ap.add_argument("--per-level", type=int, default=64)
    ap.add_argument("--gsm8k", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--system", default=Config().model.system_prompt)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    path = gguf_source.hf_folder(a.model, a.cache) if gguf_source.is_gguf(a.model) else a.model
    model, tok = load_policy(path)
    print(guard_attention(next(model.parameters()).device).line())  # the run's kernel choice: cuDNN SDPA off on CUDA
    engine = HFEngine(model, tok, max_new_tokens=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, chunk=64)
    rows = {}
    for level in [int(x) for x in a.levels.split(",") if x]:
        recs = arith.generate(0, a.per_level, "test", {level: 1.0})
        t = time.perf_counter()
        rows[f"arith L{level}"] = accuracy(engine, tok, recs, a.system, a.max_new_tokens)
        print(f"arith level {level}: {rows[f'arith L{level}']} {time.perf_counter() - t:.0f} s", flush=True)
    if a.gsm8k:
        recs, _ = read_source(Path(a.data) / "gsm8k" / "test.jsonl", "gsm8k")
        t = time.perf_counter()
        rows["gsm8k"] = accuracy(engine, tok, recs[: a.gsm8k], a.system, a.max_new_tokens)
        print(f"gsm8k: {rows['gsm8k']} {time.perf_counter() - t:.0f} s", flush=True)
    table = {"model": a.model, "system": a.system, "max_new_tokens": a.max_new_tokens, "per_level": a.per_level,
             "gsm8k": a.gsm8k, "rows": rows}
    print(json.dumps(table, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
