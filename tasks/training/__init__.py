"""Training: the rounds of GRPO steps (``loop``) with their one-line summaries (``rounds``) and crash-safe
checkpoints (``checkpoint``). The step's parts live where their concern does: selection in ``tasks/selection``,
rollouts in ``tasks/generation`` and ``tasks/calibration``, the update in ``tasks/update``, the overlap in
``tasks/overlap``.
"""
