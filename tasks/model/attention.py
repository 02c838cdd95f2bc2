"""Which attention kernels the training passes may run: cuDNN SDPA off on CUDA, whatever the torch version.

PyTorch's cuDNN backend of ``scaled_dot_product_attention`` (the default on H100/H200 since torch 2.11) returns NaN
in the query gradient when an explicit ``attn_mask`` is passed, the padded length is 64 modulo 128 and some query
row's log-sum-exp is below about -88.7 (pytorch/pytorch issue 196678; TRL issue 7181 traced DPO NaNs on Qwen2.5 to
it). rlsift's training and scoring passes pass no mask (tasks/model/forward.py: contiguous rows, causal attention
without a mask tensor), which is the root fix; :func:`guard_attention` keeps cuDNN SDPA off for the whole process as
well, so a pass that still builds a mask (a model whose attention needs one, a future layout) cannot reach the bug:
SDPA then picks flash, memory-efficient or math attention. The flag is process-wide (``torch.backends.cuda``), so
it covers the forward pass, the recompute under activation checkpointing and the backward pass, whichever thread
runs them. docs/performance.md ("On a GPU") tells the GPU run that motivates it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: Why cuDNN SDPA is off, as the log line and the run's tag say it.
CUDNN_SDPA_ISSUE = "pytorch#196678"


@dataclass(frozen=True)
class AttentionKernels:
    """The SDPA kernels a process may run (``torch.backends.cuda``'s flags) and whether the guard turned cuDNN off.

    Attributes:
        device_type: ``cuda``, ``cpu``, ...
        kernels: the enabled SDPA backends among flash, efficient, math, cudnn, in that order (CUDA only).
        cudnn_off: :func:`guard_attention` turned cuDNN SDPA off (CUDA only).
    """

    device_type: str
    kernels: tuple[str, ...]
    cudnn_off: bool

    @classmethod
    def current(cls, device_type: str, cudnn_off: bool) -> AttentionKernels:
        """The flags as they are now (no kernel listed off CUDA: there the flags choose nothing)."""
        b = torch.backends.cuda
        flags = (("flash", b.flash_sdp_enabled()), ("efficient", b.mem_efficient_sdp_enabled()),
                 ("math", b.math_sdp_enabled()), ("cudnn", b.cudnn_sdp_enabled()))
        kernels = tuple(k for k, on in flags if on) if device_type == "cuda" else ()
        return cls(device_type=device_type, kernels=kernels, cudnn_off=cudnn_off)

    def describe(self) -> str:
        """``sdpa, kernels flash/efficient/math; cuDNN SDPA off: pytorch#196678`` (CUDA), ``sdpa on cpu``."""
        if self.device_type != "cuda":
            return f"sdpa on {self.device_type}"
        out = f"sdpa, kernels {'/'.join(self.kernels) or 'none'}"
        return f"{out}; cuDNN SDPA off: {CUDNN_SDPA_ISSUE}" if self.cudnn_off else out

    def line(self) -> str:
        """The log line: ``attention: `` and :meth:`describe`."""
        return f"attention: {self.describe()}"

    def tags(self) -> dict[str, str]:
        """The run's tag (MLflow) ``rlsift.attention``: :meth:`describe`."""
        return {"rlsift.attention": self.describe()}


_logged: set[str] = set()


def guard_attention(device: torch.device | str) -> AttentionKernels:
    """Choose the process's SDPA kernels for ``device``: on CUDA, cuDNN SDPA off (``enable_cudnn_sdp(False)``);
    elsewhere nothing changes. Logs the choice once per process (a later call with the same outcome is silent).

    Call it where a process sets up the device its update runs on (tasks/run.py for the run's process,
    tasks/update/sharded_update.py for each rank), before any training pass.
    """
    device_type = torch.device(device).type
    cudnn_off = device_type == "cuda"
    if cudnn_off:
        torch.backends.cuda.enable_cudnn_sdp(False)
    chosen = AttentionKernels.current(device_type, cudnn_off)
    line = chosen.line()
    if line not in _logged:
        _logged.add(line)
        log.info("%s", line)
    return chosen
