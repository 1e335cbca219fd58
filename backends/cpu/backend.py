"""CPUBackend: 32-byte aligned numpy arenas and the numba kernel table."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

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
        512-token prompt 2.7x slower than single-threaded BLAS beside numba's threads."""
        return _blas_limit(self.blas_threads)


@lru_cache(maxsize=1)
def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _blas_limit(n: int) -> Any:
    return _controller().limit(limits=n, user_api="blas")
