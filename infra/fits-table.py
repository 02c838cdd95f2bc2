"""What the memory check (tasks/update/memory_check.py) counts for one update step of the Qwen2.5 shapes: the table
of README.md and docs/scale-out.md ("What fits"), printed from the estimate itself, so that the table is what a run
would compute. Nothing is allocated: each model is built on the meta device.

    python infra/fits-table.py [--micro-batch-tokens 8192] [--row-tokens 1152]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "infra")]

from qwen_shapes import SHAPES  # noqa: E402

from tasks.update.memory_check import GIB, ModelShape, estimate  # noqa: E402
from tasks.update.precision import resolve_precision  # noqa: E402

#: LoRA's rank (``model.lora.rank``'s default) and the linear layers it adapts in each decoder layer.
LORA_RANK = 16


def qwen(shape: dict) -> tuple[torch.nn.Module, Qwen2Config]:
    cfg = Qwen2Config(**shape)
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg), cfg


def lora_trainable(cfg: Qwen2Config, rank: int = LORA_RANK) -> int:
    """Adapter parameters of rank ``rank`` on every linear layer of the decoder: r x (in + out) each."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    pairs = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q, k, v, o, gate, up, down
    return cfg.num_hidden_layers * sum(rank * (a + b) for a, b in pairs)


#: One GPU's memory (an H100's 80 GB, GiB): a larger count says "does not fit".
CARD_GIB = 80 * 1e9 / 2**30


def rows(micro_batch_tokens: int = 8192, row_tokens: int = 1152) -> list[str]:
    """README.md's table (model, full, full + checkpointing, LoRA, LoRA + checkpointing, FSDP2 / ZeRO-3 on 8 GPUs),
    its header first: the estimate of each (module docstring)."""
    mixed = resolve_precision("bf16-mixed", torch.device("cuda"))
    out = ["| model | full | full + checkpointing | LoRA | LoRA + checkpointing | FSDP2 / ZeRO-3 on 8 GPUs, rank 0 |",
           "|---|---|---|---|---|---|"]
    for name in ("0.5b", "1.5b", "7b"):
        model, cfg = qwen(SHAPES[name])
        full = ModelShape.of(model, cfg)
        lora = ModelShape(**{**full.__dict__, "trainable": lora_trainable(cfg), "params": full.params
                             + lora_trainable(cfg), "head_trained": False, "embedding_trained": False})
        cells = []
        for shape, ckpt in ((full, False), (full, True), (lora, False), (lora, True)):
            gib = estimate(shape, mixed, tokens=micro_batch_tokens, checkpointing=ckpt, padded=False,
                           row_tokens=row_tokens, fused_adamw=True).total / GIB
            cells.append("does not fit" if gib > CARD_GIB else f"{gib:.1f}")
        sharded = [estimate(full, mixed, tokens=micro_batch_tokens, checkpointing=True, padded=False,
                            row_tokens=row_tokens, backend=b, world=8).total / GIB
                   for b in ("fsdp2", "deepspeed_zero3")]
        out.append(f"| Qwen2.5-{name.upper()} | {' | '.join(cells)} | {sharded[0]:.1f} / {sharded[1]:.1f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--row-tokens", type=int, default=1152)
    args = ap.parse_args()
    print(f"micro-batches of {args.micro_batch_tokens:,} tokens, rows up to {args.row_tokens:,}, bf16-mixed, fused "
          f"AdamW, LoRA rank {LORA_RANK} on every linear layer, generation elsewhere; GiB (over {CARD_GIB:.1f}: does "
          "not fit one 80 GB card)\n")
    print("\n".join(rows(args.micro_batch_tokens, args.row_tokens)))


if __name__ == "__main__":
    main()
