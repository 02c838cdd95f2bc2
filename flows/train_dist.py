"""``torchrun`` entry for the multi-process training backends (``scale.backend``: ddp, fsdp2, deepspeed_zero2/3).

    torchrun --nproc_per_node 2 -m flows.train_dist -c conf/presets/all.yaml scale.backend=fsdp2 [--json]
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m flows.train_dist -c CONFIG scale.backend=deepspeed_zero3

Rank 0 runs the ordinary ``pipeline`` flow (the same stages, ledger, MLflow run and summary as
``rlsift run``); the other ranks serve the sharded policy updates (``tasks/update/sharded_update.py``) and exit
when rank 0 is done. Same arguments as ``rlsift run``. If rank 0 fails, it exits non-zero without
releasing the others and torchrun stops them (they may be inside a collective that can no longer finish).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from flows.cli import _env

    _env()
    p = argparse.ArgumentParser(prog="torchrun ... -m flows.train_dist", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", help="YAML config (e.g. conf/presets/all.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. scale.backend=fsdp2")
    p.add_argument("--resume", metavar="RUN_ID", help="continue a crashed run (same backend and world size)")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object on stdout")
    args = p.parse_args(argv)
    out = sys.stdout
    if args.json:  # stdout carries exactly one JSON object: anything else (DeepSpeed's build notes) -> stderr
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    from tasks.config import ConfigError
    from tasks.config.load import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"train_dist: {err}\n")
        return 2
    if cfg.scale.backend == "single":
        from tasks.records.commands import command

        sys.stderr.write(f"train_dist: scale.backend=single runs in one process: use `{command('run')}` (or set "
                         "scale.backend to ddp, fsdp2, deepspeed_zero2 or deepspeed_zero3)\n")
        return 2

    import torch.distributed as dist

    from tasks.update.distributed import init_distributed
    from tasks.update.sharded_update import serve, stop_workers

    info = init_distributed(cfg.model.device)
    logging.basicConfig(level=logging.INFO if info.rank == 0 and not args.json else logging.WARNING,
                        stream=sys.stderr, format=f"%(asctime)s [rank {info.rank}] %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    if info.rank != 0:
        serve()
        dist.destroy_process_group()
        # A worker holds nothing to flush but its streams; the interpreter's teardown sometimes aborted it
        # ("terminate called without an active exception": a native thread still joinable at exit; seen once in
        # six 2-rank FSDP2 runs on CPU), and torchrun then fails the run after rank 0 had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from flows.pipeline import pipeline

    summary = pipeline(config=args.config, overrides=list(args.overrides), resume=args.resume)
    stop_workers()
    dist.destroy_process_group()
    if args.json:
        out.write(json.dumps(summary, default=str) + "\n")
        out.flush()
    else:
        out.write(f"run {summary['run_id']} {summary['status']} ({cfg.scale.backend}, {info.world} processes) "
                  f"in {summary['wall_s']:.0f} s: held-out greedy accuracy {summary['eval_accuracy_start']:.3f} -> "
                  f"{summary['eval_accuracy_end']:.3f}; run folder {summary['run_dir']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
