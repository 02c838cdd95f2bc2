"""Tests of the DOTS attention-based adaptive-difficulty predictor (rlcore/difficulty.py)."""

import io
import math

import pytest
import torch
from torch import nn

from rlcore.difficulty import AttentionDifficultyPredictor, pearson

# the knobs the config sets (tasks/config/select.py PredictorConfig, and the run's seed) are required
KNOBS = {"hidden": 64, "layers": 2, "dropout": 0.1, "tau_att": 1.0, "calibration": "group_logit_temp",
         "linear_recalibration": False, "min_labels": 64, "lr": 1e-3, "seed": 0}


def _predictor(**kw):
    return AttentionDifficultyPredictor(**(KNOBS | kw))

torch.set_num_threads(1)


def _synthetic(n: int, gen: torch.Generator, centers: torch.Tensor, w: torch.Tensor):
    """Clustered random embeddings with success rate sigmoid(1.5 * w.z)."""
    c = torch.randint(0, centers.shape[0], (n,), generator=gen)
    z = centers[c] + torch.randn(n, centers.shape[1], generator=gen)
    return z, torch.sigmoid(1.5 * (z @ w))


@pytest.fixture(scope="module")
def task():
    gen = torch.Generator().manual_seed(0)
    dim = 32
    centers = 2 * torch.randn(8, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    w = w / w.norm()
    return {
        "dim": dim,
        "train": _synthetic(1024, gen, centers, w),
        "test": _synthetic(512, gen, centers, w),
        "ref": _synthetic(64, gen, centers, w),
    }


def test_pearson_hand_worked():
    # x = [1, 2, 3], y = [2, 4, 7]: xc = [-1, 0, 1], yc = [-7/3, -1/3, 8/3]
    # sum xc*yc = 7/3 + 8/3 = 5; sum xc^2 = 2; sum yc^2 = (49 + 1 + 64)/9 = 38/3
    # r = 5 / sqrt(2 * 38/3) = 5 / sqrt(25.3333) = 0.993399
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])) == pytest.approx(0.993399, abs=1e-6)
    assert math.isnan(pearson(torch.ones(4), torch.arange(4.0)))
    with pytest.raises(ValueError):
        pearson(torch.ones(3), torch.ones(4))


def test_off_the_shelf_hand_worked_two_references():
    p = _predictor(dim=2)
    refs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([1.0, 0.0])
    # query [1, 0]: cos = [1, 0]; scores = cos / sqrt(2) = [0.707107, 0]
    # a_1 = e^0.707107 / (e^0.707107 + 1) = 2.028115 / 3.028115 = 0.669761; prediction = a_1 * 1 + a_2 * 0
    # query [3, 3]: cos = [0.707107, 0.707107] -> equal weights -> 0.5
    pred = p.predict(torch.tensor([[1.0, 0.0], [3.0, 3.0]]), refs, labels)
    assert p.mode == "off_the_shelf"
    assert pred.tolist() == pytest.approx([0.669761, 0.5], abs=1e-6)
    # tau_att = 0.5: scores = [1.414214, 0]; e^1.414214 = 4.113250; 4.113250 / 5.113250 = 0.804430
    p_half = _predictor(dim=2, tau_att=0.5)
    assert p_half.predict(torch.tensor([[1.0, 0.0]]), refs, labels).item() == pytest.approx(0.804430, abs=1e-6)
    # top_k = 1 keeps only the most similar reference
    p_top = _predictor(dim=2, top_k=1)
    assert p_top.predict(torch.tensor([[1.0, 0.2]]), refs, labels).item() == pytest.approx(1.0)


def test_trained_path_hand_worked_calibration():
    p = _predictor(dim=2, hidden=2)
    p.query_tower, p.ref_tower = nn.Identity(), nn.Identity()  # so that P(z) = z
    with torch.no_grad():
        p.calib_head[2].weight.zero_()
        # o1 = log(e^2 - 1) -> temp = softplus(o1) = 2; o2 = atanh(0.5) -> bias = 0.5
        p.calib_head[2].bias.copy_(torch.tensor([math.log(math.e**2 - 1), math.atanh(0.5)]))
    refs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # scores = <z_i, z_q> / sqrt(2) = [0.707107, 0] -> p_raw = 0.669761 (as above)
    # logit(p_raw) = log(0.669761 / 0.330239) = 0.707107 (the score gap); / temp 2 = 0.353553; + bias = 0.853553
    # sigmoid(0.853553) = 1 / (1 + e^-0.853553) = 1 / (1 + 0.425899) = 0.701312
    out = p(torch.tensor([[1.0, 0.0]]), refs, torch.tensor([1.0, 0.0]))
    assert out.item() == pytest.approx(0.701312, abs=1e-5)


def test_forward_matches_loop_oracle(task):
    p = _predictor(dim=task["dim"], hidden=16, seed=3).eval()
    zq, zr, yr = task["test"][0][:5], task["ref"][0][:7], task["ref"][1][:7]
    out = p(zq, zr, yr)
    with torch.no_grad():
        std = yr.std()
        o = p.calib_head(torch.stack([yr.mean(), std]))
        temp, bias = torch.nn.functional.softplus(o[0]).clamp(0.01, 10), torch.tanh(o[1])
        for m in range(5):
            q = p.query_tower(zq[m : m + 1])[0]
            scores = [float(q @ p.ref_tower(zr[i : i + 1])[0]) / math.sqrt(16) for i in range(7)]
            e = [math.exp(s) for s in scores]
            raw = sum(ei * float(yr[i]) for i, ei in enumerate(e)) / sum(e)
            raw = min(max(raw, 1e-4), 1 - 1e-4)
            expected = 1 / (1 + math.exp(-(math.log(raw / (1 - raw)) / float(temp) + float(bias))))
            assert out[m].item() == pytest.approx(expected, abs=1e-5)


def test_learns_synthetic_mapping(task):
    (ztr, ytr), (zte, yte), (zref, yref) = task["train"], task["test"], task["ref"]
    p = _predictor(dim=task["dim"], min_labels=64)
    p.observe(ztr, ytr)
    off_the_shelf = pearson(p.predict(zte, zref, yref), yte)
    metrics = p.fit(200, torch.Generator().manual_seed(1))
    assert p.mode == "trained" and metrics["difficulty/trained"] == 1.0
    pred = p.predict(zte, zref, yref)
    r = pearson(pred, yte)
    assert r > 0.9, f"held-out Pearson {r:.3f}"
    assert r > off_the_shelf + 0.05
    assert ((pred >= 0) & (pred <= 1)).all()


def test_off_the_shelf_until_min_labels(task):
    (ztr, ytr), (zref, yref) = task["train"], task["ref"]
    p = _predictor(dim=task["dim"], min_labels=100)
    p.observe(ztr[:60], ytr[:60], step=0)
    m = p.fit(20, torch.Generator().manual_seed(0))
    assert m["difficulty/trained"] == 0.0 and m["difficulty/fit_steps"] == 0.0
    assert p.mode == "off_the_shelf"
    before = p.predict(ztr[:10], zref, yref)
    # oracle: cosine / sqrt(D) attention on the raw embeddings
    cos = torch.nn.functional.normalize(ztr[:10], dim=1) @ torch.nn.functional.normalize(zref, dim=1).T
    torch.testing.assert_close(before, torch.softmax(cos / math.sqrt(task["dim"]), 1) @ yref)
    p.observe(ztr[60:120], ytr[60:120], step=1)
    p.fit(5, torch.Generator().manual_seed(0))
    assert p.mode == "trained"
    assert not torch.allclose(p.predict(ztr[:10], zref, yref), before)


def test_linear_recalibration_hand_worked_and_clipped():
    p = _predictor(dim=2, linear_recalibration=True)
    refs, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, 0.0])
    # reference predictions x = [0.669761, 0.330239], y = [1, 0]: the line through both points,
    # a = 1 / 0.339523 = 2.945309, b = -a * 0.330239 = -0.972657, maps 0.5 -> 0.5 and 0.669761 -> 1.
    # query [1, -1]: cos = [0.707107, -0.707107], scores = [0.5, -0.5], p_raw = 1 / (1 + e^-1) = 0.731059
    # -> 2.945309 * 0.731059 - 0.972657 = 1.180537, clipped to 1.
    q = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]])
    assert p.predict(q, refs, labels).tolist() == pytest.approx([1.0, 0.5, 1.0, 0.0], abs=1e-5)
    # constant reference predictions (one reference): the line is undefined, predictions unchanged
    assert p.predict(q[:1], refs[:1], labels[:1]).item() == pytest.approx(1.0)


def test_predictions_in_unit_interval_all_options(task):
    (ztr, ytr), (zte, _), (zref, yref) = task["train"], task["test"], task["ref"]
    for kw in [{}, {"calibration": "none"}, {"linear_recalibration": True}]:
        p = _predictor(dim=task["dim"], min_labels=64, **kw)
        p.observe(ztr[:256], ytr[:256])
        p.fit(10, torch.Generator().manual_seed(0))
        pred = p.predict(100 * zte[:64], zref, yref)
        assert pred.shape == (64,) and ((pred >= 0) & (pred <= 1)).all()


def test_state_round_trip_identical_predictions_and_training(task):
    (ztr, ytr), (zte, _), (zref, yref) = task["train"], task["test"], task["ref"]
    p = _predictor(dim=task["dim"], min_labels=64, max_labels=500)
    p.observe(ztr[:300], ytr[:300], step=0)
    p.observe(ztr[300:600], ytr[300:600], step=1)
    p.fit(20, torch.Generator().manual_seed(0))
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    buf.seek(0)
    q = _predictor(dim=task["dim"], min_labels=64, max_labels=500, seed=99)
    q.load_state_dict(torch.load(buf))
    assert q.mode == "trained" and q.num_labels == 500
    torch.testing.assert_close(q.predict(zte, zref, yref), p.predict(zte, zref, yref), rtol=0, atol=0)
    # the label store and optimiser state came along: continued training stays identical
    p.fit(5, torch.Generator().manual_seed(7))
    q.fit(5, torch.Generator().manual_seed(7))
    torch.testing.assert_close(q.predict(zte, zref, yref), p.predict(zte, zref, yref), rtol=0, atol=0)


def test_label_store_keeps_newest_with_step():
    p = _predictor(dim=2, min_labels=2, max_labels=3)
    p.observe(torch.zeros(2, 2), torch.tensor([0.1, 0.2]), step=5)
    p.observe(torch.ones(2, 2), torch.tensor([0.3, 0.4]))  # default step: number of earlier calls = 1
    state = p.state_dict()["_extra_state"]
    assert state["store_y"].tolist() == pytest.approx([0.2, 0.3, 0.4])
    assert state["store_step"].tolist() == [5, 1, 1]


def test_input_validation():
    p = _predictor(dim=3)
    with pytest.raises(ValueError, match="shape"):
        p.predict(torch.zeros(2, 4), torch.zeros(1, 3), torch.zeros(1))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        p.observe(torch.zeros(1, 3), torch.tensor([1.5]))
    with pytest.raises(ValueError, match="rows"):
        p.observe(torch.zeros(2, 3), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="K >= 1"):
        p.predict(torch.zeros(2, 3), torch.zeros(0, 3), torch.zeros(0))
    with pytest.raises(ValueError, match="calibration"):
        _predictor(dim=3, calibration="platt")


def test_a_fit_with_the_foreach_adam_equals_the_per_tensor_one():
    """The predictor's Adam runs its step over all tensors at once (foreach), for speed: 100 fit steps give exactly
    the weights the per-tensor loop gives (and move them)."""
    def fitted(foreach: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        p = AttentionDifficultyPredictor(16, hidden=8, layers=2, dropout=0.1, tau_att=1.0,
                                         calibration="group_logit_temp", linear_recalibration=False, min_labels=8,
                                         lr=1e-2, seed=0)
        assert p._optimizer.defaults["foreach"] is True
        if not foreach:
            p._optimizer = torch.optim.Adam(p.parameters(), lr=1e-2, foreach=False)
        before = [w.detach().clone() for w in p.parameters()]
        g = torch.Generator().manual_seed(1)
        for s in range(3):
            p.observe(torch.randn(20, 16, generator=g), torch.rand(20, generator=g), s)
        p.fit(100, torch.Generator().manual_seed(2))
        return before, [w.detach().clone() for w in p.parameters()]

    (start, ours), (_, theirs) = fitted(True), fitted(False)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ours, start, strict=True))
