"""The overlap of generation and update (``overlap.lag`` 1): step t+1's rollouts drawn while update t runs.

``concurrent`` (the sampler, :class:`~tasks.overlap.concurrent.Sampler`, and the two threads of a step) and
``generator_process`` (the sampler's own process, which holds a copy of the weights and generates beside the
trainer). The lag's choice is pure: rlcore/overlap_lag.py.
"""
