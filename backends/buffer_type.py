"""Buffer types: what a backend's memory is and how bytes move in and out of it, after ggml's
buffer type and buffer (ggml-backend-impl.h: alloc_buffer, get_alignment, set_tensor,
get_tensor, memset_tensor).

`BufferType` names a kind of memory and its alignment (the registry's, backends/registry.py);
that is all a planner asks of it, and all a remote stage's stand-in has. `HostBufferType` is
memory in this process: aligned numpy arenas, a tensor's view in one (F16 as its uint16 bits),
leaf data used in place, reads and writes through ggraph.codecs.buffers. A device's buffer
type (backends/cuda/buffers.py) allocates there and copies across.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ggraph.codecs import buffers
from ggraph.ir.tensor import Tensor
from ggraph.plan.host_memory import check_buffers


def aligned_empty(nbytes: int, alignment: int) -> np.ndarray:
    """A uint8 array of nbytes whose first byte is aligned (numpy only promises 16)."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


class BufferType:
    """A kind of memory: its name (llama.cpp's label: CPU, CUDA0) and the alignment of every
    tensor in it. Holding memory is a subclass's: this one only describes it."""

    def __init__(self, name: str, alignment: int) -> None:
        self.name = name
        self.alignment = alignment

    def _no_memory(self) -> Any:
        raise RuntimeError(f"buffer type {self.name} describes memory this process does not "
                           f"hold")

    def alloc(self, nbytes: int) -> Any:
        """A buffer of nbytes (an arena the allocator's plan places tensors in)."""
        return self._no_memory()

    def view(self, buf: Any, offset: int, t: Tensor) -> Any:
        """The kernels' view of `t` at `offset` in `buf`."""
        return self._no_memory()

    def upload(self, t: Tensor) -> Any:
        """Memory the kernels read for leaf `t`'s host data (`t.data`)."""
        return self._no_memory()

    def fill(self, buf: Any, byte: int) -> None:
        self._no_memory()

    def to_host(self, buf: Any) -> np.ndarray:
        return self._no_memory()

    def read(self, buf: Any, offset: int, t: Tensor) -> np.ndarray:
        """`t`'s values (decoded, in its shape) from `buf` at `offset`."""
        return self._no_memory()

    def write(self, buf: Any, offset: int, t: Tensor, values: np.ndarray) -> None:
        self._no_memory()

    def read_bytes(self, buf: Any, offset: int, n: int) -> np.ndarray:
        """n raw bytes of `buf` from `offset`, on the host."""
        return self._no_memory()

    def write_bytes(self, buf: Any, offset: int, data: np.ndarray) -> None:
        self._no_memory()


class HostBufferType(BufferType):
    """Memory in this process: numpy arrays the kernels read and write directly."""

    def alloc(self, nbytes: int) -> np.ndarray:
        # a plan larger than the memory left: one line naming the sizes, not numpy's error
        check_buffers([("", nbytes)], self.name)
        return aligned_empty(max(nbytes, 1), self.alignment)

    def view(self, buf: Any, offset: int, t: Tensor) -> Any:
        return buffers.raw_view(buf, offset, t, half_bits=True)

    def upload(self, t: Tensor) -> Any:
        return t.data   # used in place (a weight in a read-only mmap stays there)

    def fill(self, buf: Any, byte: int) -> None:
        buf[...] = byte

    def to_host(self, buf: Any) -> np.ndarray:
        return np.asarray(buf)

    def read(self, buf: Any, offset: int, t: Tensor) -> np.ndarray:
        return buffers.read(np.asarray(buf), offset, t)

    def write(self, buf: Any, offset: int, t: Tensor, values: np.ndarray) -> None:
        buffers.write(buf, offset, t, values)

    def read_bytes(self, buf: Any, offset: int, n: int) -> np.ndarray:
        return np.array(np.asarray(buf)[offset:offset + n])

    def write_bytes(self, buf: Any, offset: int, data: np.ndarray) -> None:
        buf[offset:offset + data.nbytes] = data
