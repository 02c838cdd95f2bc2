"""Training: the loop (``loop``), one policy-gradient step (``update``) on one process or sharded
(``distributed``, ``sharded_update``), prompt selection (``selector``: ScalingRL -> GAIN-RL -> DOTS),
the scoring pass (``score``: embeddings and angle concentration), checkpoints (``checkpoint``) and
held-out evaluation (``evaluate``).
"""
