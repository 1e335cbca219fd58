"""CUDABackend: device arenas with CUDA's 128-byte alignment, the CUDA kernel table, and the
memory hooks of backends/base.py for device memory.

Leaf data (weights, test inputs) is uploaded once per backend and cached by tensor identity
(weakly, so dropping a tensor frees its device copy; a new `set_data` array uploads again).
Reads and writes of one tensor copy the byte span it covers between host and device and
convert on the host with ggraph.codecs.buffers, so strided views read and write correctly.

Each backend holds one GPU (`CUDABackend(device=1)`): every allocation, copy, binding and run
happens with that GPU current on the calling thread, and its launches and copies queue on the
backend's own stream, so several backends in one process (`--devices cuda,cuda`) each keep
to their device.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from ggraph.codecs import buffers
from ggraph.ir.tensor import Tensor
from ..errors import BackendUnavailableError
from ..base import Backend, Session
from ..registry import KINDS
from . import runtime as R
from . import templates as K
from .kernels import KERNELS
from .replay import CallList, run_calls
from .tc_gemm import Scratch


class CUDABackend(Backend):
    name = "cuda"
    alignment = KINDS["cuda"].alignment  # ggml's (ggml-alloc pads every tensor to it)
    kernels = KERNELS

    def __init__(self, device: int = 0) -> None:
        why = R.unavailable_reason()
        if why is not None:  # one line instead of numba's CudaSupportError at the first launch
            raise BackendUnavailableError(why)
        try:
            self.device = R.open_device(int(device))
        except ValueError as e:
            raise BackendUnavailableError(str(e)) from None
        # tensor -> (the host array that was uploaded, its device copy)
        self._uploads: "weakref.WeakKeyDictionary[Tensor, tuple[np.ndarray, Any]]" = \
            weakref.WeakKeyDictionary()
        # called with each tensor whose data is uploaded (gpu-check keeps them alive to read
        # their device copies back)
        self.upload_observers: list[Callable[[Tensor], None]] = []

    @property
    def device_name(self) -> str:
        with self.device.active():
            return R.device_name()

    def session(self, **kw: Any) -> Session:
        return CUDASession(self, **kw)

    def run_context(self, key: Any = None) -> Any:
        return self.device.active()

    def run_calls(self, calls: list) -> None:
        run_calls(calls)

    def fuse(self, order: list[Tensor], session: Session) -> Any:
        from .fusion import fuse

        return fuse(order, session)

    # -- memory -----------------------------------------------------------------------------
    def alloc_arena(self, nbytes: int) -> Any:
        with self.device.active():
            return R.alloc_bytes(nbytes)

    def view(self, buf: Any, offset: int, t: Tensor) -> Any:
        return R.view(buf, offset, t)

    def upload(self, t: Tensor) -> Any:
        hit = self._uploads.get(t)
        if hit is not None and hit[0] is t.data:
            return hit[1]
        if t.data.nbytes != t.nbytes:
            raise ValueError(f"tensor {t.describe()} carries {t.data.nbytes} bytes of data, "
                             f"expected {t.nbytes}")
        with self.device.active():
            dev = R.upload_bytes(t.data)
        self._uploads[t] = (t.data, dev)
        for observe in self.upload_observers:
            observe(t)
        return dev

    def uploaded(self, t: Tensor) -> tuple[np.ndarray, Any] | None:
        """(the host array uploaded for `t`, its device copy), or None if none is held."""
        return self._uploads.get(t)

    def fill(self, buf: Any, byte: int) -> None:
        if R.MODE == "ptx":
            buf[...] = byte
            return
        with self.device.active():
            R.launch(K.k_fill_bytes, R.blocks_for(buf.nbytes, K.EW_NT), K.EW_NT, buf,
                     np.uint8(byte))

    def to_host(self, buf: Any) -> np.ndarray:
        with self.device.active():
            return R.to_host(buf)

    def read(self, buf: Any, offset: int, t: Tensor) -> np.ndarray:
        with self.device.active():
            return buffers.read(R.to_host(buf, offset, offset + t.nbytes), 0, t)

    def write(self, buf: Any, offset: int, t: Tensor, values: np.ndarray) -> None:
        with self.device.active():
            # a packed tensor's span is all its own: one copy queued on the stream, no read
            # back (a decode step's token ids and positions, every token); a strided view's
            # is read, modified and written, keeping the bytes between its elements
            host = np.empty(t.nbytes, np.uint8) if t.is_contiguous() else \
                R.to_host(buf, offset, offset + t.nbytes)
            buffers.write(host, 0, t, values)
            R.from_host(buf, offset, host)

    def read_bytes(self, buf: Any, offset: int, n: int) -> np.ndarray:
        with self.device.active():
            return np.array(R.to_host(buf, offset, offset + n))

    def write_bytes(self, buf: Any, offset: int, data: np.ndarray) -> None:
        with self.device.active():
            R.from_host(buf, offset, np.ascontiguousarray(data))

    def synchronize(self) -> None:
        with self.device.active():
            R.synchronize()


class CUDASession(Session):
    """A Session whose launches are bound with its backend's GPU current, so they capture
    that GPU's stream and stand-in arrays; `tc_scratch` holds the F16 weight copy its
    tensor-core products share (tc_gemm.py)."""

    def __init__(self, backend: "CUDABackend", **kw: Any) -> None:
        super().__init__(backend, **kw)
        self.tc_scratch = Scratch()

    def bind_calls(self, nodes: list[Tensor], fuse: bool = False) -> Any:
        with self.backend.device.active():
            return super().bind_calls(nodes, fuse)

    def _bind(self, graph: Any) -> list:
        # a whole graph's calls: replayed as one CUDA graph from its third run (replay.py)
        return CallList(super()._bind(graph), self.backend.device.stream, R.MODE == "device")
