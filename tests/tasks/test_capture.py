"""When a CUDA graph capture of the decode step fails: the policy's decisions, fed the exceptions a capture raises
(the CUDA part, ``tasks.generation.capture.capture``, runs in infra/gpu_bench_generation.py's check)."""

from __future__ import annotations

import logging

import pytest
import torch

from tasks.generation.capture import CapturePolicy, capture_mode, is_out_of_memory

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
KEY, SMALLER = (512, 256, None), (256, 256, None)


def test_out_of_memory_is_recognised_and_other_errors_are_not():
    assert is_out_of_memory(OOM)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("operation not permitted when stream is capturing"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_out_of_memory_defers_the_graph_to_a_later_call_then_gives_up_on_it(caplog):
    """An OOM: this graph is not tried again in the call (others, a smaller bucket, are), it is at the next call,
    up to ``oom_retries`` more times, then that graph stays eager; graphs stay on for the rest."""
    policy = CapturePolicy(oom_retries=2)
    assert policy.should_capture(KEY)
    with caplog.at_level(logging.WARNING):
        for tries in range(3):
            assert policy.failed(KEY, OOM) == "retry"
            assert not policy.should_capture(KEY) and policy.should_capture(SMALLER)
            policy.new_call()
            assert policy.should_capture(KEY) == (tries < 2)
    assert not policy.eager and policy.should_capture(SMALLER)
    assert len(caplog.records) == 3 and "eager from now on" in caplog.records[-1].message
    policy.new_shape()  # new buffers: the memory left is another
    assert policy.should_capture(KEY)


def test_any_other_failure_means_eager_for_good_with_one_warning(caplog):
    policy = CapturePolicy()
    with caplog.at_level(logging.WARNING):
        assert policy.failed(KEY, RuntimeError("operation not permitted when stream is capturing")) == "eager"
        assert policy.failed(SMALLER, RuntimeError("again")) == "eager"
    assert policy.eager and not policy.should_capture(KEY) and not policy.should_capture(SMALLER)
    policy.new_call()
    policy.new_shape()
    assert not policy.should_capture((1, 128, None))
    assert len(caplog.records) == 1 and "not permitted" in caplog.records[0].message


def test_several_ranks_capture_thread_local():
    """The NCCL watchdog thread's CUDA calls would invalidate a global-mode capture."""
    assert capture_mode(1) == "global" and capture_mode(2) == "thread_local" and capture_mode(8) == "thread_local"
    with pytest.raises(ValueError, match="world size 0"):
        capture_mode(0)
    with pytest.raises(ValueError, match="oom_retries -1"):
        CapturePolicy(oom_retries=-1)


def test_the_decoder_takes_a_new_pool_after_a_failed_capture(monkeypatch):
    """A capture that fails leaves its pool unusable (PyTorch's ``use_count > 0`` assertion at the next
    ``capture_begin``, seen on an H200): the decoder's next capture must go to a new pool, and a capture that
    succeeds keeps the pool for the graphs after it. The CUDA calls are replaced by recorders; the decision is the
    decoder's own (``Decoder._step``)."""
    import tasks.generation.decode as decode

    handles = iter(range(1, 100))
    used: list[int] = []

    class Graph:
        def replay(self):
            pass

    def fake_capture(graph, fn, *, pool, stream, mode):
        used.append(pool)
        if len(used) == 1:
            raise OOM
        return fn()

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(torch.cuda, "Stream", object)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(decode, "capture", fake_capture)
    dec = decode.Decoder(torch.nn.Linear(1, 1))
    ran: list[tuple] = []
    monkeypatch.setattr(dec, "_step_body", lambda m, width, sampling: ran.append((m, width)))
    for key in (KEY, SMALLER):
        dec._step(*key, graphs=True)  # the warm-up run of each key: eager, no capture
    dec._step(*KEY, graphs=True)  # out of memory: eager, a new pool for the next capture
    dec._step(*SMALLER, graphs=True)  # captured
    dec.policy.new_call()
    dec._step(*KEY, graphs=True)  # retried at a later call: captured in the same pool as SMALLER's graph
    assert used == [(1, 0), (2, 0), (2, 0)], used
    assert dec.graphs == 2 and len(ran) == 5
