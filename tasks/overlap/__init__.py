"""The overlap of generation and update (``overlap.lag`` 1): step t+1's rollouts drawn while update t runs.

``lag`` (whether a training overlaps: ``overlap.lag`` as set, or for ``auto`` from where the sampler and the trainer
run and, on a shared device, a probe of the draw and the update alone and at once; the choice's JSON record),
``concurrent`` (the sampler, :class:`~tasks.overlap.concurrent.Sampler`, the two threads of a step and the handover of
the probe's generator process to the training) and ``generator_process`` (the sampler's own process, which holds a
copy of the weights and generates beside the trainer). The decision itself is pure: rlcore/overlap_lag.py.
"""
