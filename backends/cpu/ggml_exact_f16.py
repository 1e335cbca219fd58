"""ggml's F16 x F32 mul_mat on the CPU, bit for bit (part of the ggml_exact mode,
backends/cpu/ggml_exact.py): src1 rounded to F16 first, then one of two kernels as ggml picks:
- llamafile's tinyBLAS (AVX512: 16 lanes of fma, reduced by halves) when llamafile_sgemm takes
  the product: src1 of 2 rows or more, rows of a multiple of 16 values, src0 rows a multiple
  of 4 (prompt batches' K*Q and V*softmax);
- ggml_vec_dot_f16 (AVX512: 4 accumulators of 16 lanes, an f64 tail) otherwise, decoding's
  one-row products among them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .ggml_exact_lanes import fma32, h2f, sum_halves

LANES_F16 = 16   # tinyBLAS's vector width for F16 on AVX512 (8 on AVX2)


@njit(parallel=True, cache=True)
def dot_f16(A, B16, D, lanes):
    """D = A (F16 bits) x B16 (F32 already rounded to F16), as llamafile's tinyBLAS does:
    each output is `lanes` accumulators (16 with AVX512, 8 with AVX2), lane j accumulating
    products j, j+lanes, ... with one fma each, then reduced by halves (x[j] + x[j+half]);
    src0 broadcast over dims 2 and 3."""
    a3, a2, M, K = A.shape
    b3, b2, N = B16.shape[0], B16.shape[1], B16.shape[2]
    r3, r2 = b3 // a3, b2 // a2
    for t in prange(b3 * b2 * M):
        i3, i2, m = t // (b2 * M), (t // M) % b2, t % M
        row = np.empty(K, np.float32)
        for k in range(K):
            row[k] = h2f(A[i3 // r3, i2 // r2, m, k])
        acc = np.empty(lanes, np.float32)
        for n in range(N):
            acc[:] = 0
            for k0 in range(0, K, lanes):
                for j in range(lanes):
                    acc[j] = fma32(row[k0 + j], B16[i3, i2, n, k0 + j], acc[j])
            D[i3, i2, n, m] = sum_halves(acc)


@njit(parallel=True, cache=True)
def dot_f16_vec(A, B16, D):
    """D = A (F16 bits) x B16 as ggml_vec_dot_f16 (AVX512, the path of one-row src1, which
    tinyBLAS declines): 4 accumulators of 16 lanes over steps of 64 values, one fma each,
    reduced acc0+acc2, acc1+acc3, then their sum, then by halves; the tail past a multiple
    of 64 added product by product in f64, the total narrowed to f32."""
    a3, a2, M, K = A.shape
    b3, b2, N = B16.shape[0], B16.shape[1], B16.shape[2]
    r3, r2 = b3 // a3, b2 // a2
    np_ = K - K % 64
    for t in prange(b3 * b2 * M):
        i3, i2, m = t // (b2 * M), (t // M) % b2, t % M
        row = np.empty(K, np.float32)
        for k in range(K):
            row[k] = h2f(A[i3 // r3, i2 // r2, m, k])
        acc = np.empty((4, 16), np.float32)
        for n in range(N):
            acc[:] = 0
            for k0 in range(0, np_, 64):
                for j in range(4):
                    for lane in range(16):
                        k = k0 + 16 * j + lane
                        acc[j, lane] = fma32(row[k], B16[i3, i2, n, k], acc[j, lane])
            for lane in range(16):
                acc[0, lane] = acc[0, lane] + acc[2, lane]
                acc[1, lane] = acc[1, lane] + acc[3, lane]
            for lane in range(16):
                acc[0, lane] = acc[0, lane] + acc[1, lane]
            total = np.float64(sum_halves(acc[0]))
            for k in range(np_, K):
                total += np.float64(row[k] * B16[i3, i2, n, k])
            D[i3, i2, n, m] = np.float32(total)


def bind_mul_mat_f16(A: np.ndarray, B: np.ndarray, D: np.ndarray):
    """ggml's F16 x F32 mul_mat: through tinyBLAS where llamafile_sgemm takes it (2 src1 rows
    or more, rows of a multiple of 16 values, a multiple of 4 src0 rows), else through
    ggml_vec_dot_f16; None for other types."""
    if A.dtype != np.uint16 or B.dtype != np.float32:
        return None
    B16 = np.empty(B.shape, np.float32)
    tiny = B.shape[2] >= 2 and A.shape[3] % LANES_F16 == 0 and A.shape[2] % 4 == 0

    def call() -> None:
        B16[...] = B.astype(np.float16)      # ggml converts src1 to F16 first (RNE)
        if tiny:
            dot_f16(A, B16, D, LANES_F16)
        else:
            dot_f16_vec(A, B16, D)

    return call
