"""Matrix products through BLAS (numpy's OpenBLAS) for batches of columns, split over the
run's threads.

OpenBLAS runs one thread per call here (backends/cpu/backend.py: its own pool spinning beside
numba's made prompts slower), so a product is cut into contiguous runs of weight rows, one per
thread of the run (numba.get_num_threads(): -t, or the thread governor's choice), each run
dequantized and multiplied in a Python thread of a pool of our own: numpy's matmul and the
nogil dequantizer release the GIL, so the runs use every core. Each run streams its own part
of the weights and writes its own columns of the result.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable

import numba
import numpy as np

DEQUANT_CHUNK = 1 << 22  # float32 elements dequantized at a time per thread (16 MiB)
MIN_ROWS_PER_THREAD = 64  # fewer weight rows than this per thread: one thread does it all


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS,
                              thread_name_prefix="ggraph-blas")


def _rows(A: np.ndarray, bs: np.ndarray, ds: np.ndarray, j3: int, j2: int, m0: int, m1: int,
          deq: Callable | None) -> None:
    """ds[..., m0:m1] = bs @ rows m0..m1 of A[j3, j2], transposed (dequantized by deq)."""
    if deq is None:
        np.matmul(bs, A[j3, j2, m0:m1].T, out=ds[..., m0:m1])
        return
    k = bs.shape[-1]
    step = max(1, min(m1 - m0, DEQUANT_CHUNK // k))
    scratch = np.empty((step, k), np.float32)
    for c0 in range(m0, m1, step):
        c1 = min(m1, c0 + step)
        deq(A, j3, j2, c0, scratch[: c1 - c0])
        np.matmul(bs, scratch[: c1 - c0].T, out=ds[..., c0:c1])


def mul_mat_blas(A: np.ndarray, B: np.ndarray, D: np.ndarray, deq: Callable | None) -> None:
    """D[i3, i2] = B[i3, i2] @ A[i3 // r3, i2 // r2]^T. A: float32 weights (deq None) or a
    quantized type's bytes, rows dequantized by deq(A, j3, j2, m0, out), which must release
    the GIL (numba nogil)."""
    r3, r2 = D.shape[0] // A.shape[0], D.shape[1] // A.shape[1]
    m = A.shape[2]
    n = max(1, min(numba.get_num_threads(), m // MIN_ROWS_PER_THREAD))
    # runs of whole 16-row groups: a thread's columns of D start on a 64-byte boundary
    cut = [min(m, (-(-m * t // n) + 15) // 16 * 16) for t in range(n)] + [m]
    for j3 in range(A.shape[0]):
        for j2 in range(A.shape[1]):
            bs = B[j3 * r3:(j3 + 1) * r3, j2 * r2:(j2 + 1) * r2]
            ds = D[j3 * r3:(j3 + 1) * r3, j2 * r2:(j2 + 1) * r2]
            if n == 1:
                _rows(A, bs, ds, j3, j2, 0, m, deq)
                continue
            jobs = [_pool().submit(_rows, A, bs, ds, j3, j2, cut[t], cut[t + 1], deq)
                    for t in range(n) if cut[t] < cut[t + 1]]
            for j in jobs:
                j.result()
