"""CPUBackend: 32-byte aligned numpy arenas, the numba kernel table, the fusion pass, and
the threads each run uses (backends/cpu/threads.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from functools import lru_cache
from typing import Any, Hashable, Iterator, Mapping

from .threads import ThreadGovernor, configure_openmp

import numba  # noqa: E402

from ggraph.ir.tensor import Tensor  # noqa: E402
from ggraph import config
from ..base import Backend, Session  # noqa: E402
from ..registry import KINDS  # noqa: E402
from . import fusion  # noqa: E402
from ggraph.ir.opkind import OpKind  # noqa: E402
from .kernels import KERNELS, compiled_for, compiled_nogil, packed_weight  # noqa: E402
from .packstore import PackStore, WeightSource  # noqa: E402

# GGRAPH_ADAPTIVE_THREADS=0: every run uses all the backend's threads (no governor)
ADAPTIVE = config.adaptive_threads()


class CPUBackend(Backend):
    name = "cpu"
    alignment = KINDS["cpu"].alignment
    kernels = KERNELS

    def __init__(self, n_threads: int | None = None, blas_threads: int = 1,
                 ggml_exact: bool = False, fuse: bool | None = None,
                 adaptive: bool | None = None, weights: WeightSource | None = None) -> None:
        # before numba starts its threads, which loads the OpenMP runtime: it reads its
        # environment once (and libggml-cpu shares it in the benchmarks)
        configure_openmp()
        most = numba.config.NUMBA_NUM_THREADS
        if n_threads is not None and not 1 <= n_threads <= most:
            raise ValueError(f"n_threads={n_threads}: numba runs 1 to {most} threads here "
                             f"(NUMBA_NUM_THREADS)")
        # -t: every run sets it in the thread that runs (numba's count is per thread)
        self.n_threads = n_threads or most
        numba.set_num_threads(self.n_threads)
        # fewer threads for graphs that run faster so, as on a busy machine (threads.py)
        self.governor = ThreadGovernor(self.n_threads) if (
            ADAPTIVE if adaptive is None else adaptive) else None
        self.blas_threads = blas_threads
        # element-wise chains run as one kernel call (backends/cpu/fusion.py)
        # (never with ggml_exact: a fused norm chain is not ggml's rms_norm, bit for bit)
        self.fusion = (fusion.ENABLED if fuse is None else fuse) and not ggml_exact
        if ggml_exact:  # compute as ggml's CPU does, bit for bit (backends/cpu/ggml_exact.py)
            from .ggml_exact import kernel_table

            self.kernels = kernel_table(KERNELS)
        # weights in the packed layout of the quantized products (backends/cpu/qpack.py),
        # made once, read from `weights` (the model file) where given; none for ggml_exact,
        # whose kernels read the stored blocks
        self.packs = None if ggml_exact else PackStore(weights)

    def prepare_weights(self, nodes: list[Tensor], session: Session) -> None:
        """Pack every weight the products of `nodes` will read packed (kernels.packed_weight),
        before the first run: load time carries it, and the memory lines count it."""
        for node in nodes:
            if node.op == OpKind.MUL_MAT:
                packed_weight(node.src[0], node.src[1], session)

    def model_buffers(self) -> list[tuple[str, int]]:
        n = self.packs.nbytes if self.packs is not None else 0
        return [("CPU_REPACK", n)] if n else []

    def fuse(self, order: list[Tensor], session: Session) -> Mapping[Tensor, Any]:
        if not self.fusion:
            return {}
        return fusion.fuse(order, session, compiled_for, compiled_nogil)

    def run_context(self, key: Hashable | None = None) -> Any:
        """The threads of a run: the governor's choice for graph `key` (all of them without
        a key), timed for the governor.

        BLAS with one thread while a graph runs: numba's threads and OpenBLAS's both spin
        between calls, and on a small machine the two pools fighting for cores made SmolLM2's
        512-token prompt 2.7x slower than single-threaded BLAS beside numba's threads.

        Graphs run by different Sessions in different threads take turns when numba's
        threading layer is `workqueue` (the only one guaranteed present): it is not
        thread-safe and aborts the process on concurrent parallel kernels. tbb and omp are
        thread-safe and run concurrently."""
        return _running(self, key)


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
def _running(backend: CPUBackend, key: Hashable | None) -> Iterator[None]:
    gov = backend.governor if key is not None else None
    n = gov.choose(key) if gov is not None else backend.n_threads
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    with _KERNEL_LOCK if _kernels_need_lock() else contextlib.nullcontext(), \
            _blas_limit(backend.blas_threads):
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
