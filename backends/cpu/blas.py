"""Matrix products through BLAS (numpy's OpenBLAS) for batches of columns, split over the
run's threads, and the BLAS thread count a run holds while it calls BLAS.

OpenBLAS runs one thread per call here (`blas_scope`: its own pool spinning beside numba's
made prompts slower), so a product is cut into runs of RUN_ROWS weight rows, each
dequantized and multiplied in a Python thread of a pool of our own, as many at once as the
run has threads (numba.get_num_threads(): -t, or the thread governor's choice): numpy's
matmul and the nogil dequantizer release the GIL, so the runs use every core. Each run
streams its own part of the weights and writes its own columns of the result.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator

import numba
import numpy as np

RUN_ROWS = 256  # weight rows per BLAS call: fixed, so results never depend on the thread count


@lru_cache(maxsize=1)
def pool() -> ThreadPoolExecutor:
    """The thread pool of BLAS-backed work (run_units: here and backends/cpu/attn_fusion.py)."""
    return ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS,
                              thread_name_prefix="ggraph-blas")


def _unit(A: np.ndarray, B: np.ndarray, D: np.ndarray, i3: int, i2: int, m0: int, m1: int,
          deq: Callable | None) -> None:
    """D[i3, i2, :, m0:m1] = B[i3, i2] @ rows m0..m1 of A's slice for (i3, i2), transposed
    (dequantized by deq)."""
    j3, j2 = i3 // (D.shape[0] // A.shape[0]), i2 // (D.shape[1] // A.shape[1])
    if deq is None:
        np.matmul(B[i3, i2], A[j3, j2, m0:m1].T, out=D[i3, i2, :, m0:m1])
        return
    scratch = np.empty((m1 - m0, B.shape[-1]), np.float32)
    deq(A, j3, j2, m0, scratch)
    np.matmul(B[i3, i2], scratch.T, out=D[i3, i2, :, m0:m1])


def mul_mat_blas(A: np.ndarray, B: np.ndarray, D: np.ndarray, deq: Callable | None) -> None:
    """D[i3, i2] = B[i3, i2] @ A[i3 // r3, i2 // r2]^T. A: float32 weights (deq None) or a
    quantized type's bytes, rows dequantized by deq(A, j3, j2, m0, out), which must release
    the GIL (numba nogil).

    The work is cut into units of one (i3, i2) slice of D (a head of attention's products:
    K*Q and V*softmax have few rows, many heads) by a run of RUN_ROWS weight rows, one BLAS
    call each, whatever the thread count: OpenBLAS sums a row's products in an order that
    depends on where the row falls in the call (its microkernel tails), so a split by thread
    count would make the logits change with -t or the thread governor's choice."""
    m = A.shape[2]
    run_units(lambda *u: _unit(A, B, D, *u, deq),
              [(i3, i2, m0, min(m, m0 + RUN_ROWS)) for i3 in range(D.shape[0])
               for i2 in range(D.shape[1]) for m0 in range(0, m, RUN_ROWS)])


def run_units(fn: Callable, units: list[tuple]) -> None:
    """fn(*unit) for every unit: on the pool when the run has threads to spare (as many at
    once as it has), else in this thread. Every BLAS call of a run comes through here, so
    this is where the run's scope (blas_scope) takes BLAS's thread count."""
    _take_limit()
    if min(numba.get_num_threads(), len(units)) == 1:
        for u in units:
            fn(*u)
        return
    for j in [pool().submit(fn, *u) for u in units]:
        j.result()


# ---- BLAS's threads while a run calls it ---------------------------------------------------
# Each run of a graph enters blas_scope(n); its first BLAS call (run_units) sets every BLAS
# library loaded to n threads and the scope's end gives back what they had. A run that calls
# no BLAS (a decode step over packed weights) never touches them: setting and restoring
# OpenBLAS's count around every run took ~80 us of a 1.5B decode step (probes around it, Zen 4:
# its structures cold after the step's weight stream; whole tokens moved within the noise).
# Set and given back in the run's own thread, as before.

@dataclass
class _Scope:
    threads: int
    before: list[int] | None = None     # each library's count before the scope set it


_local = threading.local()


@lru_cache(maxsize=1)
def blas_libs() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries loaded (numpy's OpenBLAS), found
    once: a search on every run cost ~8 us hot and ~0.1 ms a decode step cold."""
    from threadpoolctl import ThreadpoolController

    return tuple(ThreadpoolController().select(user_api="blas").lib_controllers)


@contextlib.contextmanager
def blas_scope(n: int) -> Iterator[None]:
    """A run: BLAS on n threads from its first call through run_units to the scope's end
    (nested scopes in one thread: the innermost applies)."""
    outer = getattr(_local, "scope", None)
    scope = _local.scope = _Scope(n)
    try:
        yield
    finally:
        _local.scope = outer
        if scope.before is not None:
            for lib, was in zip(blas_libs(), scope.before):
                if lib.num_threads != was:
                    lib.set_num_threads(was)


def _take_limit() -> None:
    scope = getattr(_local, "scope", None)
    if scope is None or scope.before is not None:
        return
    libs = blas_libs()
    scope.before = [lib.num_threads for lib in libs]
    for lib in libs:
        if lib.num_threads != scope.threads:
            lib.set_num_threads(scope.threads)
