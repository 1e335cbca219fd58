"""CPUBackend: the CPU device (the numba kernel table, the packed weight copies its products
read) with host memory (32-byte aligned numpy arenas, backends/buffer_type.py) and the CPU's
executor (threads, fusion: backends/cpu/executor.py)."""
from __future__ import annotations

from .threads import ThreadGovernor, configure_openmp

import numba  # noqa: E402

from ggraph.ir.tensor import Tensor  # noqa: E402
from ggraph import config  # noqa: E402
from ggraph.ir.opkind import OpKind  # noqa: E402
from ..base import Backend, Session  # noqa: E402
from ..buffer_type import HostBufferType  # noqa: E402
from ..registry import KINDS  # noqa: E402
from . import fusion  # noqa: E402
from .executor import CPUExecutor  # noqa: E402
from .kernels import KERNELS, packed_weight  # noqa: E402
from .packstore import PackStore, WeightSource  # noqa: E402

# GGRAPH_ADAPTIVE_THREADS=0: every run uses all the backend's threads (no governor)
ADAPTIVE = config.adaptive_threads()


class CPUBackend(Backend):
    """The CPU device: numba kernels, host memory, the CPU executor's threads, and the packed
    copies of quantized weights its products read (CPU_REPACK)."""

    name = "cpu"
    kernels = KERNELS
    buffers = HostBufferType(KINDS["cpu"].label, KINDS["cpu"].alignment)

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
        # fewer threads for graphs that run faster so, as on a busy machine (threads.py);
        # element-wise chains run as one kernel call (backends/cpu/fusion.py), never with
        # ggml_exact: a fused norm chain is not ggml's rms_norm, bit for bit
        self.executor = CPUExecutor(
            self.n_threads,
            ThreadGovernor(self.n_threads) if (ADAPTIVE if adaptive is None else adaptive)
            else None,
            blas_threads, (fusion.ENABLED if fuse is None else fuse) and not ggml_exact)
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
