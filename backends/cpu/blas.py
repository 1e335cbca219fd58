"""Matrix products through BLAS (numpy's OpenBLAS) for batches of columns, split over the
run's threads.

OpenBLAS runs one thread per call here (backends/cpu/backend.py: its own pool spinning beside
numba's made prompts slower), so a product is cut into runs of RUN_ROWS weight rows, each
dequantized and multiplied in a Python thread of a pool of our own, as many at once as the
run has threads (numba.get_num_threads(): -t, or the thread governor's choice): numpy's
matmul and the nogil dequantizer release the GIL, so the runs use every core. Each run
streams its own part of the weights and writes its own columns of the result.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Callable

import numba
import numpy as np

RUN_ROWS = 256  # weight rows per BLAS call: fixed, so results never depend on the thread count


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
    scratch = np.empty((m1 - m0, bs.shape[-1]), np.float32)
    deq(A, j3, j2, m0, scratch)
    np.matmul(bs, scratch.T, out=ds[..., m0:m1])


def mul_mat_blas(A: np.ndarray, B: np.ndarray, D: np.ndarray, deq: Callable | None) -> None:
    """D[i3, i2] = B[i3, i2] @ A[i3 // r3, i2 // r2]^T. A: float32 weights (deq None) or a
    quantized type's bytes, rows dequantized by deq(A, j3, j2, m0, out), which must release
    the GIL (numba nogil).

    The weight rows go in runs of RUN_ROWS, one BLAS call each, whatever the thread count:
    OpenBLAS sums a row's products in an order that depends on where the row falls in the
    call (its microkernel tails), so a split by thread count would make the logits change
    with -t or the thread governor's choice."""
    r3, r2 = D.shape[0] // A.shape[0], D.shape[1] // A.shape[1]
    m = A.shape[2]
    runs = [(m0, min(m, m0 + RUN_ROWS)) for m0 in range(0, m, RUN_ROWS)]
    threads = min(numba.get_num_threads(), len(runs))
    for j3 in range(A.shape[0]):
        for j2 in range(A.shape[1]):
            bs = B[j3 * r3:(j3 + 1) * r3, j2 * r2:(j2 + 1) * r2]
            ds = D[j3 * r3:(j3 + 1) * r3, j2 * r2:(j2 + 1) * r2]
            if threads == 1:
                for m0, m1 in runs:
                    _rows(A, bs, ds, j3, j2, m0, m1, deq)
                continue
            jobs = [_pool().submit(_rows, A, bs, ds, j3, j2, m0, m1, deq) for m0, m1 in runs]
            for j in jobs:
                j.result()
