"""ggml's x86 CPU arithmetic for K-quant weights (Q4_K, Q6_K) times F32 activations, bit for
bit: a part of the ggml_exact mode (backends/cpu/ggml_exact.py holds the rest and the kernel
table).

ggml quantizes the activations to Q8_K (per 256 values: d = 1/iscale with iscale = -127/max,
max the first value of largest magnitude, q = round-half-even(iscale * x), 16-value sums
`bsums`), then one of four kernels computes each output, and which one runs decides the
rounding (this build: AVX512F/BW/VL/VNNI, REPACK=1, the tiled K-quant path on):
- repacked Q4_K (llama.cpp's CPU_REPACK buffer takes every 2-D Q4_K weight with a multiple of
  8 rows; repack.cpp q4_K_8x8_q8_K): rows of the batch in groups of 4 through the gemm, whose
  activations are quantized 4 rows at a time (the same numbers except when +max and -max tie:
  the positive one wins) and which adds one fma per 64 values (two 32-value sub-blocks); the
  rest through the gemv, one fma per 256 values. Each output: acc += (float)isum * (dw * da),
  accm += (float)imin * (dminw * da), result acc - accm.
- ggml_vec_dot_q6_K_q8_K / q4_K_q8_K (AVX2 code, batches below 8 rows, weights not repacked):
  8 int32 lanes of 4 values each, one fma per 256 values and lane, lanes summed by halves;
  Q4_K's min terms in 4 more lanes.
- the tiled K-quant matmul (ggml-cpu/tiled, batches of 8 rows or more, weights not repacked):
  per 256 values r = (float)isum * dw (Q4_K: r = fma(-dminw, (float)imin, r)), buf += r * da
  (one fma: GCC contracts the add of the product), buf starting at 0.
Integer sums are exact in any order, so only each float step is reproduced.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit, prange

from ggraph.ir.types import GGMLType

from .ggml_exact_lanes import fma32, sum_halves


F32 = np.float32
QK_K = 256

# per-row kernel choices (`how` of dot_kquant)
REPACK_GEMV, REPACK_GEMM, VEC_DOT, TILED = 0, 1, 2, 3


@njit(parallel=True, cache=True)
def quantize_q8_K(x, qs, d, bsums, quad_rows):
    """Rows x (R, K) -> Q8_K: int8 qs (R, K), d (R, K/256), bsums (R, K/16). Rows below
    quad_rows are quantized as ggml_quantize_mat_q8_K_4x8 does (a +max/-max tie picks +)."""
    R, K = x.shape
    for r in prange(R):
        for b in range(K // QK_K):
            o = b * QK_K
            amax = F32(0.0)
            mx = F32(0.0)
            has_pos = False
            for j in range(QK_K):
                v = x[r, o + j]
                a = abs(v)
                if a > amax:
                    amax = a
                    mx = v
            for j in range(QK_K):
                if x[r, o + j] == amax:
                    has_pos = True
            if amax == F32(0.0):
                d[r, b] = F32(0.0)
                for j in range(QK_K):
                    qs[r, o + j] = 0
            else:
                if r < quad_rows:
                    iscale = F32(-127.0) / amax if has_pos else F32(127.0) / amax
                else:
                    iscale = F32(-127.0) / mx
                for j in range(QK_K):
                    qs[r, o + j] = min(127, np.int32(np.rint(iscale * x[r, o + j])))
                d[r, b] = F32(1.0) / iscale
            for s in range(QK_K // 16):
                t = 0
                for j in range(16):
                    t += np.int32(qs[r, o + 16 * s + j])
                bsums[r, b * 16 + s] = t


@njit(cache=True)
def _dot4(q, m, a, r, e):
    """Four products q[m, e..e+3] * a[r, e..e+3] summed (one int32 lane of dpbusd/madd)."""
    return (np.int32(q[m, e]) * np.int32(a[r, e]) + np.int32(q[m, e + 1]) * np.int32(a[r, e + 1])
            + np.int32(q[m, e + 2]) * np.int32(a[r, e + 2])
            + np.int32(q[m, e + 3]) * np.int32(a[r, e + 3]))


@njit(cache=True)
def _subdots(q, m, a, r, o, n_sub, sub, dots):
    """Integer dot of each `sub`-value sub-block of the 256-value block at o."""
    for s in range(n_sub):
        t = 0
        for e in range(o + s * sub, o + (s + 1) * sub, 4):
            t += _dot4(q, m, a, r, e)
        dots[s] = t


@njit(parallel=True, cache=True)
def dot_kquant(q, sc, mn, dw, dmw, q6, qa, da, bsums, how, out):
    """out[r, m] = ggml's product of weight row m with activation row r (module docstring).
    q (M, K) the weight codes (Q4_K 0..15, Q6_K 0..63, unbiased); sc (M, K/32 or K/16) the
    sub-block scales, mn (M, K/32) Q4_K's mins; dw, dmw (M, K/256) d and dmin; q6: Q6_K;
    qa, da, bsums: the Q8_K activations; how[r]: the kernel of row r."""
    M, K = q.shape
    R = qa.shape[0]
    nb = K // QK_K
    n_sub = 16 if q6 else 8
    sub = QK_K // n_sub
    chunk = 8
    for c in prange((M + chunk - 1) // chunk):
        dots = np.empty(16, np.int32)
        lanes = np.empty(8, np.int32)
        accv = np.empty(8, np.float32)
        accm = np.empty(4, np.float32)
        for m in range(c * chunk, min(M, (c + 1) * chunk)):
            for r in range(R):
                k = how[r]
                acc = F32(0.0)
                acc_min = F32(0.0)
                accv[:] = 0
                accm[:] = 0
                for b in range(nb):
                    o = b * QK_K
                    if k == VEC_DOT:
                        _lanes_vec_dot(q, sc, m, qa, bsums, r, b, q6, lanes)
                        dd = da[r, b] * dw[m, b]
                        for j in range(8):
                            accv[j] = fma32(dd, F32(lanes[j]), accv[j])
                        if not q6:
                            dmin = -da[r, b] * dmw[m, b]
                            for j in range(4):
                                p = (mn[m, 8 * b + 2 * j] *
                                     (bsums[r, 16 * b + 4 * j] + bsums[r, 16 * b + 4 * j + 1]) +
                                     mn[m, 8 * b + 2 * j + 1] *
                                     (bsums[r, 16 * b + 4 * j + 2] + bsums[r, 16 * b + 4 * j + 3]))
                                accm[j] = fma32(dmin, F32(p), accm[j])
                        continue
                    _subdots(q, m, qa, r, o, n_sub, sub, dots)
                    if k == TILED:
                        s1 = 0
                        s2 = 0
                        for s in range(n_sub):
                            if q6:
                                s1 += sc[m, 16 * b + s] * (dots[s] - 32 * bsums[r, 16 * b + s])
                            else:
                                s1 += sc[m, 8 * b + s] * dots[s]
                                s2 += mn[m, 8 * b + s] * (bsums[r, 16 * b + 2 * s] +
                                                          bsums[r, 16 * b + 2 * s + 1])
                        res = F32(s1) * dw[m, b]
                        if not q6:
                            res = fma32(-dmw[m, b], F32(s2), res)
                        acc = fma32(res, da[r, b], acc)
                        continue
                    dd = dw[m, b] * da[r, b]
                    ddm = dmw[m, b] * da[r, b]
                    step = 2 if k == REPACK_GEMM else 8   # sub-blocks per fma
                    for s0 in range(0, 8, step):
                        isum = 0
                        imin = 0
                        for s in range(s0, s0 + step):
                            isum += sc[m, 8 * b + s] * dots[s]
                            imin += mn[m, 8 * b + s] * (bsums[r, 16 * b + 2 * s] +
                                                        bsums[r, 16 * b + 2 * s + 1])
                        acc = fma32(F32(isum), dd, acc)
                        acc_min = fma32(F32(imin), ddm, acc_min)
                if k == VEC_DOT:
                    tot = sum_halves(accv)
                    if not q6:
                        tot = tot + ((accm[0] + accm[2]) + (accm[1] + accm[3]))
                    out[r, m] = tot
                elif k == TILED:
                    out[r, m] = acc
                else:
                    out[r, m] = acc - acc_min


@njit(cache=True)
def _lanes_vec_dot(q, sc, m, qa, bsums, r, b, q6, lanes):
    """The 8 int32 lanes of ggml_vec_dot_q{4,6}_K_q8_K's AVX2 loop for block b: lane l holds
    bytes 4l..4l+3 of each 32-value vector, times that vector's scale (Q6_K: minus the 32 *
    scale * bsum of sub-blocks 2l and 2l+1)."""
    o = b * QK_K
    for l in range(8):
        t = 0
        if q6:
            for j in range(2):
                for u in range(4):
                    e = o + 128 * j + 32 * u + 4 * l
                    t += sc[m, 16 * b + 8 * j + 2 * u + (1 if l >= 4 else 0)] * \
                        _dot4(q, m, qa, r, e)
            t -= 32 * (bsums[r, 16 * b + 2 * l] * sc[m, 16 * b + 2 * l] +
                       bsums[r, 16 * b + 2 * l + 1] * sc[m, 16 * b + 2 * l + 1])
        else:
            for j in range(4):
                t += sc[m, 8 * b + 2 * j] * _dot4(q, m, qa, r, o + 64 * j + 4 * l)
                t += sc[m, 8 * b + 2 * j + 1] * _dot4(q, m, qa, r, o + 64 * j + 32 + 4 * l)
        lanes[l] = t


# -- weight unpacking (numpy, once per weight) ----------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def unpack_q4_K(w: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K rows (M, nb*144 bytes) -> codes (M, K) uint8, scales and mins (M, K/32) int32,
    d and dmin (M, nb) float32 (block: d, dmin f16; 12 bytes of 6-bit scales/mins; 128 bytes
    of nibbles, each 32 bytes holding values 64j+i low and 64j+32+i high)."""
    M = w.shape[0]
    blk = w.reshape(M, -1, 144)
    nb = blk.shape[1]
    d, dmin = _f16(blk[..., 0:2]).reshape(M, nb), _f16(blk[..., 2:4]).reshape(M, nb)
    s = blk[..., 4:16].astype(np.int32)
    sc = np.empty((M, nb, 8), np.int32)
    mn = np.empty((M, nb, 8), np.int32)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blk[..., 16:].reshape(M, nb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(M, nb * QK_K)
    return (np.ascontiguousarray(q, np.uint8), sc.reshape(M, -1), mn.reshape(M, -1), d, dmin)


def unpack_q6_K(w: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q6_K rows (M, nb*210 bytes) -> codes 0..63 (M, K) uint8, scales (M, K/16) int32,
    d (M, nb) (block: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d)."""
    M = w.shape[0]
    blk = w.reshape(M, -1, 210)
    nb = blk.shape[1]
    ql = blk[..., :128].reshape(M, nb, 2, 64)
    qh = blk[..., 128:192].reshape(M, nb, 2, 32)
    q = np.empty((M, nb, 2, 4, 32), np.uint8)
    q[..., 0, :] = (ql[..., :32] & 15) | ((qh & 3) << 4)
    q[..., 1, :] = (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4)
    q[..., 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q[..., 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    sc = blk[..., 192:208].view(np.int8).astype(np.int32).reshape(M, -1)
    d = _f16(blk[..., 208:210]).reshape(M, nb)
    return q.reshape(M, nb * QK_K), sc, np.zeros((M, 1), np.int32), d, np.zeros_like(d)


# -- binding ------------------------------------------------------------------------------

@dataclass
class KQuantPaths:
    """Which of ggml's paths the exact mode reproduces: `repack` as llama.cpp loads a model
    (Q4_K weights with a multiple of 8 rows in the CPU_REPACK buffer); False as a plain ggml
    buffer (libggml run directly, ggraph.check.ggml_ref). `tiled_min_rows`: the batch from which
    ggml takes the tiled path for weights not repacked (ggml_tiled_min_batch)."""
    repack: bool = True
    tiled_min_rows: int = 8


PATHS = KQuantPaths()
UNPACK = {GGMLType.Q4_K: unpack_q4_K, GGMLType.Q6_K: unpack_q6_K}
# unpacked weights by address: each entry holds its weight array, so no other array can take
# that address while the entry lives; the oldest go first past CACHE_SIZE
_unpacked: OrderedDict[tuple[int, tuple[int, ...], GGMLType],
                       tuple[np.ndarray, tuple[np.ndarray, ...]]] = OrderedDict()
CACHE_SIZE = 512


def _weights(a_type: GGMLType, W: np.ndarray) -> tuple[np.ndarray, ...]:
    """The weight unpacked once (a model's weights keep their memory while it lives)."""
    key = (W.__array_interface__["data"][0], W.shape, a_type)
    if key not in _unpacked:
        _unpacked[key] = (W, UNPACK[a_type](np.ascontiguousarray(W)))
        if len(_unpacked) > CACHE_SIZE:
            _unpacked.popitem(last=False)
    _unpacked.move_to_end(key)
    return _unpacked[key][1]


def row_paths(a_type: GGMLType, M: int, R: int, paths: KQuantPaths | None = None) -> np.ndarray:
    """The kernel each of the R activation rows goes through (module docstring)."""
    paths = paths or PATHS
    if a_type == GGMLType.Q4_K and paths.repack and M % 8 == 0:
        how = np.full(R, REPACK_GEMV, np.int32)
        how[:R - R % 4] = REPACK_GEMM
        return how
    return np.full(R, TILED if R >= paths.tiled_min_rows else VEC_DOT, np.int32)


def bind_mul_mat(a_type: GGMLType, b_type: GGMLType, A: np.ndarray, B: np.ndarray,
                 D: np.ndarray) -> Callable[[], None] | None:
    """D = mul_mat(A, B) for 2-D Q4_K/Q6_K weights and F32 activations, as ggml's CPU
    computes it; None elsewhere."""
    if a_type not in UNPACK or b_type != GGMLType.F32 or A.shape[0] * A.shape[1] != 1:
        return None
    W = A[0, 0]
    K = B.shape[3]
    R = B.shape[0] * B.shape[1] * B.shape[2]
    if K % QK_K:
        return None
    q, sc, mn, dw, dmw = _weights(a_type, W)
    how = row_paths(a_type, W.shape[0], R)
    quad = int(np.sum(how == REPACK_GEMM))
    qa = np.empty((R, K), np.int8)
    da = np.empty((R, K // QK_K), np.float32)
    bsums = np.empty((R, K // 16), np.int32)
    out = np.empty((R, W.shape[0]), np.float32)
    q6 = a_type == GGMLType.Q6_K

    def call() -> None:
        quantize_q8_K(np.ascontiguousarray(B).reshape(R, K), qa, da, bsums, quad)
        dot_kquant(q, sc, mn, dw, dmw, q6, qa, da, bsums, how, out)
        D[...] = out.reshape(D.shape)

    return call
