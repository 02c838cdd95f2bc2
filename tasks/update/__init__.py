"""The update engine: how one policy-gradient step runs, on one process or on many.

``policy_update`` (the loss on a batch of groups, micro-batched, and the ``Updater`` interface every backend meets
the loop through), ``minibatch`` (which rows go in which minibatch and micro-batch), ``distributed`` (torch DDP,
FSDP2 and DeepSpeed ZeRO-2/3: wrapping, collectives, state), ``sharded_update`` (the torchrun driver: rank 0 sends
commands, every rank steps), ``memory_check`` (whether a step fits the device, before anything is built), ``precision``
(``model.precision``: bf16 passes over float32 master weights and AdamW state) and ``backend`` (the run's updater
for ``scale.backend``). A reader who comes for "how does a step run on 8 GPUs" starts at
``backend.build_updater``.
"""
