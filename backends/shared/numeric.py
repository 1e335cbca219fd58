"""Scalar math used inside kernels: f16/bf16 conversion without bit casts, C rounding,
activations, a row's norm. Plain Python over numpy scalars so numba can compile it for any target.

The conversions are arithmetic (exact in float64, frexp/ldexp) because numba has no float16
type on the CPU and no scalar bit cast; they round to nearest even exactly like the hardware.
"""
import math

import numpy as np


def half_to_f32(h):
    """IEEE half bits (an unsigned integer) -> float32. Exact: (1024 + m) << e is an integer
    below 2^41 and the division is by a power of two (no pow on the hot path)."""
    h = np.int64(h)
    s = (h >> 15) & 1
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float64(m) * 5.9604644775390625e-08          # m * 2^-24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = np.float64((1024 + m) << e) * 2.9802322387695312e-08  # * 2^-25
    return np.float32(-v if s else v)


def f32_to_half(x):
    """float32 -> IEEE half bits as uint16, round to nearest even (inf on overflow)."""
    v = np.float64(x)
    if v != v:
        return np.uint16(0x7E00)
    s = 0
    if v < 0.0 or (v == 0.0 and math.copysign(1.0, v) < 0.0):
        s = 0x8000
    a = abs(v)
    if a >= 65520.0:
        return np.uint16(s | 0x7C00)
    if a < 6.103515625e-05:                                  # below 2^-14: subnormal
        return np.uint16(s | np.int32(rint(a * 16777216.0)))
    mant, e = math.frexp(a)                                  # a = mant * 2^e, mant in [0.5, 1)
    frac = np.int32(rint((mant * 2.0 - 1.0) * 1024.0))    # may carry into the exponent
    return np.uint16(s | (((e - 1 + 15) << 10) + frac))


def bf16_to_f32(h):
    h = np.int64(h)
    s = (h >> 15) & 1
    e = (h >> 7) & 0xFF
    m = h & 0x7F
    if e == 0:
        v = math.ldexp(np.float64(m), -133)
    elif e == 255:
        v = np.inf if m == 0 else np.nan
    else:
        v = math.ldexp(np.float64(128 + m), int(e) - 134)
    return np.float32(-v if s else v)


def f32_to_bf16(x):
    """float32 -> bf16 bits, round to nearest even; NaN becomes a quiet NaN (0x7fc0 with the
    sign; ggml keeps the upper payload bits, which no computation here depends on)."""
    v = np.float64(np.float32(x))
    if v != v:
        return np.uint16(0x7FC0 | (0x8000 if math.copysign(1.0, v) < 0.0 else 0))
    s = 0
    if v < 0.0 or (v == 0.0 and math.copysign(1.0, v) < 0.0):
        s = 0x8000
    a = abs(v)
    if a == np.inf:
        return np.uint16(s | 0x7F80)
    if a < 1.1754943508222875e-38:                           # f32 subnormal range
        return np.uint16(s | np.int32(rint(math.ldexp(a, 133))))
    mant, e = math.frexp(a)
    frac = np.int32(rint((mant * 2.0 - 1.0) * 128.0))
    return np.uint16(s | (((e - 1 + 127) << 7) + frac))


def rint(x):
    """Round half to even (np.rint, which numba-cuda cannot compile)."""
    f = math.floor(x)
    r = x - f
    if r > 0.5 or (r == 0.5 and f - 2.0 * math.floor(f * 0.5) != 0.0):  # tie: to the even
        return f + 1.0
    return f


def mul_rn(a, b):
    """a * b rounded to float32 by itself: never fused with the add that follows it (the
    quantizers' x * id + 8.5 must round twice, as ggml's C does, to give gguf.quants' bytes).
    The CPU compiles kernels without contraction; the GPU target binds an unfusable multiply."""
    return np.float32(a * b)


def roundf(x):
    """C roundf on float32: half away from zero (exact: no x + 0.5 rounding)."""
    a = abs(x)
    f = math.floor(a)
    r = f + 1.0 if a - f >= 0.5 else f
    return -r if x < 0 else r


def silu(x):
    return x / (np.float32(1.0) + math.exp(-x))


def gelu(x):
    return np.float32(0.5) * x * (np.float32(1.0) + math.tanh(
        np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)))


def sigmoid(x):
    return np.float32(1.0) / (np.float32(1.0) + math.exp(-x))


def alibi_slope(h, n_head, max_bias):
    """Slope of head h of n_head heads; 1 when max_bias is 0 (as ggml)."""
    if max_bias <= 0.0:
        return np.float32(1.0)
    n_log2 = 1
    while n_log2 * 2 <= n_head:
        n_log2 *= 2
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    if h < n_log2:
        return np.float32(m0 ** (h + 1))
    return np.float32(m1 ** (2 * (h - n_log2) + 1))


def rope_cos_sin(p, i, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr_lo,
                 corr_hi, ff):
    """cos and sin of rotated pair i at position p (ggml's rope_yarn): linear scaling, the
    YaRN ramp between corr_lo and corr_hi with its magnitude correction, freq factor ff."""
    theta_extrap = p * freq_base ** (-2.0 * i / n_dims) / ff
    theta_interp = freq_scale * theta_extrap
    theta = theta_interp
    mscale = attn_factor
    if ext_factor != 0.0:
        y = (i - corr_lo) / max(0.001, corr_hi - corr_lo)
        ramp = (1.0 - min(1.0, max(0.0, y))) * ext_factor
        theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return math.cos(theta) * mscale, math.sin(theta) * mscale


def norm_row(x, eps, rms):
    """x (float32 row) normalized in place as ggml's norm / rms_norm: mean (none for rms) and
    mean square summed in float64, x = (x - mean) / sqrt(ms + eps) rounded to float32.

    The sums run in 4 interleaved float64 chains added at the end, a fixed order: one chain
    waits on each add's latency (a decode step's 1536-wide norm spent ~2 us there)."""
    n0 = x.shape[0]
    n4 = n0 - n0 % 4
    mean = 0.0
    if not rms:
        m0 = m1 = m2 = m3 = 0.0
        for i in range(0, n4, 4):
            m0 += x[i]
            m1 += x[i + 1]
            m2 += x[i + 2]
            m3 += x[i + 3]
        for i in range(n4, n0):
            m0 += x[i]
        mean = ((m0 + m1) + (m2 + m3)) / n0
    s0 = s1 = s2 = s3 = 0.0
    for i in range(0, n4, 4):
        c0 = np.float64(x[i]) - mean
        c1 = np.float64(x[i + 1]) - mean
        c2 = np.float64(x[i + 2]) - mean
        c3 = np.float64(x[i + 3]) - mean
        s0 += c0 * c0
        s1 += c1 * c1
        s2 += c2 * c2
        s3 += c3 * c3
    for i in range(n4, n0):
        c = np.float64(x[i]) - mean
        s0 += c * c
    ss = (s0 + s1) + (s2 + s3)
    sc = 1.0 / math.sqrt(ss / n0 + eps)
    for i in range(n0):
        x[i] = np.float32((np.float64(x[i]) - mean) * sc)
