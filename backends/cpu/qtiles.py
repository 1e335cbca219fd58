"""Dot products of packed weight tiles (backends/cpu/qpack.py) with one activation column, R
rows at once, and the decode mat-vec over a packed weight.

Each type has one tile function, `tile_<type>(acc, w, t, q, ysb, ysf, b)` -> acc plus block b
of the tile's R rows dotted with the activation row q (the bytes of the weights' vec_dot_type:
Q8_0 blocks of 34 bytes, Q8_K blocks of 292), lane l being row l. The integer sums are
ggml's (backends/shared/qdot.py computes the same; the tests compare them): unsigned weight
values times int8 quants summed by vpdpbusd, an offset (Q4_0's 8, Q5_0's 16, Q8_0's 128,
Q6_K's 32, IQ4_XS's 128) taken off as offset * sum(quants), sub-block scales applied as
integers, then one float multiply-add per block with the rows' f16 scales. `ysb` holds each
32-element activation block's sum of quants as little-endian int16 (`aux_*` fills it; Q4_K
and Q5_K read them by pairs against their mins), `ysf` the f16-rounded d * sum that Q4_1 and
Q5_1 add times their mins (Q8_1's s).

`k_mul_mat_packed` quantizes the few columns first (serially: a decode step has one), then
threads take runs of row groups, so each streams its own contiguous part of the weight once
and dots each group with every column while it is in L1/L2. The helpers `_half_row`,
`_f32_row`, `_i16_row`, `_sum_i8`, `_f16_round` are the shared codec helpers the CPU target
binds (backends/jit.py); `tile`, `aux`, `TILE`, the codecs and `dec_b`/`enc_r` are bound per
type (backends/cpu/kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit, prange

from ggraph.types import GGMLType
from .qlanes import (R, bit5, dpb, dpw, ffma, fmas, fstore, fzero, hi2, hi4, ladd, lane,
                     ldh, ldq, lmul, lo4, lsub, lut16, lzero)

# IQ4_NL's 16 values + 128: unsigned bytes for vpdpbusd (128 * sum(quants) is taken off)
IQ4_U8 = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
          + 128).astype(np.uint8)


# ---- 32-element blocks (activations: Q8_0, 34 bytes a block: f16 d, 32 int8) --------------

def nib_sum(w, t, q, p, hb):
    """sum of a 32-element block's nibbles (a fifth bit from masks at hb where hb >= 0)
    times the activation quants at q[p:]."""
    s = lzero(R)
    for k in range(4):
        v = ldq(w, t + 4 * R * k, R)
        lo, hi = lo4(v), hi4(v)
        if hb >= 0:
            lo, hi = bit5(lo, w, hb + R * k), bit5(hi, w, hb + R * k + R // 2)
        s = dpb(dpb(s, lo, q, p + 4 * k), hi, q, p + 16 + 4 * k)
    return s


def tile_q4_0(acc, w, t, q, ysb, ysf, b):
    s = lsub(nib_sum(w, t, q, 34 * b + 2, -1), 8 * _i16_row(ysb, 2 * b))  # noqa: F821
    return ffma(acc, s, ldh(w, t + 16 * R, R), _half_row(q, 34 * b))  # noqa: F821


def tile_q4_1(acc, w, t, q, ysb, ysf, b):
    s = nib_sum(w, t, q, 34 * b + 2, -1)  # noqa: F821
    acc = ffma(acc, s, ldh(w, t + 16 * R, R), _half_row(q, 34 * b))  # noqa: F821
    return fmas(acc, ldh(w, t + 18 * R, R), ysf[b])


def tile_q5_0(acc, w, t, q, ysb, ysf, b):
    s = nib_sum(w, t, q, 34 * b + 2, t + 16 * R)  # noqa: F821
    s = lsub(s, 16 * _i16_row(ysb, 2 * b))  # noqa: F821
    return ffma(acc, s, ldh(w, t + 20 * R, R), _half_row(q, 34 * b))  # noqa: F821


def tile_q5_1(acc, w, t, q, ysb, ysf, b):
    s = nib_sum(w, t, q, 34 * b + 2, t + 16 * R)  # noqa: F821
    acc = ffma(acc, s, ldh(w, t + 20 * R, R), _half_row(q, 34 * b))  # noqa: F821
    return fmas(acc, ldh(w, t + 22 * R, R), ysf[b])


def tile_q8_0(acc, w, t, q, ysb, ysf, b):
    p = 34 * b + 2
    s = lzero(R)
    for k in range(8):
        s = dpb(s, ldq(w, t + 4 * R * k, R), q, p + 4 * k)
    s = lsub(s, 128 * _i16_row(ysb, 2 * b))  # noqa: F821
    return ffma(acc, s, ldh(w, t + 32 * R, R), _half_row(q, 34 * b))  # noqa: F821


# ---- 256-element super-blocks (activations: Q8_K, 292 bytes: f32 d, 256 int8, 16 int16) ---

def k4_sums(w, t, q, p, ms, hb):
    """Q4_K/Q5_K: sum_j scale_j * dot_j over the 8 sub-blocks (nibbles at t, a fifth bit
    from masks at hb where hb >= 0), scales at ms."""
    isum = lzero(R)
    for jp in range(4):
        s0, s1 = lzero(R), lzero(R)
        for k in range(8):
            g = 8 * jp + k
            v = ldq(w, t + 4 * R * g, R)
            lo, hi = lo4(v), hi4(v)
            if hb >= 0:
                lo, hi = bit5(lo, w, hb + R * g), bit5(hi, w, hb + R * g + R // 2)
            s0 = dpb(s0, lo, q, p + 64 * jp + 4 * k)
            s1 = dpb(s1, hi, q, p + 64 * jp + 32 + 4 * k)
        isum = ladd(isum, ladd(lmul(s0, w, ms + 2 * jp * R, False),
                               lmul(s1, w, ms + (2 * jp + 1) * R, False)))
    return isum


def k4_tile(acc, w, t, q, ysb, b, hb, ms, dq):
    """Q4_K/Q5_K: d * sum_j scale_j dot_j - dmin * sum_j min_j sum_j(quants), dq the
    activation block's d."""
    isum = k4_sums(  # noqa: F821
        w, t, q, 292 * b + 4, ms, hb)
    msum = lzero(R)
    for pr in range(4):  # mins by pairs of sub-blocks against pairs of activation sums
        msum = dpw(msum, w, ms + 8 * R + 2 * R * pr, ysb, 16 * b + 4 * pr, False)
    acc = ffma(acc, isum, ldh(w, ms + 16 * R, R), dq)
    return ffma(acc, msum, ldh(w, ms + 18 * R, R), -dq)


def tile_q4_k(acc, w, t, q, ysb, ysf, b):
    return k4_tile(  # noqa: F821
        acc, w, t, q, ysb, b, -1, t + 128 * R, _f32_row(q, 292 * b))  # noqa: F821


def tile_q5_k(acc, w, t, q, ysb, ysf, b):
    return k4_tile(  # noqa: F821
        acc, w, t, q, ysb, b, t + 128 * R, t + 160 * R,
                    _f32_row(q, 292 * b))  # noqa: F821


def tile_q6_k(acc, w, t, q, ysb, ysf, b):
    """Halves of 128 values: low nibbles of ql bytes l (values l, l + 64) and l + 32 (values
    l + 32, l + 96), their 2 high bits in qh byte l; sub-blocks of 16, signed scales."""
    p = 292 * b + 4
    isum = lzero(R)
    for n in range(2):
        for h in range(2):
            a0, a1, a2, a3 = lzero(R), lzero(R), lzero(R), lzero(R)
            for kk in range(4):
                k = 4 * h + kk
                va = ldq(w, t + 4 * R * (16 * n + k), R)
                vb = ldq(w, t + 4 * R * (16 * n + 8 + k), R)
                hq = ldq(w, t + 128 * R + 4 * R * (8 * n + k), R)
                yo = p + 128 * n + 4 * k
                a0 = dpb(a0, hi2(lo4(va), hq, 0), q, yo)
                a1 = dpb(a1, hi2(lo4(vb), hq, 1), q, yo + 32)
                a2 = dpb(a2, hi2(hi4(va), hq, 2), q, yo + 64)
                a3 = dpb(a3, hi2(hi4(vb), hq, 3), q, yo + 96)
            j = 8 * n + h
            bs = 292 * b + 260 + 2 * j
            sc = t + 192 * R + j * R
            isum = ladd(isum, lmul(lsub(a0, 32 * _i16_row(q, bs)), w, sc, True))  # noqa: F821
            isum = ladd(isum, lmul(lsub(a1, 32 * _i16_row(q, bs + 4)), w, sc + 2 * R,  # noqa
                                   True))
            isum = ladd(isum, lmul(lsub(a2, 32 * _i16_row(q, bs + 8)), w, sc + 4 * R,  # noqa
                                   True))
            isum = ladd(isum, lmul(lsub(a3, 32 * _i16_row(q, bs + 12)), w, sc + 6 * R,  # noqa
                                   True))
    return ffma(acc, isum, ldh(w, t + 208 * R, R), _f32_row(q, 292 * b))  # noqa: F821


def tile_iq4_xs(acc, w, t, q, ysb, ysf, b):
    p = 292 * b + 4
    isum = lzero(R)
    for j in range(8):
        s = lzero(R)
        for k in range(4):
            v = ldq(w, t + 4 * R * (4 * j + k), R)
            s = dpb(s, lut16(lo4(v), IQ4_U8, 0), q, p + 32 * j + 4 * k)
            s = dpb(s, lut16(hi4(v), IQ4_U8, 0), q, p + 32 * j + 16 + 4 * k)
        s = lsub(s, 128 * _i16_row(ysb, 16 * b + 2 * j))  # noqa: F821
        isum = ladd(isum, lmul(s, w, t + 128 * R + j * R, True))
    return ffma(acc, isum, ldh(w, t + 136 * R, R), _f32_row(q, 292 * b))  # noqa: F821


# ---- activation sums ----------------------------------------------------------------------

@njit(inline="always")
def _put_i16(a, o, v):
    a[o] = v & 255
    a[o + 1] = (v >> 8) & 255


def aux_q8_0(q, ysb, ysf, n32):
    """Per Q8_0 block: its quants' sum (int16 into ysb) and Q8_1's f16-rounded d * sum."""
    for b in range(n32):
        s = _sum_i8(q, 34 * b + 2, 32)  # noqa: F821
        _put_i16(ysb, 2 * b, s)
        ysf[b] = _f16_round(np.float32(_half_row(q, 34 * b) * np.float32(s)))  # noqa: F821


def aux_q8_k(q, ysb, ysf, n32):
    """Per 32 elements of Q8_K blocks: the sum of its two int16 sums of 16."""
    for j in range(n32):
        o = 292 * (j // 8) + 260 + 4 * (j % 8)
        _put_i16(ysb, 2 * j, _i16_row(q, o) + _i16_row(q, o + 2))  # noqa: F821


# ---- the mat-vec --------------------------------------------------------------------------

def k_mul_mat_packed(w, b, q, ysb, ysf, d, kk, nb, m):
    """d[i3, i2, n, :m] = packed weight w (m rows, nb blocks of kk / nb elements) times
    column b[i3, i2, n], for the few columns of a decode step (see the module docstring)."""
    n3, n2, nn = d.shape[0], d.shape[1], d.shape[2]
    x = np.empty(kk, np.float32)
    for s in range(n3 * n2 * nn):
        i3, i2, n = s // (n2 * nn), (s // nn) % n2, s % nn
        dec_b(b, i3, i2, n, x, kk)  # noqa: F821
        enc_r(x, q, i3, i2, n, kk)  # noqa: F821
        aux(q[i3, i2, n], ysb[i3, i2, n], ysf[i3, i2, n], kk // 32)  # noqa: F821
    groups = (m + R - 1) // R
    for g in prange(groups):
        base = g * nb * TILE  # noqa: F821
        r0 = g * R
        for s in range(n3 * n2 * nn):
            i3, i2, n = s // (n2 * nn), (s // nn) % n2, s % nn
            qc, yb, yf = q[i3, i2, n], ysb[i3, i2, n], ysf[i3, i2, n]
            acc = fzero(R)
            for blk in range(nb):
                acc = tile(acc, w, base + blk * TILE, qc, yb, yf, blk)  # noqa: F821
            if r0 + R <= m:
                fstore(d[i3, i2, n], r0, acc)
            else:
                for r in range(m - r0):
                    d[i3, i2, n, r0 + r] = lane(acc, r)


@dataclass(frozen=True)
class Tile:
    """A packed type's tile function, the activation sums it reads, and the helper templates
    it calls (bound in order, each seeing the ones before, under their names)."""
    fn: Callable
    aux: Callable
    helpers: tuple[Callable, ...] = ()


T = GGMLType
TILES: dict[GGMLType, Tile] = {
    T.Q4_0: Tile(tile_q4_0, aux_q8_0, (nib_sum,)), T.Q4_1: Tile(tile_q4_1, aux_q8_0, (nib_sum,)),
    T.Q5_0: Tile(tile_q5_0, aux_q8_0, (nib_sum,)), T.Q5_1: Tile(tile_q5_1, aux_q8_0, (nib_sum,)),
    T.Q8_0: Tile(tile_q8_0, aux_q8_0), T.Q4_K: Tile(tile_q4_k, aux_q8_k, (k4_sums, k4_tile)),
    T.Q5_K: Tile(tile_q5_k, aux_q8_k, (k4_sums, k4_tile)), T.Q6_K: Tile(tile_q6_k, aux_q8_k),
    T.IQ4_XS: Tile(tile_iq4_xs, aux_q8_k),
}
