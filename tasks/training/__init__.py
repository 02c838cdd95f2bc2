"""Training: the rounds of GRPO steps. ``entry`` (the stage's entry: the trainer built with its updater and sampler,
and closed after), ``loop`` (the :class:`~tasks.training.loop.Trainer`, one method a phase of the step), ``draw``
(a step's selection, rollouts and groups), ``recorder`` (the step's ledger rows, MLflow metrics and
``metrics.jsonl``), ``rounds`` (each round's one-line summary) and ``checkpoint`` (crash-safe checkpoints). The
step's other parts live where their concern does: selection in ``tasks/selection``, rollouts in ``tasks/generation``
and ``tasks/calibration``, the update in ``tasks/update``, the overlap in ``tasks/overlap``.
"""
