"""The scalar math shared by the backends (backends/shared/numeric.py) against numpy over
every f16 and bf16 bit pattern, both as the shared arithmetic (what CUDA compiles) and as the
CPU target's compiled functions (where f16 -> f32 is a table)."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ggraph import quants
from ggraph.backends.cpu.kernels import TARGET
from ggraph.backends.jit import Target

ALL16 = np.arange(65536, dtype=np.uint16)
SHARED = Target("shared-arith", numba.njit(cache=True))


def _map(fn, xs, out_dtype):
    @numba.njit
    def run(xs, out):
        for i in range(xs.size):
            out[i] = fn(xs[i])
    out = np.zeros(xs.size, out_dtype)
    run(xs, out)
    return out


def _floats():
    rng = np.random.default_rng(0)
    f16 = ALL16.view(np.float16).astype(np.float32)
    return np.concatenate([f16[~np.isnan(f16)], rng.normal(0, 1e3, 50000),
                           rng.uniform(-1e-4, 1e-4, 50000), [0.0, -0.0, 65519.0, 65520.0, 1e9,
                                                             -np.inf, np.inf]]).astype(np.float32)


@pytest.mark.parametrize("target", [SHARED, TARGET], ids=["shared", "cpu"])
def test_half_to_f32_all_patterns(target):
    got = _map(target.fn("half_to_f32"), ALL16, np.float32)
    ref = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan], ref[~nan]) and np.isnan(got[nan]).all()


def test_f32_to_half_rounds_like_numpy():
    x = _floats()
    got = _map(SHARED.fn("f32_to_half"), x, np.uint16)
    with np.errstate(over="ignore"):  # 65520 and above round to inf, as intended
        ref = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, ref)


def test_bf16_both_ways():
    ref = quants.bf16_bits_to_f32(ALL16)
    got = _map(SHARED.fn("bf16_to_f32"), ALL16, np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan], ref[~nan]) and np.isnan(got[nan]).all()
    x = _floats()
    assert np.array_equal(_map(SHARED.fn("f32_to_bf16"), x, np.uint16), quants.f32_to_bf16_bits(x))
