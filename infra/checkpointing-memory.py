"""Peak memory and time of one update's forward + backward with and without activation checkpointing
(``train.gradient_checkpointing``), on a randomly initialised Llama of hidden 256 and 8 layers, 32 rows of 544
tokens, CPU. Usage: .venv/bin/python infra/checkpointing-memory.py 0  (then 1); each run in its own process, so the
peak RSS is its own."""

import resource
import sys
import time

import torch

from tasks.model.forward import token_logprobs
from tasks.model.policy import build_tiny_model
from tasks.training.update import gradient_checkpointing

torch.set_num_threads(2)
on = sys.argv[1] == "1"
model = build_tiny_model(hidden=256, layers=8, heads=4, seed=0, max_positions=1024)
gradient_checkpointing(model, on)
model.train()
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(4, 90, (32,), generator=g) for _ in range(32)]
comp = torch.randint(4, 90, (32, 512), generator=g)
mask = torch.ones(32, 512, dtype=torch.bool)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
for _ in range(2):
    lp = token_logprobs(model, prompts, comp, mask, 0, 1.0, "cpu", max_tokens=0)
    lp.sum().backward()
peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
sys.stdout.write(f"checkpointing={on}: peak RSS +{peak_mib:.0f} MiB, {(time.perf_counter() - t0) / 2:.2f} s a step\n")
