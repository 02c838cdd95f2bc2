"""Training: the loop (``loop``), rollouts with verified rewards and reference rollouts (``rollouts``), one
policy-gradient step (``update``: the ``Updater`` interface) on one process or sharded (``distributed``,
``sharded_update``; ``backend`` builds the run's), prompt selection (``selector``: ScalingRL -> GAIN-RL -> DOTS),
the scoring pass (``score``: embeddings and angle concentration), checkpoints (``checkpoint``) and
held-out evaluation (``evaluate``).
"""
