"""CUDABackend: one GPU as a device (the CUDA kernel table) with its buffer type (device
arenas, uploads, copies: backends/cuda/buffers.py) and its executor (backends/cuda/
executor.py).

Each backend holds one GPU (`CUDABackend(device=1)`): every allocation, copy, binding and run
happens with that GPU current on the calling thread, and its launches and copies queue on the
backend's own stream, so several backends in one process (`--devices cuda,cuda`) each keep
to their device.
"""
from __future__ import annotations

from typing import Any

from ggraph.ir.tensor import Tensor
from ..errors import BackendUnavailableError
from ..base import Backend, Session
from ..registry import KINDS
from . import runtime as R
from .buffers import CUDABufferType
from .executor import CUDAExecutor
from .kernels import KERNELS
from .replay import CallList
from .tc_gemm import Scratch


class CUDABackend(Backend):
    """One GPU: the CUDA kernel table, device memory (backends/cuda/buffers.py) and the CUDA
    executor (backends/cuda/executor.py)."""

    name = "cuda"
    kernels = KERNELS

    def __init__(self, device: int = 0) -> None:
        why = R.unavailable_reason()
        if why is not None:  # one line instead of numba's CudaSupportError at the first launch
            raise BackendUnavailableError(why)
        try:
            self.device = R.open_device(int(device))
        except ValueError as e:
            raise BackendUnavailableError(str(e)) from None
        self.buffers = CUDABufferType(KINDS["cuda"].device_name(int(device)), self.device)
        self.executor = CUDAExecutor(self.device)

    @property
    def device_name(self) -> str:
        with self.device.active():
            return R.device_name()

    def session(self, **kw: Any) -> Session:
        return CUDASession(self, **kw)


class CUDASession(Session):
    """A Session whose launches are bound with its backend's GPU current, so they capture
    that GPU's stream and stand-in arrays; `tc_scratch` holds the F16 weight copy its
    tensor-core products share (tc_gemm.py)."""

    def __init__(self, backend: "CUDABackend", **kw: Any) -> None:
        super().__init__(backend, **kw)
        self.tc_scratch = Scratch()

    def bind_groups(self, nodes: list[Tensor], fuse: bool = False,
                    observed: frozenset[Tensor] = frozenset()) -> Any:
        with self.backend.device.active():
            return super().bind_groups(nodes, fuse, observed)

    def _bind(self, graph: Any) -> list:
        # a whole graph's calls: replayed as one CUDA graph from its third run (replay.py)
        return CallList(super()._bind(graph), self.backend.device.stream, R.MODE == "device")
