"""The update engine: how one policy-gradient step runs, on one process or on many.

``updater`` (the ``Updater`` interface every backend meets the loop through, what a step takes, ``LossSettings``, and
gives, ``UpdateResult``, and the learning-rate schedule), ``policy_update`` (the step on a batch of groups,
minibatch by minibatch, and the one-process ``LocalUpdater``), ``minibatch`` (which rows go in which minibatch and
micro-batch), ``loss`` (one micro-batch's share of the loss, and the metrics), ``skips`` and ``nan_locator`` (a
minibatch not applied: its cause and where the first non-finite value appeared), ``skip_guard`` (the run's stop after
too many skipped steps in a row), ``distributed`` (torch DDP, FSDP2 and DeepSpeed ZeRO-2/3: wrapping, collectives,
state), ``sharded_update`` (the torchrun driver: rank 0 sends commands, every rank steps), ``memory_check`` (whether a
step fits the device, before anything is built), ``precision`` (``model.precision``: bf16 passes over float32 master
weights and AdamW state) and ``backend`` (the run's updater for ``scale.backend``). A reader who comes for "how does
a step run on 8 GPUs" starts at ``backend.build_updater``.
"""
