"""CUDABackend: device arenas with CUDA's 128-byte alignment, the CUDA kernel table, and the
memory hooks of backends/base.py for device memory.

Leaf data (weights, test inputs) is uploaded once per backend and cached by tensor identity
(weakly, so dropping a tensor frees its device copy; a new `set_data` array uploads again).
Reads and writes of one tensor copy the byte span it covers between host and device and
convert on the host with ggraph.buffers, so strided views read and write correctly.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ggraph import buffers
from ggraph.tensor import Tensor
from .. import BackendUnavailableError
from ..base import Backend
from . import runtime as R
from . import templates as K
from .kernels import KERNELS


class CUDABackend(Backend):
    name = "cuda"
    alignment = 128  # ggml's CUDA buffer alignment (ggml-alloc pads every tensor to it)
    kernels = KERNELS

    def __init__(self, device: int | None = None) -> None:
        why = R.unavailable_reason()
        if why is not None:  # one line instead of numba's CudaSupportError at the first launch
            raise BackendUnavailableError(why)
        if device is not None and R.MODE == "device":
            from numba import cuda

            cuda.select_device(device)
        # tensor -> (the host array that was uploaded, its device copy)
        self._uploads: "weakref.WeakKeyDictionary[Tensor, tuple[np.ndarray, Any]]" = \
            weakref.WeakKeyDictionary()

    @property
    def device_name(self) -> str:
        return R.device_name()

    # -- memory -----------------------------------------------------------------------------
    def alloc_arena(self, nbytes: int) -> Any:
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
        dev = R.upload_bytes(t.data)
        self._uploads[t] = (t.data, dev)
        return dev

    def fill(self, buf: Any, byte: int) -> None:
        if R.MODE == "ptx":
            buf[...] = byte
            return
        R.launch(K.k_fill_bytes, R.blocks_for(buf.nbytes, K.EW_NT), K.EW_NT, buf,
                 np.uint8(byte))

    def to_host(self, buf: Any) -> np.ndarray:
        return R.to_host(buf)

    def read(self, buf: Any, offset: int, t: Tensor) -> np.ndarray:
        return buffers.read(R.to_host(buf, offset, offset + t.nbytes), 0, t)

    def write(self, buf: Any, offset: int, t: Tensor, values: np.ndarray) -> None:
        # read-modify-write of t's byte span: bytes between a strided view's elements stay
        host = R.to_host(buf, offset, offset + t.nbytes)
        buffers.write(host, 0, t, values)
        R.from_host(buf, offset, host)

    def read_bytes(self, buf: Any, offset: int, n: int) -> np.ndarray:
        return np.array(R.to_host(buf, offset, offset + n))

    def write_bytes(self, buf: Any, offset: int, data: np.ndarray) -> None:
        R.from_host(buf, offset, np.ascontiguousarray(data))

    def synchronize(self) -> None:
        R.synchronize()
