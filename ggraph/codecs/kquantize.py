"""Numpy quantizers for ggml's K-quants (Q2_K..Q6_K) and IQ4_XS, bit-exact with ggml's C code.

This module owns the *encoding* side of the 256-element super-block types: for each type a
kernel `quantize_<type>(x, out)` takes `x`, a (nb, 256) float32 array of blocks, and fills
`out`, a (nb, type_size) uint8 array, with exactly the bytes ggml's reference quantizer writes
(`ggml/src/ggml-quants.c`: `quantize_row_q{2..6}_K_ref`, and `quantize_iq4_xs` without an
importance matrix, which is what `ggml_quantize_chunk(..., imatrix=NULL)` runs). Byte layouts
and decoding live with the type records; this module imports nothing but numpy.

Every kernel is vectorized over blocks (and sub-blocks); only the few steps of ggml's iterative
scale searches, and the element order of sums that ggml accumulates sequentially, are Python
loops. What bit-exactness rests on (checked against libggml-base, built for plain x86-64 SSE):

- f32 throughout, one rounding per C operation, in C's association order (`w*x[i]*l` is
  `(w*x)*l`; `a*b - c*d` is two products then a subtraction). libggml-base is built without FMA
  instructions, so no operation is fused. Integers meet floats as exactly converted f32.
- Sums that C accumulates in a loop (`s = 0; s += t[i]`) are sequential, never pairwise:
  `np.add.accumulate` along the element axis, then `+ 0` so an all-(-0) sum is +0 as in C.
  np.sum (pairwise) would differ in the last bit and flip later decisions.
- `nearest_int(f)` is ggml's float trick: `bits(f + 12582912.f) & 0x7fffff - 0x400000`, i.e.
  round half to even for |f| < 2^22; it is emulated on the bits, so even out-of-range values
  (a huge `x*sl2/slx` in make_q3_quants) give ggml's garbage-but-deterministic integer.
- Integer casts in the C code are kept: Q4_K/Q5_K store `(uint8_t)nearest_int(...)` before
  `MIN(63, .)`, Q2_K writes the int into a uint8 (wraps), Q6_K's scales are int8.
- The super-block scales `d`/`dmin` are rounded to f16 (round to nearest even, as numpy's
  float16 cast and ggml's software `fp32_to_fp16`), and the final quants are recomputed with
  the f16-rounded `d * sc` (`(x + dm)/d` or `x/d`); where that product is 0 the quants of the
  search are kept, as in C. IQ4_XS instead uses the unrounded f32 `d` for its final pass.
- Maxima pick the first element of largest magnitude (C's strict `>` from 0); when every
  magnitude is 0 the C variable keeps its initial +0, which matters for the sign of IQ4_XS' d.
- The searches: make_qkx2_quants (Q2_K: 16 values, nmax 3, rmin -0.5, rdelta 0.1, 15 steps,
  mean absolute error, weights |x|; Q4_K: 32, 15, -1, 0.1, 20 steps, squared error; Q5_K: 32,
  31, -0.5, 0.1, 15, squared; both with weights `sqrt(mean x^2) + |x|`) fits scale and min by
  weighted least squares over candidate inverse scales, keeping a candidate only when its error
  is strictly smaller. make_qx_quants (Q6_K: 16 values, nmax 32, weights x^2) tries the
  inverse scales -(nmax + 0.1*is)/max for is = -9..9 (not 0) and keeps the best
  sumlx^2/suml2. make_q3_quants (Q3_K: nmax 4) refines each quant in element order, up to 5
  passes; a pass that changes nothing leaves the state as it was, so running all 5 passes for
  every sub-block equals ggml's early exit. IQ4_XS tries -max/127 and then (itry - 127)/max
  for itry = -7..7 on the non-linear grid kvalues_iq4nl, using ggml's `best_index_int8`
  (nearest grid value, ties to the upper one).

Non-finite input is not supported (ggml itself asserts or produces undefined casts there).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = [
    "quantize_q2_K", "quantize_q3_K", "quantize_q4_K", "quantize_q5_K", "quantize_q6_K",
    "quantize_iq4_xs", "KQUANT_KERNELS",
]

QK_K = 256
_F32 = np.float32
_GROUP_MAX_EPS = _F32(1e-15)
_ROUND_MAGIC = _F32(12582912.0)  # 1.5 * 2^23: adding it leaves the rounded integer in the mantissa
# kvalues_iq4nl: the 16 levels of IQ4_NL / IQ4_XS
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                  dtype=_F32)
# blocks per numpy pass: bounds the (nb, 256)-sized temporaries for huge tensors
_CHUNK_BLOCKS = 1 << 14


# ----------------------------------------------------------------------------- helpers

def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int on f32 values, bit for bit (int32 result)."""
    with np.errstate(invalid="ignore", over="ignore"):
        bits = (v.astype(_F32, copy=False) + _ROUND_MAGIC).view(np.int32)
    return (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def _seqsum(t: np.ndarray) -> np.ndarray:
    """Sequential f32 sum over the last axis, as C's `s = 0; for (...) s += t[i];`."""
    return np.add.accumulate(t, axis=-1)[..., -1] + _F32(0)


def _first_absmax(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(signed value, magnitude) of the first largest-|a| entry per row; +0 if all are 0."""
    idx = np.abs(a).argmax(axis=-1)
    val = np.take_along_axis(a, idx[..., None], axis=-1)[..., 0]
    amax = np.abs(val)
    return np.where(amax > 0, val, _F32(0)).astype(_F32), amax


def _f16(v: np.ndarray) -> np.ndarray:
    """f32 -> f16 rounding (nearest even), returned as f16 values."""
    with np.errstate(over="ignore"):
        return v.astype(_F32, copy=False).astype(np.float16)


def _put_f16(out: np.ndarray, offset: int, h: np.ndarray) -> None:
    out[:, offset:offset + 2] = h.astype("<f2").view(np.uint8).reshape(-1, 2)


def _recip_or_zero(v: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(v != 0, _F32(1) / np.where(v != 0, v, _F32(1)), _F32(0)).astype(_F32)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(nb, 256) values 0..3 -> (nb, 64): byte l of half h holds L[128h + l + 32k] at bits 2k."""
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 six-bit scales and mins -> 12 bytes (inverse of get_scale_min_k4)."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _best_index_iq4nl(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over kvalues_iq4nl: nearest level, ties go to the upper one."""
    ml = np.clip(np.searchsorted(_IQ4NL, v, side="right") - 1, 0, 14)
    lo = _IQ4NL[ml]
    hi = _IQ4NL[ml + 1]
    idx = np.where((v - lo) < (hi - v), ml, ml + 1)
    idx = np.where(v <= _IQ4NL[0], 0, idx)
    return np.where(v >= _IQ4NL[15], 15, idx)


# ----------------------------------------------------------------------------- searches

def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int, use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants on rows of x (N, n) with weights w: returns (scale, the_min, L)."""
    mn = np.minimum(x.min(axis=1), _F32(0))
    mx = x.max(axis=1)
    flat = mx == mn
    sum_w = np.add.accumulate(w, axis=1)[:, -1]          # C starts from weights[0], not 0
    sum_x = np.add.accumulate(w * x, axis=1)[:, -1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = _F32(nmax) / (mx - mn)
        scale = _F32(1) / iscale

        def err_of(s: np.ndarray, m: np.ndarray, lf: np.ndarray) -> np.ndarray:
            diff = s[:, None] * lf + m[:, None] - x
            diff = np.abs(diff) if use_mad else diff * diff
            return _seqsum(w * diff)

        L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        best = err_of(scale, mn, L.astype(_F32))
        for step in range(nstep + 1):
            # C updates `min` in place when a step wins: later steps use the new min
            iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / (mx - mn)
            la = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
            lf = la.astype(_F32)
            wl = w * lf
            sum_l = _seqsum(wl)
            sum_l2 = _seqsum(wl * lf)
            sum_xl = _seqsum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, _F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur = err_of(this_scale, this_min, lf)
            upd = (D > 0) & (cur < best)
            L = np.where(upd[:, None], la, L)
            best = np.where(upd, cur, best)
            scale = np.where(upd, this_scale, scale)
            mn = np.where(upd, this_min, mn)
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, _F32(0), scale)
    return scale.astype(_F32), (-mn).astype(_F32), L


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(rmse_type=1, no weights) on rows of x: returns (scale, L in 0..2nmax-1)."""
    vmax, amax = _first_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            l = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
            lf = l.astype(_F32)
            return l, _seqsum(wx * lf), _seqsum((w * lf) * lf)

        l, sumlx, suml2 = trial(_F32(-nmax) / vmax)
        L = l + nmax
        scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            l, sumlx, suml2 = trial(-(_F32(nmax) + _F32(0.1) * _F32(step)) / vmax)
            upd = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(upd[:, None], l + nmax, L)
            scale = np.where(upd, sumlx / suml2, scale)
            best = np.where(upd, scale * sumlx, best)
    L = np.where(zero[:, None], 0, L)
    return np.where(zero, _F32(0), scale).astype(_F32), L


def _make_q3_quants_rmse(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(do_rmse=true) on rows of x: returns (scale, L in 0..2nmax-1)."""
    vmax, amax = _first_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        L = np.clip(_nearest_int((_F32(-nmax) / vmax)[:, None] * x), -nmax, nmax - 1)
        Lf = L.astype(_F32)
        sumlx = _seqsum(wx * Lf)
        suml2 = _seqsum((w * Lf) * Lf)
        for _ in range(5):  # passes after one without change repeat it exactly
            for i in range(x.shape[1]):
                wi, xi, wxi, li = w[:, i], x[:, i], wx[:, i], Lf[:, i]
                slx = sumlx - wxi * li
                sl2 = suml2 - (wi * li) * li
                new_l = np.clip(_nearest_int((xi * sl2) / slx), -nmax, nmax - 1)
                nf = new_l.astype(_F32)
                slx2 = slx + wxi * nf
                sl22 = sl2 + (wi * nf) * nf
                upd = ((slx > 0) & (nf != li) & (sl22 > 0)
                       & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22))
                Lf[:, i] = np.where(upd, nf, li)
                sumlx = np.where(upd, slx2, sumlx)
                suml2 = np.where(upd, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, _F32(0))
    L = np.where(zero[:, None], 0, Lf.astype(np.int32) + nmax)
    return np.where(zero, _F32(0), scale).astype(_F32), L


# ----------------------------------------------------------------------------- K-quants

def _q2_K(x: np.ndarray, out: np.ndarray) -> None:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    scales, mins, L = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales = scales.reshape(nb, 16)
    mins = mins.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    q4 = _F32(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = _nearest_int((q4 / max_scale)[:, None] * scales)
        lm = _nearest_int((q4 / max_min)[:, None] * mins)
    sb = np.where((max_scale > 0)[:, None], ls & 0xFF, 0)       # C stores the int in a uint8
    sb = np.where((max_min > 0)[:, None], (sb | (lm << 4)) & 0xFF, sb)
    dh = _f16(np.where(max_scale > 0, max_scale / q4, _F32(0)))
    mh = _f16(np.where(max_min > 0, max_min / q4, _F32(0)))
    d = dh.astype(_F32)[:, None] * (sb & 0xF).astype(_F32)
    dm = mh.astype(_F32)[:, None] * (sb >> 4).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest_int((x.reshape(nb, 16, 16) + dm[:, :, None]) / d[:, :, None]), 0, 3)
    L = np.where((d != 0)[:, :, None], lq, L).reshape(nb, 256)
    out[:, 0:16] = sb.astype(np.uint8)
    out[:, 16:80] = _pack_2bit(L)
    _put_f16(out, 80, dh)
    _put_f16(out, 82, mh)


def _q3_K(x: np.ndarray, out: np.ndarray) -> None:
    nb = x.shape[0]
    scales, L = _make_q3_quants_rmse(x.reshape(nb * 16, 16), 4)
    scales = scales.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    max_scale, _ = _first_absmax(scales)
    nz = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = _F32(-32) / max_scale
        l = np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32
        dh = _f16(np.where(nz, _F32(1) / iscale, _F32(0)))
    l = np.where(nz[:, None], l, 0)
    sb = np.zeros((nb, 12), dtype=np.int32)
    sb[:, 0:8] = (l[:, 0:8] & 0xF) | ((l[:, 8:16] & 0xF) << 4)
    hi = (l >> 4).reshape(nb, 4, 4)                            # [j // 4, j % 4]
    sb[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    d = dh.astype(_F32)[:, None] * (l - 32).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest_int(x.reshape(nb, 16, 16) / d[:, :, None]), -4, 3) + 4
    L = np.where((d != 0)[:, :, None], lq, L).reshape(nb, 256)
    hbits = (L > 3).reshape(nb, 8, 32).astype(np.uint8)        # bit k of hmask[m]: L[32k + m]
    hmask = np.zeros((nb, 32), dtype=np.uint8)
    for k in range(8):
        hmask |= hbits[:, k] << k
    out[:, 0:32] = hmask
    out[:, 32:96] = _pack_2bit(L & 3)
    out[:, 96:108] = sb.astype(np.uint8)
    _put_f16(out, 108, dh)


def _q45_K_common(x: np.ndarray, nmax: int, rmin: float, nstep: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared Q4_K/Q5_K path: returns (12 scale bytes, f16 d, f16 dmin, L (nb, 256))."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seqsum(xs * xs) / _F32(32))
    w = av_x[:, None] + np.abs(xs)
    scales, mins, L = _make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    L = L.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # (uint8_t) then MIN
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    dh = _f16(max_scale / _F32(63))
    mh = _f16(max_min / _F32(63))
    d = dh.astype(_F32)[:, None] * ls.astype(_F32)
    dm = mh.astype(_F32)[:, None] * lm.astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest_int((x.reshape(nb, 8, 32) + dm[:, :, None]) / d[:, :, None]),
                     0, nmax)
    L = np.where((d != 0)[:, :, None], lq, L).reshape(nb, 256)
    return _pack_k4_scales(ls, lm), dh, mh, L


def _q4_K(x: np.ndarray, out: np.ndarray) -> None:
    sb, dh, mh, L = _q45_K_common(x, 15, -1.0, 20)
    _put_f16(out, 0, dh)
    _put_f16(out, 2, mh)
    out[:, 4:16] = sb
    q = L.reshape(-1, 4, 2, 32).astype(np.uint8)
    out[:, 16:144] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q5_K(x: np.ndarray, out: np.ndarray) -> None:
    sb, dh, mh, L = _q45_K_common(x, 31, -0.5, 15)
    _put_f16(out, 0, dh)
    _put_f16(out, 2, mh)
    out[:, 4:16] = sb
    q = L.reshape(-1, 4, 2, 32).astype(np.uint8)               # [chunk c, half, j]
    out[:, 48:176] = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for c in range(4):                                          # bits 2c, 2c+1 of qh[j]
        qh |= ((q[:, c, 0] >> 4) << (2 * c)) | ((q[:, c, 1] >> 4) << (2 * c + 1))
    out[:, 16:48] = qh


def _q6_K(x: np.ndarray, out: np.ndarray) -> None:
    nb = x.shape[0]
    scales, L = _make_qx_quants_rmse1(x.reshape(nb * 16, 16), 32)
    scales = scales.reshape(nb, 16)
    L = L.reshape(nb, 16, 16)
    max_scale, max_abs = _first_absmax(scales)
    zero = max_abs < _GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = _F32(-128) / max_scale
        dh = _f16(np.where(zero, _F32(0), _F32(1) / iscale))
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127)
    sc = np.where(zero[:, None], 0, sc)
    d = dh.astype(_F32)[:, None] * sc.astype(np.int8).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest_int(x.reshape(nb, 16, 16) / d[:, :, None]), -32, 31) + 32
    L = np.where((d != 0)[:, :, None], lq, L).reshape(nb, 2, 4, 32).astype(np.uint8)
    lo = L & 0xF                                               # [half, k, l] = L[128h + 32k + l]
    out[:, 0:128] = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4),
                                    lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2).reshape(nb, 128)
    h = L >> 4
    out[:, 128:192] = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4)
                       | (h[:, :, 3] << 6)).reshape(nb, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    _put_f16(out, 208, dh)
    out[zero] = 0                                              # C memsets the whole block


# ----------------------------------------------------------------------------- IQ4_XS

def _iq4_xs(x: np.ndarray, out: np.ndarray) -> None:
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    vmax, amax = _first_absmax(xs)
    zero = amax < _GROUP_MAX_EPS
    w = xs * xs
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        def trial(id_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            q = _IQ4NL[_best_index_iq4nl(id_[:, None] * xs)]
            wq = w * q
            return _seqsum(wq * xs), _seqsum(wq * q)

        d = (-vmax) / _F32(-127)                               # ntry > 0: -max/values[0]
        sumqx, sumq2 = trial(_F32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, _F32(0))
        best = d * sumqx
        for itry in range(-7, 8):
            sumqx, sumq2 = trial(_F32(itry - 127) / vmax)
            upd = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(upd, sumqx / sumq2, d)
            best = np.where(upd, d * sumqx, best)
    scales = np.where(zero, _F32(0), d).astype(_F32).reshape(nb, 8)
    max_scale, _ = _first_absmax(scales)
    dsb = (-max_scale) / _F32(32)
    id_ = _recip_or_zero(dsb)
    l = np.clip(_nearest_int(id_[:, None] * scales), -32, 31)
    dl = dsb[:, None] * l.astype(_F32)
    idl = _recip_or_zero(dl)
    L = _best_index_iq4nl((idl[:, :, None] * x.reshape(nb, 8, 32))).astype(np.uint8)
    l = (l + 32).astype(np.uint16)
    _put_f16(out, 0, _f16(dsb))
    sh = np.zeros(nb, dtype=np.uint16)
    for ib in range(8):
        sh |= (l[:, ib] >> 4) << (2 * ib)
    out[:, 2:4] = sh.astype("<u2").view(np.uint8).reshape(nb, 2)
    ll = (l & 0xF).astype(np.uint8)
    out[:, 4:8] = ll[:, 0::2] | (ll[:, 1::2] << 4)
    out[:, 8:136] = (L[:, :, 0:16] | (L[:, :, 16:32] << 4)).reshape(nb, 128)


# ----------------------------------------------------------------------------- public kernels

def _chunked(kernel: Callable[[np.ndarray, np.ndarray], None], type_size: int, name: str
             ) -> Callable[[np.ndarray, np.ndarray], None]:
    def quantize(x: np.ndarray, out: np.ndarray) -> None:
        if x.ndim != 2 or x.shape[1] != QK_K:
            raise ValueError(f"{name}: expected blocks of shape (nb, {QK_K}), got {x.shape}")
        if out.shape != (x.shape[0], type_size) or out.dtype != np.uint8:
            raise ValueError(f"{name}: expected a uint8 output of shape "
                             f"({x.shape[0]}, {type_size}), got {out.dtype} {out.shape}")
        x = x.astype(_F32, copy=False)
        for s in range(0, x.shape[0], _CHUNK_BLOCKS):
            e = min(s + _CHUNK_BLOCKS, x.shape[0])
            block = np.empty((e - s, type_size), dtype=np.uint8)
            # masked lanes (zero sub-blocks, rejected candidates) may divide by 0 or overflow
            with np.errstate(all="ignore"):
                kernel(np.ascontiguousarray(x[s:e]), block)
            out[s:e] = block
    quantize.__name__ = name
    quantize.__doc__ = (f"Fill out (nb, {type_size}) uint8 with ggml's {name[9:]} bytes for "
                        f"x (nb, {QK_K}) float32, bit-exact with ggml's reference quantizer.")
    return quantize


quantize_q2_K = _chunked(_q2_K, 84, "quantize_q2_K")
quantize_q3_K = _chunked(_q3_K, 110, "quantize_q3_K")
quantize_q4_K = _chunked(_q4_K, 144, "quantize_q4_K")
quantize_q5_K = _chunked(_q5_K, 176, "quantize_q5_K")
quantize_q6_K = _chunked(_q6_K, 210, "quantize_q6_K")
quantize_iq4_xs = _chunked(_iq4_xs, 136, "quantize_iq4_xs")

# type name (as in ggml / GGMLType) -> (kernel, block size, bytes per block)
KQUANT_KERNELS: dict[str, tuple[Callable[[np.ndarray, np.ndarray], None], int, int]] = {
    "Q2_K": (quantize_q2_K, QK_K, 84),
    "Q3_K": (quantize_q3_K, QK_K, 110),
    "Q4_K": (quantize_q4_K, QK_K, 144),
    "Q5_K": (quantize_q5_K, QK_K, 176),
    "Q6_K": (quantize_q6_K, QK_K, 210),
    "IQ4_XS": (quantize_iq4_xs, QK_K, 136),
}
