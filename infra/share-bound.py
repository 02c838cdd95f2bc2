"""How high the effective share of a screened step can go on a pool: the likelihood screen against an oracle.

For a sample of the pool's prompts this measures each one's pass rate from R rollouts of the policy and the screen's
score q (tasks/selection/screen.py ``policy_likelihood``), then simulates a step's draw many times: f x B candidates
drawn uniformly, the B whose groups of n are likeliest mixed kept (``rlcore.selection.screen``), by q (the screen)
or by a pass rate measured from R / 2 rollouts of each (what spending rollouts to measure would choose). Each kept
prompt counts its chance that a group of n of its own rollouts is mixed, estimated without bias from rollouts the
choice did not see (the U-statistic 1 - C(s, n) / C(r, n) - C(r - s, n) / C(r, n) of s successes in r rollouts:
the other half for the measured choice, all R for the screen's). The table is the expected effective share of the
trained groups at the policy given, for each f: what a screen of f candidates a prompt reaches there.

Usage (about 20 s on 2 cores for 800 prompts x 16 rollouts of the tiny model):
    python infra/share-bound.py                               # the default mix, the shipped warm start
    python infra/share-bound.py --mix balanced --model PATH   # another pool or policy
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlcore.selection import screen  # noqa: E402
from tasks.data import arith  # noqa: E402
from tasks.data.rewards import reward  # noqa: E402
from tasks.generation.rollout import HFEngine  # noqa: E402
from tasks.model.attention import guard_attention  # noqa: E402
from tasks.model.loading import load_policy  # noqa: E402
from tasks.policy import Policy  # noqa: E402
from tasks.selection.screen import policy_likelihood  # noqa: E402


def mixed_chance(successes: int, r: int, n: int) -> float:
    """Unbiased estimate, from s of r rollouts, of the chance that n fresh rollouts are not all equal."""
    total = math.comb(r, n)
    return 1 - math.comb(successes, n) / total - math.comb(r - successes, n) / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "assets" / "tiny-warmstart"), help="the policy (a saved folder)")
    p.add_argument("--mix", default="default", help="the bundled task's mix (default, balanced, easy, ...)")
    p.add_argument("--pool", type=int, default=2000, help="pool size the sample is drawn from")
    p.add_argument("--prompts", type=int, default=800, help="prompts measured")
    p.add_argument("--rollouts", type=int, default=16, help="R rollouts a prompt (even, at least 2 n)")
    p.add_argument("--n", type=int, default=4, help="rollouts a trained group")
    p.add_argument("--need", type=int, default=16, help="B prompts a step keeps")
    p.add_argument("--f", type=int, nargs="+", default=[1, 4, 6, 8, 12, 24], help="candidates a prompt")
    p.add_argument("--draws", type=int, default=300, help="simulated steps for each f")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the policy runs (cpu, cuda)")
    args = p.parse_args(argv)
    if args.rollouts % 2 or args.rollouts < 2 * args.n:
        p.error(f"--rollouts must be even and at least 2 x --n ({2 * args.n}), got {args.rollouts}")
    if args.need * max(args.f) > args.prompts:
        p.error(f"--prompts ({args.prompts}) must hold --need x the largest --f ({args.need * max(args.f)})")

    guard_attention(args.device)  # cuDNN SDPA off on CUDA, as in a run
    model, tok = load_policy(args.model, device=args.device)
    engine = HFEngine(model, tok, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, chunk=512,
                      device=args.device)
    policy = Policy(model=model, tokenizer=tok, engine=engine)
    pool = arith.generate(args.seed, args.pool, "train", args.mix)
    rng = random.Random(args.seed)
    records = rng.sample(pool, args.prompts)
    likelihood = policy_likelihood(policy, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                   micro_batch_tokens=2048, device=args.device)
    q = torch.cat([likelihood(records[i:i + 100]) for i in range(0, len(records), 100)])  # [M]
    r, rewards = args.rollouts, []
    for i in range(0, len(records), 32):
        part = records[i:i + 32]
        gen = engine.generate(policy.prompts(part), r, seed=args.seed + 1 + i)
        rewards += [[reward(rec.reward, gen.texts[b * r + j], rec) for j in range(r)] for b, rec in enumerate(part)]
    right = torch.tensor(rewards) > 0.5  # [M, R]
    half = r // 2
    seen, unseen = right[:, :half].sum(1), right[:, half:].sum(1)  # the oracle's choice, its count
    screen_value = torch.tensor([mixed_chance(int(s), r, args.n) for s in right.sum(1)])
    oracle_value = torch.tensor([mixed_chance(int(s), r - half, args.n) for s in unseen])
    mid = float(((right.float().mean(1) >= 0.2) & (right.float().mean(1) <= 0.8)).float().mean())
    print(f"{args.mix} pool, {args.prompts} prompts x {r} rollouts of {args.model}: pass rate mean "
          f"{float(right.float().mean()):.3f}, {mid:.1%} of prompts between 0.2 and 0.8; steps keep {args.need} "
          f"prompts for groups of {args.n}, {args.draws} simulated draws each")
    print(f"| candidates a prompt (f) | the screen (q) | a pass rate from {half} rollouts |\n|---|---|---|")
    for f in args.f:
        by_q, by_rate = [], []
        for _ in range(args.draws):
            drawn = torch.tensor(rng.sample(range(len(records)), f * args.need))
            by_q.append(float(screen_value[drawn[screen(q[drawn], args.n, args.need)]].mean()))
            rate = seen[drawn].double() / half
            by_rate.append(float(oracle_value[drawn[screen(rate, args.n, args.need)]].mean()))
        print(f"| {f} | {sum(by_q) / len(by_q):.3f} | {sum(by_rate) / len(by_rate):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
