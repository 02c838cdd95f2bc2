"""The GPU check's generation half (run by infra/gpu-bench.py): the in-process sampler, one-GPU overlap, and the
bf16 sampler/trainer mismatch. Imports only torch, transformers, peft, pydantic, numpy and rlsift's modules that
need no more.

- **Sampler**: the run's decode loop (``tasks.generation.decode.Decoder``: KV cache written in place, each prompt
  prefilled once, CUDA graphs per row bucket) against today's reference (``infra/decode_reference.py``, the loop
  before it: ``DynamicCache``, every row prefilled) on ``rows / 8`` prompts of 64-128 tokens (left-padded to 128)
  with 8 rollouts each, ``new`` tokens each (no stop token: every row runs to the end). Arms interleaved, all on one
  clock (``perf_counter`` after a device sync): each arm's first call, then its second call (steady state: the new
  loop reuses its buffers and graphs); for the new loop the one-time capture (``Decoder.capture_s``) is reported
  and taken out of its first call. Peak memory of the new loop's steady call above what was allocated before it
  (``max_memory_allocated``, and reserved), beside the KV cache as ``tasks/update/memory_check.py`` counts it (rows x
  (prompt + new) x layers x 2 x kv heads x head size x bytes) and as allocated. The floor is what the card allows a
  decode step: the larger of reading the weights and the KV cache once (bytes / memory bandwidth) and the step's
  FLOPs (2 N a row / peak), so tokens/s <= rows / that time.
- **One decode step** (:func:`step_profile`, run alone: ``PYTHONPATH=. python infra/gpu_bench_generation.py``,
  one GPU call): torch.profiler's kernel time of an eager step by part (attention kernel, attention projections,
  MLP, LM head, sampling, record + stop check, mask update, compaction, other), beside the step's eager wall time
  and its graph replay's; with it the race's first (compiling) call, a fresh decoder's first call at 256 rows
  against its second (:func:`first_call`), and a capture that fails leaving the caller's stream current
  (:func:`capture_check`). docs/performance.md says what to read from it.
- **Overlap on one GPU**: the sampler in a second process on the same GPU beside update steps in this one, against
  the two one after the other: the ratio is what ``overlap.lag`` 1 can save on a shared device.
- **Mismatch**: the sampler's bf16 log-probs mu against the trainer's recomputation pi_old on the same weights
  (``tasks.update.policy_update.mismatch_metrics``), and the first update on those rollouts with mu = the sampler's
  (the decoupled loss's correction) and with mu = pi_old (no correction): how much the correction changes the
  gradient (relative norm of the difference).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import time

import torch

from infra.decode_reference import decode_reference
from rlcore.types import RolloutGroup
from tasks.generation.decode import Decoder
from tasks.generation.decode_options import DecodeOptions
from tasks.generation.sampling import Sampling
from tasks.model.attention import guard_attention
from tasks.model.forward import token_logprobs
from tasks.update.loss import mismatch_metrics
from tasks.update.policy_update import policy_update
from tasks.update.updater import LossSettings

#: Memory bandwidth (TB/s) and dense bf16 TFLOP/s of the cards the check knows (vendor figures, SXM parts).
CARDS = {"H100": (3.35, 989.0), "H200": (4.8, 989.0), "A100": (2.0, 312.0)}
PROMPT = 128
GROUP = 8  # rollouts a prompt


def card(name: str) -> tuple[float, float] | None:
    return next((v for k, v in CARDS.items() if k in name), None)


def prompts(rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows / 8`` random prompts of 64 to :data:`PROMPT` tokens, left-padded to :data:`PROMPT` (each is decoded
    with its 8 rollouts)."""
    g = torch.Generator().manual_seed(1)
    b = max(rows // GROUP, 1)
    ids = torch.randint(4, vocab, (b, PROMPT), generator=g)
    lens = torch.randint(PROMPT // 2, PROMPT + 1, (b,), generator=g)
    am = torch.arange(PROMPT)[None, :] >= PROMPT - lens[:, None]
    return ids.masked_fill(~am, 0).to(device), am.long().to(device)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def draw(model, rows: int, new: int, device, seed: int = 0, decoder: Decoder | None = None):
    """The new loop's ``rows`` rollouts (each prompt's 8 prefilled once); returns the prompts repeated per row and
    ``(ids, logp)``."""
    ids, am = prompts(rows, model.config.vocab_size, device)
    seeds = torch.arange(len(ids), dtype=torch.long) + seed
    out = (decoder or Decoder(model))(ids, am, n=GROUP, max_new_tokens=new, sampling=Sampling(temperature=1.0),
                                      stop_ids=(), pad_id=0, seeds=seeds)
    rows_ids = [p[a.bool()] for p, a in zip(ids, am, strict=True) for _ in range(GROUP)]
    return rows_ids, out


def draw_reference(model, rows: int, new: int, device, seed: int = 0):
    """Today's reference loop on the same prompts, each repeated for its 8 rows."""
    ids, am = prompts(rows, model.config.vocab_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return decode_reference(model, ids.repeat_interleave(GROUP, 0), am.repeat_interleave(GROUP, 0),
                            max_new_tokens=new, sampling=Sampling(temperature=1.0), eos_id=-1, pad_id=0,
                            generator=gen)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def floor_tokens_per_s(model, rows: int, new: int, bandwidth_tbs: float, peak_tflops: float) -> float:
    """rows / the fastest a decode step can be (module docstring), at the mean context length."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    b = next(model.parameters()).element_size()
    kv_width = (c.num_key_value_heads or c.num_attention_heads) * (c.hidden_size // c.num_attention_heads)
    kv_bytes = rows * (PROMPT + new / 2) * c.num_hidden_layers * 2 * kv_width * b
    t_mem = (params * b + kv_bytes) / (bandwidth_tbs * 1e12)
    t_flops = 2 * params * rows / (peak_tflops * 1e12)
    return rows / max(t_mem, t_flops)


def kv_count_bytes(model, rows: int, prompt: int, new: int) -> int:
    """The KV cache as tasks/update/memory_check.py counts it: rows x (prompt + new) x layers x 2 x kv heads x
    head size x bytes."""
    c = model.config
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    b = next(model.parameters()).element_size()
    return rows * (prompt + new) * c.num_hidden_layers * 2 * (c.num_key_value_heads or c.num_attention_heads) * head * b


def sampler_rows(model, rows_list: list[int], new: int, device, name: str) -> list[str]:
    out = ["| rows | new tokens | loop | first call s | capture s | first call less capture / steady | steady s | "
           "steady tokens/s | vs today | peak GiB (reserved) over weights | KV cache GiB counted / allocated | "
           "floor tokens/s | share of floor |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    spec = card(name)
    cuda = torch.device(device).type == "cuda"
    gib = 2.0 ** 30
    warm = timed(lambda: (draw_reference(model, GROUP, 2, device), draw(model, GROUP, 2, device)), device)
    out.insert(0, f"process warm-up (CUDA and cuBLAS start, the race noise's kernel compiled), both loops at "
                  f"{GROUP} rows x 2 tokens: {warm:.1f} s, not in the table\n")
    for rows in rows_list:
        decoder = Decoder(model)
        first_old = timed(lambda rows=rows: draw_reference(model, rows, new, device), device)
        first_new = timed(lambda rows=rows, d=decoder: draw(model, rows, new, device, decoder=d), device)
        capture = decoder.capture_s
        steady_old = timed(lambda rows=rows: draw_reference(model, rows, new, device, seed=1), device)
        if cuda:
            torch.cuda.empty_cache()
            base, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)
        steady_new = timed(lambda rows=rows, d=decoder: draw(model, rows, new, device, seed=1, decoder=d), device)
        peak = "-"
        if cuda:
            peak = (f"{(torch.cuda.max_memory_allocated(device) - base) / gib:.2f} "
                    f"({(torch.cuda.max_memory_reserved(device) - base_reserved) / gib:.2f})")
        kv = f"{kv_count_bytes(model, rows, PROMPT, new) / gib:.2f} / {decoder.kv_bytes / gib:.2f}"
        floor = floor_tokens_per_s(model, rows, new, *spec) if spec else 0.0
        for loop, first, cap, steady in (("today", first_old, None, steady_old), ("new", first_new, capture,
                                                                                 steady_new)):
            tps = rows * new / steady
            ratio = (first - (cap or 0.0)) / steady
            floor_s, share = ("", "") if spec is None else (f"{floor:,.0f}", f"{tps / floor:.0%}")
            out.append(f"| {rows} | {new} | {loop} | {first:.2f} | {'-' if cap is None else f'{cap:.2f}'} | "
                       f"{ratio:.2f}x | {steady:.2f} | {tps:,.0f} | {steady_old / steady:.2f}x | "
                       f"{peak if loop == 'new' else '-'} | {kv if loop == 'new' else '-'} | {floor_s} | {share} |")
        del decoder
        if cuda:
            torch.cuda.empty_cache()
    return out


def _sampler_worker(shape: dict, dtype, device: str, rows: int, new: int, repeats: int, start, done) -> None:
    """The second process: its own model of the same shape on the same device, ``repeats`` draws."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    guard_attention(device)  # a process of its own: the flags are per process
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype).eval()
    draw(model, rows, 8, device)  # warm
    start.wait()
    t0 = time.perf_counter()
    for _ in range(repeats):
        draw(model, rows, new, device)
    sync(device)
    done.put(time.perf_counter() - t0)


def overlap_rows(shape: dict, dtype, device, update_fn, rows: int, new: int, repeats: int, steps: int) -> list[str]:
    """The sampler in a second process beside ``steps`` calls of ``update_fn`` here, against one after the other."""
    ctx = mp.get_context("spawn")

    def run(with_updates: bool, with_draws: bool) -> tuple[float, float | None]:
        start, done = ctx.Event(), ctx.Queue()
        proc = None
        if with_draws:
            proc = ctx.Process(target=_sampler_worker, args=(shape, dtype, str(device), rows, new, repeats, start,
                                                             done))
            proc.start()
            time.sleep(1.0)
        start.set()
        t0 = time.perf_counter()
        if with_updates:
            for _ in range(steps):
                update_fn()
            sync(device)
        upd = time.perf_counter() - t0
        drawn = done.get(timeout=1800) if with_draws else None
        if proc is not None:
            proc.join()
        return (max(upd, drawn) if drawn is not None else upd), drawn

    upd_alone, _ = run(True, False)
    _, draw_alone = run(False, True)
    both, _ = run(True, True)
    seq = upd_alone + draw_alone
    return ["| update steps | draws | update alone s | sampler alone s | one after the other s | at once s | ratio |",
            "|---|---|---|---|---|---|---|",
            f"| {steps} | {repeats} x {rows} rows x {new} | {upd_alone:.1f} | {draw_alone:.1f} | {seq:.1f} | "
            f"{both:.1f} | {both / seq:.2f}x |"]


def mismatch_rows(model, rows: int, new: int, device) -> list[str]:
    """mu (the sampler's log-probs) against pi_old (the trainer's recomputation), and the first update's gradient
    with and without the correction."""
    ids, (comp, mu) = draw(model, rows, new, device, seed=3)
    comp, mu = comp.cpu(), mu.cpu().float()
    mask = torch.ones_like(comp, dtype=torch.bool)
    prompts_ = [p.cpu() for p in ids]
    with torch.no_grad():
        old = token_logprobs(model, prompts_, comp, mask, 0, 1.0, device).cpu()
    m = mismatch_metrics(old, mu, mask, log_cap=torch.log(torch.tensor(2.0)).item())
    group = GROUP
    rewards = torch.tensor([1.0, 0.0] * (group // 2))
    groups = [RolloutGroup(prompt_id=f"p{k}", prompt_ids=prompts_[k * group],
                           completion_ids=comp[k * group:(k + 1) * group],
                           completion_mask=mask[k * group:(k + 1) * group], rewards=rewards,
                           advantages=rewards - rewards.mean(), behaviour_logp=torch.zeros(0), success_rate=0.5,
                           n_generated=group, step=0) for k in range(rows // group)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)  # the weights stay; the gradients stay readable
    grads, stats = {}, {}
    for corrected in (True, False):
        batch = copy.deepcopy(groups)
        for k, g in enumerate(batch):
            if corrected:  # mu = the sampler's log-probs (train.behaviour=sampler)
                g.sampler_logp = mu[k * group:(k + 1) * group]
                g.behaviour_logp = g.sampler_logp.clone()
        stats[corrected] = policy_update(model, opt, batch, LossSettings(
            clip_eps=0.2, aggregation="token", grad_clip=1e9, temperature=1.0, pad_id=0, minibatches=1, kl_coef=0.0,
            micro_batch_tokens=8192, behaviour_cap=2.0), device=device).metrics
        grads[corrected] = torch.cat([p.grad.float().flatten() for p in params])
    opt.zero_grad(set_to_none=True)
    change = float((grads[True] - grads[False]).norm() / grads[False].norm())
    return ["| KL(mu, pi_old) | mean pi_old / mu | max pi_old / mu | max abs log diff | tokens over cap 2 | "
            "gradient change by the correction |", "|---|---|---|---|---|---|",
            f"| {m['offpolicy/kl']:.2e} | {m['offpolicy/ratio_mean']:.4f} | {m['offpolicy/ratio_max']:.3f} | "
            f"{m['offpolicy/logp_diff_max']:.3f} | {m['offpolicy/truncated_frac']:.2%} | {change:.2%} |"]


# ---------------------------------------------------------------- where a decode step's time goes
#: The step's parts, each a profiler range opened by :func:`instrumented` (innermost wins): kernels under none are
#: "other" (embeddings, norms, rotary, residual adds, the KV write).
PARTS = ("attention kernel", "attention projections", "mlp", "lm head", "sampling", "record + stop check",
         "mask update", "compaction", "other")
_ATTENTION_OPS = ("attention", "fmha", "flash", "sdpa", "cudnn")


def instrumented(decoder: Decoder):
    """Profiler ranges around the step's parts of ``decoder``'s model and loop (forward hooks and wrapped methods,
    for profiling only); returns an undo function."""
    from torch.autograd.profiler import record_function

    from tasks.generation import decode as decode_module

    model, undo, open_ranges = decoder.model, [], {}

    def around(module, name):
        def pre(mod, *_):
            open_ranges[id(mod)] = record_function(name).__enter__()

        def post(mod, *_):
            open_ranges.pop(id(mod)).__exit__(None, None, None)

        undo.extend([module.register_forward_pre_hook(pre).remove, module.register_forward_hook(post).remove])

    for layer in model.model.layers:
        around(layer.self_attn, "attention projections")
        around(layer.mlp, "mlp")
    around(model.lm_head, "lm head")

    def wrap(owner, attr, name):
        fn = getattr(owner, attr)

        def wrapped(*args, **kw):
            with record_function(name):
                return fn(*args, **kw)

        setattr(owner, attr, wrapped)
        undo.append(lambda: setattr(owner, attr, fn))

    wrap(decode_module, "sample_next", "sampling")
    wrap(decoder, "_advance", "record + stop check")
    wrap(decoder, "_open_column", "mask update")
    wrap(decoder, "_compact", "compaction")
    return lambda: [u() for u in reversed(undo)]


def part_of(event) -> str:
    """The part a profiled op belongs to: an attention kernel by its op's name, else its innermost range."""
    if any(a in event.name.lower() for a in _ATTENTION_OPS) and event.name.startswith("aten::"):
        return "attention kernel"
    e = event
    while e is not None:
        if e.name in PARTS:
            return e.name
        e = e.cpu_parent
    return "other"


def breakdown(prof, cuda: bool) -> dict[str, float]:
    """Milliseconds of device time (CUDA kernels; on the CPU the ops' own CPU time) by part."""
    out = dict.fromkeys(PARTS, 0.0)
    for e in prof.events():
        if cuda:
            us = sum(getattr(k, "duration", 0.0) for k in e.kernels)
        else:
            us = e.self_cpu_time_total if e.name.startswith("aten::") else 0.0
        if us:
            out[part_of(e)] += us / 1e3
    return out


@torch.inference_mode()
def step_profile(model, rows: int, new: int, device) -> list[str]:
    """One decode step at ``rows`` rows (no stop token, the cache half written), after a full call: torch.profiler
    over an eager step (kernel time by part), and the wall time of the eager step and of its graph's replay."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    decoder = Decoder(model)
    draw(model, rows, new, device, decoder=decoder)  # buffers, graphs, the race's compile
    draw(model, rows, new, device, decoder=decoder, seed=1)
    mid = new // 2
    opts = decoder.options or DecodeOptions.for_device(device)
    w = opts.width_multiple
    width = decoder.cache.length if w is None else min(decoder.cache.length, -(-(decoder._p + mid) // w) * w)
    sampling = Sampling(temperature=1.0)

    def eager_step():
        decoder._t.fill_(mid)
        decoder._step_body(rows, width, sampling)

    for _ in range(3):
        eager_step()
    eager_ms = timed(lambda: [eager_step() for _ in range(10)], device) * 100
    undo = instrumented(decoder)
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            eager_step()
            sync(device)
    finally:
        undo()
    parts = breakdown(prof, cuda)
    graph = decoder._graphs.get((rows, width, sampling))
    replay_ms = None
    if graph is not None:
        def replay():
            for _ in range(10):
                decoder._t.fill_(mid)
                graph.replay()
        replay()
        replay_ms = timed(replay, device) * 100
    total = sum(parts.values())
    out = [f"one decode step at {rows} rows, step {mid} of {new} (attention width {width} of "
           f"{decoder.cache.length} columns): eager {eager_ms:.2f} ms wall, "
           f"graph replay {'-' if replay_ms is None else f'{replay_ms:.2f}'} ms wall; "
           f"{'kernel' if cuda else 'CPU op'} time by part (one eager step, torch.profiler):",
           "| part | ms | share |", "|---|---|---|"]
    out += [f"| {k} | {v:.3f} | {v / total:.0%} |" for k, v in parts.items()]
    out.append(f"| all | {total:.3f} | 100% |")
    if cuda:
        out.append("\ntop kernels:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    return out


def first_call(model, rows: int, new: int, device) -> list[str]:
    """A fresh decoder's first call at ``rows`` rows against its second, the capture's share of it, and the race's
    first (compiling) call."""
    from tasks.generation import sampling as sampling_module

    x = torch.randn(4, model.config.vocab_size, device=device, dtype=next(model.parameters()).dtype)
    keys = sampling_module.step_keys(sampling_module.row_keys(torch.zeros(1, dtype=torch.long, device=device), 4), 0)
    race_s = timed(lambda: sampling_module.sample_next(x, Sampling(temperature=1.0), keys), device)
    decoder = Decoder(model)
    first = timed(lambda: draw(model, rows, new, device, decoder=decoder), device)
    capture, graphs = decoder.capture_s, decoder.graphs
    second = timed(lambda: draw(model, rows, new, device, decoder=decoder, seed=1), device)
    fused = sampling_module._FUSED
    return [f"race's first call (compile: {fused.compiled if fused.fn is not None else 'eager device'}): "
            f"{race_s:.2f} s",
            f"first call at {rows} rows x {new} tokens: {first:.2f} s ({graphs} graphs captured in {capture:.2f} s); "
            f"second call {second:.2f} s; first - second {first - second:.2f} s"]


def capture_check(device) -> list[str]:
    """A capture whose function raises: the caller's stream is current again, and the next capture works."""
    from tasks.generation.capture import capture

    if torch.device(device).type != "cuda":
        return ["capture check: CUDA only"]
    x = torch.ones(4, device=device)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    before = torch.cuda.current_stream()

    def broken():
        x.mul_(2)
        raise RuntimeError("broken step")

    try:
        capture(torch.cuda.CUDAGraph(), broken, pool=pool, stream=stream, mode="global")
    except RuntimeError as err:
        raised = str(err)
    restored = torch.cuda.current_stream() == before
    pool = torch.cuda.graph_pool_handle()  # as the decoder does: the failed capture's pool is not reused
    graph = torch.cuda.CUDAGraph()
    capture(graph, lambda: x.add_(1), pool=pool, stream=stream, mode="global")
    graph.replay()
    torch.cuda.synchronize()
    return [f"capture check: a failing capture raised {raised!r}, caller's stream restored: {restored}; the next "
            f"capture replays: {bool((x == 2).all())}"]


def main(argv: list[str] | None = None) -> int:
    """The decode step's profile, the first call and the capture check on one device (one GPU call)."""
    import argparse
    import sys
    from pathlib import Path

    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    gpu_bench = __import__("gpu-bench")
    p = argparse.ArgumentParser(description="decode step profile, first call, capture check")
    p.add_argument("--shape", default=None, help="gpu-bench.py's SHAPES (default 1.5b on CUDA, toy on the CPU)")
    p.add_argument("--rows", type=int, nargs=2, default=None, help="first-call rows, profile rows (256 512)")
    p.add_argument("--new", type=int, default=None, help="new tokens (256; 8 on the CPU)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(guard_attention(device).line())  # the run's kernel choice: cuDNN SDPA off on CUDA
    shape = args.shape or ("1.5b" if cuda else "toy")
    first_rows, profile_rows = args.rows or ((256, 512) if cuda else (16, 32))
    new = args.new or (256 if cuda else 8)
    model = gpu_bench.build(shape, "full", device, torch.bfloat16 if cuda else torch.float32)[0].eval()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name}, {shape}, torch {torch.__version__}")
    for part in (lambda: first_call(model, first_rows, new, device), lambda: capture_check(device),
                 lambda: step_profile(model, profile_rows, new, device),
                 lambda: sampler_rows(model, [profile_rows], new, device, name)):
        print("\n".join(part()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
