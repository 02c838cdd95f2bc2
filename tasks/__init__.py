"""Everything with I/O, in one package per concern (imports go flows -> tasks -> rlcore).

At the top: ``config`` (typed, frozen configuration and every default), ``run`` (the run context every
stage receives) and ``stages`` (the Prefect tasks: thin wrappers that time, cost, record and call the
library code below).

- ``data``: the bundled task, source adapters, ingestion, prompt records, verifiable rewards, the sandbox.
- ``model``: policy loading and the tiny default, its warm start, rollout engines, forward passes.
- ``training``: the training loop, the update and its backends, selection, scoring, checkpoints, evaluation.
- ``records``: what a run leaves behind: the ledger (only duckdb user), tracking (only MLflow user), cost, plots.
- ``bench``: the benchmark's analysis and report, and TRL's GRPOTrainer as the outside control.
"""
