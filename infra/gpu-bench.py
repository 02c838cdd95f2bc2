"""The GPU check: rlsift's own update on random-weight models of real shapes, one table.

For each model shape (Qwen2.5-0.5B, 1.5B and 7B's configs, built with random weights: nothing is downloaded), full
weights and LoRA (rank 16 on every linear layer), with and without activation checkpointing, and three step sizes,
it runs ``tasks.update.policy_update.policy_update`` (every check it does: the micro-batches, the chunked LM head, the
NaN guard, the mismatch metrics) on a batch of groups of 8 rollouts of 128 prompt and 1,024 completion tokens, and
prints one row an arm as the arm ends: the step's tokens (real, and padded beside them), its micro-batches, seconds a
step, tokens a second, model-FLOPs utilisation and the peak memory measured against tasks/update/memory_check.py's
estimate.

- Model FLOPs: 6 N a token with full weights (forward 2N, backward 4N), 4 N under LoRA (the frozen weights get no
  gradient), N the parameters; attention's own FLOPs and checkpointing's recompute are not counted (the usual MFU
  convention). The tokens are those the update's passes computed (``UpdateResult.tokens``: each row's real prompt and
  completion tokens; the padded ones, each micro-batch's rows times its longest row, beside them with their own
  MFU). The peak is the card's dense bf16 rate (``--peak-tflops``; H100 SXM 989, H200 989).
- Rows of varied length (prompts of half to all of ``--prompt`` tokens, completions of half to all of
  ``--completion``), so attention takes the padded path real batches take (a mask: keys and values repeated).
- Precision (``--precisions``, tasks/update/precision.py): ``bf16-mixed`` (bf16 passes, float32 master weights
  and AdamW state, the run's default on a GPU), ``bf16-true``, ``fp32``.
- Peak memory: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the timed step (on a CPU the
  process's peak resident set, ``VmHWM``, reset per arm where Linux allows it, less the resident set just before
  the arm: the interpreter and libraries left out), beside tasks/update/memory_check.py's estimate of the arm.
- One warm-up step, then ``--steps`` timed steps. An arm whose model build or step fails to allocate
  (``torch.OutOfMemoryError``, or a RuntimeError that says so: cuBLAS's workspace) says so and the others go on.
- An arm whose update is skipped (a non-finite loss or gradient: the optimizer never stepped) fails: its status
  says ``skipped: <site>`` (tasks/update/nan_locator.py: module, phase, row and position, dtype, the attention
  kernel) and no time, MFU, peak or estimate is printed for it; the script then exits with status 1. The bench
  bisects such an arm by itself (:func:`bisect`): from the simplest variant (no checkpointing, rows cut to
  ``--bisect-positions`` positions, one micro-batch of 8 rows, cuDNN SDPA off) it turns on one factor at a time
  towards the arm (cuDNN SDPA, the arm's rows in its micro-batches, rows past that length, checkpointing) and
  prints each variant's result and which first goes non-finite, then the arm with cuDNN SDPA off. One model serves
  every variant (AdamW at learning rate 0 keeps its weights as built) and no variant starts after
  ``--bisect-seconds``; the locator re-runs at most a few micro-batches (tasks/update/skips.py).
  ``--inject-nan MODULE@POSITION[:backward]`` writes a NaN into that module's output (or its gradient) at that
  position of row 0, in every pass long enough: the failure path checked on purpose (the CPU test does).

Then the generation half (infra/gpu_bench_generation.py) on the first model: the in-process sampler against
transformers' ``generate`` and the card's floor, the bf16 sampler/trainer mismatch; and the one-GPU overlap
(infra/gpu_bench_overlap.py: one clock from a common start, a dead sampler process noticed). Each part that fails
to allocate says so; the others go on.

It imports only torch, transformers, peft, pydantic and numpy (and rlsift's modules that need no more), so it runs
on a machine where the rest of the stack is not installed. Meant to take under 8 minutes on one H100 with the
defaults (not yet run on a GPU).

Usage:
    python infra/gpu-bench.py                      # on a GPU: the full table
    python infra/gpu-bench.py --toy                # tiny shapes on the CPU (what the default test tier runs)
    python infra/gpu-bench.py --models 1.5b --rows 512 --modes full+ckpt   # one arm: 64 prompts x 8 rollouts
    python infra/gpu-bench.py --no-generation --shared-prefix   # the update with each group's prompt computed once
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from gpu_bench_overlap import ChildDied, is_alloc_failure, overlap_rows  # noqa: E402
from qwen_shapes import SHAPES  # noqa: E402
from synthetic_batch import GROUP, batch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tasks.config import LoraConfig  # noqa: E402
from tasks.model.attention import guard_attention  # noqa: E402
from tasks.model.lora import apply_lora, base_model, trainable_parameters  # noqa: E402
from tasks.records.memory import own_peak_mb, reset_own_peak  # noqa: E402
from tasks.update.memory_check import ModelShape, estimate  # noqa: E402
from tasks.update.nan_locator import SkippedUpdate, inject_nan  # noqa: E402
from tasks.update.policy_update import gradient_checkpointing, policy_update  # noqa: E402  # noqa: E402
from tasks.update.precision import (  # noqa: E402  # noqa: E402
    PRECISIONS,
    Precision,
    adamw_kernel,
    build_optimizer,
    resolve_precision,
)
from tasks.update.updater import LossSettings  # noqa: E402

MODES = ("full", "full+ckpt", "lora", "lora+ckpt")


@dataclass(frozen=True)
class Arm:
    model: str
    mode: str
    rows: int
    precision: str


def build(name: str, mode: str, device: torch.device, dtype: torch.dtype):
    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=4096, rope_theta=1e6, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    if mode.startswith("lora"):
        model = apply_lora(model, LoraConfig(enabled=True, rank=16, alpha=32.0), seed=0)
    gradient_checkpointing(base_model(model), mode.endswith("+ckpt"))
    return model, cfg




def rss_mb() -> float:
    """This process's resident set now (Linux), in MiB; 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def release(device: torch.device) -> None:
    """Give back what the last arm freed (the caching allocator's blocks; glibc's heap on Linux)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def arm_estimate(arm: Arm, model, cfg, precision: Precision, args, groups) -> float:
    """tasks/update/memory_check.py's estimate of the arm's step, in GiB."""
    tokens = sum(g.size * (g.prompt_ids.numel() + g.completion_ids.shape[1]) for g in groups)
    micro = min(args.micro_batch_tokens, tokens) if args.micro_batch_tokens else tokens
    est = estimate(ModelShape.of(model, cfg), precision, tokens=micro, checkpointing=arm.mode.endswith("+ckpt"),
                   accumulating=micro < tokens, padded=False, row_tokens=args.prompt + args.completion,
                   fused_adamw=bool(adamw_kernel(model.device)["fused"]))
    return est.total / 2**30


def injected(model, args):
    """``--inject-nan``'s NaN in ``model`` (:func:`tasks.update.nan_locator.inject_nan`), or nothing."""
    if not args.inject_nan:
        return contextlib.nullcontext()
    spec, _, phase = args.inject_nan.partition(":")
    module, _, position = spec.rpartition("@")
    if not module or not position.isdigit() or phase not in ("", "forward", "backward"):
        raise SystemExit(f"--inject-nan {args.inject_nan!r}: want MODULE@POSITION[:backward]")
    return inject_nan(model, module, int(position), phase or "forward")


def run_arm(arm: Arm, args, device: torch.device) -> dict:
    """One arm: build, warm up, time ``args.steps`` steps; an allocation failure anywhere is the arm's result, and
    so is a skipped update (``row["skipped"]``: its :class:`SkippedUpdate`), which ends the arm at once."""
    precision = resolve_precision(arm.precision, device)
    groups = batch(arm.rows, args.prompt, args.completion, SHAPES[arm.model]["vocab_size"])
    row = {"arm": arm}
    settings = LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0,
                            minibatches=1, kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens,
                            skip_zero_advantage=True, shared_prefix=args.shared_prefix)
    release(device)
    base_mb = rss_mb() if device.type == "cpu" else 0.0
    model = optimizer = None
    try:
        model, cfg = build(arm.model, arm.mode, device, precision.compute)
        row["estimate_gib"] = arm_estimate(arm, model, cfg, precision, args, groups)
        adamw = functools.partial(torch.optim.AdamW, lr=1e-6, foreach=device.type == "cuda")
        optimizer = build_optimizer(trainable_parameters(model), adamw, precision)
        n_params = sum(p.numel() for p in model.parameters())
        with injected(model, args):
            result = policy_update(model, optimizer, groups, settings, device=device)  # warm-up (the optimizer's state)
            skips: list[SkippedUpdate] = list(result.skipped)
            sync(device)
            reset_own_peak(device)
            t0 = time.perf_counter()
            for _ in range(args.steps if not skips else 0):
                result = policy_update(model, optimizer, groups, settings, device=device)
                skips += result.skipped
            sync(device)
        stats = result.metrics
        step_s = (time.perf_counter() - t0) / args.steps
        row["tokens"], row["padded"] = result.tokens.real, result.tokens.padded  # what the passes computed
        if skips:  # the optimizer never stepped: no time, peak or estimate stands for this arm
            row["skipped"] = skips[0]
            return row
    except Exception as err:
        if not is_alloc_failure(err):
            raise
        row["oom"] = str(err).splitlines()[0][:120]
        return row
    finally:
        del model, optimizer
        release(device)
    if not all(math.isfinite(v) for v in stats.values()):
        raise RuntimeError(f"{arm}: non-finite metrics {stats}")
    flops_per_token = (6 if arm.mode.startswith("full") else 4) * n_params
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else float("nan")
    row.update(micro=int(stats["train/micro_batches"]), step_s=step_s, tokens_per_s=row["tokens"] / step_s,
               mfu=mfu(flops_per_token, row["tokens"], step_s, args.peak_tflops),
               mfu_padded=mfu(flops_per_token, row["padded"], step_s, args.peak_tflops),
               peak_gib=(own_peak_mb(device) - base_mb) / 1024, reserved_gib=reserved)
    return row


def mfu(flops_per_token: float, tokens: int, step_s: float, peak_tflops: float | None) -> float:
    """Model-FLOPs utilisation of a step of ``tokens`` in ``step_s`` against ``peak_tflops`` (NaN without one)."""
    return flops_per_token * tokens / step_s / (peak_tflops * 1e12) if peak_tflops else float("nan")


@dataclass(frozen=True)
class Variant:
    """One bisection run of a skipped arm: ``positions``, the longest row (prompt + completion); ``one``: one
    micro-batch of a group's 8 rows (else the arm's rows in its micro-batches); ``cudnn``: cuDNN SDPA enabled."""

    label: str
    checkpointing: bool
    positions: int
    one: bool
    cudnn: bool


def variants(arm: Arm, args) -> list[Variant]:
    """The simplest variant, then one factor turned towards the arm at a time (those where the arm differs), then
    the arm with cuDNN SDPA off."""
    longest = args.prompt + args.completion
    short = min(longest, args.bisect_positions)
    ckpt = arm.mode.endswith("+ckpt")
    v = Variant(f"simplest: no checkpointing, rows to {short} positions, one micro-batch of {GROUP} rows, "
                "cuDNN SDPA off", checkpointing=False, positions=short, one=True, cudnn=False)
    out = [v]
    steps = [("cudnn", True, "+ cuDNN SDPA on"),
             ("one", False, f"+ {arm.rows} rows in micro-batches of {args.micro_batch_tokens} tokens"),
             ("positions", longest, f"+ rows past {short} positions (to {longest})"),
             ("checkpointing", ckpt, "+ activation checkpointing")]
    for name, value, label in steps:
        if getattr(v, name) != value:
            v = Variant(label, **{**{f: getattr(v, f) for f in ("checkpointing", "positions", "one", "cudnn")},
                                  name: value})
            out.append(v)
    if v.cudnn:
        out.append(Variant("the arm with cuDNN SDPA off", v.checkpointing, v.positions, v.one, cudnn=False))
    return out


def run_variant(model, optimizer, arm: Arm, v: Variant, args, device: torch.device) -> str:
    """One update of variant ``v`` of ``arm`` on ``model`` (the bisection's one model, its checkpointing set to the
    variant's): ``finite``, ``skipped: <site>`` or ``out of memory (...)``."""
    completion = max(v.positions - args.prompt, 1)
    groups = batch(GROUP if v.one else arm.rows, args.prompt, completion, SHAPES[arm.model]["vocab_size"])
    settings = LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0,
                            minibatches=1, kl_coef=0.0, micro_batch_tokens=0 if v.one else args.micro_batch_tokens,
                            skip_zero_advantage=True)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(v.cudnn)
        gradient_checkpointing(base_model(model), v.checkpointing)
        with injected(model, args):
            skips = policy_update(model, optimizer, groups, settings, device=device).skipped
        return f"skipped: {skips[0].describe()}" if skips else "finite"
    except Exception as err:
        if not is_alloc_failure(err):
            raise
        return f"out of memory ({str(err).splitlines()[0][:120]})"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        optimizer.zero_grad(set_to_none=True)
        release(device)


def bisect(arm: Arm, args, device: torch.device) -> str:
    """Which variant of a skipped ``arm`` first goes non-finite (:func:`variants`), as a table and a line.

    One model serves every variant (built once with the arm's weights; checkpointing switched per variant) and its
    AdamW has learning rate 0, which leaves the weights exactly as built (weight decay is scaled by it too), so each
    variant sees the arm's own weights. Variants not started within ``--bisect-seconds`` are listed as not run."""
    out = [f"\nbisection of {arm.model} {arm.mode} {arm.precision} {arm.rows} rows (its update was skipped)",
           "| variant | checkpointing | longest row | micro-batches | cuDNN SDPA | result |", "|---" * 6 + "|"]
    first = None
    precision = resolve_precision(arm.precision, device)
    release(device)
    model = optimizer = None
    t0 = time.perf_counter()
    try:
        model, _ = build(arm.model, arm.mode, device, precision.compute)
        optimizer = build_optimizer(trainable_parameters(model), functools.partial(
            torch.optim.AdamW, lr=0.0, foreach=device.type == "cuda"), precision)
        for v in variants(arm, args):
            if time.perf_counter() - t0 > args.bisect_seconds:
                result = f"not run (the bisection's cap of {args.bisect_seconds:.0f} s)"
            else:
                print(f"  bisect: {v.label}", file=sys.stderr, flush=True)
                result = run_variant(model, optimizer, arm, v, args, device)
            out.append(f"| {v.label} | {'on' if v.checkpointing else 'off'} | {v.positions} | "
                       f"{'one' if v.one else 'many'} | {'on' if v.cudnn else 'off'} | {result} |")
            if first is None and result.startswith("skipped"):
                first = f"first non-finite: {v.label} -> {result}"
    except Exception as err:
        if not is_alloc_failure(err):
            raise
        out.append(f"the bisection's model: out of memory ({str(err).splitlines()[0][:120]})")
    finally:
        del model, optimizer
        release(device)
    out.append(first or "first non-finite: none of the variants (the arm's own batch or seed matters)")
    return "\n".join(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table_head(device_name: str) -> str:
    """The update table's title and header (:func:`table_row` prints its rows, one as each arm ends)."""
    return "\n".join([
        f"update on {device_name}: policy_update, groups of {GROUP} rollouts of varied length",
        "| model | weights | precision | rows | tokens a step | padded tokens | status | micro-batches | s / step | "
        "tokens / s | MFU | MFU on padded | peak GiB | reserved GiB | estimate GiB | estimate / peak |",
        "|---" * 16 + "|"])


def table_row(r: dict) -> str:
    """One arm's row. Tokens a step: the real prompt and completion tokens the update's passes computed, and the
    padded tokens beside them (each micro-batch's rows times its longest row: tasks/update/minibatch.py
    ``PassTokens``); MFU counts the real ones (the padded ones beside it). Status: ``ok``, ``out of memory (...)``
    or ``skipped: <site>``; a skipped arm shows no time, MFU, peak or estimate."""
    a = r["arm"]
    est = f"{r['estimate_gib']:.2f}" if "estimate_gib" in r else ""
    tokens = f"{r['tokens']:,} | {r['padded']:,}" if "tokens" in r else " | "
    head = f"| {a.model} | {a.mode} | {a.precision} | {a.rows} | {tokens} |"
    if r.get("oom"):
        return f"{head} out of memory ({r['oom']}) | | | | | | | | {est} | |"
    if r.get("skipped"):
        return f"{head} skipped: {r['skipped'].describe()} | | | | | | | | | |"
    pct = ["" if math.isnan(r[k]) else f"{r[k]:.1%}" for k in ("mfu", "mfu_padded")]
    reserved = "" if math.isnan(r["reserved_gib"]) else f"{r['reserved_gib']:.2f}"
    return (f"{head} ok | {r['micro']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {pct[0]} | {pct[1]} | "
            f"{r['peak_gib']:.3f} | {reserved} | {est} | {r['estimate_gib'] / max(r['peak_gib'], 1e-9):.2f} |")


def verdict(results: list[dict]) -> str:
    """One line: how many arms ran, were skipped or ran out of memory, and each finished arm's time and MFU."""
    done = [r for r in results if "step_s" in r]
    skipped, oom = sum(1 for r in results if r.get("skipped")), sum(1 for r in results if r.get("oom"))
    arms = "; ".join(f"{r['arm'].model} {r['arm'].mode} {r['arm'].precision} {r['arm'].rows} rows "
                     f"{r['step_s']:.2f} s a step" + ("" if math.isnan(r["mfu"]) else f", MFU {r['mfu']:.1%}")
                     for r in done)
    return (f"verdict: {'FAILS: ' if skipped else ''}{len(done)} of {len(results)} arms finite"
            + (f", {skipped} skipped" if skipped else "") + (f", {oom} out of memory" if oom else "")
            + (f" ({arms})" if arms else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (the default test tier's check)")
    p.add_argument("--models", nargs="+", default=None, help=f"from {', '.join(SHAPES)} (default 1.5b 7b)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--precisions", nargs="+", default=None, choices=[n for n in PRECISIONS if n != "auto"],
                   help="model.precision of the arms (default bf16-mixed on a GPU; fp32 and bf16-mixed on a CPU)")
    p.add_argument("--rows", nargs="+", type=int, default=None, help="rollouts a step (default 16 64 512)")
    p.add_argument("--prompt", type=int, default=None, help="longest prompt, tokens (default 128)")
    p.add_argument("--completion", type=int, default=None, help="longest completion, tokens (default 1024)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="train.micro_batch_tokens (default 8192)")
    p.add_argument("--steps", type=int, default=1, help="timed steps an arm (after one warm-up step)")
    p.add_argument("--no-generation", action="store_true", help="only the update's table")
    p.add_argument("--shared-prefix", action="store_true", help="the update's arms compute each group's prompt once "
                   "(train.shared_prefix=true; tasks/model/shared_prefix.py): its time and memory against the rows'")
    p.add_argument("--bisect-positions", type=int, default=1024, help="a skipped arm's bisection cuts rows to this "
                   "many positions (prompt + completion) against the arm's own (default 1024)")
    p.add_argument("--bisect-seconds", type=float, default=90.0, help="a skipped arm's bisection starts no variant "
                   "after this many seconds (default 90)")
    p.add_argument("--inject-nan", default=None, metavar="MODULE@POSITION[:backward]",
                   help="a NaN in that module's output (or its gradient) at that position of row 0, e.g. "
                   "model.layers.1.mlp@40: the skipped-arm path and its bisection, on purpose")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense bf16 TFLOP/s (default: "
                   "989 on an H100/H200, none elsewhere)")
    args = p.parse_args(argv)
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    print(guard_attention(device).line())  # the run's kernel choice: cuDNN SDPA off on CUDA
    models = args.models or (["toy"] if toy else ["1.5b", "7b"])
    rows = args.rows or ([8, 32] if toy else [16, 64, 512])
    precisions = args.precisions or (["fp32", "bf16-mixed"] if toy else ["bf16-mixed"])
    args.prompt = args.prompt or (16 if toy else 128)
    args.completion = args.completion or (48 if toy else 1024)
    args.micro_batch_tokens = args.micro_batch_tokens if args.micro_batch_tokens is not None else \
        (512 if toy else 8192)
    name = "CPU" if toy else torch.cuda.get_device_name(device)
    if args.peak_tflops is None and not toy and any(k in name for k in ("H100", "H200")):
        args.peak_tflops = 989.0
    if toy:
        torch.set_num_threads(2)
    # the 7B: what fits one card, in minutes (full weights under bf16-mixed hold 16 bytes a parameter: 112 GiB)
    arms = [Arm(m, mode, r, prec) for m in models for prec in precisions for mode in args.modes for r in rows
            if not (m == "7b" and (r > 64 or not mode.endswith("+ckpt")
                                   or (mode.startswith("full") and prec != "bf16-true")))]
    results = []
    print(table_head(f"{name}, torch {torch.__version__}, micro-batches of {args.micro_batch_tokens} tokens"),
          flush=True)
    for i, arm in enumerate(arms, 1):
        print(f"[{i}/{len(arms)}] {arm.model} {arm.mode} {arm.precision} {arm.rows} rows", file=sys.stderr,
              flush=True)
        results.append(run_arm(arm, args, device))
        print(table_row(results[-1]), flush=True)  # as the arm ends: a later arm that overruns loses nothing
    failed = [r["arm"] for r in results if r.get("skipped")]
    print(verdict(results), flush=True)
    for arm in failed:
        print(bisect(arm, args, device), flush=True)
    if not args.no_generation:
        generation(args, models[0], device, resolve_precision(precisions[0], device), name)
    return 1 if failed else 0


def guarded(what: str, fn) -> None:
    """Print ``fn()``'s lines; an allocation failure or a dead sampler process is printed instead."""
    try:
        print("\n".join(fn()))
    except (ChildDied, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError
        if not (isinstance(err, ChildDied) or is_alloc_failure(err)):
            raise
        print(f"{what}: {'out of memory' if is_alloc_failure(err) else 'failed'} ({str(err).splitlines()[0][:160]})")


def generation(args, shape: str, device: torch.device, precision: Precision, name: str) -> None:
    """The sampler and the bf16 mismatch (infra/gpu_bench_generation.py), and the one-GPU overlap
    (infra/gpu_bench_overlap.py) on ``shape`` in ``precision``'s compute dtype; each part in its own guard."""
    import gpu_bench_generation as gen

    toy = device.type == "cpu"
    dtype = precision.compute
    rows, new = ([16, 32], 8) if toy else ([256, 512], 512)
    state: dict = {}

    def model_for_sampling():
        if "model" not in state:
            state["model"] = build(shape, "full", device, dtype)[0].eval()
        return state["model"]

    print(f"\nsampler on {name}: tasks.generation.decode against today's (infra/decode_reference.py), {shape}, "
          f"prompts of {gen.PROMPT} tokens")
    guarded("sampler", lambda: gen.sampler_rows(model_for_sampling(), rows, new, device, name))
    print(f"\nsampler/trainer mismatch on {name} ({dtype}, the same weights)")
    guarded("mismatch", lambda: gen.mismatch_rows(model_for_sampling(), rows[0], new, device))
    state.clear()
    release(device)

    def overlap():
        model, cfg = build(shape, "full+ckpt", device, dtype)
        adamw = functools.partial(torch.optim.AdamW, lr=1e-6, foreach=device.type == "cuda")
        optimizer = build_optimizer(trainable_parameters(model), adamw, precision)
        groups = batch(16 if toy else 64, args.prompt, args.completion, cfg.vocab_size)
        settings = LossSettings(clip_eps=0.2, aggregation="token", grad_clip=1.0, temperature=1.0, pad_id=0,
                                minibatches=1, kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens)
        policy_update(model, optimizer, groups, settings, device=device)  # warm-up
        return overlap_rows(SHAPES[shape], dtype, device,
                            lambda: policy_update(model, optimizer, groups, settings, device=device),
                            rows=rows[0], new=new if toy else 256, repeats=2 if toy else 3, steps=2 if toy else 4)

    print(f"\noverlap on one {name}: the sampler in a second process beside full + checkpointing update steps, "
          "one clock from a common start")
    guarded("overlap", overlap)
    release(device)


if __name__ == "__main__":
    sys.exit(main())
