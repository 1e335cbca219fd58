"""CPUBackend: 32-byte aligned numpy arenas and the numba kernel table."""
from __future__ import annotations

import contextlib
import threading
from functools import lru_cache
from typing import Any, Iterator

import numba

from ..base import Backend
from .kernels import KERNELS


class CPUBackend(Backend):
    name = "cpu"
    alignment = 32
    kernels = KERNELS

    def __init__(self, n_threads: int | None = None, blas_threads: int = 1,
                 ggml_exact: bool = False) -> None:
        if n_threads:
            numba.set_num_threads(n_threads)
        self.blas_threads = blas_threads
        if ggml_exact:  # compute as ggml's CPU does, bit for bit (backends/cpu/ggml_exact.py)
            from .ggml_exact import kernel_table

            self.kernels = kernel_table(KERNELS)

    def run_context(self) -> Any:
        """BLAS with one thread while a graph runs: numba's threads and OpenBLAS's both spin
        between calls, and on a small machine the two pools fighting for cores made SmolLM2's
        512-token prompt 2.7x slower than single-threaded BLAS beside numba's threads.

        Graphs run by different Sessions in different threads take turns when numba's
        threading layer is `workqueue` (the only one guaranteed present): it is not
        thread-safe and aborts the process on concurrent parallel kernels. tbb and omp are
        thread-safe and run concurrently."""
        return _running(self.blas_threads)


@lru_cache(maxsize=1)
def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _blas_limit(n: int) -> Any:
    return _controller().limit(limits=n, user_api="blas")


# one graph at a time in the whole process while numba's threading layer cannot take more
_KERNEL_LOCK = threading.RLock()
_layer: str | None = None


@contextlib.contextmanager
def _running(blas_threads: int) -> Iterator[None]:
    with _KERNEL_LOCK if _kernels_need_lock() else contextlib.nullcontext(), \
            _blas_limit(blas_threads):
        yield


def _kernels_need_lock() -> bool:
    global _layer
    if _layer is None:
        try:
            _layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet, so no layer is chosen: be safe
            return True
    return _layer == "workqueue"
