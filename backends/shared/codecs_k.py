"""Row decoders and dot products of the K-quants (Q2_K .. Q6_K), IQ4_NL and IQ4_XS, and the
codec of Q8_K (the activation type of K-quant dot products), shared by the CPU and CUDA
targets like codecs.py (same signatures, same helpers: `_half_row`, `_opaque`, ...).

Block layouts are ggraph/codecs/quants_k.py's. Decoders compute in ggml's order (`d * sc` first,
then times the quant, then minus `dmin * m`), so they are bit-exact with the numpy codecs.
The dot products are the mat-vec hot path (memory-bound): each walks a block in inner loops
over contiguous bytes whose trip count the compiler cannot see (`_opaque`), accumulating the
quant sums per sub-block and applying the sub-block scales (and the mins, through the sum of
the activations) once per sub-block, as ggml's integer dot products do.

Only IQ4_NL (a KV cache type) and Q8_K have encoders here; the K-quants and IQ4_XS are not
storable (their records name `enc_none`).
"""
import math

import numpy as np
from .bound import bound

# names each binding supplies (backends/shared/bound.py)
(_finite_or_zero, _half_row, _opaque, _put_half, _u32_row, rint) = bound(
    "_finite_or_zero", "_half_row", "_opaque", "_put_half", "_u32_row", "rint")

# ggml-common.h kvalues_iq4nl as float32 (a compile-time constant array of the kernels)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                         1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _k4_scale(row, o, j):
    """Q4_K / Q5_K: the 6-bit scale of sub-block j from the 12 scale bytes at o."""
    if j < 4:
        return np.float32(np.int32(row[o + j]) & 63)
    return np.float32((np.int32(row[o + j + 4]) & 15) | ((np.int32(row[o + j - 4]) >> 6) << 4))


def _k4_min(row, o, j):
    if j < 4:
        return np.float32(np.int32(row[o + j + 4]) & 63)
    return np.float32((np.int32(row[o + j + 4]) >> 4) | ((np.int32(row[o + j]) >> 6) << 4))


def _q3_scale(row, o, i):
    """Q3_K: the signed 6-bit scale of sub-block i (of 16) from the 12 scale bytes at o."""
    lo = (np.int32(row[o + i % 8]) >> (4 * (i // 8))) & 15
    hi = (np.int32(row[o + 8 + i % 4]) >> (2 * (i // 4))) & 3
    return np.float32((lo | (hi << 4)) - 32)


# ---- decoders ----------------------------------------------------------------------------

def dec_q2_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 84
        d = _half_row(row, o + 80)
        dmin = _half_row(row, o + 82)
        for si in range(16):  # sub-block si: elements 16 si.., bits 2j of bytes n*32 + 16h..
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            sc = np.int32(row[o + si])
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            qo = o + 16 + nn * 32 + h * 16
            eo = b * 256 + si * 16
            for l in range(k16):
                out[eo + l] = dl * np.float32((np.int32(row[qo + l]) >> (2 * j)) & 3) - ml


def dec_q3_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 110
        d = _half_row(row, o + 108)
        for si in range(16):
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            dl = d * _q3_scale(row, o + 96, si)
            qo = o + 32 + nn * 32 + h * 16
            mo = o + h * 16
            bit = nn * 4 + j
            eo = b * 256 + si * 16
            for l in range(k16):
                q = (np.int32(row[qo + l]) >> (2 * j)) & 3
                hb = (np.int32(row[mo + l]) >> bit) & 1
                out[eo + l] = dl * np.float32(q - 4 + 4 * hb)


def dec_q4_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k32 = _opaque(32, n)
    for b in range(n // 256):
        o = b * 144
        d = _half_row(row, o)
        dmin = _half_row(row, o + 2)
        for j in range(4):
            d1 = d * _k4_scale(row, o + 4, 2 * j)
            m1 = dmin * _k4_min(row, o + 4, 2 * j)
            d2 = d * _k4_scale(row, o + 4, 2 * j + 1)
            m2 = dmin * _k4_min(row, o + 4, 2 * j + 1)
            qo = o + 16 + 32 * j
            eo = b * 256 + 64 * j
            for l in range(k32):
                q = np.int32(row[qo + l])
                out[eo + l] = d1 * np.float32(q & 15) - m1
                out[eo + 32 + l] = d2 * np.float32(q >> 4) - m2


def dec_q5_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k32 = _opaque(32, n)
    for b in range(n // 256):
        o = b * 176
        d = _half_row(row, o)
        dmin = _half_row(row, o + 2)
        for j in range(4):
            d1 = d * _k4_scale(row, o + 4, 2 * j)
            m1 = dmin * _k4_min(row, o + 4, 2 * j)
            d2 = d * _k4_scale(row, o + 4, 2 * j + 1)
            m2 = dmin * _k4_min(row, o + 4, 2 * j + 1)
            qo = o + 48 + 32 * j
            eo = b * 256 + 64 * j
            for l in range(k32):
                q = np.int32(row[qo + l])
                h = np.int32(row[o + 16 + l]) >> (2 * j)
                out[eo + l] = d1 * np.float32((q & 15) | ((h & 1) << 4)) - m1
                out[eo + 32 + l] = d2 * np.float32((q >> 4) | ((h & 2) << 3)) - m2


def dec_q6_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 210
        d = _half_row(row, o + 208)
        for nn in range(2):
            for h in range(2):
                so = o + 192 + 8 * nn + h
                d1 = d * np.float32(np.int8(row[so]))
                d2 = d * np.float32(np.int8(row[so + 2]))
                d3 = d * np.float32(np.int8(row[so + 4]))
                d4 = d * np.float32(np.int8(row[so + 6]))
                lo = o + 64 * nn + 16 * h
                ho = o + 128 + 32 * nn + 16 * h
                eo = b * 256 + 128 * nn + 16 * h
                for l in range(k16):
                    a = np.int32(row[lo + l])
                    c = np.int32(row[lo + 32 + l])
                    q = np.int32(row[ho + l])
                    out[eo + l] = d1 * np.float32(((a & 15) | ((q & 3) << 4)) - 32)
                    out[eo + 32 + l] = d2 * np.float32(((c & 15) | (((q >> 2) & 3) << 4)) - 32)
                    out[eo + 64 + l] = d3 * np.float32(((a >> 4) | (((q >> 4) & 3) << 4)) - 32)
                    out[eo + 96 + l] = d4 * np.float32(((c >> 4) | (((q >> 6) & 3) << 4)) - 32)


def dec_iq4_nl(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k16 = _opaque(16, n)
    for b in range(n // 32):
        o = b * 18
        d = _half_row(row, o)
        for j in range(k16):
            q = np.int32(row[o + 2 + j])
            out[b * 32 + j] = IQ4NL_VALUES[q & 15] * d
            out[b * 32 + j + 16] = IQ4NL_VALUES[q >> 4] * d


def _iq4_xs_scale(row, o, ib):
    """IQ4_XS: the signed 6-bit scale of sub-block ib (of 8); block at o."""
    lo = (np.int32(row[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15
    hi = ((np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)) >> (2 * ib)) & 3
    return np.float32((lo | (hi << 4)) - 32)


def dec_iq4_xs(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 136
        d = _half_row(row, o)
        for ib in range(8):
            dl = d * _iq4_xs_scale(row, o, ib)
            qo = o + 8 + 16 * ib
            eo = b * 256 + 32 * ib
            for j in range(k16):
                q = np.int32(row[qo + j])
                out[eo + j] = dl * IQ4NL_VALUES[q & 15]
                out[eo + j + 16] = dl * IQ4NL_VALUES[q >> 4]


# ---- dot products ------------------------------------------------------------------------

def dot_q2_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 84
        d = _half_row(row, o + 80)
        dmin = _half_row(row, o + 82)
        for si in range(16):
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            sc = np.int32(row[o + si])
            qo = o + 16 + nn * 32 + h * 16
            eo = b * 256 + si * 16
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            acc = np.float32(0.0)
            for l in range(k16):
                acc += (dl * np.float32((np.int32(row[qo + l]) >> (2 * j)) & 3) - ml) * v[eo + l]
            s += acc
    return s


def dot_q3_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 110
        d = _half_row(row, o + 108)
        for si in range(16):
            nn, j, h = si // 8, (si // 2) % 4, si % 2
            qo = o + 32 + nn * 32 + h * 16
            mo = o + h * 16
            bit = nn * 4 + j
            eo = b * 256 + si * 16
            acc = np.float32(0.0)
            for l in range(k16):
                q = (np.int32(row[qo + l]) >> (2 * j)) & 3
                hb = (np.int32(row[mo + l]) >> bit) & 1
                acc += np.float32(q - 4 + 4 * hb) * v[eo + l]
            s += d * _q3_scale(row, o + 96, si) * acc
    return s


def dot_q4_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k32 = _opaque(32, n)
    for b in range(n // 256):
        o = b * 144
        d = _half_row(row, o)
        dmin = _half_row(row, o + 2)
        for j in range(4):
            # the sub-block values d*sc*q - dmin*m formed in the loop: one accumulator (one
            # horizontal sum per 64 elements) costs no more flops than summing q*v and v apart
            d1 = d * _k4_scale(row, o + 4, 2 * j)
            m1 = dmin * _k4_min(row, o + 4, 2 * j)
            d2 = d * _k4_scale(row, o + 4, 2 * j + 1)
            m2 = dmin * _k4_min(row, o + 4, 2 * j + 1)
            qo = o + 16 + 32 * j
            eo = b * 256 + 64 * j
            acc = np.float32(0.0)
            for l in range(k32):
                q = np.int32(row[qo + l])
                acc += (d1 * np.float32(q & 15) - m1) * v[eo + l] + \
                    (d2 * np.float32(q >> 4) - m2) * v[eo + 32 + l]
            s += acc
    return s


def dot_q5_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k32 = _opaque(32, n)
    for b in range(n // 256):
        o = b * 176
        d = _half_row(row, o)
        dmin = _half_row(row, o + 2)
        for j in range(4):  # as dot_q4_k: sub-block values formed in the loop
            d1 = d * _k4_scale(row, o + 4, 2 * j)
            m1 = dmin * _k4_min(row, o + 4, 2 * j)
            d2 = d * _k4_scale(row, o + 4, 2 * j + 1)
            m2 = dmin * _k4_min(row, o + 4, 2 * j + 1)
            qo = o + 48 + 32 * j
            eo = b * 256 + 64 * j
            acc = np.float32(0.0)
            for l in range(k32):
                q = np.int32(row[qo + l])
                h = np.int32(row[o + 16 + l]) >> (2 * j)
                acc += (d1 * np.float32((q & 15) | ((h & 1) << 4)) - m1) * v[eo + l] + \
                    (d2 * np.float32((q >> 4) | ((h & 2) << 3)) - m2) * v[eo + 32 + l]
            s += acc
    return s


def dot_q6_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 210
        d = _half_row(row, o + 208)
        for nn in range(2):
            for h in range(2):
                lo = o + 64 * nn + 16 * h
                ho = o + 128 + 32 * nn + 16 * h
                eo = b * 256 + 128 * nn + 16 * h
                so = o + 192 + 8 * nn + h
                d1 = d * np.float32(np.int8(row[so]))
                d2 = d * np.float32(np.int8(row[so + 2]))
                d3 = d * np.float32(np.int8(row[so + 4]))
                d4 = d * np.float32(np.int8(row[so + 6]))
                acc = np.float32(0.0)  # one accumulator: one horizontal sum per 64 elements
                for l in range(k16):
                    a = np.int32(row[lo + l])
                    c = np.int32(row[lo + 32 + l])
                    q = np.int32(row[ho + l])
                    acc += (d1 * np.float32(((a & 15) | ((q & 3) << 4)) - 32) * v[eo + l]
                            + d2 * np.float32(((c & 15) | (((q >> 2) & 3) << 4)) - 32)
                            * v[eo + 32 + l]
                            + d3 * np.float32(((a >> 4) | (((q >> 4) & 3) << 4)) - 32)
                            * v[eo + 64 + l]
                            + d4 * np.float32(((c >> 4) | (((q >> 6) & 3) << 4)) - 32)
                            * v[eo + 96 + l])
                s += acc
    return s


def dot_iq4_nl(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k16 = _opaque(16, n)
    for b in range(n // 32):
        o = b * 18
        vo = b * 32
        acc = np.float32(0.0)
        for j in range(k16):
            q = np.int32(row[o + 2 + j])
            acc += IQ4NL_VALUES[q & 15] * v[vo + j] + IQ4NL_VALUES[q >> 4] * v[vo + j + 16]
        s += acc * _half_row(row, o)
    return s


def dot_iq4_xs(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k16 = _opaque(16, n)
    for b in range(n // 256):
        o = b * 136
        d = _half_row(row, o)
        for ib in range(8):
            qo = o + 8 + 16 * ib
            eo = b * 256 + 32 * ib
            acc = np.float32(0.0)
            for j in range(k16):
                q = np.int32(row[qo + j])
                acc += IQ4NL_VALUES[q & 15] * v[eo + j] + IQ4NL_VALUES[q >> 4] * v[eo + j + 16]
            s += d * _iq4_xs_scale(row, o, ib) * acc
    return s


# ---- IQ4_NL encoder (a KV cache type) ----------------------------------------------------

def _best_iq4(f):
    """ggml's best_index_int8 over the IQ4_NL table: nearest entry, the upper one on a tie."""
    if f <= IQ4NL_VALUES[0]:
        return 0
    if f >= IQ4NL_VALUES[15]:
        return 15
    ml = 0
    mu = 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if f < IQ4NL_VALUES[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if f - IQ4NL_VALUES[mu - 1] < IQ4NL_VALUES[mu] - f else mu


def enc_iq4_nl(v, x, i3, i2, i1, n):
    """quantize_row_iq4_nl_ref, as ggraph/codecs/quants_k.py: indices from d0 = max/-127, scale
    sum(w q x) / sum(w q q) with w = x*x; the indices are found again when packing (no
    scratch: the same inputs give the same indices)."""
    for b in range(n // 32):
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(32):
            a = abs(v[b * 32 + j])
            if a > amax:
                amax = a
                mx = v[b * 32 + j]
        o = b * 18
        live = amax >= np.float32(1e-15)
        idd = np.float32(np.float32(1.0) / np.float32(mx / np.float32(-127.0))) if live \
            else np.float32(0.0)
        sqx = np.float32(0.0)
        sq2 = np.float32(0.0)
        for j in range(32):
            xj = v[b * 32 + j]
            q = IQ4NL_VALUES[_best_iq4(np.float32(idd * xj))]
            wq = np.float32(np.float32(xj * xj) * q)
            sqx = np.float32(sqx + np.float32(wq * xj))
            sq2 = np.float32(sq2 + np.float32(wq * q))
        d = np.float32(sqx / sq2) if (live and sq2 > 0) else np.float32(0.0)
        _put_half(x, i3, i2, i1, o, d)
        for j in range(16):
            l0 = _best_iq4(np.float32(idd * v[b * 32 + j])) if live else 0
            l1 = _best_iq4(np.float32(idd * v[b * 32 + j + 16])) if live else 0
            x[i3, i2, i1, o + 2 + j] = np.uint8(l0 | (l1 << 4))


# ---- Q8_K: activations of K-quant dot products (f32 scale) --------------------------------

def _f32_row(row, o):
    """The little-endian float32 at byte o of a row, from its bits."""
    u = _u32_row(row, o)
    e = (u >> 23) & 255
    m = u & 0x7FFFFF
    if e == 255:
        f = math.inf if m == 0 else math.nan
    elif e == 0:
        f = math.ldexp(float(m), -149)
    else:
        f = math.ldexp(float(m | 0x800000), int(e) - 150)
    return np.float32(-f if u >> 31 else f)


def _put_f32(x, i3, i2, i1, o, f):
    """Store finite float32 f at byte o as little-endian bits (sign, exponent, mantissa)."""
    s = np.int64(0x80000000) if (f < 0 or (f == 0 and math.copysign(1.0, f) < 0)) else \
        np.int64(0)
    a = abs(np.float64(f))
    u = s
    if a != 0.0:
        m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
        if e + 126 >= 1:
            u = s | (np.int64(e + 126) << 23) | (np.int64(m * 16777216.0) - 0x800000)
        else:
            u = s | np.int64(math.ldexp(a, 149))
    for k in range(4):
        x[i3, i2, i1, o + k] = np.uint8((u >> (8 * k)) & 0xFF)


def dec_q8_k(x, i3, i2, i1, out, n):
    row = x[i3, i2, i1]
    for b in range(n // 256):
        d = _f32_row(row, b * 292)
        for j in range(256):
            out[b * 256 + j] = d * np.float32(np.int8(row[b * 292 + 4 + j]))


def enc_q8_k(v, x, i3, i2, i1, n):
    """quantize_row_q8_K_ref: q = round half even (-127/max * x) capped at 127, d = 1/iscale,
    int16 sums of each 16 (zero blocks: all zero)."""
    row = x[i3, i2, i1]   # one row's bytes: stores without four-index address arithmetic
    for b in range(n // 256):
        s = b * 256
        # the largest magnitude in 8 independent running maxima (one chain of compares was
        # the quantizer's critical path; each lane skips NaN as the one chain did), then the
        # first element of that magnitude, as ggml's strict > keeps the first
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = np.float32(0.0)
        for j in range(s, s + 256, 8):
            a0, a1, a2, a3 = abs(v[j]), abs(v[j + 1]), abs(v[j + 2]), abs(v[j + 3])
            a4, a5, a6, a7 = abs(v[j + 4]), abs(v[j + 5]), abs(v[j + 6]), abs(v[j + 7])
            m0 = a0 if a0 > m0 else m0
            m1 = a1 if a1 > m1 else m1
            m2 = a2 if a2 > m2 else m2
            m3 = a3 if a3 > m3 else m3
            m4 = a4 if a4 > m4 else m4
            m5 = a5 if a5 > m5 else m5
            m6 = a6 if a6 > m6 else m6
            m7 = a7 if a7 > m7 else m7
        amax = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        mx = np.float32(0.0)
        if amax > 0:
            for j in range(s, s + 256):
                if abs(v[j]) == amax:
                    mx = v[j]
                    break
        o = b * 292
        iscale = np.float32(np.float32(-127.0) / mx) if amax > 0 else np.float32(0.0)
        for g in range(16):
            t = 0
            for j in range(16):
                f = _finite_or_zero(rint(np.float32(iscale * v[s + g * 16 + j])))
                q = min(127, np.int32(f))
                t += q
                row[o + 4 + g * 16 + j] = np.uint8(q & 0xFF)
            row[o + 260 + 2 * g] = np.uint8(t & 0xFF)
            row[o + 261 + 2 * g] = np.uint8((t >> 8) & 0xFF)
        _put_f32(x, i3, i2, i1, o, np.float32(np.float32(1.0) / iscale) if amax > 0
                 else np.float32(0.0))


def dot_q8_k(x, i3, i2, i1, v, n):
    row = x[i3, i2, i1]
    s = np.float32(0.0)
    k = _opaque(256, n)
    for b in range(n // 256):
        acc = np.float32(0.0)
        for j in range(k):
            acc += np.float32(np.int8(row[b * 292 + 4 + j])) * v[b * 256 + j]
        s += acc * _f32_row(row, b * 292)
    return s
