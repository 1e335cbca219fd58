"""CPUBackend: 32-byte aligned numpy arenas and the numba kernel table."""
from __future__ import annotations

import numba

from ..base import Backend
from .kernels import KERNELS


class CPUBackend(Backend):
    name = "cpu"
    alignment = 32
    kernels = KERNELS

    def __init__(self, n_threads: int | None = None) -> None:
        if n_threads:
            numba.set_num_threads(n_threads)
