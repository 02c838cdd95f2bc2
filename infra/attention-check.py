"""Confirm or rule out pytorch#196678 on a GPU: one micro-batch's forward and backward at the real shape, in the
generation layout (left-padded prompts, an explicit attention mask: fully masked query rows) and in the training
layout (contiguous rows, no mask: tasks/model/forward.py), each with cuDNN SDPA on and off.

The bug (cuDNN SDPA backward, pytorch/pytorch issue 196678; docs/performance.md, "On a GPU") needs a mask tensor, a
padded length of 64 modulo 128 and a query row whose log-sum-exp is below about -88.7: the defaults give 8 rows of a
random Qwen2.5-1.5B (bf16, activation checkpointing) whose longest prompt (64) and completion (1,024) make 1,088 =
8.5 x 128 columns. Each variant prints whether its loss and gradient are finite, the first parameter with a
non-finite gradient, and the attention kernels the CUDA profiler saw; the last line is the verdict. ``--toy`` runs
the same on the CPU (a 2-layer shape; no cuDNN there, every variant finite), which tests/test_infra.py runs.

    python infra/attention-check.py                # on a CUDA machine
    python infra/attention-check.py --toy          # the CPU twin
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from qwen_shapes import SHAPES as QWEN  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from tasks.model.forward import pack, token_logprobs  # noqa: E402
from tasks.model.logprob_head import CompletionIndex, chunked_head  # noqa: E402
from tasks.update.policy_update import gradient_checkpointing  # noqa: E402

#: Qwen2.5-1.5B's shape (infra/qwen_shapes.py) and a 2-layer CPU twin with a small vocabulary.
SHAPES = {"1.5b": QWEN["1.5b"], "toy": {**QWEN["toy"], "vocab_size": 1_000}}
#: Substrings of the CUDA kernel names of SDPA's backends.
KERNELS = {"cudnn": ("cudnn",), "flash": ("flash",), "efficient": ("fmha", "efficient", "mem_eff")}


@dataclass(frozen=True)
class Outcome:
    layout: str
    cudnn: bool
    loss_finite: bool
    grad_norm: float
    first_bad: str | None
    kernels: tuple[str, ...]

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.first_bad is None

    def line(self) -> str:
        bad = f", first non-finite gradient: {self.first_bad}" if self.first_bad else ""
        return (f"{self.layout:<10} cuDNN SDPA {'on ' if self.cudnn else 'off'}: loss "
                f"{'finite' if self.loss_finite else 'NOT finite'}, gradient norm {self.grad_norm:.4g}{bad}; "
                f"attention kernels: {'/'.join(self.kernels) or 'not seen (CPU)'}")


def rows(n: int, prompt: int, completion: int, vocab: int):
    """``n`` rows: prompts of ``prompt / 2 .. prompt`` tokens, completions of ``completion / 2 .. completion``; the
    first row reaches both longest lengths (the padded width is ``prompt + completion``)."""
    g = torch.Generator().manual_seed(0)
    p_lens = torch.randint(max(prompt // 2, 1), prompt + 1, (n,), generator=g)
    c_lens = torch.randint(max(completion // 2, 1), completion + 1, (n,), generator=g)
    p_lens[0], c_lens[0] = prompt, completion
    prompts = [torch.randint(4, vocab, (int(k),), generator=g) for k in p_lens]
    mask = torch.arange(completion) < c_lens[:, None]
    comp = torch.where(mask, torch.randint(4, vocab, (n, completion), generator=g), 0)
    return prompts, comp, mask


def generation_layout_logprobs(model, prompts, comp, mask, device) -> torch.Tensor:
    """[N, L] log-probs through the generation layout (:func:`pack`: left pads, an explicit mask), the head chunked
    as the training pass's (its states at ``P - 1 + j``, P the padded prompt width)."""
    ids, am, pos, width = pack(prompts, comp, mask, 0)
    r, c = mask.nonzero(as_tuple=True)
    index = CompletionIndex(rows=r, columns=c, positions=width - 1 + c, targets=comp[r, c], n=len(prompts),
                            width=ids.shape[1]).to(device)
    with chunked_head(model, index, 1.0) as chunked:
        assert chunked
        lp = model(input_ids=ids.to(device), attention_mask=am.to(device), position_ids=pos.to(device),
                   use_cache=False, logits_to_keep=index.keep).logits
    return index.scatter(lp, comp.shape[1])


def run(model, layout: str, cudnn: bool, data, device: torch.device) -> Outcome:
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    prompts, comp, mask = data
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, comp.numel()).reshape(comp.shape).to(device) * mask.to(device)
    cuda = device.type == "cuda"
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if cuda else nullcontext()
    with profiler as prof:
        if layout == "generation":
            lp = generation_layout_logprobs(model, prompts, comp, mask, device)
        else:
            lp = token_logprobs(model, prompts, comp, mask, 0, device=device)
        loss = (lp * weights).sum() / mask.sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
    names = {e.key.lower() for e in prof.key_averages()} if cuda else set()
    kernels = tuple(k for k, subs in KERNELS.items() if any(s in n for n in names for s in subs))
    first_bad = next((n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()),
                     None)
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                       if p.grad is not None])))
    return Outcome(layout, cudnn, bool(loss.isfinite()), norm, first_bad, kernels)


def verdict(out: list[Outcome]) -> str:
    by = {(o.layout, o.cudnn): o.finite for o in out}
    if all(by.values()):
        return "verdict: every variant finite: pytorch#196678 not reproduced at this shape"
    if not by[("generation", True)] and by[("generation", False)] and by[("contiguous", True)] \
            and by[("contiguous", False)]:
        return ("verdict: pytorch#196678 confirmed: the masked layout goes non-finite with cuDNN SDPA only; the "
                "contiguous layout (no mask) is finite with it")
    bad = ", ".join(f"{lay} cuDNN {'on' if c else 'off'}" for (lay, c), ok in by.items() if not ok)
    return f"verdict: non-finite in {bad}: not (only) pytorch#196678"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--toy", action="store_true", help="the CPU twin (also without a GPU)")
    p.add_argument("--rows", type=int, default=None, help="rows of the micro-batch (8; toy 4)")
    p.add_argument("--prompt", type=int, default=None, help="longest prompt (64; toy 8)")
    p.add_argument("--completion", type=int, default=None, help="longest completion (1,024; toy 24)")
    p.add_argument("--no-checkpointing", action="store_true", help="keep activations instead of recomputing them")
    args = p.parse_args(argv)
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    shape = SHAPES["toy" if toy else "1.5b"]
    cfg = Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=1e6, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.float32 if toy else torch.bfloat16)
    gradient_checkpointing(model, not args.no_checkpointing)
    model.train()
    data = rows(args.rows or (4 if toy else 8), args.prompt or (8 if toy else 64),
                args.completion or (24 if toy else 1024), shape["vocab_size"])
    width = max(p.numel() for p in data[0]) + data[1].shape[1]
    print(f"{'CPU' if toy else torch.cuda.get_device_name(device)}, torch {torch.__version__}: {len(data[0])} rows, "
          f"generation layout {width} columns ({width % 128} modulo 128)")
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        out = [run(model, layout, cudnn, data, device) for layout in ("generation", "contiguous")
               for cudnn in (True, False)]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    for o in out:
        print(o.line())
    print(verdict(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
