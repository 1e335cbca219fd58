"""The CUDA buffer type (backends/buffer_type.py): device arenas with CUDA's 128-byte
alignment on one GPU, leaf data uploaded once and cached by tensor identity (weakly, so
dropping a tensor frees its device copy; a new `set_data` array uploads again), and reads and
writes of one tensor that copy the byte span it covers between host and device and convert on
the host with ggraph.codecs.buffers, so strided views read and write correctly."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from ggraph.codecs import buffers
from ggraph.ir.tensor import Tensor
from ..buffer_type import BufferType
from ..registry import KINDS
from . import runtime as R
from . import templates as K


class CUDABufferType(BufferType):
    """Memory on `device` (runtime.open_device's handle: every allocation and copy happens
    with that GPU current and queues on its stream)."""

    def __init__(self, name: str, device: Any) -> None:
        super().__init__(name, KINDS["cuda"].alignment)  # ggml's: ggml-alloc pads to it
        self.device = device
        # tensor -> (the host array that was uploaded, its device copy)
        self._uploads: "weakref.WeakKeyDictionary[Tensor, tuple[np.ndarray, Any]]" = \
            weakref.WeakKeyDictionary()
        # called with each tensor whose data is uploaded (gpu-check keeps them alive to read
        # their device copies back)
        self.upload_observers: list[Callable[[Tensor], None]] = []

    def alloc(self, nbytes: int) -> Any:
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
