"""The GPU check's learning part: does rlsift's update learn at real shapes, in bf16-mixed, on weights like Qwen2.5's?

For each of two weight sets of one model shape (random Qwen2.5-1.5B on a GPU; ``--toy`` a tiny one on the CPU):

- ``random``: the shape's random initialisation (seed 0);
- ``massive``: the same weights given what Qwen2.5's real weights have and random ones lack (Sun et al. 2024,
  "Massive Activations in Large Language Models", arXiv 2402.17762: a few hidden channels of the residual stream in
  the thousands; TRL issue 7181 traced Qwen2.5's DPO NaNs to them): rows of an early layer's MLP ``down_proj``
  scaled so that ``--outlier-channels`` channels of the residual reach ``--outlier`` (calibrated on the batch), and
  one query head whose attention log-sum-exp is far below the -88.7 of pytorch/pytorch#196678 on every row (its
  q and k biases set along the lowest rotary frequency, where the rotation barely turns: every score is about
  -``--lse``). The measured outlier and the lowest log-sum-exp are printed, so the injection is seen to hold.

it runs, on one fixed batch of rollouts with fixed advantages (``--rows`` rows, groups of 8 with rewards 1, 0, ...):

1. **bf16 against float32**: one update's gradient (``policy_update``, learning rate 0, no clipping) of the weights
   in float32 and of their bf16 copy (what bf16-mixed's passes compute before its float32 step), and the relative
   difference ``|g_bf16 - g_fp32| / |g_fp32|``;
2. **learning**: ``--steps`` updates under bf16-mixed (float32 masters and AdamW, the run's default on a GPU) at
   ``--lr``, with activation checkpointing, printing each step's loss and gradient norm. The loss is the
   policy-gradient loss of the batch at the step's weights, ``-sum_i A_i sum_t log pi(y_it) / tokens`` (token
   aggregation), from the log-probs the step's own passes computed (``UpdateResult.behaviour``): its gradient is the
   clipped surrogate's at ratio 1 (the update's own ``train/loss`` is -mean A there, the same every step), so on a
   fixed batch it must fall.

An arm passes when every step's loss and gradient norm are finite (no update skipped), the loss falls from the
first step to the last, and the gradients differ by at most ``--max-grad-diff``. One ``verdict:`` line ends the
output; the exit status is 1 when an arm fails.

Usage:
    python infra/learning-check.py            # on a GPU: 1.5B, 64 rows of prompts to 128 and completions to 1,024
    python infra/learning-check.py --toy      # the CPU twin (tiny shapes)
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from qwen_shapes import SHAPES  # noqa: E402
from synthetic_batch import GROUP, batch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb  # noqa: E402

from rlcore.types import RolloutGroup  # noqa: E402
from tasks.model.attention import guard_attention  # noqa: E402
from tasks.update.policy_update import gradient_checkpointing, policy_update  # noqa: E402
from tasks.update.precision import Precision, build_optimizer, resolve_precision  # noqa: E402
from tasks.update.updater import LossSettings  # noqa: E402

#: The layer whose MLP writes the outlier channels and whose head gets the very negative log-sum-exp (an early one,
#: as in Qwen2.5, where the massive activations appear in the first layers and stay in the residual stream).
LAYER = 1


def build(shape: str, device: torch.device) -> tuple[Qwen2ForCausalLM, Qwen2Config]:
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).float(), cfg


def _sample(groups: list[RolloutGroup], device: torch.device, tokens: int = 256) -> torch.Tensor:
    """[1, S] the first row of the batch (prompt and completion), at most ``tokens`` long: what the injection is
    calibrated and measured on."""
    g = groups[0]
    row = torch.cat([g.prompt_ids, g.completion_ids[0][g.completion_mask[0]]])
    return row[:tokens].unsqueeze(0).to(device)


@torch.no_grad()
def residual_max(model, ids: torch.Tensor, channels: list[int]) -> float:
    """The largest |value| of ``channels`` in the residual stream after any layer, on ``ids``."""
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1:]
    return max(float(h[..., channels].abs().max()) for h in hidden)


@torch.no_grad()
def lowest_lse(model, ids: torch.Tensor, layer: int = LAYER) -> float:
    """The lowest log-sum-exp of a query row's causal attention scores (q k / sqrt(d), after the rotary embedding)
    in ``layer``, over its heads and positions, on ``ids``: recomputed from q_proj's and k_proj's outputs."""
    attn = model.model.layers[layer].self_attn
    got = {}
    hooks = [m.register_forward_hook(lambda _m, _i, out, k=k: got.__setitem__(k, out.float()))
             for k, m in (("q", attn.q_proj), ("k", attn.k_proj))]
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    s = ids.shape[1]
    q = got["q"].view(1, s, cfg.num_attention_heads, d).transpose(1, 2)
    k = got["k"].view(1, s, cfg.num_key_value_heads, d).transpose(1, 2)
    cos, sin = model.model.rotary_emb(q, torch.arange(s, device=ids.device)[None])
    q, k = apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    k = k.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    return float(scores.masked_fill(~causal, -math.inf).logsumexp(-1).min())


@torch.no_grad()
def inject_massive(model, ids: torch.Tensor, *, outlier: float, channels: int, lse: float) -> tuple[list[int], float,
                                                                                                     float]:
    """Give ``model`` Qwen2.5-like massive activations (module docstring); returns the outlier channels, their
    measured largest |value| and the lowest log-sum-exp of layer :data:`LAYER`."""
    cfg = model.config
    h = cfg.hidden_size
    chosen = [(h * (j + 1)) // (channels + 1) for j in range(channels)]
    layer = min(LAYER, cfg.num_hidden_layers - 2)  # not the last: its output is the final norm's input
    mlp = model.model.layers[layer].mlp
    out = {}
    hook = mlp.register_forward_hook(lambda _m, _i, o: out.__setitem__("mlp", o.float()))
    try:
        model(input_ids=ids)
    finally:
        hook.remove()
    for c in chosen:  # the MLP's write into channel c, scaled so that it alone reaches the target
        mlp.down_proj.weight[c] *= outlier / float(out["mlp"][..., c].abs().max())
    attn = model.model.layers[layer].self_attn
    d = h // cfg.num_attention_heads
    slot = d // 2 - 1  # the lowest rotary frequency: rotate_half pairs slot with slot + d / 2
    a = math.sqrt(lse * math.sqrt(d))  # q . k / sqrt(d) = -a^2 / sqrt(d) on every pair of positions
    attn.q_proj.bias[slot] = -a  # query head 0 ...
    attn.k_proj.bias[slot] = a  # ... and the key head it reads
    return chosen, residual_max(model, ids, chosen), lowest_lse(model, ids, layer)


def settings(micro_batch_tokens: int, grad_clip: float) -> LossSettings:
    return LossSettings(clip_eps=0.2, aggregation="token", grad_clip=grad_clip, temperature=1.0, pad_id=0,
                        minibatches=1, kl_coef=0.0, micro_batch_tokens=micro_batch_tokens, skip_zero_advantage=True)


def gradient(model, groups, args, device: torch.device) -> tuple[torch.Tensor, bool]:
    """[P] one update's gradient of ``model``'s weights in their own dtype, as float32 (AdamW at learning rate 0 leaves
    the weights as they are; no clipping), and whether the update was applied (finite)."""
    optimizer = build_optimizer(model.parameters(), functools.partial(torch.optim.AdamW, lr=0.0),
                                Precision("as-is", next(model.parameters()).dtype, next(model.parameters()).dtype))
    result = policy_update(model, optimizer, groups, settings(args.micro_batch_tokens, math.inf), device=device)
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]) \
        if not result.skipped else torch.zeros(0)
    model.zero_grad(set_to_none=True)
    del optimizer
    return grads, not result.skipped


def pg_loss(groups: list[RolloutGroup], behaviour) -> float:
    """``-sum_i A_i sum_t log pi(y_it) / tokens`` from the update's log-probs (``UpdateResult.behaviour``)."""
    num = den = 0.0
    for g, lp in zip(groups, behaviour, strict=True):
        mask = g.completion_mask[:, :lp.shape[1]].float()
        num += float((g.advantages[:, None] * lp.float() * mask).sum())
        den += float(mask.sum())
    return -num / den


def reference_gradient(model, groups: list[RolloutGroup]) -> torch.Tensor:
    """[P] the same loss's gradient from plain transformers, one row at a time with no padding and no mask: the
    token-aggregated policy-gradient loss ``-sum_i A_i sum_t log pi(y_it) / tokens`` (:func:`pg_loss`; at ratio 1
    the clipped surrogate has this gradient), log-softmax of the full logits in float32."""
    device = next(model.parameters()).device
    tokens = sum(float(g.completion_mask.sum()) for g in groups)
    model.zero_grad(set_to_none=True)
    for g in groups:
        for i in range(g.size):
            comp = g.completion_ids[i][g.completion_mask[i]]
            ids = torch.cat([g.prompt_ids, comp])[None].to(device)
            p = g.prompt_ids.numel()
            logits = model(input_ids=ids).logits[0, p - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, comp.to(device)[:, None]).sum()
            (-float(g.advantages[i]) * lp / tokens).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (NaN where either is missing)."""
    return float((a - b).norm() / b.norm()) if a.numel() and a.shape == b.shape else math.nan


def arm(name: str, args, device: torch.device, groups: list[RolloutGroup]) -> tuple[bool, str]:
    """One weight set: its injection, the gradient comparison and the learning steps; (passed, summary)."""
    t0 = time.perf_counter()
    model, _ = build(args.shape, device)
    ids = _sample(groups, device)
    if name == "massive":
        chosen, top, lse = inject_massive(model, ids, outlier=args.outlier, channels=args.outlier_channels,
                                          lse=args.lse)
        note = f"outlier channels {chosen} reach |h| {top:,.0f}, lowest attention log-sum-exp {lse:.1f}"
    else:
        note = (f"largest |h| {residual_max(model, ids, list(range(model.config.hidden_size))):,.1f}, lowest "
                f"attention log-sum-exp {lowest_lse(model, ids):.1f}")
    print(f"\n{name} weights: {note}", flush=True)
    compare = groups[: max(1, args.compare_rows // GROUP)]
    g32, ok32 = gradient(model, compare, args, device)
    r32 = reference_gradient(model, compare)
    bf16 = Qwen2ForCausalLM(model.config).to(device=device, dtype=torch.bfloat16)
    bf16.load_state_dict(model.state_dict())  # the same weights, rounded to bf16
    del model
    g16, ok16 = gradient(bf16, compare, args, device)
    r16 = reference_gradient(bf16, compare)
    same, diff, ref = rel(g32, r32), (rel(g16, g32) if ok16 and ok32 else math.nan), rel(r16, r32)
    print(f"gradient on {sum(g.size for g in compare)} rows, norm {float(g32.norm()):.4g}: rlsift's float32 against "
          f"plain transformers' (a row at a time) {same:.1e}; bf16 against float32: rlsift {diff:.2%}, plain "
          f"transformers {ref:.2%}", flush=True)
    del g32, g16, r32, r16
    mixed = resolve_precision("bf16-mixed", device)
    gradient_checkpointing(bf16, True)
    optimizer = build_optimizer(bf16.parameters(), functools.partial(
        torch.optim.AdamW, lr=args.lr, foreach=device.type == "cuda"), mixed)
    print("| step | loss | gradient norm | finite | s |\n|---|---|---|---|---|", flush=True)
    losses, finite = [], True
    for step in range(args.steps):
        s0 = time.perf_counter()
        result = policy_update(bf16, optimizer, groups, settings(args.micro_batch_tokens, 1.0), device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        loss, gnorm = pg_loss(groups, result.behaviour), result.metrics.get("train/grad_norm", math.nan)
        ok = not result.skipped and math.isfinite(loss) and math.isfinite(gnorm)
        finite &= ok
        losses.append(loss)
        why = "yes" if ok else "no: " + (result.skipped[0].describe() if result.skipped else "non-finite")
        print(f"| {step + 1} | {loss:.5f} | {gnorm:.4g} | {why} | {time.perf_counter() - s0:.2f} |", flush=True)
    del bf16, optimizer
    falls = finite and losses[-1] < losses[0]
    # bf16's own error grows with such weights (plain transformers shows it too): the update may not add to it
    bound = max(args.max_grad_diff, ref * 1.25 + 0.01) if math.isfinite(ref) else args.max_grad_diff
    close = diff <= bound and same <= 1e-3
    passed = finite and falls and close
    summary = (f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps "
               f"({'falls' if falls else 'does not fall'}), {'finite' if finite else 'NOT finite'} every step, "
               f"bf16 vs float32 gradient {diff:.2%} (plain transformers {ref:.2%}; {'within' if close else 'above'} "
               f"{bound:.0%}), float32 against transformers {same:.0e}")
    print(f"{summary} [{time.perf_counter() - t0:.0f} s]", flush=True)
    return passed, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (the CPU twin)")
    p.add_argument("--shape", default=None, help=f"from {', '.join(SHAPES)} (default 1.5b; toy with --toy)")
    p.add_argument("--weights", nargs="+", default=["random", "massive"], choices=["random", "massive"])
    p.add_argument("--rows", type=int, default=None, help="rollouts of the fixed batch (default 64; 16 with --toy)")
    p.add_argument("--compare-rows", type=int, default=16, help="rows of the bf16 / float32 gradient comparison")
    p.add_argument("--prompt", type=int, default=None, help="longest prompt, tokens (default 128; 16 with --toy)")
    p.add_argument("--completion", type=int, default=None, help="longest completion (default 1024; 48 with --toy)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="default 8192 (512 with --toy)")
    p.add_argument("--steps", type=int, default=6, help="learning steps on the fixed batch")
    p.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default 3e-5; 1e-3 with --toy)")
    p.add_argument("--outlier", type=float, default=3000.0, help="the outlier channels' largest |value|")
    p.add_argument("--outlier-channels", type=int, default=2, help="how many hidden channels carry it")
    p.add_argument("--lse", type=float, default=150.0, help="minus the injected head's attention score")
    p.add_argument("--max-grad-diff", type=float, default=0.05, help="the largest relative difference of the bf16 "
                   "gradient from the float32 one that passes (or 1.25x plain transformers' own + 1 point, where "
                   "larger)")
    args = p.parse_args(argv)
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    print(guard_attention(device).line())  # the run's kernel choice: cuDNN SDPA off on CUDA
    if toy:
        torch.set_num_threads(2)
    args.shape = args.shape or ("toy" if toy else "1.5b")
    args.rows = args.rows or (16 if toy else 64)
    args.prompt = args.prompt or (16 if toy else 128)
    args.completion = args.completion or (48 if toy else 1024)
    args.micro_batch_tokens = args.micro_batch_tokens or (512 if toy else 8192)
    args.lr = args.lr or (1e-3 if toy else 3e-5)
    name = "CPU" if toy else torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}: {args.shape}, {args.rows} rows of prompts to {args.prompt} and "
          f"completions to {args.completion} tokens, micro-batches of {args.micro_batch_tokens}, lr {args.lr:g}, "
          f"{args.steps} steps, bf16-mixed with checkpointing", flush=True)
    groups = batch(args.rows, args.prompt, args.completion, SHAPES[args.shape]["vocab_size"])
    results = [arm(w, args, device, groups) for w in args.weights]
    ok = all(passed for passed, _ in results)
    print(f"verdict: {'learns' if ok else 'FAILS'}: " + "; ".join(s for _, s in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
