"""Lane arithmetic the ggml_exact kernels share (backends/cpu/ggml_exact.py): f16 conversions,
one fma rounding, SIMD-style reductions by halves."""
from __future__ import annotations

import numpy as np
from numba import njit

from .compile import TARGET

# The CPU target's f16 conversions (F16C where the host has it, as ggml's on x86; bit for bit
# the shared ones): numba cannot compile the shared functions by themselves, their helpers
# (rint) are bound per target, so a cold numba cache failed here
f2h = TARGET.globals["f32_to_half"]
h2f = TARGET.globals["half_to_f32"]


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
