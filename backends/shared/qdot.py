"""Integer dot products of a stored weight row with quantized activations, as ggml's CPU does
them (shared by the CPU and CUDA targets, compiled like codecs.py).

`qdot_<type>(x, i3, i2, i1, q, n)` dots n elements of row (i3, i2, i1) of weight `x` with the
row `q` of the weight type's vec_dot_type blocks (Q8_0 for 32-element quants, Q8_K for
K-quants: the bytes `enc_q8_0` / `enc_q8_k` write). Each block's weight values times the int8
activation quants are summed in integers (`_isum_*` below), the sub-block scales applied as
integers where ggml does, then one float multiply per block by both blocks' scales: ggml's
order of rounding, no dequantized copy of either side.

The `_isum_*` helpers are written here as plain loops (what CUDA compiles); the CPU target
binds LLVM vector versions in their place (backends/cpu/qsimd.py, same arguments). Their `k`
(16 or 32) is always a literal: the CPU versions need it as the vector length. Types a record
names no qdot for (IQ4_NL, IQ4_XS: table lookups) keep the float path.
"""
import numpy as np
from .bound import bound

# names each binding supplies (backends/shared/bound.py)
(_f32_row, _half_row, _k4_min, _k4_scale, _q3_scale, _u32_row, f32_to_half, half_to_f32) = bound(
    "_f32_row", "_half_row", "_k4_min", "_k4_scale", "_q3_scale", "_u32_row", "f32_to_half",
    "half_to_f32")

# ---- integer block sums (the CPU replaces these by vector IR) -----------------------------


def _isum_i8(a, ao, b, bo, k):
    """sum_j int8(a[ao + j]) * int8(b[bo + j]), j < k."""
    t = 0
    for j in range(k):
        t += np.int32(np.int8(a[ao + j])) * np.int32(np.int8(b[bo + j]))
    return np.int64(t)


def _sum_i8(b, bo, k):
    t = 0
    for j in range(k):
        t += np.int32(np.int8(b[bo + j]))
    return np.int64(t)


def _isum_nib(a, ao, s, lm, off, b, bo, k):
    """sum_j (((a[ao + j] >> s) & lm) - off) * int8(b[bo + j]), j < k."""
    t = 0
    for j in range(k):
        t += (((np.int32(a[ao + j]) >> s) & lm) - off) * np.int32(np.int8(b[bo + j]))
    return np.int64(t)


def _isum_nib_h(a, ao, s, lm, h, ho, hs, hm, up, off, b, bo, k):
    """sum_j ((((a[ao+j] >> s) & lm) | (((h[ho+j] >> hs) & hm) << up)) - off) * int8(b[bo+j])."""
    t = 0
    for j in range(k):
        v = ((np.int32(a[ao + j]) >> s) & lm) | (((np.int32(h[ho + j]) >> hs) & hm) << up)
        t += (v - off) * np.int32(np.int8(b[bo + j]))
    return np.int64(t)


def _isum_q4(a, ao, off, b, bo):
    """A 32-element block of packed nibbles (low: elements 0-15, high: 16-31) minus off, dotted
    with 32 int8 quants at bo."""
    t = 0
    for j in range(16):
        w = np.int32(a[ao + j])
        t += ((w & 15) - off) * np.int32(np.int8(b[bo + j])) + \
            ((w >> 4) - off) * np.int32(np.int8(b[bo + 16 + j]))
    return np.int64(t)


def _isum_q5(a, ao, qh, off, b, bo):
    """_isum_q4 with bit j of the 32-bit qh as bit 4 of element j (Q5_0, Q5_1)."""
    t = 0
    for j in range(16):
        w = np.int32(a[ao + j])
        lo = (w & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (w >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        t += (lo - off) * np.int32(np.int8(b[bo + j])) + \
            (hi - off) * np.int32(np.int8(b[bo + 16 + j]))
    return np.int64(t)


def _isum_q4k(a, ao, sc1, sc2, b, bo):
    """A Q4_K sub-block pair: sc1 * (low nibbles . 32 quants at bo) + sc2 * (high nibbles .
    the next 32)."""
    t1 = 0
    t2 = 0
    for j in range(32):
        w = np.int32(a[ao + j])
        t1 += (w & 15) * np.int32(np.int8(b[bo + j]))
        t2 += (w >> 4) * np.int32(np.int8(b[bo + 32 + j]))
    return np.int64(sc1) * t1 + np.int64(sc2) * t2


def _k4_min_sum(row, so, q, bo, j):
    """Q4_K/Q5_K sub-block pair j's mins (6-bit, packed at byte so of the weight row) times
    the activations' sums: the Q8_K int16 sums of 16 at byte bo of q, two per sub-block."""
    return np.int64(_k4_min(row, so, 2 * j)) * (_i16_row(q, bo) + _i16_row(q, bo + 2)) + \
        np.int64(_k4_min(row, so, 2 * j + 1)) * (_i16_row(q, bo + 4) + _i16_row(q, bo + 6))  # noqa


def _f16_round(x):
    """float32 x rounded to the nearest f16 and back (the CPU binds one vcvtps2ph/vcvtph2ps)."""
    return half_to_f32(f32_to_half(x))


def _i16_row(row, o):
    """The little-endian int16 at byte o (Q8_K's bsums)."""
    u = np.int32(row[o]) | (np.int32(row[o + 1]) << 8)
    return np.int64(u - 65536 if u >= 32768 else u)


# ---- 32-element blocks times Q8_0 (34 bytes: f16 d, 32 int8) ------------------------------

def qdot_q4_0(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 32):
        o, p = b * 18, b * 34
        t = _isum_q4(row, o + 2, 8, q, p + 2)
        s += np.float32(t) * (_half_row(row, o) * _half_row(q, p))
    return s


def qdot_q4_1(x, i3, i2, i1, q, n):
    """ggml dots Q4_1 with Q8_1, whose s = d * sum(quants) is stored as f16: Q8_0's quants
    are the same, s is formed here (rounded to f16 as Q8_1 stores it)."""
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 32):
        o, p = b * 20, b * 34
        dq = _half_row(q, p)
        sy = _f16_round(np.float32(dq * np.float32(_sum_i8(q, p + 2, 32))))
        t = _isum_q4(row, o + 4, 0, q, p + 2)
        s += np.float32(t) * (_half_row(row, o) * dq) + _half_row(row, o + 2) * sy
    return s


def qdot_q5_0(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 32):
        o, p = b * 22, b * 34
        t = _isum_q5(row, o + 6, _u32_row(row, o + 2), 16, q, p + 2)
        s += np.float32(t) * (_half_row(row, o) * _half_row(q, p))
    return s


def qdot_q5_1(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 32):
        o, p = b * 24, b * 34
        dq = _half_row(q, p)
        sy = _f16_round(np.float32(dq * np.float32(_sum_i8(q, p + 2, 32))))
        t = _isum_q5(row, o + 8, _u32_row(row, o + 4), 0, q, p + 2)
        s += np.float32(t) * (_half_row(row, o) * dq) + _half_row(row, o + 2) * sy
    return s


def qdot_q8_0(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 32):
        o = b * 34
        t = _isum_i8(row, o + 2, q, o + 2, 32)
        s += np.float32(t) * (_half_row(row, o) * _half_row(q, o))
    return s


# ---- K-quants times Q8_K (292 bytes: f32 d, 256 int8, 16 int16 sums of 16) ----------------

def qdot_q2_k(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 256):
        o, p = b * 84, b * 292
        sumi = 0
        summ = 0
        for si in range(16):
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            sc = np.int32(row[o + si])
            t = _isum_nib(row, o + 16 + nn * 32 + h * 16, 2 * j, 3, 0, q, p + 4 + si * 16, 16)
            sumi += (sc & 15) * t
            summ += (sc >> 4) * _i16_row(q, p + 260 + 2 * si)
        dq = _f32_row(q, p)
        s += dq * _half_row(row, o + 80) * np.float32(sumi) - \
            dq * _half_row(row, o + 82) * np.float32(summ)
    return s


def qdot_q3_k(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 256):
        o, p = b * 110, b * 292
        sumi = 0
        for si in range(16):
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            t = _isum_nib_h(row, o + 32 + nn * 32 + h * 16, 2 * j, 3, row, o + h * 16,
                            nn * 4 + j, 1, 2, 4, q, p + 4 + si * 16, 16)
            sumi += np.int64(_q3_scale(row, o + 96, si)) * t
        s += _f32_row(q, p) * _half_row(row, o + 108) * np.float32(sumi)
    return s


def qdot_q4_k(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 256):
        o, p = b * 144, b * 292
        sumi = 0
        summ = 0
        for j in range(4):
            qo = o + 16 + 32 * j
            eo = p + 4 + 64 * j
            sumi += _isum_q4k(row, qo, np.int32(_k4_scale(row, o + 4, 2 * j)),
                              np.int32(_k4_scale(row, o + 4, 2 * j + 1)), q, eo)
            summ += _k4_min_sum(row, o + 4, q, p + 260 + 8 * j, j)
        dq = _f32_row(q, p)
        s += dq * _half_row(row, o) * np.float32(sumi) - \
            dq * _half_row(row, o + 2) * np.float32(summ)
    return s


def qdot_q5_k(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 256):
        o, p = b * 176, b * 292
        sumi = 0
        summ = 0
        for j in range(4):
            qo = o + 48 + 32 * j
            eo = p + 4 + 64 * j
            t1 = _isum_nib_h(row, qo, 0, 15, row, o + 16, 2 * j, 1, 4, 0, q, eo, 32)
            t2 = _isum_nib_h(row, qo, 4, 15, row, o + 16, 2 * j + 1, 1, 4, 0, q, eo + 32, 32)
            sumi += np.int64(_k4_scale(row, o + 4, 2 * j)) * t1 + \
                np.int64(_k4_scale(row, o + 4, 2 * j + 1)) * t2
            summ += _k4_min_sum(row, o + 4, q, p + 260 + 8 * j, j)
        dq = _f32_row(q, p)
        s += dq * _half_row(row, o) * np.float32(sumi) - \
            dq * _half_row(row, o + 2) * np.float32(summ)
    return s


def qdot_q6_k(x, i3, i2, i1, q, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for b in range(n // 256):
        o, p = b * 210, b * 292
        sumi = 0
        for nn in range(2):
            for h in range(2):
                lo = o + 64 * nn + 16 * h
                ho = o + 128 + 32 * nn + 16 * h
                eo = p + 4 + 128 * nn + 16 * h
                so = o + 192 + 8 * nn + h
                t1 = _isum_nib_h(row, lo, 0, 15, row, ho, 0, 3, 4, 32, q, eo, 16)
                t2 = _isum_nib_h(row, lo + 32, 0, 15, row, ho, 2, 3, 4, 32, q, eo + 32, 16)
                t3 = _isum_nib_h(row, lo, 4, 15, row, ho, 4, 3, 4, 32, q, eo + 64, 16)
                t4 = _isum_nib_h(row, lo + 32, 4, 15, row, ho, 6, 3, 4, 32, q, eo + 96, 16)
                sumi += np.int64(np.int8(row[so])) * t1 + np.int64(np.int8(row[so + 2])) * t2 + \
                    np.int64(np.int8(row[so + 4])) * t3 + np.int64(np.int8(row[so + 6])) * t4
        s += _f32_row(q, p) * _half_row(row, o + 208) * np.float32(sumi)
    return s
