"""Row kernels of ggml's 256-element super-block quantizers (Q2_K..Q6_K, IQ4_XS) in numba.

This module owns, for each super-block type, a kernel over rows without an importance matrix
(ggml's `quantize_row_*_ref`; for IQ4_XS `quantize_iq4_xs` with quant_weights NULL) and one
with it (`quantize_row_*_impl`). Byte layouts are those of ggml-common.h's block_q2_K ..
block_q6_K and block_iq4_xs. The entry point, argument checks and the 32-element types are in
backends/cpu/quantize_rows.py; the searches in backends/cpu/quant_search.py, whose module
docstring lists what bit-exactness rests on; the pieces the kernels share (sums, importance
weights, the packing of quant and scale bytes) in backends/cpu/quantize_k_pieces.py.

Each kernel works a row at a time: the row is cut into the groups ggml searches independently
(16 or 32 values), transposed so that the lane searches of quant_lanes run all of them side by
side, then every super-block is finished in C's order from its groups' scales and quants.

Steps of the ported C that matter for the bytes: super-block scales are rounded to f16 and
the final quants recomputed from the f16-rounded `d * sc` (`(x + dm)/d` or `x/d`), keeping the
search's quants where that product is 0; the scale bytes keep C's integer wraps ((uint8_t) of
nearest_int in Q4_K/Q5_K before MIN(63, .), the int stored in Q2_K's uint8 scales, int8 scales
in Q3_K/Q6_K); a Q6_K super-block whose scales are all below GROUP_MAX_EPS is all zero bytes;
IQ4_XS requantizes with the unrounded f32 super-block scale.
"""
from __future__ import annotations

import numpy as np

from ggraph.codecs.quants_k import QK_K

from .quant_search import (
    JIT as _jit, GROUP_MAX_EPS, ONE, ZERO, fp16_to_fp32, fp32_to_fp16, iq4_nl_index, low_i8, make_q3_quants, make_qp_quants, make_qx_quants, nearest_int, put_f16,
)
from .quant_lanes import iq4_scale_lanes, make_qkx_quants_lanes, make_qx_quants_lanes, to_lanes
from .quantize_k_pieces import (from_lanes, get_scale_min_k4, imatrix_lanes, lane_sums,
                                pack_2bit, pack_q3_scales, put_scale_min_k4, sum_sq)

__all__ = ["KERNELS"]

F32 = np.float32
_F15 = F32(15.0)
_F32 = F32(32.0)
_F63 = F32(63.0)
_F256 = F32(256.0)
_TWO = F32(2.0)
_MINUS_32 = F32(-32.0)
_MINUS_128 = F32(-128.0)
_TWO_OVER_256 = F32(2.0) / F32(256.0)             # IQ4_XS: 2.f/super_block_size
_RDELTA_2 = F32(0.1)                               # make_qkx2_quants' rdelta in every caller
_RMIN_Q2 = F32(-0.5)
_RMIN_Q4 = F32(-1.0)
_RMIN_Q5 = F32(-0.5)
_RMIN_3 = F32(-0.9)                                # make_qkx3_quants(..., -0.9f, 0.05f, 36, false)
_RDELTA_3 = F32(0.05)


# ----------------------------------------------------------------------------- Q2_K

@_jit
def _q2_K_finish(xb, L, y, at, dh, mh):
    """Q2_K tail (84-byte block: scales[16], qs[64], d, dmin): requantize each 16 with the f16
    d*scale and dmin*min where d*scale != 0, pack qs, store d and dmin."""
    d_all = fp16_to_fp32(dh)
    m_all = fp16_to_fp32(mh)
    for j in range(16):
        b = np.int64(y[at + j])
        d = d_all * F32(b & 0xF)
        if d == ZERO:
            continue
        dm = m_all * F32(b >> 4)
        for ii in range(16):
            k = 16 * j + ii
            L[k] = max(0, min(3, nearest_int((xb[k] + dm) / d)))
    pack_2bit(L, y, at + 16)
    put_f16(y, at + 80, dh)
    put_f16(y, at + 82, mh)


@_jit
def _q2_K_rows(x, out):
    """quantize_row_q2_K_ref: make_qkx2_quants(16, 3, x, |x|, ..., -0.5f, 0.1f, 15, mad) per
    16, then scales and mins as 4-bit fractions of their maxima."""
    G = x.shape[1] // 16
    xt = np.empty((16, G), np.float32)
    wt = np.empty((16, G), np.float32)
    L = np.empty((16, G), np.float32)
    scales = np.empty(G, np.float32)
    mins = np.empty(G, np.float32)
    Lsb = np.empty(QK_K, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 16, xt)
        for i in range(16):
            for k in range(G):
                wt[i, k] = abs(xt[i, k])
        make_qkx_quants_lanes(xt, wt, 3, _RMIN_Q2, _RDELTA_2, 15, True, L, scales, mins)
        for sb in range(G // 16):
            at = 84 * sb
            max_scale = ZERO
            max_min = ZERO
            for j in range(16):
                if scales[16 * sb + j] > max_scale:
                    max_scale = scales[16 * sb + j]
                if mins[16 * sb + j] > max_min:
                    max_min = mins[16 * sb + j]
            if max_scale > ZERO:
                iscale = _F15 / max_scale
                for j in range(16):      # the int lands in a uint8
                    y[at + j] = nearest_int(iscale * scales[16 * sb + j]) & 0xFF
                dh = fp32_to_fp16(max_scale / _F15)
            else:
                for j in range(16):
                    y[at + j] = 0
                dh = fp32_to_fp16(ZERO)
            if max_min > ZERO:
                iscale = _F15 / max_min
                for j in range(16):
                    lm = nearest_int(iscale * mins[16 * sb + j])
                    y[at + j] = (np.int64(y[at + j]) | (lm << 4)) & 0xFF
                mh = fp32_to_fp16(max_min / _F15)
            else:
                mh = fp32_to_fp16(ZERO)
            from_lanes(L, 16 * sb, Lsb)
            _q2_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, y, at, dh, mh)


@_jit
def _q2_K_rows_imatrix(x, qw, out):
    """quantize_row_q2_K_impl: make_qkx3_quants(16, 3, ..., -0.9f, 0.05f, 36) with weights
    qw*sqrt(sigma2 + x^2), sigma2 = mean x^2 of the super-block; scales and mins to 4 bits by
    make_qp_quants(16, 15, ...) weighted by each 16's weight sum."""
    G = x.shape[1] // 16
    nsb = G // 16
    xt = np.empty((16, G), np.float32)
    wt = np.empty((16, G), np.float32)
    L = np.empty((16, G), np.float32)
    scales = np.empty(G, np.float32)
    mins = np.empty(G, np.float32)
    sw = np.empty(G, np.float32)
    sigma2 = np.empty(nsb, np.float32)
    Ls = np.empty(16, np.int64)
    Lm = np.empty(16, np.int64)
    Lsb = np.empty(QK_K, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 16, xt)
        for sb in range(nsb):
            sigma2[sb] = sum_sq(xr, QK_K * sb, QK_K * (sb + 1)) / _F256
        imatrix_lanes(xr, qw, sigma2, xt, wt)
        lane_sums(wt, sw)
        make_qkx_quants_lanes(xt, wt, 3, _RMIN_3, _RDELTA_3, 36, False, L, scales, mins)
        for sb in range(nsb):
            g = slice(16 * sb, 16 * sb + 16)
            dm = make_qp_quants(16, 15, scales[g], Ls, sw[g])
            mm = make_qp_quants(16, 15, mins[g], Lm, sw[g])
            at = 84 * sb
            for j in range(16):
                y[at + j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
            from_lanes(L, 16 * sb, Lsb)
            _q2_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, y, at, fp32_to_fp16(dm),
                         fp32_to_fp16(mm))


# ----------------------------------------------------------------------------- Q3_K

@_jit
def _q3_K_finish(xb, L, y, at, dh):
    """Q3_K tail (110-byte block: hmask[32], qs[64], scales[12], d): requantize each 16 with
    the f16 d times its signed 6-bit scale read back from the bytes, then the high bit of
    quant j goes to bit j/32 of hmask[j%32] and the low two bits to qs."""
    d_all = fp16_to_fp32(dh)
    for j in range(16):
        lo = np.int64(y[at + 96 + j]) & 0xF if j < 8 else np.int64(y[at + 96 + j - 8]) >> 4
        hi = (np.int64(y[at + 104 + j % 4]) >> (2 * (j // 4))) & 3
        d = d_all * F32(low_i8((lo | (hi << 4)) - 32))
        if d == ZERO:
            continue
        for ii in range(16):
            k = 16 * j + ii
            L[k] = max(-4, min(3, nearest_int(xb[k] / d))) + 4
    for m in range(32):                              # quants are 0..7: bit 2 is the high bit
        h = 0
        for b in range(8):
            h |= (L[32 * b + m] >> 2) << b
            L[32 * b + m] &= 3
        y[at + m] = h
    pack_2bit(L, y, at + 32)
    put_f16(y, at + 108, dh)


@_jit
def _q3_K_rows(x, out):
    """quantize_row_q3_K_ref: make_q3_quants(16, 4, x, L, rmse) per 16, then 6-bit signed
    scales relative to the scale of largest magnitude. The scalar search: its passes mostly
    skip work on branches, which the lane form cannot."""
    L = np.empty(QK_K, np.int64)
    scales = np.empty(16, np.float32)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        for sb in range(xr.shape[0] // QK_K):
            xb = xr[QK_K * sb:QK_K * (sb + 1)]
            at = 110 * sb
            max_scale = ZERO
            amax = ZERO
            for j in range(16):
                s = make_q3_quants(16, 4, xb[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
                scales[j] = s
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            for k in range(12):
                y[at + 96 + k] = 0
            if max_scale != ZERO:
                iscale = _MINUS_32 / max_scale
                for j in range(16):
                    l = max(-32, min(31, low_i8(nearest_int(iscale * scales[j])))) + 32
                    pack_q3_scales(j, l, y, at + 96)
                dh = fp32_to_fp16(ONE / iscale)
            else:
                dh = fp32_to_fp16(ZERO)
            _q3_K_finish(xb, L, y, at, dh)


@_jit
def _q3_K_rows_imatrix(x, qw, out):
    """quantize_row_q3_K_impl: make_qx_quants(16, 4, x, L, 1, weights) per 16 with weights
    qw*sqrt(2*mean x^2 + x^2), then the 16 scales of a super-block by make_qx_quants(16, 32,
    ...) weighted by each 16's weight sum."""
    G = x.shape[1] // 16
    nsb = G // 16
    xt = np.empty((16, G), np.float32)
    wt = np.empty((16, G), np.float32)
    L = np.empty((16, G), np.float32)
    scales = np.empty(G, np.float32)
    sw = np.empty(G, np.float32)
    sigma2 = np.empty(nsb, np.float32)
    Ls = np.empty(16, np.int64)
    Lsb = np.empty(QK_K, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 16, xt)
        for sb in range(nsb):
            sigma2[sb] = _TWO * sum_sq(xr, QK_K * sb, QK_K * (sb + 1)) / _F256
        imatrix_lanes(xr, qw, sigma2, xt, wt)
        lane_sums(wt, sw)
        make_qx_quants_lanes(xt, wt, 4, L, scales)
        for sb in range(nsb):
            at = 110 * sb
            for k in range(12):
                y[at + 96 + k] = 0
            g = slice(16 * sb, 16 * sb + 16)
            d_block = make_qx_quants(16, 32, scales[g], Ls, sw[g], True)
            for j in range(16):
                pack_q3_scales(j, Ls[j], y, at + 96)
            from_lanes(L, 16 * sb, Lsb)
            _q3_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, y, at, fp32_to_fp16(d_block))


# ----------------------------------------------------------------------------- Q4_K, Q5_K

@_jit
def _q45_K_finish(xb, L, y, at, nmax, dh, mh):
    """Q4_K / Q5_K tail: requantize each 32 with the f16 d*sc and dmin*m where d*sc != 0, store
    d and dmin, then the quants: Q4_K (144 bytes) nibbles qs[32c + l] = L[64c + l] |
    L[64c + 32 + l] << 4; Q5_K (176 bytes) the same low nibbles after qh[32], whose bits 2c and
    2c + 1 hold the fifth bits of L[64c + l] and L[64c + 32 + l]."""
    d_all = fp16_to_fp32(dh)
    m_all = fp16_to_fp32(mh)
    for j in range(8):
        sc, m = get_scale_min_k4(j, y, at + 4)
        d = d_all * F32(sc)
        if d == ZERO:
            continue
        dm = m_all * F32(m)
        for ii in range(32):
            k = 32 * j + ii
            L[k] = max(0, min(nmax, nearest_int((xb[k] + dm) / d)))
    put_f16(y, at, dh)
    put_f16(y, at + 2, mh)
    if nmax == 15:
        for c in range(4):
            for l in range(32):
                y[at + 16 + 32 * c + l] = (L[64 * c + l] | (L[64 * c + 32 + l] << 4)) & 0xFF
    else:
        for l in range(32):
            y[at + 16 + l] = 0
        for c in range(4):
            for l in range(32):
                l1 = L[64 * c + l]
                l2 = L[64 * c + 32 + l]
                h = np.int64(y[at + 16 + l])
                if l1 > 15:
                    l1 -= 16
                    h |= 1 << (2 * c)
                if l2 > 15:
                    l2 -= 16
                    h |= 2 << (2 * c)
                y[at + 16 + l] = h
                y[at + 48 + 32 * c + l] = (l1 | (l2 << 4)) & 0xFF


@_jit
def _q45_K_rows(x, out, nmax, rmin, nstep, bsize):
    """quantize_row_q4_K_ref (nmax 15, rmin -1, 20 steps, 144 bytes) / q5_K_ref (31, -0.5, 15,
    176): make_qkx2_quants(32, nmax, ..., weights sqrt(mean x^2) + |x|, rmin, 0.1f, nstep) per
    32, then 6-bit scales and mins relative to their maxima."""
    G = x.shape[1] // 32
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    L = np.empty((32, G), np.float32)
    scales = np.empty(G, np.float32)
    mins = np.empty(G, np.float32)
    av_x = np.empty(G, np.float32)
    Lsb = np.empty(QK_K, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 32, xt)
        for k in range(G):
            av_x[k] = ZERO
        for i in range(32):
            for k in range(G):
                av_x[k] += xt[i, k] * xt[i, k]
        for k in range(G):
            av_x[k] = np.sqrt(av_x[k] / _F32)
        for i in range(32):
            for k in range(G):
                wt[i, k] = av_x[k] + abs(xt[i, k])
        make_qkx_quants_lanes(xt, wt, nmax, rmin, _RDELTA_2, nstep, False, L, scales, mins)
        for sb in range(G // 8):
            at = bsize * sb
            max_scale = ZERO
            max_min = ZERO
            for j in range(8):
                if scales[8 * sb + j] > max_scale:
                    max_scale = scales[8 * sb + j]
                if mins[8 * sb + j] > max_min:
                    max_min = mins[8 * sb + j]
            inv_scale = _F63 / max_scale if max_scale > ZERO else ZERO
            inv_min = _F63 / max_min if max_min > ZERO else ZERO
            for j in range(8):          # (uint8_t)nearest_int(...), then MIN(63, .)
                ls = min(63, nearest_int(inv_scale * scales[8 * sb + j]) & 0xFF)
                lm = min(63, nearest_int(inv_min * mins[8 * sb + j]) & 0xFF)
                put_scale_min_k4(j, ls, lm, y, at + 4)
            from_lanes(L, 8 * sb, Lsb)
            _q45_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, y, at, nmax,
                          fp32_to_fp16(max_scale / _F63), fp32_to_fp16(max_min / _F63))


@_jit
def _q45_K_rows_imatrix(x, qw, out, nmax, bsize):
    """quantize_row_q4_K_impl / q5_K_impl: make_qkx3_quants(32, nmax, ..., -0.9f, 0.05f, 36)
    with weights qw*sqrt(2*mean x^2 + x^2), then scales and mins to 6 bits by
    make_qp_quants(8, 63, ...) weighted by each 32's weight sum (Q5_K caps them at 63)."""
    G = x.shape[1] // 32
    nsb = G // 8
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    L = np.empty((32, G), np.float32)
    scales = np.empty(G, np.float32)
    mins = np.empty(G, np.float32)
    sw = np.empty(G, np.float32)
    sigma2 = np.empty(nsb, np.float32)
    Ls = np.empty(8, np.int64)
    Lm = np.empty(8, np.int64)
    Lsb = np.empty(QK_K, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 32, xt)
        for sb in range(nsb):
            sigma2[sb] = _TWO * sum_sq(xr, QK_K * sb, QK_K * (sb + 1)) / _F256
        imatrix_lanes(xr, qw, sigma2, xt, wt)
        lane_sums(wt, sw)
        make_qkx_quants_lanes(xt, wt, nmax, _RMIN_3, _RDELTA_3, 36, False, L, scales, mins)
        for sb in range(nsb):
            at = bsize * sb
            g = slice(8 * sb, 8 * sb + 8)
            d_block = make_qp_quants(8, 63, scales[g], Ls, sw[g])
            m_block = make_qp_quants(8, 63, mins[g], Lm, sw[g])
            for j in range(8):
                ls = Ls[j]
                lm = Lm[j]
                if nmax == 31:
                    ls = min(63, ls)
                    lm = min(63, lm)
                put_scale_min_k4(j, ls, lm, y, at + 4)
            from_lanes(L, 8 * sb, Lsb)
            _q45_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, y, at, nmax,
                          fp32_to_fp16(d_block), fp32_to_fp16(m_block))


# ----------------------------------------------------------------------------- Q6_K

@_jit
def _q6_K_finish(xb, L, scales, y, at):
    """Q6_K on one super-block from its 16 scales and search quants L (210 bytes: ql[128],
    qh[64], scales[16] int8, d): 8-bit scales relative to the scale of largest magnitude,
    quants requantized with the f16 d; all zero bytes when every |scale| < GROUP_MAX_EPS."""
    max_scale = ZERO
    max_abs_scale = ZERO
    for ib in range(16):
        if abs(scales[ib]) > max_abs_scale:
            max_abs_scale = abs(scales[ib])
            max_scale = scales[ib]
    if max_abs_scale < GROUP_MAX_EPS:                # C memsets the whole block
        for k in range(210):
            y[at + k] = 0
        return
    iscale = _MINUS_128 / max_scale
    dh = fp32_to_fp16(ONE / iscale)
    for ib in range(16):
        y[at + 192 + ib] = min(127, nearest_int(iscale * scales[ib])) & 0xFF   # int8 store
    d_all = fp16_to_fp32(dh)
    for j in range(16):
        d = d_all * F32(low_i8(np.int64(y[at + 192 + j])))
        if d == ZERO:
            continue
        for ii in range(16):
            k = 16 * j + ii
            L[k] = max(-32, min(31, nearest_int(xb[k] / d))) + 32
    for h in range(2):
        for l in range(32):
            b = 128 * h + l
            q1 = L[b] & 0xF
            q2 = L[b + 32] & 0xF
            q3 = L[b + 64] & 0xF
            q4 = L[b + 96] & 0xF
            y[at + 64 * h + l] = q1 | (q3 << 4)
            y[at + 64 * h + l + 32] = q2 | (q4 << 4)
            y[at + 128 + 32 * h + l] = ((L[b] >> 4) | ((L[b + 32] >> 4) << 2)
                                        | ((L[b + 64] >> 4) << 4) | ((L[b + 96] >> 4) << 6)) & 0xFF
    put_f16(y, at + 208, dh)


@_jit
def _q6_K_rows(x, qw, out, use_qw):
    """quantize_row_q6_K_ref / q6_K_impl: make_qx_quants(16, 32, x, L, 1, qw or NULL) per 16
    (weights: the raw importance weights, or x*x)."""
    G = x.shape[1] // 16
    xt = np.empty((16, G), np.float32)
    wt = np.empty((16, G), np.float32)
    L = np.empty((16, G), np.float32)
    scales = np.empty(G, np.float32)
    Lsb = np.empty(QK_K, np.int64)
    if use_qw:                                       # the same weights for every row
        to_lanes(qw, 16, wt)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 16, xt)
        if not use_qw:
            for i in range(16):
                for k in range(G):
                    wt[i, k] = xt[i, k] * xt[i, k]
        make_qx_quants_lanes(xt, wt, 32, L, scales)
        for sb in range(G // 16):
            from_lanes(L, 16 * sb, Lsb)
            _q6_K_finish(xr[QK_K * sb:QK_K * (sb + 1)], Lsb, scales[16 * sb:16 * sb + 16], y,
                         210 * sb)


# ----------------------------------------------------------------------------- IQ4_XS

@_jit
def _iq4_xs_finish(xb, scales, y, at):
    """quantize_row_iq4_nl_impl's tail for one super-block (136 bytes: d, scales_h u16,
    scales_l[4], qs[128]): a 6-bit signed scale per 32 relative to d = -max_scale/32 (max_scale:
    the scale of largest magnitude), quants from the unrounded d*l."""
    max_scale = ZERO
    amax_scale = ZERO
    for ib in range(8):
        if abs(scales[ib]) > amax_scale:
            amax_scale = abs(scales[ib])
            max_scale = scales[ib]
    d = -max_scale / _F32
    put_f16(y, at, fp32_to_fp16(d))
    inv = ONE / d if d != ZERO else ZERO
    scales_h = 0
    for ib in range(8):
        l = max(-32, min(31, nearest_int(inv * scales[ib])))
        dl = d * F32(l)
        idl = ONE / dl if dl != ZERO else ZERO
        for j in range(16):
            k = 32 * ib + j
            l0, _ = iq4_nl_index(idl * xb[k])
            l1, _ = iq4_nl_index(idl * xb[k + 16])
            y[at + 8 + 16 * ib + j] = l0 | (l1 << 4)
        l += 32
        if ib % 2 == 0:
            y[at + 4 + ib // 2] = l & 0xF
        else:
            y[at + 4 + ib // 2] = (np.int64(y[at + 4 + ib // 2]) | ((l & 0xF) << 4)) & 0xFF
        scales_h |= (l >> 4) << (2 * ib)
    y[at + 2] = scales_h & 0xFF
    y[at + 3] = (scales_h >> 8) & 0xFF


@_jit
def _iq4_xs_rows(x, qw, out, use_qw):
    """quantize_iq4_xs: quantize_row_iq4_nl_impl(256, 32, ..., ntry = 7) per super-block, the
    per-32 scale search with weights qw*sqrt(sigma2 + x^2) (sigma2 = 2*mean x^2 of the
    super-block) or x^2."""
    G = x.shape[1] // 32
    nsb = G // 8
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    scales = np.empty(G, np.float32)
    sigma2 = np.empty(nsb, np.float32)
    for r in range(x.shape[0]):
        xr = x[r]
        y = out[r]
        to_lanes(xr, 32, xt)
        if use_qw:
            for sb in range(nsb):
                sigma2[sb] = sum_sq(xr, QK_K * sb, QK_K * (sb + 1)) * _TWO_OVER_256
            imatrix_lanes(xr, qw, sigma2, xt, wt)
        else:
            for i in range(32):
                for k in range(G):
                    wt[i, k] = xt[i, k] * xt[i, k]
        iq4_scale_lanes(xt, wt, scales)
        for sb in range(nsb):
            _iq4_xs_finish(xr[QK_K * sb:QK_K * (sb + 1)], scales[8 * sb:8 * sb + 8], y, 136 * sb)


# ----------------------------------------------------------------------------- dispatch

_NO_WEIGHTS = np.zeros(1, np.float32)              # placeholder where C passes NULL


def _q2_K(x, w, out):
    if w is None:
        _q2_K_rows(x, out)
    else:
        _q2_K_rows_imatrix(x, w, out)


def _q3_K(x, w, out):
    if w is None:
        _q3_K_rows(x, out)
    else:
        _q3_K_rows_imatrix(x, w, out)


def _q4_K(x, w, out):
    if w is None:
        _q45_K_rows(x, out, 15, _RMIN_Q4, 20, 144)
    else:
        _q45_K_rows_imatrix(x, w, out, 15, 144)


def _q5_K(x, w, out):
    if w is None:
        _q45_K_rows(x, out, 31, _RMIN_Q5, 15, 176)
    else:
        _q45_K_rows_imatrix(x, w, out, 31, 176)


def _q6_K(x, w, out):
    _q6_K_rows(x, _NO_WEIGHTS if w is None else w, out, w is not None)


def _iq4_xs(x, w, out):
    _iq4_xs_rows(x, _NO_WEIGHTS if w is None else w, out, w is not None)


# type name -> (elements per block, bytes per block, runs `x, imatrix|None, out`)
KERNELS = {
    "Q2_K": (QK_K, 84, _q2_K),
    "Q3_K": (QK_K, 110, _q3_K),
    "Q4_K": (QK_K, 144, _q4_K),
    "Q5_K": (QK_K, 176, _q5_K),
    "Q6_K": (QK_K, 210, _q6_K),
    "IQ4_XS": (QK_K, 136, _iq4_xs),
}
