"""Row decoders and encoders per tensor type, for kernels written once for every type.

A kernel sees each tensor as a 4-D numpy array in numpy order (i3, i2, i1, i0):
- element types as typed strided arrays (F32 float32; F16 and BF16 their uint16 bits;
  I32/I64 ints), any strides;
- quantized types as the bytes of each row, (i3, i2, i1, row_bytes), blocks packed.
`dec_<type>(x, i3, i2, i1, out, n)` writes n float32 values of row (i3, i2, i1) into out;
`enc_<type>(v, x, i3, i2, i1, n)` stores n float32 values there, quantizing like ggml's
reference quantizers (bit-exact with gguf.quants). `load_<type>`/`store_<type>` do one element.
The K-quants, IQ4 and Q8_K codecs are in codecs_k.py (same conventions, same helpers); both
modules are compiled by backends/jit.py, which looks each record's codec names up in both.
"""
import math

import numpy as np
from .bound import bound

# names each binding supplies (backends/shared/bound.py)
(bf16_to_f32, f32_to_bf16, f32_to_half, half_to_f32, load, load1, mul_rn, roundf, store) = bound(
    "bf16_to_f32", "f32_to_bf16", "f32_to_half", "half_to_f32", "load", "load1", "mul_rn", "roundf",
    "store")

# ---- element types -----------------------------------------------------------------------


def load_f32(x, i3, i2, i1, i0):
    return np.float32(x[i3, i2, i1, i0])


def store_f32(x, i3, i2, i1, i0, v):
    x[i3, i2, i1, i0] = v


def load_f16(x, i3, i2, i1, i0):
    return half_to_f32(x[i3, i2, i1, i0])  # (bound by the specializer)


def store_f16(x, i3, i2, i1, i0, v):
    x[i3, i2, i1, i0] = f32_to_half(v)


def load_bf16(x, i3, i2, i1, i0):
    return bf16_to_f32(x[i3, i2, i1, i0])


def store_bf16(x, i3, i2, i1, i0, v):
    x[i3, i2, i1, i0] = f32_to_bf16(v)


def load1_f32(r, i0):
    return np.float32(r[i0])


def load1_f16(r, i0):
    return half_to_f32(r[i0])


def load1_bf16(r, i0):
    return bf16_to_f32(r[i0])


def load_int(x, i3, i2, i1, i0):
    return np.float32(x[i3, i2, i1, i0])


def store_int(x, i3, i2, i1, i0, v):
    x[i3, i2, i1, i0] = v


def dec_elem(x, i3, i2, i1, out, n):
    for i0 in range(n):
        out[i0] = load(x, i3, i2, i1, i0)  # (load_<type>)


def enc_elem(v, x, i3, i2, i1, n):
    for i0 in range(n):
        store(x, i3, i2, i1, i0, v[i0])  # (store_<type>)


# ---- quantized rows ----------------------------------------------------------------------

def _half_at(x, i3, i2, i1, o):
    return half_to_f32(np.int32(x[i3, i2, i1, o]) | (np.int32(x[i3, i2, i1, o + 1]) << 8))  # noqa


def _put_half(x, i3, i2, i1, o, v):
    h = f32_to_half(v)
    x[i3, i2, i1, o] = np.uint8(h & 0xFF)
    x[i3, i2, i1, o + 1] = np.uint8(h >> 8)


def dec_q4_0(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    qh = _opaque(16, n)
    for b in range(n // 32):
        o = b * 18
        d = _half_row(row, o)
        for j in range(qh):
            q = np.int32(row[o + 2 + j])
            out[b * 32 + j] = np.float32((q & 0xF) - 8) * d
            out[b * 32 + j + qh] = np.float32((q >> 4) - 8) * d


def dec_q4_1(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    qh = _opaque(16, n)
    for b in range(n // 32):
        o = b * 20
        d = _half_row(row, o)
        m = _half_row(row, o + 2)
        for j in range(qh):
            q = np.int32(row[o + 4 + j])
            out[b * 32 + j] = np.float32(q & 0xF) * d + m
            out[b * 32 + j + qh] = np.float32(q >> 4) * d + m


def dec_q8_0(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    qk = _opaque(32, n)
    for b in range(n // 32):
        o = b * 34
        d = _half_row(row, o)
        for j in range(qk):
            out[b * 32 + j] = np.float32(np.int8(row[o + 2 + j])) * d


def enc_q4_0(v, x, i3, i2, i1, n):
    for b in range(n // 32):
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            a = abs(v[b * 32 + j])
            if a > amax:
                amax = a
                mx = v[b * 32 + j]
        d = np.float32(mx / np.float32(-8.0))
        idd = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        o = b * 18
        _put_half(x, i3, i2, i1, o, d)
        for j in range(16):
            x0 = mul_rn(v[b * 32 + j], idd) + np.float32(8.5)
            x1 = mul_rn(v[b * 32 + j + 16], idd) + np.float32(8.5)
            q0 = min(15, _trunc_u8(x0))
            q1 = min(15, _trunc_u8(x1))
            x[i3, i2, i1, o + 2 + j] = np.uint8(q0 | (q1 << 4))


def enc_q4_1(v, x, i3, i2, i1, n):
    for b in range(n // 32):
        mn = v[b * 32]
        mx = v[b * 32]
        for j in range(1, 32):
            t = v[b * 32 + j]
            if t < mn:
                mn = t
            if t > mx:
                mx = t
        d = np.float32((mx - mn) / np.float32(15.0))
        idd = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        o = b * 20
        _put_half(x, i3, i2, i1, o, d)
        _put_half(x, i3, i2, i1, o + 2, mn)
        for j in range(16):
            x0 = mul_rn(np.float32(v[b * 32 + j] - mn), idd) + np.float32(0.5)
            x1 = mul_rn(np.float32(v[b * 32 + j + 16] - mn), idd) + np.float32(0.5)
            q0 = min(15, _trunc_u8(x0))
            q1 = min(15, _trunc_u8(x1))
            x[i3, i2, i1, o + 4 + j] = np.uint8(q0 | (q1 << 4))


def enc_q8_0(v, x, i3, i2, i1, n):
    for b in range(n // 32):
        amax = np.float32(0.0)
        for j in range(32):
            a = abs(v[b * 32 + j])
            if a > amax:
                amax = a
        d = np.float32(amax / np.float32(127.0))
        idd = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        o = b * 34
        _put_half(x, i3, i2, i1, o, d)
        for j in range(32):
            q = np.int32(_finite_or_zero(roundf(np.float32(v[b * 32 + j] * idd))))  # noqa
            x[i3, i2, i1, o + 2 + j] = np.uint8(q & 0xFF)


def enc_none(v, x, i3, i2, i1, n):
    """The encoder of a type ggraph cannot write (no quantizer: the K-quants): never called,
    since no op stores into such a type (its record is not storable); bound so that every
    codec has three functions."""
    return


def _u32_row(row, o):
    """The little-endian uint32 at byte o of a row (Q5's fifth bits), as an int64."""
    return (np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16)
            | (np.int64(row[o + 3]) << 24))


def dec_q5_0(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    qk = _opaque(16, n)
    for b in range(n // 32):
        o = b * 22
        d = _half_row(row, o)
        qh = _u32_row(row, o + 2)
        for j in range(qk):
            q = np.int32(row[o + 6 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = np.float32(lo - 16) * d
            out[b * 32 + j + 16] = np.float32(hi - 16) * d


def dec_q5_1(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    qk = _opaque(16, n)
    for b in range(n // 32):
        o = b * 24
        d = _half_row(row, o)
        m = _half_row(row, o + 2)
        qh = _u32_row(row, o + 4)
        for j in range(qk):
            q = np.int32(row[o + 8 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            out[b * 32 + j] = np.float32(lo) * d + m
            out[b * 32 + j + 16] = np.float32(hi) * d + m


def _put_fives(x, i3, i2, i1, o, v, b, idd, mn, off):
    """Q5 quants of block b ((v - mn)*idd + off, truncated, capped at 31: ggml shifts by the
    minimum first; v - 0 is v) at byte o: the 32-bit qh of fifth bits, then the nibbles."""
    qh = np.int64(0)
    for j in range(16):
        q0 = min(31, _trunc_u8(mul_rn(np.float32(v[b * 32 + j] - mn), idd) + off))
        q1 = min(31, _trunc_u8(mul_rn(np.float32(v[b * 32 + j + 16] - mn), idd) + off))  # noqa
        qh |= np.int64((q0 >> 4) & 1) << j
        qh |= np.int64((q1 >> 4) & 1) << (j + 16)
        x[i3, i2, i1, o + 4 + j] = np.uint8((q0 & 15) | ((q1 & 15) << 4))
    for k in range(4):
        x[i3, i2, i1, o + k] = np.uint8((qh >> (8 * k)) & 0xFF)


def enc_q5_0(v, x, i3, i2, i1, n):
    for b in range(n // 32):
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            a = abs(v[b * 32 + j])
            if a > amax:
                amax = a
                mx = v[b * 32 + j]
        d = np.float32(mx / np.float32(-16.0))
        idd = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        _put_half(x, i3, i2, i1, b * 22, d)
        _put_fives(x, i3, i2, i1, b * 22 + 2, v, b, idd, np.float32(0.0), np.float32(16.5))


def enc_q5_1(v, x, i3, i2, i1, n):
    for b in range(n // 32):
        mn = v[b * 32]
        mx = v[b * 32]
        for j in range(1, 32):
            t = v[b * 32 + j]
            if t < mn:
                mn = t
            if t > mx:
                mx = t
        d = np.float32((mx - mn) / np.float32(31.0))
        idd = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0.0)
        _put_half(x, i3, i2, i1, b * 24, d)
        _put_half(x, i3, i2, i1, b * 24 + 2, mn)
        _put_fives(x, i3, i2, i1, b * 24 + 4, v, b, idd, mn, np.float32(0.5))


def _finite_or_zero(f):
    # C leaves the cast of inf/NaN undefined; x86 and gguf.quants give 0 for the value bits
    return f if math.isfinite(f) else 0.0


def _trunc_u8(f):
    """(int8_t) cast of a non-negative float, 0 for inf/NaN (matches gguf.quants)."""
    if not math.isfinite(f):
        return 0
    return np.int32(f) & 0xFF


# ---- dot products of a stored row with float32 values (mat-vec, attention) ---------------
# Each takes the row as a 1-D slice first so that contiguous weights compile to unit-stride
# loops; the targets compile these with reassociation allowed so the sums vectorize.

def dot_elem(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    for i0 in range(n):
        s += load1(row, i0) * v[i0]  # (load1_<type>)
    return s


def _half_row(row, o):
    return half_to_f32(np.int32(row[o]) | (np.int32(row[o + 1]) << 8))


def dot_q4_0(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    qh = _opaque(16, n)
    for b in range(n // 32):
        o = b * 18 + 2
        vo = b * 32
        acc = np.float32(0.0)
        for j in range(qh):
            q = np.int32(row[o + j])
            acc += np.float32((q & 15) - 8) * v[vo + j] + np.float32((q >> 4) - 8) * v[vo + j + qh]
        s += acc * _half_row(row, o - 2)
    return s


def dot_q4_1(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    qh = _opaque(16, n)
    for b in range(n // 32):
        o = b * 20
        vo = b * 32
        acc = np.float32(0.0)
        vs = np.float32(0.0)
        for j in range(qh):
            q = np.int32(row[o + 4 + j])
            v0 = v[vo + j]
            v1 = v[vo + j + qh]
            acc += np.float32(q & 15) * v0 + np.float32(q >> 4) * v1
            vs += v0 + v1
        s += acc * _half_row(row, o) + vs * _half_row(row, o + 2)
    return s


def dot_q8_0(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    qk = _opaque(32, n)
    for b in range(n // 32):
        o = b * 34 + 2
        vo = b * 32
        acc = np.float32(0.0)
        for j in range(qk):
            acc += np.float32(np.int8(row[o + j])) * v[vo + j]
        s += acc * _half_row(row, o - 2)
    return s


def dot_q5_0(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    qk = _opaque(16, n)
    for b in range(n // 32):
        o = b * 22
        vo = b * 32
        qh = _u32_row(row, o + 2)
        acc = np.float32(0.0)
        for j in range(qk):
            q = np.int32(row[o + 6 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            acc += np.float32(lo - 16) * v[vo + j] + np.float32(hi - 16) * v[vo + j + 16]
        s += acc * _half_row(row, o)
    return s


def dot_q5_1(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    qk = _opaque(16, n)
    for b in range(n // 32):
        o = b * 24
        vo = b * 32
        qh = _u32_row(row, o + 4)
        acc = np.float32(0.0)
        vs = np.float32(0.0)
        for j in range(qk):
            q = np.int32(row[o + 8 + j])
            lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
            hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
            v0 = v[vo + j]
            v1 = v[vo + j + 16]
            acc += np.float32(lo) * v0 + np.float32(hi) * v1
            vs += v0 + v1
        s += acc * _half_row(row, o) + vs * _half_row(row, o + 2)
    return s


def _opaque(k, n):
    """k, as a value the compiler cannot see: a block's inner loop with a constant trip count is
    unrolled and the block loop around it vectorized with gathers (4-5x slower); a loop of
    unknown length is vectorized itself, over contiguous bytes. n is never 0 here."""
    return k if n > 0 else k // 2
