"""Lane arithmetic the ggml_exact kernels share (backends/cpu/ggml_exact.py): f16 conversions,
one fma rounding, SIMD-style reductions by halves."""
from __future__ import annotations

import numpy as np
from numba import njit

from ..shared import numeric

f2h = njit(cache=True)(numeric.f32_to_half)
h2f = njit(cache=True)(numeric.half_to_f32)


@njit(cache=True)
def round_f16(x):
    return h2f(f2h(np.float32(x)))


@njit(cache=True)
def sum_halves(v):
    """Sum of v (a power-of-two length) as SIMD reductions add: the upper half onto the lower,
    again and again (hsum_float_8, _mm512_reduce_add_ps). Overwrites v."""
    h = v.shape[0] // 2
    while h >= 1:
        for j in range(h):
            v[j] = v[j] + v[j + h]
        h //= 2
    return v[0]


@njit(cache=True)
def fma32(a, b, c):
    """a * b + c rounded once to float32, as _mm256_fmadd_ps: a * b is exact in float64 (two
    24-bit mantissas), and the sum rounds twice (f64, then f32) only in rare ties."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
