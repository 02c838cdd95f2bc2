"""The attention guard (tasks/model/attention.py): cuDNN SDPA off on CUDA, logged once, a run tag; on CPU builds the
CUDA flags are settable, so the function that applies the guard runs here for real."""

import logging

import pytest
import torch

import tasks.model.attention as attention
from tasks.model.attention import AttentionKernels, guard_attention


@pytest.fixture(autouse=True)
def _restore_flags(monkeypatch):
    """Each test starts with cuDNN SDPA on (torch's default) and nothing logged, and leaves the flag as it was."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(attention, "_logged", set())
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_the_guard_turns_cudnn_sdpa_off_on_cuda_and_logs_once(caplog):
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with caplog.at_level(logging.INFO, logger="tasks.model.attention"):
        chosen = guard_attention(torch.device("cuda", 0))
        again = guard_attention("cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert chosen == again == AttentionKernels("cuda", ("flash", "efficient", "math"), cudnn_off=True)
    line = "attention: sdpa, kernels flash/efficient/math; cuDNN SDPA off: pytorch#196678"
    assert [r.getMessage() for r in caplog.records] == [line]  # once, however many callers
    assert chosen.tags() == {"rlsift.attention": "sdpa, kernels flash/efficient/math; cuDNN SDPA off: pytorch#196678"}


def test_the_guard_leaves_other_devices_alone(caplog):
    with caplog.at_level(logging.INFO, logger="tasks.model.attention"):
        chosen = guard_attention("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing changed
    assert chosen.tags() == {"rlsift.attention": "sdpa on cpu"}
    assert [r.getMessage() for r in caplog.records] == ["attention: sdpa on cpu"]


def test_the_kernels_reported_are_the_flags():
    """The record reads the flags as they are: a kernel turned off elsewhere is not listed."""
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert guard_attention("cuda").kernels == ("efficient", "math")
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
