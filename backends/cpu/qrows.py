"""Whole-row integer dot products for the CPU mat-vec: one stored weight row with one row of
quantized activations (the bytes of the weight type's vec_dot_type, Q8_0 or Q8_K), as ggml's
CPU vec_dot functions compute them.

They are the same sums as backends/shared/qdot.py (which CUDA compiles and these are tested
against), organised for x86's integer SIMD: per block, the weight values and activation
quants are multiplied and summed in groups of four in 8 integer lanes (vpmaddubsw /
vpmaddwd, backends/cpu/qvec.py), the block's sub-block scales applied there as integers, and
the lanes scaled by the block's float scales into an 8-lane float accumulator, reduced once
per row. The shared version reduces every block to a scalar instead, which made the decode
mat-vecs compute-bound at a third of the memory bandwidth.

`rowdot_<type>(row, q, ys, nb)`: row, one weight row's bytes; q, the activation row's bytes;
ys, per 32-element activation block the f16-rounded d * sum(quants) (Q8_1's s, which
Q4_1/Q5_1 need; `act_sums` fills it); nb, blocks in the row. The helpers `_half_row`,
`_f32_row`, `_k4_scale`, `_k4_min`, `_i16_row`, `_sum_i8`, `_f16_round` are the shared codec
helpers the CPU target binds (backends/jit.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggraph.types import GGMLType
from .qvec import (add32, f8_fma, f8_sum, f8_zero, i32_zero, ld32, madd1, madd_2s, madd_s,
                   maddubs, maddubs_c, nib32, nib_hi, nib_lo, q5_bits, q6_lanes, signed_dot,
                   sub16)

# ---- 32-element blocks times Q8_0 (34 bytes: f16 d, 32 int8) ------------------------------


def rowdot_q4_0(row, q, ys, nb):
    acc = f8_zero()
    for b in range(nb):
        o, p = b * 18, b * 34
        y = ld32(q, p + 2)
        v = madd1(sub16(maddubs(nib32(row, o + 2), y), maddubs_c(8, y)))
        acc = f8_fma(acc, v, _half_row(row, o) * _half_row(q, p))  # noqa: F821
    return f8_sum(acc)


def rowdot_q4_1(row, q, ys, nb):
    acc = f8_zero()
    c = np.float32(0.0)
    for b in range(nb):
        o, p = b * 20, b * 34
        v = madd1(maddubs(nib32(row, o + 4), ld32(q, p + 2)))
        acc = f8_fma(acc, v, _half_row(row, o) * _half_row(q, p))  # noqa: F821
        c += _half_row(row, o + 2) * ys[b]  # noqa: F821
    return f8_sum(acc) + c


def rowdot_q5_0(row, q, ys, nb):
    acc = f8_zero()
    for b in range(nb):
        o, p = b * 22, b * 34
        y = ld32(q, p + 2)
        v = madd1(sub16(maddubs(q5_bits(nib32(row, o + 6), row, o + 2), y), maddubs_c(16, y)))
        acc = f8_fma(acc, v, _half_row(row, o) * _half_row(q, p))  # noqa: F821
    return f8_sum(acc)


def rowdot_q5_1(row, q, ys, nb):
    acc = f8_zero()
    c = np.float32(0.0)
    for b in range(nb):
        o, p = b * 24, b * 34
        v = madd1(maddubs(q5_bits(nib32(row, o + 8), row, o + 4), ld32(q, p + 2)))
        acc = f8_fma(acc, v, _half_row(row, o) * _half_row(q, p))  # noqa: F821
        c += _half_row(row, o + 2) * ys[b]  # noqa: F821
    return f8_sum(acc) + c


def rowdot_q8_0(row, q, ys, nb):
    acc = f8_zero()
    for b in range(nb):
        o = b * 34
        v = signed_dot(ld32(row, o + 2), ld32(q, o + 2))
        acc = f8_fma(acc, v, _half_row(row, o) * _half_row(q, o))  # noqa: F821
    return f8_sum(acc)


# ---- K-quants times Q8_K (292 bytes: f32 d, 256 int8, 16 int16 sums of 16) ----------------

def rowdot_q4_k(row, q, ys, nb):
    acc = f8_zero()
    c = np.float32(0.0)
    for b in range(nb):
        o, p = b * 144, b * 292
        isum = i32_zero()
        summ = 0
        for j in range(4):
            qo, eo, bo = o + 16 + 32 * j, p + 4 + 64 * j, p + 260 + 8 * j
            isum = add32(isum, madd_s(maddubs(nib_lo(row, qo), ld32(q, eo)),
                                      _k4_scale(row, o + 4, 2 * j)))  # noqa: F821
            isum = add32(isum, madd_s(maddubs(nib_hi(row, qo), ld32(q, eo + 32)),
                                      _k4_scale(row, o + 4, 2 * j + 1)))  # noqa: F821
            summ += np.int64(_k4_min(row, o + 4, 2 * j)) * (  # noqa: F821
                _i16_row(q, bo) + _i16_row(q, bo + 2)) + np.int64(  # noqa: F821
                _k4_min(row, o + 4, 2 * j + 1)) * (_i16_row(q, bo + 4)  # noqa: F821
                                                   + _i16_row(q, bo + 6))  # noqa: F821
        dq = _f32_row(q, p)  # noqa: F821
        acc = f8_fma(acc, isum, dq * _half_row(row, o))  # noqa: F821
        c += dq * _half_row(row, o + 2) * np.float32(summ)  # noqa: F821
    return f8_sum(acc) - c


def rowdot_q6_k(row, q, ys, nb):
    acc = f8_zero()
    for b in range(nb):
        o, p = b * 210, b * 292
        isum = i32_zero()
        for nn in range(2):
            lo, ho, so, eo = o + 64 * nn, o + 128 + 32 * nn, o + 192 + 8 * nn, p + 4 + 128 * nn
            for k in range(4):
                # value j of quarter k: bits of byte j (or 32 + j) of the low plane, k's two
                # bits of byte j of the high plane; sub-blocks of 16 with their own scales
                y = ld32(q, eo + 32 * k)
                x = q6_lanes(row, lo + 32 * (k % 2), 4 * (k // 2), ho, 2 * k)
                isum = add32(isum, madd_2s(sub16(maddubs(x, y), maddubs_c(32, y)),
                                           np.int8(row[so + 2 * k]),
                                           np.int8(row[so + 2 * k + 1])))
        acc = f8_fma(acc, isum, _f32_row(q, p) * _half_row(row, o + 208))  # noqa: F821
    return f8_sum(acc)


def rowdot_shared(row, q, ys, nb):
    """A type without a vector row dot here: the shared qdot (qdot_a, BLOCK elements a block)
    on the row."""
    return qdot_a(row[None, None, None, :], 0, 0, 0, q, nb * BLOCK)  # noqa: F821


def act_sums(q, ys, nb):
    """ys[b] = Q8_0 activation block b's d * sum(quants), rounded to f16 (Q8_1's s)."""
    for b in range(nb):
        p = b * 34
        ys[b] = _f16_round(np.float32(_half_row(q, p) * np.float32(_sum_i8(q, p + 2, 32))))  # noqa


@dataclass(frozen=True)
class RowDot:
    """A weight type's whole-row dot; `sums` when it reads `act_sums`' ys."""
    fn: Callable
    sums: bool = False


ROW_DOTS: dict[GGMLType, RowDot] = {
    GGMLType.Q4_0: RowDot(rowdot_q4_0), GGMLType.Q4_1: RowDot(rowdot_q4_1, sums=True),
    GGMLType.Q5_0: RowDot(rowdot_q5_0), GGMLType.Q5_1: RowDot(rowdot_q5_1, sums=True),
    GGMLType.Q8_0: RowDot(rowdot_q8_0), GGMLType.Q4_K: RowDot(rowdot_q4_k),
    GGMLType.Q6_K: RowDot(rowdot_q6_k),
}
