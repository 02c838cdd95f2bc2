"""Training: the loop (``loop``) and its rounds (``rounds``), rollouts with verified rewards and reference
rollouts (``rollouts``), the overlap of generation and update (``overlap``), prompt selection (``selector``:
ScalingRL -> GAIN-RL -> DOTS; ``screen``, ``score``, ``calibration``), the plan (``plan``, ``probe``),
checkpoints (``checkpoint``) and held-out evaluation (``evaluate``). The step itself is the update engine's,
``tasks/update/``; generation is ``tasks/generation/``.
"""
