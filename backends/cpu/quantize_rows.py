"""ggml_quantize_chunk in numba: float32 rows -> the bytes ggml's CPU quantizers write.

This module owns the public entry point `quantize_rows(type_name, x, imatrix=None, out=None)`
and the row kernels of the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL); the
256-element super-block types (Q2_K..Q6_K, IQ4_XS) live in backends/cpu/quantize_rows_k.py and
the shared searches and scalar helpers in backends/cpu/quant_search.py.

For every type the result is byte for byte what `ggml_quantize_chunk(type, x, dst, 0, nrows,
n_per_row, imatrix)` writes (ggml/src/ggml.c dispatch, ggml/src/ggml-quants.c quantizers), which
is what llama-quantize stores:

- imatrix None: the `quantize_row_*_ref` quantizers (Q4_0..Q8_0, Q2_K..Q6_K), and for IQ4_NL /
  IQ4_XS `quantize_iq4_nl` / `quantize_iq4_xs` with no weights (scale search with ntry = 7;
  not `quantize_row_iq4_nl_ref`, which skips the search).
- imatrix given (n_per_row float32 weights, the same for every row): the `quantize_row_*_impl`
  quantizers, whose weights also depend on the row (Q4_0..Q5_1: sigma2 over the whole row),
  the super-block (K-quants, IQ4_XS) or the block (IQ4_NL). Q8_0 ignores the imatrix, as ggml
  does (`USES_IMATRIX`).

Kernels are `njit(cache=True, nogil=True)` loops over rows, each row independent, so a caller
may run `quantize_rows(t, x[a:b], w, out=out[a:b])` for disjoint row ranges on several threads.
Input must be finite: ggml's behaviour on inf/NaN is undefined and is not reproduced.
"""
from __future__ import annotations

import numpy as np

from . import quantize_rows_k as _k
from .quant_search import (
    JIT as _jit, ONE, ZERO, cvtt_i32, fp32_to_fp16, iq4_nl_index, low_i8, put_f16, roundf_i32,
)
from .quant_lanes import iq4_scale_lanes, make_qkx_quants_lanes, make_qx_quants_lanes, to_lanes

__all__ = ["quantize_rows", "QUANTIZABLE", "USES_IMATRIX", "BLOCK_LAYOUT", "row_bytes"]


F32 = np.float32
_FLT_MAX = F32(3.4028234663852886e38)
_MINUS_8 = F32(-8.0)
_MINUS_16 = F32(-16.0)
_F15 = F32(15.0)
_F31 = F32(31.0)
_F127 = F32(127.0)
_F8_5 = F32(8.5)
_F16_5 = F32(16.5)
_HALF = F32(0.5)
_TWO_OVER_32 = F32(2.0) / F32(32.0)               # IQ4_NL: 2.f/super_block_size
_RMIN_3 = F32(-0.9)                                # make_qkx3_quants(..., -0.9f, 0.05f, 36, false)
_RDELTA_3 = F32(0.05)


# ----------------------------------------------------------------------------- shared pieces

@_jit
def _first_absmax(x, a, b):
    """(max, amax) of C's `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` over x[a:b]."""
    amax = ZERO
    vmax = ZERO
    for j in range(a, b):
        v = x[j]
        if amax < abs(v):
            amax = abs(v)
            vmax = v
    return vmax, amax


@_jit
def _min_max(x, a, b):
    """(min, max) from FLT_MAX / -FLT_MAX as quantize_row_q4_1_ref / q5_1_ref find them."""
    vmin = _FLT_MAX
    vmax = -_FLT_MAX
    for j in range(a, b):
        v = x[j]
        if v < vmin:
            vmin = v
        if v > vmax:
            vmax = v
    return vmin, vmax


@_jit
def _pack_nibbles(L, o, out, at):
    """qs[j] = L[j] | (L[j + 16] << 4) for the 32 quants of L[o:o + 32]."""
    for j in range(16):
        out[at + j] = (L[o + j] | (L[o + j + 16] << 4)) & 0xFF


@_jit
def _pack_fives(L, o, out, at_qh, at_qs):
    """Q5_0 / Q5_1 layout: low nibbles as _pack_nibbles, the fifth bits in a 32-bit qh (bit j
    for quant j, bit j + 16 for quant j + 16), little-endian."""
    qh = 0
    for j in range(16):
        xi0 = L[o + j] & 0xFF
        xi1 = L[o + j + 16] & 0xFF
        out[at_qs + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    for k in range(4):
        out[at_qh + k] = (qh >> (8 * k)) & 0xFF


@_jit
def _row_sigma2(x):
    """sum_x2/n_per_row over the whole row (Q4_0..Q5_1 importance weights)."""
    sum_x2 = ZERO
    for j in range(x.shape[0]):
        sum_x2 += x[j] * x[j]
    return sum_x2 / F32(x.shape[0])


@_jit
def _imatrix_lanes(qw, sigma2, xt, wt):
    """wt[i, k] = qw[32k + i] * sqrtf(sigma2 + x^2) for the transposed row xt."""
    for k in range(xt.shape[1]):
        for i in range(32):
            wt[i, k] = qw[32 * k + i] * np.sqrt(sigma2 + xt[i, k] * xt[i, k])


# ----------------------------------------------------------------------------- Q4_0, Q5_0

@_jit
def _q4_0_rows(x, out):
    """quantize_row_q4_0_ref: d = max / -8 (max: the first value of largest |x|), quants
    MIN(15, (int8_t)(x*id + 8.5f)) with id = 1/d (0 when d is 0)."""
    L = np.empty(32, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        for ib in range(xr.shape[0] // 32):
            o = 32 * ib
            vmax, _ = _first_absmax(xr, o, o + 32)
            d = vmax / _MINUS_8
            inv = ONE / d if d != ZERO else ZERO
            put_f16(yr, 18 * ib, fp32_to_fp16(d))
            for j in range(32):
                L[j] = min(15, low_i8(cvtt_i32(xr[o + j] * inv + _F8_5)))
            _pack_nibbles(L, 0, yr, 18 * ib + 2)


@_jit
def _q5_0_rows(x, out):
    """quantize_row_q5_0_ref: d = max / -16, quants MIN(31, (int8_t)(x*id + 16.5f))."""
    L = np.empty(32, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        for ib in range(xr.shape[0] // 32):
            o = 32 * ib
            vmax, _ = _first_absmax(xr, o, o + 32)
            d = vmax / _MINUS_16
            inv = ONE / d if d != ZERO else ZERO
            put_f16(yr, 22 * ib, fp32_to_fp16(d))
            for j in range(32):
                L[j] = min(31, low_i8(cvtt_i32(xr[o + j] * inv + _F16_5)))
            _pack_fives(L, 0, yr, 22 * ib + 2, 22 * ib + 6)


@_jit
def _qx_0_rows_imatrix(x, qw, out, nmax, bsize):
    """quantize_row_q4_0_impl (nmax 8, 18-byte blocks) / q5_0_impl (nmax 16, 22 bytes):
    make_qx_quants(32, nmax, x, L, 1, weights) per block, weights qw*sqrt(sigma2 + x^2)."""
    G = x.shape[1] // 32
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    Lt = np.empty((32, G), np.float32)
    d = np.empty(G, np.float32)
    L = np.empty(32, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        to_lanes(xr, 32, xt)
        _imatrix_lanes(qw, _row_sigma2(xr), xt, wt)
        make_qx_quants_lanes(xt, wt, nmax, Lt, d)
        for ib in range(G):
            put_f16(yr, bsize * ib, fp32_to_fp16(d[ib]))
            for j in range(32):
                L[j] = np.int64(Lt[j, ib])
            if nmax == 8:
                _pack_nibbles(L, 0, yr, bsize * ib + 2)
            else:
                _pack_fives(L, 0, yr, bsize * ib + 2, bsize * ib + 6)


# ----------------------------------------------------------------------------- Q4_1, Q5_1

@_jit
def _qx_1_rows(x, out, nmax, bsize):
    """quantize_row_q4_1_ref (nmax 15, 20-byte blocks) / q5_1_ref (nmax 31, 24 bytes):
    d = (max - min)/nmax, m = min, quants (x - min)*id + 0.5f cast to an integer: Q4_1 takes
    MIN(15, (int8_t)v), Q5_1 `(uint8_t)v` (no cap)."""
    L = np.empty(32, np.int64)
    fn = _F15 if nmax == 15 else _F31
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        for ib in range(xr.shape[0] // 32):
            o = 32 * ib
            at = bsize * ib
            vmin, vmax = _min_max(xr, o, o + 32)
            d = (vmax - vmin) / fn
            inv = ONE / d if d != ZERO else ZERO
            put_f16(yr, at, fp32_to_fp16(d))
            put_f16(yr, at + 2, fp32_to_fp16(vmin))
            for j in range(32):
                v = cvtt_i32((xr[o + j] - vmin) * inv + _HALF)
                L[j] = min(15, low_i8(v)) if nmax == 15 else v & 0xFF
            if nmax == 15:
                _pack_nibbles(L, 0, yr, at + 4)
            else:
                _pack_fives(L, 0, yr, at + 4, at + 8)


@_jit
def _qx_1_rows_imatrix(x, qw, out, nmax, bsize):
    """quantize_row_q4_1_impl / q5_1_impl: make_qkx3_quants(32, nmax, x, weights, L, &min,
    Laux, -0.9f, 0.05f, 36, false) per block, d = the scale, m = -the_min."""
    G = x.shape[1] // 32
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    Lt = np.empty((32, G), np.float32)
    d = np.empty(G, np.float32)
    the_min = np.empty(G, np.float32)
    L = np.empty(32, np.int64)
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        to_lanes(xr, 32, xt)
        _imatrix_lanes(qw, _row_sigma2(xr), xt, wt)
        make_qkx_quants_lanes(xt, wt, nmax, _RMIN_3, _RDELTA_3, 36, False, Lt, d, the_min)
        for ib in range(G):
            at = bsize * ib
            put_f16(yr, at, fp32_to_fp16(d[ib]))
            put_f16(yr, at + 2, fp32_to_fp16(-the_min[ib]))
            for j in range(32):
                L[j] = np.int64(Lt[j, ib])
            if nmax == 15:
                _pack_nibbles(L, 0, yr, at + 4)
            else:
                _pack_fives(L, 0, yr, at + 4, at + 8)


# ----------------------------------------------------------------------------- Q8_0

@_jit
def _q8_0_rows(x, out):
    """quantize_row_q8_0_ref: d = amax/127, quants roundf(x*id) (half away from zero)."""
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        for ib in range(xr.shape[0] // 32):
            o = 32 * ib
            amax = ZERO
            for j in range(32):
                a = abs(xr[o + j])
                amax = amax if amax > a else a       # MAX(amax, fabsf(v))
            d = amax / _F127
            inv = ONE / d if d != ZERO else ZERO
            put_f16(yr, 34 * ib, fp32_to_fp16(d))
            for j in range(32):
                yr[34 * ib + 2 + j] = roundf_i32(xr[o + j] * inv) & 0xFF


# ----------------------------------------------------------------------------- IQ4_NL

@_jit
def _iq4_nl_rows(x, qw, out, use_qw):
    """quantize_iq4_nl: quantize_row_iq4_nl_impl(32, 32, ..., ntry = 7) per block, with or
    without importance weights (qw*sqrt(sigma2 + x^2), sigma2 = 2*mean x^2 of the block, or
    x^2): the scale search of IQ4_XS on one block, whose scale is stored as f16 and whose
    quants are recomputed with the unrounded 1/scale."""
    G = x.shape[1] // 32
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    d = np.empty(G, np.float32)
    sigma2 = np.empty(G, np.float32)
    for r in range(x.shape[0]):
        xr = x[r]
        yr = out[r]
        to_lanes(xr, 32, xt)
        if use_qw:
            for k in range(G):
                sigma2[k] = ZERO
            for i in range(32):
                for k in range(G):
                    sigma2[k] += xt[i, k] * xt[i, k]
            for k in range(G):
                s2 = sigma2[k] * _TWO_OVER_32
                for i in range(32):
                    wt[i, k] = qw[32 * k + i] * np.sqrt(s2 + xt[i, k] * xt[i, k])
        else:
            for i in range(32):
                for k in range(G):
                    wt[i, k] = xt[i, k] * xt[i, k]
        iq4_scale_lanes(xt, wt, d)
        for ib in range(G):
            put_f16(yr, 18 * ib, fp32_to_fp16(d[ib]))
            inv = ONE / d[ib] if d[ib] != ZERO else ZERO
            for j in range(16):
                l0, _ = iq4_nl_index(inv * xr[32 * ib + j])
                l1, _ = iq4_nl_index(inv * xr[32 * ib + j + 16])
                yr[18 * ib + 2 + j] = l0 | (l1 << 4)


# ----------------------------------------------------------------------------- dispatch

def _q4_0(x, w, out):
    if w is None:
        _q4_0_rows(x, out)
    else:
        _qx_0_rows_imatrix(x, w, out, 8, 18)


def _q5_0(x, w, out):
    if w is None:
        _q5_0_rows(x, out)
    else:
        _qx_0_rows_imatrix(x, w, out, 16, 22)


def _q4_1(x, w, out):
    if w is None:
        _qx_1_rows(x, out, 15, 20)
    else:
        _qx_1_rows_imatrix(x, w, out, 15, 20)


def _q5_1(x, w, out):
    if w is None:
        _qx_1_rows(x, out, 31, 24)
    else:
        _qx_1_rows_imatrix(x, w, out, 31, 24)


def _q8_0(x, w, out):
    _q8_0_rows(x, out)                                  # quantize_q8_0 ignores quant_weights


def _iq4_nl(x, w, out):
    if w is None:
        _iq4_nl_rows(x, _NO_WEIGHTS, out, False)
    else:
        _iq4_nl_rows(x, w, out, True)


_NO_WEIGHTS = np.zeros(1, np.float32)                   # placeholder where C passes NULL

# type name -> (elements per block, bytes per block, runs `x, imatrix|None, out`)
_KERNELS = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "IQ4_NL": (32, 18, _iq4_nl),
    **_k.KERNELS,
}

QUANTIZABLE: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K",
                                "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
"""The ggml type names quantize_rows writes."""

USES_IMATRIX: dict[str, bool] = {t: t != "Q8_0" for t in QUANTIZABLE}
"""Whether an importance matrix changes a type's bytes (ggml's Q8_0 ignores it)."""

BLOCK_LAYOUT: dict[str, tuple[int, int]] = {t: _KERNELS[t][:2] for t in QUANTIZABLE}
"""type name -> (elements per block, bytes per block)."""

assert set(_KERNELS) == set(QUANTIZABLE)


def row_bytes(type_name: str, n_per_row: int) -> int:
    """Bytes of one quantized row of n_per_row elements (a multiple of the block size)."""
    block, size = _layout(type_name)
    if n_per_row % block:
        raise ValueError(f"{type_name}: n_per_row {n_per_row} is not a multiple of the "
                         f"block size {block}")
    return n_per_row // block * size


def _layout(type_name: str) -> tuple[int, int]:
    if not isinstance(type_name, str) or type_name not in BLOCK_LAYOUT:
        raise ValueError(f"cannot quantize to {type_name!r}: not one of "
                         f"{', '.join(QUANTIZABLE)}")
    return BLOCK_LAYOUT[type_name]


def quantize_rows(type_name: str, x: np.ndarray, imatrix: np.ndarray | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
    """The bytes ggml_quantize_chunk(type, x, dst, 0, nrows, n_per_row, imatrix) writes.

    x: C-contiguous float32 (nrows, n_per_row), n_per_row a multiple of the type's block size
    (32, or 256 for the K-quants and IQ4_XS). imatrix: None or n_per_row float32 importance
    weights, the same for every row. out: None or a C-contiguous uint8 (nrows, row_bytes)
    array to fill. Returns out (a new array when None). Bad arguments raise ValueError naming
    the type and the problem.
    """
    block, size = _layout(type_name)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        what = (f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray)
                else type(x).__name__)
        raise ValueError(f"{type_name}: x must be a float32 (nrows, n_per_row) array, "
                         f"got {what}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{type_name}: x must be C-contiguous (np.ascontiguousarray)")
    nrows, n_per_row = x.shape
    if n_per_row % block:
        raise ValueError(f"{type_name}: n_per_row {n_per_row} is not a multiple of the "
                         f"block size {block}")
    nbytes = n_per_row // block * size
    if imatrix is not None:
        if (not isinstance(imatrix, np.ndarray) or imatrix.dtype != np.float32
                or imatrix.shape != (n_per_row,)):
            what = (f"{imatrix.dtype} array of shape {imatrix.shape}"
                    if isinstance(imatrix, np.ndarray) else type(imatrix).__name__)
            raise ValueError(f"{type_name}: imatrix must be a float32 array of shape "
                             f"({n_per_row},), got {what}")
        imatrix = np.ascontiguousarray(imatrix)
    if out is None:
        out = np.empty((nrows, nbytes), dtype=np.uint8)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8
          or out.shape != (nrows, nbytes) or not out.flags.c_contiguous):
        what = (f"{out.dtype} array of shape {out.shape}" if isinstance(out, np.ndarray)
                else type(out).__name__)
        raise ValueError(f"{type_name}: out must be a C-contiguous uint8 array of shape "
                         f"({nrows}, {nbytes}), got {what}")
    if nrows and n_per_row:
        _KERNELS[type_name][2](x, imatrix, out)
    return out
