"""The pieces ggml's 256-element super-block quantizers share, as numba functions the row
kernels of backends/cpu/quantize_rows_k.py call: C's in-order sums of squares and of weights,
the importance-matrix weights of the *_impl quantizers, a super-block's quants back from the
lane layout, and the packing of the quants' and scales' bytes (ggml-common.h's block_q2_K ..
block_q5_K: 2-bit quants, the 6-bit scale and min pairs of Q4_K / Q5_K, Q3_K's scales)."""
from __future__ import annotations

import numpy as np

from ggraph.codecs.quants_k import QK_K

from .quant_search import JIT as _jit, ZERO


@_jit
def sum_sq(x, a, b):
    """C's `s = 0; for (...) s += x[j]*x[j];` over x[a:b]."""
    s = ZERO
    for j in range(a, b):
        s += x[j] * x[j]
    return s


@_jit
def lane_sums(wt, sw):
    """sw[k] = C's `s = 0; for (l...) s += weight[l];` over group k's weights."""
    for k in range(wt.shape[1]):
        sw[k] = ZERO
    for i in range(wt.shape[0]):
        for k in range(wt.shape[1]):
            sw[k] += wt[i, k]


@_jit
def imatrix_lanes(xr, qw, sigma2, xt, wt):
    """wt[i, k] = qw[e] * sqrtf(sigma2[sb] + x[e]*x[e]) for element e = n*k + i of the row
    (sb its super-block): the weights of the *_impl quantizers."""
    n, G = xt.shape
    for k in range(G):
        s2 = sigma2[(n * k) // QK_K]
        for i in range(n):
            wt[i, k] = qw[n * k + i] * np.sqrt(s2 + xt[i, k] * xt[i, k])


@_jit
def from_lanes(L, g0, Lsb):
    """Lsb[e] = L[e % n, g0 + e // n]: one super-block's quants back in element order."""
    n = L.shape[0]
    for j in range(QK_K // n):
        for i in range(n):
            Lsb[n * j + i] = np.int64(L[i, g0 + j])


@_jit
def pack_2bit(L, y, at):
    """Q2_K / Q3_K qs: byte at + 32h + l holds L[128h + l + 32k] at bits 2k."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            b = j + l
            y[at + j // 4 + l] = (L[b] | (L[b + 32] << 2) | (L[b + 64] << 4)
                                  | (L[b + 96] << 6)) & 0xFF


@_jit
def get_scale_min_k4(j, y, at):
    """ggml's get_scale_min_k4 on the 12 scale bytes y[at:at + 12]: (scale, min) of j."""
    if j < 4:
        return np.int64(y[at + j]) & 63, np.int64(y[at + j + 4]) & 63
    hi = np.int64(y[at + j + 4])                     # int64 first: numba types uint8 | int as float
    d = (hi & 0xF) | ((np.int64(y[at + j - 4]) >> 6) << 4)
    m = (hi >> 4) | ((np.int64(y[at + j]) >> 6) << 4)
    return d, m


@_jit
def put_scale_min_k4(j, ls, lm, y, at):
    """Q4_K / Q5_K: store 6-bit scale ls and min lm of sub-block j (j ascending from 0, as
    C's loop: the upper two bits of j >= 4 are OR-ed into bytes j - 4 and j)."""
    if j < 4:
        y[at + j] = ls & 0xFF
        y[at + j + 4] = lm & 0xFF
    else:
        y[at + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
        y[at + j - 4] = (np.int64(y[at + j - 4]) | ((ls >> 4) << 6)) & 0xFF
        y[at + j] = (np.int64(y[at + j]) | ((lm >> 4) << 6)) & 0xFF


@_jit
def pack_q3_scales(j, l, y, at):
    """Q3_K: store the 6-bit scale l (0..63) of sub-block j (j ascending, bytes zeroed)."""
    if j < 8:
        y[at + j] = l & 0xF
    else:
        y[at + j - 8] = (np.int64(y[at + j - 8]) | ((l & 0xF) << 4)) & 0xFF
    y[at + j % 4 + 8] = (np.int64(y[at + j % 4 + 8]) | ((l >> 4) << (2 * (j // 4)))) & 0xFF
