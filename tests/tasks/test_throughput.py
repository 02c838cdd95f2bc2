"""FLOP counts and the peak that MFU divides by (tasks/records/throughput.py)."""

import pytest
import torch

from rlcore.types import RolloutGroup
from tasks.model.loading import build_tiny_model
from tasks.records.throughput import DATASHEET_TFLOPS, FlopModel, Peak, measured_peak_flops, peak
from tasks.training.draw import FreshBatch
from tasks.training.recorder import throughput


def test_flops_by_hand():
    shape = FlopModel(params=1000, layers=2, hidden=8)
    # per token: 2 N = 2000, attention 4 * layers * context * hidden = 4 * 2 * 10 * 8 = 640
    assert shape.forward_flops(tokens=5, context=10) == 5 * (2000 + 640)
    assert shape.train_flops(tokens=5, context=10) == 3 * 5 * 2640


def test_model_shape_counts_a_tied_embedding_once():
    model = build_tiny_model(hidden=64, layers=2, heads=2, seed=0)
    shape = FlopModel.of(model)
    assert shape.layers == 2 and shape.hidden == 64
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one tensor, counted once


def test_peak_uses_the_datasheet_for_known_gpus_and_measures_otherwise():
    assert peak("nvidia-h100", "cuda", torch.bfloat16).flops == DATASHEET_TFLOPS["nvidia-h100"]["bfloat16"] * 1e12
    assert peak("nvidia-h100", "cuda", torch.bfloat16).source == "datasheet"
    cpu = peak("cpu", "cpu", torch.float32)
    assert cpu.source == "measured" and cpu.flops == measured_peak_flops("cpu", torch.float32)


def test_measured_peak_is_a_real_rate():
    flops = measured_peak_flops("cpu", torch.float32, size=256, repeats=2)
    assert 1e7 < flops < 1e14  # between a slow interpreter and a GPU


def test_step_throughput_by_hand():
    """The update computed 2 rows (prompt 3 tokens, completions 2 and 4 real tokens) in 0.5 s; 3 rollouts of a
    4-token prompt generated 9 completion tokens in 2 s; peak 1e6 FLOP/s."""
    group = RolloutGroup(prompt_id="p", prompt_ids=torch.tensor([5, 6, 7]), completion_ids=torch.zeros(2, 4),
                         completion_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool),
                         rewards=torch.tensor([0.0, 1.0]), advantages=torch.tensor([-0.5, 0.5]),
                         behaviour_logp=torch.zeros(0), success_rate=0.5, n_generated=2, step=0)
    fs = FreshBatch(groups=[group], idx=[0], rows=[], records=[], rewards=torch.zeros(1, 3), generated=3, tokens=9,
                    prompt_tokens=12, gen_s=2.0, stats={})
    shape = FlopModel(params=100, layers=1, hidden=4)
    upd_tokens = 2 * 3 + 6  # prompts once per row + real completion tokens
    m = throughput(shape, Peak(1e6, "measured"), fs, {"train/update_tokens": upd_tokens, "train/update_rows": 2},
                   upd_s=0.5)
    assert m["perf/update_tokens_per_s"] == upd_tokens / 0.5
    assert m["perf/update_mfu"] == pytest.approx(3 * upd_tokens * (200 + 4 * 1 * 6 * 4) / 0.5 / 1e6)
    assert m["perf/rollout_tokens_per_s"] == 21 / 2.0
    assert m["perf/rollout_mfu"] == pytest.approx(21 * (200 + 4 * 1 * 7 * 4) / 2.0 / 1e6)
    assert m["perf/peak_tflops"] == 1e-6
