"""Everything with I/O (imports go flows -> tasks -> rlcore), in packages that follow the pipeline.

The pipeline's stages, in order: ``data`` (ingestion: sources, prompt records, verifiers, the sandbox),
``calibration`` (the reference set measured before training), ``plan`` (which composition ``auto`` trains),
``selection`` (features, the selector, the likelihood screen), ``training`` (the trainer, its rounds, replay,
checkpoints and the recorder), ``evaluation`` (held-out accuracy) and ``report`` (the final model's registration:
the quality gate, the version's tags and description). ``stages`` wraps each as a Prefect task.

The engines they use: ``model`` (loading, LoRA, forward passes), ``generation`` (every rollout engine, behind
``RolloutEngine``), ``update`` (the policy-gradient step, on one process or many) and ``overlap`` (generation
beside the update, and whether a run overlaps). ``policy`` is the :class:`~tasks.policy.Policy` every stage passes
around.

The stores and context: ``config`` (typed, frozen configuration, every default, and its loader), ``records``
(ledger, the only package with duckdb and SQL; tracking, the only MLflow user; cost, plots), ``run`` (the run
context every stage receives), ``preflight`` (checks before any heavy import) and ``bench`` (the benchmark's analysis
and report).
tests/test_architecture.py keeps the packages in layers: no import cycle between them.
"""
