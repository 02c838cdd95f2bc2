"""The race's noise: SplitMix64 bit for bit against a Python uint64 loop, never 0 (so a token that top-k or top-p
removed is never drawn), step keys from a device counter equal to those of a Python int, and a function that
``torch.compile`` compiles without an int64 literal beyond int32 (what Triton fails on) and without falling back
to eager."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tasks.generation.sampling import (
    CONSTANTS,
    E_MIN,
    _FusedDraw,
    exponential,
    mix64,
    noise_constants,
    race,
    race_draw,
    race_noise,
    row_keys,
    step_keys,
)

MASK64 = (1 << 64) - 1
INT32 = range(-(2**31), 2**31)


def mix64_oracle(z: int) -> int:
    """SplitMix64's finaliser on Python integers (uint64), the reference."""
    z &= MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return z ^ (z >> 31)


def noise_oracle(key: int, vocab: int) -> list[float]:
    """A row's noise from its step key by the recipe in Python integers and floats: float32 of
    ``max(-log((m + 1/2) 2^-53), 2^-54)``, ``m`` the top 53 bits of ``mix64(key + (v + 1) gamma)``."""
    out = []
    for v in range(vocab):
        m = mix64_oracle(key + (v + 1) * 0x9E3779B97F4A7C15) >> 11
        e = max(-math.log((m + 0.5) * 2.0 ** -53), 2.0 ** -54)
        out.append(float(torch.tensor(e, dtype=torch.float64).float()))
    return out


# ------------------------------------------------------------------ the value of the noise
def test_the_noise_is_the_python_oracles_bit_for_bit():
    """Keys at the edges of int64 and a few from the row and step keys; every entry exactly equal."""
    keys = torch.cat([torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 0x5DEECE66D]),
                      step_keys(row_keys(torch.tensor([7, 2**40 + 3]), 2), 5)])
    noise = race_noise(keys, 13)
    for i, key in enumerate(keys.tolist()):
        assert noise[i].tolist() == noise_oracle(key, 13), i


def test_step_keys_from_a_device_counter_equal_those_of_a_python_int():
    """A CUDA graph advances a 0-d int64 step counter; the keys are those of the Python int (wrapping products
    included: t = 2^40 overflows (t + 1) gamma')."""
    keys = row_keys(torch.tensor([3, 11]), 4)
    for t in (0, 1, 7, 255, 2**40):
        want = [mix64_oracle((k & MASK64) + (t + 1) * 0xD1B54A32D192ED03) for k in keys.tolist()]
        for got in (step_keys(keys, t), step_keys(keys, torch.tensor(t))):
            assert [g & MASK64 for g in got.tolist()] == want, t


def test_the_mixer_and_constants_are_splitmix64s():
    xs = [0, 1, 12345, 2**63 - 1, -1, -(2**63)]
    assert [g & MASK64 for g in mix64(torch.tensor(xs)).tolist()] == [mix64_oracle(x) for x in xs]
    assert [c & MASK64 for c in noise_constants("cpu").tolist()] == list(CONSTANTS.values())


def test_the_noise_is_positive_and_finite_for_every_bit_pattern():
    """All ones: ``(2^53 - 1 + 1/2)`` rounds to ``2^53`` in float64, ``u = 1`` and ``-log u = 0`` (the race would
    then divide by 0): it is :data:`E_MIN` now. All zeros: ``54 log 2``. The patterns next to all ones keep their
    values (the floor moves only the one)."""
    ones, zeros = (1 << 53) - 1, 0
    bits = torch.tensor([ones, ones - 1, ones - 2, 1 << 52, zeros, 1])
    e = exponential(bits)
    assert e.dtype == torch.float32 and bool((e > 0).all()) and bool(e.isfinite().all())
    assert float(e[0]) == float(torch.tensor(E_MIN).float()) > 0
    assert float(e[1]) == float(torch.tensor(-math.log1p(-2.0 ** -52)).float())  # 2^53 - 1.5 rounds to 2^53 - 2
    assert float(e[4]) == pytest.approx(54 * math.log(2), rel=1e-7)
    assert float(e[0]) < float(e[1])  # still the smallest: the order of the draws is kept


def test_a_removed_token_is_never_drawn_even_against_the_smallest_noise():
    """Rows whose cut tokens (p = 0, a -inf logit) race against :data:`E_MIN` and whose kept tokens against the
    largest noise (all zero bits): a kept token wins every row. Against a noise of 0, as the all-ones draw gave,
    0 / 0 is NaN and the removed token would win (the defect this guards)."""
    big = float(exponential(torch.tensor([0])))
    p = torch.tensor([[1.0, 0.0, 1e-30, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    kept = p > 0
    smallest = torch.where(kept, torch.full_like(p, big), torch.full_like(p, E_MIN))
    assert bool(kept.gather(1, race(p.clone(), smallest.clone())[:, None]).all())
    zero_noise = torch.where(kept, torch.full_like(p, big), torch.zeros_like(p))
    assert not bool(kept.gather(1, race(p.clone(), zero_noise)[:, None]).all())
    x = torch.log(p)  # -inf where removed
    tok, _, _ = race_draw(x, step_keys(row_keys(torch.tensor([0]), 3), 0), 1.0, noise_constants("cpu"))
    assert bool(kept.gather(1, tok[:, None]).all())


# ------------------------------------------------------------------ compiling
def int_literals_beyond_int32(code: str) -> list[int]:
    """The integer literals of generated code (C++ or Triton; decimal with C suffixes, or hex) outside int32."""
    found = [int(m, 16) for m in re.findall(r"(?<![\w.])0[xX]([0-9a-fA-F]+)(?:[uU]?[lL]{0,2})(?![\w.])", code)]
    found += [int(m) for m in re.findall(r"(?<![\w.])(\d+)(?:[uU]?[lL]{0,2})(?![\w.])", code)]
    return [v for v in found if v not in INT32 and -v not in INT32]


def test_the_literal_scan_finds_what_triton_rejects():
    assert int_literals_beyond_int32("tmp3 = tmp2 * (-7046029254386353131)\nx0 = xindex % 1000") == [
        7046029254386353131]
    assert int_literals_beyond_int32("auto tmp1 = static_cast<int64_t>(17179869183LL); tmp1 & 0xBF58476D1CE4E5B9;") \
        == [0xBF58476D1CE4E5B9, 17179869183]
    assert int_literals_beyond_int32("tmp = x0 + 1; y = 0.5 * 1.1102230246251565e-16; cpp_fused_0; 2147483647") == []


def fx_int_constants(fn, *args) -> list[int]:
    """The Python ints in the arguments of the graph dynamo traces from ``fn(*args)`` (no code generated)."""
    import torch._dynamo

    seen: list[int] = []

    def backend(gm, _inputs):
        for node in gm.graph.nodes:
            seen.extend(a for a in torch.fx.node.map_aggregate(node.args, lambda a: a)
                        if isinstance(a, int) and not isinstance(a, bool))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)(*args)
    return seen


def test_the_traced_noise_holds_no_64_bit_constant():
    """What dynamo hands inductor: no int outside int32 in the noise's graph (the constants arrive as a tensor);
    a version with the constants as Python literals does hold them (the check sees what it looks for)."""
    keys = step_keys(row_keys(torch.tensor([1]), 2), 0)
    c = noise_constants("cpu")
    assert [v for v in fx_int_constants(race_noise, keys, 50, c) if v not in INT32] == []

    def literal_noise(keys, vocab):
        z = keys[:, None] + torch.arange(1, vocab + 1) * -7046029254386353131
        return z ^ ((z >> 30) & ((1 << 34) - 1))

    assert -7046029254386353131 in fx_int_constants(literal_noise, keys, 50)


def test_the_race_compiles_on_the_cpu_without_falling_back(tmp_path, monkeypatch):
    """torch.compile (inductor, C++ on the CPU) of the race and of its noise: both compile (the fused draw reports
    no fallback), the generated code holds no integer literal outside int32, the noise is the eager noise bit for
    bit and the drawn tokens are the eager ones. Inductor's caches go to ``tmp_path`` (removed when the test passes),
    and no header is precompiled: inductor keeps that one (150 MB, one per virtual environment's path) in the
    system's temporary folder whatever its cache folder, and a CI machine's disk may be small."""
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(torch._inductor.config, "cpp_cache_precompile_headers", False)
    torch._dynamo.reset()
    c = noise_constants("cpu")
    keys = step_keys(row_keys(torch.tensor([5, 2**40 + 3]), 3), 2)
    noise, code = run_and_get_code(torch.compile(race_noise, dynamic=True, fullgraph=True), keys, 1000, c)
    assert code and all(int_literals_beyond_int32(src) == [] for src in code)
    assert torch.equal(noise, race_noise(keys, 1000))
    fused = _FusedDraw(attempt=True)
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).bfloat16()
    (tok, top, total), code = run_and_get_code(fused, x, keys, 0.7, c)
    assert fused.compiled and code and all(int_literals_beyond_int32(src) == [] for src in code)
    want = race_draw(x, keys, 0.7, c)
    assert torch.equal(tok, want[0]) and torch.equal(top, want[1])
    torch.testing.assert_close(total, want[2], atol=0, rtol=1e-6)
