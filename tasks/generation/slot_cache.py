"""The decode loop's KV cache (tasks/generation/decode.py): every layer's keys and values in buffers written in place
at given columns, behind the one method transformers' attention layers call (``past_key_values.update``)."""

from __future__ import annotations

import torch


class SlotCache:
    """Keys and values of every layer in buffers written in place at the columns ``slot`` (a device tensor); the
    model sees the first ``rows`` rows. What transformers' attention layers call: ``update`` (and, in some
    versions, ``get_seq_length`` to make positions we pass anyway). Buffers are allocated at the first ``update``
    of each layer (``length`` columns) unless given."""

    is_compileable = True

    def __init__(self, rows: int, length: int, keys: list[torch.Tensor] | None = None,
                 values: list[torch.Tensor] | None = None):
        self.rows, self.length = rows, length
        self.width: int | None = None  # columns the attention reads (None: all)
        self.keys: list[torch.Tensor] = keys if keys is not None else []
        self.values: list[torch.Tensor] = values if values is not None else []
        self.slot: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[rows, H_kv, q, D]`` keys and values at the columns ``slot`` (q of them) of layer
        ``layer_idx``; return that layer's ``[rows, H_kv, width, D]`` keys and values (``width`` default ``S``)."""
        if layer_idx == len(self.keys):  # allocate lazily, as the prefill meets each layer
            shape = (self.rows, key_states.shape[1], self.length)
            self.keys.append(key_states.new_zeros(*shape, key_states.shape[-1]))
            self.values.append(value_states.new_zeros(*shape, value_states.shape[-1]))
        k, v = self.keys[layer_idx][:self.rows], self.values[layer_idx][:self.rows]
        k.index_copy_(2, self.slot, key_states)
        v.index_copy_(2, self.slot, value_states)
        if self.width is not None:
            return k[:, :, :self.width], v[:, :, :self.width]
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
