"""A CPU backend's packed copies of its weights (the layout: backends/cpu/qpack.py): made once
per weight, at reserve or on first use, and kept while the weight lives; their bytes are
what llama.cpp calls its CPU_REPACK buffer. Their memory comes from a PageArena
(backends/cpu/hugepages.py): 2 MiB pages where Linux gives them, laid out in packing order.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import numpy as np

from .hugepages import PageArena
from .qpack import R, pack, packed_nbytes


class WeightSource(Protocol):
    """Where a backend reads weights it keeps its own copy of (graphs/gguf_file.GGUFModel):
    rows into a buffer, and the pages it may let go of once copied."""

    def read_rows(self, t: Any, row0: int, out: np.ndarray) -> None: ...

    def release(self, t: Any) -> None: ...


class PackStore:
    """The packed copies of one backend's weights, made once (at reserve, or on first use)
    and kept while their tensor lives; `nbytes` is the memory they hold (llama.cpp's
    CPU_REPACK buffer). With a `source`, a weight's rows are read from it in runs (not
    through its mapping) and its mapped pages released once packed. `arena` gives the
    packed copies their memory (a PageArena of its own by default)."""

    CHUNK = 32 << 20   # bytes of stored rows read and packed at a time

    def __init__(self, source: WeightSource | None = None,
                 arena: PageArena | None = None) -> None:
        self._packed: "weakref.WeakKeyDictionary[object, np.ndarray]" = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.source = source
        self.arena = arena if arena is not None else PageArena()
        self._buf = np.empty(0, np.uint8)   # the rows read, reused: its pages fault in once

    def get(self, t, data: np.ndarray) -> np.ndarray:
        """The packed layout of weight t (type t.type, shape t.ne) whose stored bytes are
        `data`, packing it on the first call."""
        with self._lock:
            p = self._packed.get(t)
            if p is None:
                p = self._packed[t] = self._pack(t, data)
            return p

    def _pack(self, t, data: np.ndarray) -> np.ndarray:
        m = t.ne[1]
        out = self.arena.empty(packed_nbytes(t.type, t.ne))
        if self.source is None:
            return pack(t.type, np.asarray(data).reshape(m, -1), out=out)
        width = t.nbytes // m
        per_group = out.nbytes // -(-m // R)
        step = max(R, self.CHUNK // max(width, 1) // R * R)
        if self._buf.nbytes < min(step, m) * width:
            self._buf = np.empty(min(step, m) * width, np.uint8)
        buf = self._buf[:min(step, m) * width].reshape(-1, width)
        for row0 in range(0, m, step):
            n = min(step, m - row0)
            self.source.read_rows(t, row0, buf[:n])
            g0 = row0 // R
            pack(t.type, buf[:n], out=out[g0 * per_group:(g0 + -(-n // R)) * per_group])
        self.source.release(t)
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._packed.values())

    def tensors(self) -> list[Any]:
        """The weights packed so far."""
        with self._lock:
            return list(self._packed.keys())

    def __len__(self) -> int:
        return len(self._packed)
