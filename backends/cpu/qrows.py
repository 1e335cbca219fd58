"""Whole-row integer dot products for the CPU mat-vec: one stored weight row with one row of
quantized activations (the bytes of the weight type's vec_dot_type, Q8_0 or Q8_K), as ggml's
CPU vec_dot functions compute them.

They are the same sums as backends/shared/qdot.py (which CUDA compiles and these are tested
against), organised for x86's integer SIMD: per block, the weight values and activation
quants are multiplied and summed in groups of four in 8 integer lanes (vpdpbusd with VNNI,
else vpmaddubsw / vpmaddwd: backends/cpu/qvec.py), the block's sub-block scales applied there
as integers, and the lanes scaled by the block's float scales into an 8-lane float
accumulator, reduced once per row. The shared version reduces every block to a scalar
instead, which made the decode mat-vecs compute-bound at a third of the memory bandwidth.

Each type has one block function, `blk_<type>(row, b, q, ys)` -> (block b's integer lanes,
their float scale, a float term to add: Q4_1/Q5_1's min times the activations' sum, minus the
K-quants' mins), which `rowdot(row, q, ys, nb)` runs over a row. (Four rows in one loop, four
accumulator chains, doubled the bandwidth on weights in L2 but cut it by a third on weights
streamed from memory, as decode's are: the hardware prefetchers follow one stream better
than four interleaved ones.) row:
one weight row's bytes; q: the activation row's bytes; ys: per 32-element activation block
the f16-rounded d * sum(quants) (Q8_1's s, which Q4_1/Q5_1 need; `act_sums` fills it); nb:
blocks in the row. The helpers `_half_row`, `_f32_row`, `_k4_scale`, `_k4_min_sum`, `_sum_i8`,
`_f16_round` are the shared codec helpers the CPU target binds (backends/jit.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggraph.ir.types import GGMLType
from .qvec import (add32, dot4, dot4_off, f8_fma, f8_sum, f8_zero, hplane, i32_zero, ld32,
                   madd_2s, madd_s, maddubs, maddubs_c, nib32, nib_hi, nib_lo, q5_bits,
                   signed_dot, sub16)
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(BLOCK, _f16_round, _f32_row, _half_row, _k4_min_sum, _k4_scale, _sum_i8, blk, qdot_a) = bound(
    "BLOCK", "_f16_round", "_f32_row", "_half_row", "_k4_min_sum", "_k4_scale", "_sum_i8", "blk",
    "qdot_a")

# ---- one block of a row: (its integer lanes, their float scale, a float term to add) -------
# (32-element blocks times Q8_0: 34 bytes, f16 d, 32 int8; K-quants times Q8_K: 292 bytes,
# f32 d, 256 int8, 16 int16 sums of 16)

def blk_q4_0(row, b, q, ys):
    o, p = b * 18, b * 34
    return (dot4_off(nib32(row, o + 2), ld32(q, p + 2), 8),
            _half_row(row, o) * _half_row(q, p), np.float32(0.0))


def blk_q4_1(row, b, q, ys):
    o, p = b * 20, b * 34
    return (dot4(nib32(row, o + 4), ld32(q, p + 2)), _half_row(row, o) * _half_row(q, p),  # noqa
            _half_row(row, o + 2) * ys[b])


def blk_q5_0(row, b, q, ys):
    o, p = b * 22, b * 34
    return (dot4_off(q5_bits(nib32(row, o + 6), row, o + 2), ld32(q, p + 2), 16),
            _half_row(row, o) * _half_row(q, p), np.float32(0.0))


def blk_q5_1(row, b, q, ys):
    o, p = b * 24, b * 34
    return (dot4(q5_bits(nib32(row, o + 8), row, o + 4), ld32(q, p + 2)),
            _half_row(row, o) * _half_row(q, p), _half_row(row, o + 2) * ys[b])


def blk_q8_0(row, b, q, ys):
    o = b * 34
    return (signed_dot(ld32(row, o + 2), ld32(q, o + 2)),
            _half_row(row, o) * _half_row(q, o), np.float32(0.0))


def blk_q4_k(row, b, q, ys):
    o, p = b * 144, b * 292
    isum = i32_zero()
    summ = 0
    for j in range(4):
        qo, eo, bo = o + 16 + 32 * j, p + 4 + 64 * j, p + 260 + 8 * j
        isum = add32(isum, madd_s(maddubs(nib_lo(row, qo), ld32(q, eo)),
                                  _k4_scale(row, o + 4, 2 * j)))
        isum = add32(isum, madd_s(maddubs(nib_hi(row, qo), ld32(q, eo + 32)),
                                  _k4_scale(row, o + 4, 2 * j + 1)))
        summ += _k4_min_sum(row, o + 4, q, bo, j)
    dq = _f32_row(q, p)
    return isum, dq * _half_row(row, o), -(dq * _half_row(row, o + 2) * np.float32(summ))  # noqa


def blk_q5_k(row, b, q, ys):
    """Q4_K's sums with a fifth bit per value from the 32-byte plane at byte 16 (bit 2j for
    sub-block 2j, 2j + 1 for the next)."""
    o, p = b * 176, b * 292
    isum = i32_zero()
    summ = 0
    for j in range(4):
        qo, eo, bo = o + 48 + 32 * j, p + 4 + 64 * j, p + 260 + 8 * j
        isum = add32(isum, madd_s(maddubs(hplane(nib_lo(row, qo), row, o + 16, 2 * j, 1),
                                          ld32(q, eo)), _k4_scale(row, o + 4, 2 * j)))  # noqa
        isum = add32(isum, madd_s(maddubs(hplane(nib_hi(row, qo), row, o + 16, 2 * j + 1, 1),
                                          ld32(q, eo + 32)),
                                  _k4_scale(row, o + 4, 2 * j + 1)))
        summ += _k4_min_sum(row, o + 4, q, bo, j)
    dq = _f32_row(q, p)
    return isum, dq * _half_row(row, o), -(dq * _half_row(row, o + 2) * np.float32(summ))  # noqa


def blk_q6_k(row, b, q, ys):
    o, p = b * 210, b * 292
    isum = i32_zero()
    for nn in range(2):
        lo, ho, so, eo = o + 64 * nn, o + 128 + 32 * nn, o + 192 + 8 * nn, p + 4 + 128 * nn
        for k in range(4):
            # value j of quarter k: bits of byte j (or 32 + j) of the low plane, k's two
            # bits of byte j of the high plane; sub-blocks of 16 with their own scales
            y = ld32(q, eo + 32 * k)
            a = lo + 32 * (k % 2)
            x = hplane(nib_lo(row, a) if k < 2 else nib_hi(row, a), row, ho, 2 * k, 3)
            isum = add32(isum, madd_2s(sub16(maddubs(x, y), maddubs_c(32, y)),
                                       np.int8(row[so + 2 * k]), np.int8(row[so + 2 * k + 1])))
    return isum, _f32_row(q, p) * _half_row(row, o + 208), np.float32(0.0)


# ---- a whole row -------------------------------------------------------------------------

def rowdot(row, q, ys, nb):
    """Row `row` . activation row q: blk (bound per type) over the row's nb blocks."""
    acc = f8_zero()
    c = np.float32(0.0)
    for b in range(nb):
        v, s, k = blk(row, b, q, ys)
        acc = f8_fma(acc, v, s)
        c += k
    return f8_sum(acc) + c


def rowdot_shared(row, q, ys, nb):
    """A type without a block function here: the shared qdot (qdot_a, BLOCK elements a
    block) on the row."""
    return qdot_a(row[None, None, None, :], 0, 0, 0, q, nb * BLOCK)


def act_sums(q, ys, nb):
    """ys[b] = Q8_0 activation block b's d * sum(quants), rounded to f16 (Q8_1's s)."""
    for b in range(nb):
        p = b * 34
        ys[b] = _f16_round(np.float32(_half_row(q, p) * np.float32(_sum_i8(q, p + 2, 32))))  # noqa


@dataclass(frozen=True)
class RowDot:
    """A weight type's block function for rowdot; `sums` when it reads act_sums' ys."""
    blk: Callable
    sums: bool = False


ROW_DOTS: dict[GGMLType, RowDot] = {
    GGMLType.Q4_0: RowDot(blk_q4_0), GGMLType.Q4_1: RowDot(blk_q4_1, sums=True),
    GGMLType.Q5_0: RowDot(blk_q5_0), GGMLType.Q5_1: RowDot(blk_q5_1, sums=True),
    GGMLType.Q8_0: RowDot(blk_q8_0), GGMLType.Q4_K: RowDot(blk_q4_k),
    GGMLType.Q5_K: RowDot(blk_q5_k), GGMLType.Q6_K: RowDot(blk_q6_k),
}
