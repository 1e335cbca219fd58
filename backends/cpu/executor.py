"""The CPU's executor (backends/executor.py): the threads each run uses, BLAS kept to its own
threads while a run calls it (backends/cpu/blas.py), runs taken in turn where numba's threading
layer needs it, the fusion pass (backends/cpu/fusion.py) that runs norm chains as one
call, and the loop that makes a graph's calls from machine code once it runs again
(backends/cpu/native_loop.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Hashable, Iterator, Mapping

import numba

from ggraph.ir.tensor import Tensor
from ..base import Session
from ..executor import Executor
from . import compile_ahead, fusion, native_loop
from .blas import blas_scope
from .compile import compiled_for, compiled_nogil, direct
from .threads import ThreadGovernor


class CPUExecutor(Executor):
    """Runs on `n_threads` of numba's threads (fewer where the governor finds a graph faster
    so, as on a busy machine), BLAS on `blas_threads`, element-wise chains fused where
    `fusion` is set."""

    def __init__(self, n_threads: int, governor: ThreadGovernor | None, blas_threads: int,
                 fusion: bool) -> None:
        self.n_threads = n_threads
        self.governor = governor
        self.blas_threads = blas_threads
        self.fusion = fusion

    def fuse(self, order: list[Tensor], session: Session,
             observed: frozenset[Tensor] = frozenset()) -> Mapping[Tensor, Any]:
        if not self.fusion:
            return {}
        return fusion.fuse(order, session, compiled_for, compiled_nogil, observed)

    def prepare(self, calls: list[Any]) -> None:
        compile_ahead.prepare(calls)

    def direct(self, call: Any) -> Any:
        return direct(call)

    def loop(self, calls: list[Any]) -> Any:
        return native_loop.Loop(calls, self.run_calls)

    def run_context(self, key: Hashable | None = None) -> Any:
        """The threads of a run: the governor's choice for graph `key` (all of them without
        a key), timed for the governor.

        BLAS on `blas_threads` (one) from the run's first BLAS call to its end (blas_scope):
        numba's threads and OpenBLAS's both spin between calls, and on a small machine the
        two pools fighting for cores made SmolLM2's 512-token prompt 2.7x slower than
        single-threaded BLAS beside numba's threads.

        Graphs run by different Sessions in different threads take turns when numba's
        threading layer is `workqueue` (the only one guaranteed present): it is not
        thread-safe and aborts the process on concurrent parallel kernels. tbb and omp are
        thread-safe and run concurrently."""
        return _running(self, key)


# one graph at a time in the whole process while numba's threading layer cannot take more
_KERNEL_LOCK = threading.RLock()
_layer: str | None = None


@contextlib.contextmanager
def _running(ex: CPUExecutor, key: Hashable | None) -> Iterator[None]:
    gov = ex.governor if key is not None else None
    n = gov.choose(key) if gov is not None else ex.n_threads
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    with _KERNEL_LOCK if _kernels_need_lock() else contextlib.nullcontext(), \
            blas_scope(ex.blas_threads):
        t0 = time.perf_counter()
        yield
        if gov is not None:
            gov.record(key, n, time.perf_counter() - t0)


def _kernels_need_lock() -> bool:
    global _layer
    if _layer is None:
        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet, so no layer is chosen: be safe
            return True
    return _layer == "workqueue"
