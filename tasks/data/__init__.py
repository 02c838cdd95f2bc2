"""Data: where prompts come from and how answers are checked.

``arith`` (the bundled, generated task) and ``arith_grade`` (its verifier), ``sources`` (file adapters: GSM8K,
MATH, HumanEval, JSONL, Parquet, HF), ``ingest`` (sources -> ledger, duplicates dropped, bad rows quarantined),
``prompts`` (the normalised record), ``rewards`` (verifiers) and ``sandbox`` (contained execution of code answers,
with ``sandbox_confine``, the host's confinement, and ``sandbox_programs``, the child processes' code).
"""
