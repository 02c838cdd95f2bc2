"""Where bf16-mixed accumulates its micro-batches' gradients: in bf16 (as built: autograd's own ``.grad``, upcast
once a step by ``MasterWeights.master_gradients``) or in float32 (a post-accumulate-grad hook moving each bf16
gradient into the master's float32 ``.grad``, as Megatron-LM and DeepSpeed's bf16 optimizer do).

Both against the float32 run: the run's updater (``build_updater``) on tests/tasks/dist_update_helper.py's tiny
model and fixed batch, 10 AdamW steps at lr 1e-6, ``train.micro_batch_tokens`` = the first argument (default 16:
many micro-batches a step). Prints the update's norm ratio and cosine to the float32 run's, and the first step's
gradient error. ``PYTHONPATH=. .venv/bin/python infra/precision-accumulate.py [MICRO_TOKENS]``
"""

import copy
import sys

import torch

from tasks.config.load import validate
from tasks.model.attention import guard_attention
from tasks.update.backend import build_updater
from tests.policies import policy_of
from tests.tasks import dist_update_helper as h


def run(precision: str, micro: int, hook: bool = False, steps: int = 10, lr: float = 1e-6):
    guard_attention("cpu")  # the run's kernel choice (nothing to turn off on a CPU)
    model = h.tiny_model()
    start = [p.detach().clone() for p in model.parameters()]
    batch = h.make_batch(model)
    cfg = validate({"model": {"precision": precision}, "train": {"lr": lr, "minibatches": 1, "grad_clip": 1.0,
                                                                  "micro_batch_tokens": micro}})
    model.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    updater = build_updater(cfg, policy_of(model), device="cpu")
    opt = updater.optimizer
    if hook:
        def into(master):
            def move(p):
                g = p.grad.float()
                master.grad = g if master.grad is None else master.grad.add_(g)
                p.grad = None
            return move
        for p, m in zip(opt.params, opt.masters, strict=True):
            p.register_post_accumulate_grad_hook(into(m))
    stepped = opt.masters if precision != "fp32" else list(model.parameters())
    for i in range(steps):
        micro_batches = updater.step(copy.deepcopy(batch))["train/micro_batches"]
        if i == 0:
            grad = torch.cat([m.grad.float().flatten() for m in stepped])
    start = [s.to(torch.bfloat16).float() if precision != "fp32" else s for s in start]
    update = torch.cat([(m.detach().float() - s).flatten() for m, s in zip(stepped, start, strict=True)])
    return update, grad, micro_batches


def main() -> None:
    torch.set_num_threads(1)
    micro = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    ref, gref, _ = run("fp32", micro)
    print("| accumulation | micro-batches a step | update's norm / float32's | cosine | first gradient's error |")
    print("|---|---|---|---|---|")
    for hook in (False, True):
        d, g, n = run("bf16-mixed", micro, hook)
        print(f"| {'float32 (hook)' if hook else 'bf16, upcast at the step (as built)'} | {n:.0f} | "
              f"{float(d.norm() / ref.norm()):.4f} | {float(torch.nn.functional.cosine_similarity(d, ref, dim=0)):.4f}"
              f" | {float((g - gref).norm() / gref.norm()):.4f} |")


if __name__ == "__main__":
    main()
