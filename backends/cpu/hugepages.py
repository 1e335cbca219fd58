"""Memory for a CPU backend's packed weights on 2 MiB pages, where Linux gives them.

Decode streams every weight once a token. On 4 KiB pages that is a TLB miss every 4 KiB, and
the page-table lines those misses walk are cold too, since the stream evicts them. The cost
shows on a layer's small products most, which are over before the hardware settles (Q, K, V,
attn_out: 0.2-1.3 MiB each in Qwen2.5 1.5B). numpy already asks for huge pages for arrays of
4 MiB or more, but not for smaller ones.

`PageArena` hands out byte arrays from anonymous mappings that are 2 MiB aligned and advised
MADV_HUGEPAGE. With transparent huge pages in "madvise" or "always" mode, each 2 MiB they
cover then takes one TLB entry. Small requests are carved one after the other from shared
chunks, so they sit next to each other in the order they were packed, with no 2 MiB page
each. A large request gets a mapping of its own, advised up to its last whole 2 MiB page
only: its tail stays on 4 KiB pages, so no partly used huge page sits in the resident memory.
A chunk's memory lives while any array carved from it lives.

Where the platform has no MADV_HUGEPAGE, or GGRAPH_HUGEPAGES=0, the arena returns plain
`np.empty` arrays.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from ggraph import config

HUGE = 2 << 20     # the x86-64 and arm64 transparent huge page
ALIGN = 64         # a carved array starts on a cache line


def _advise_flag() -> int | None:
    """mmap.MADV_HUGEPAGE where Python and the platform have it."""
    return getattr(mmap, "MADV_HUGEPAGE", None)


@dataclass
class _Chunk:
    """One mapping that small requests are carved from: its bytes and the next free offset."""
    data: np.ndarray
    used: int = 0


class PageArena:
    """Byte arrays on 2 MiB-aligned, MADV_HUGEPAGE-advised mappings (see the module docstring).
    Requests of at least `own` bytes get a mapping of their own; smaller ones share chunks of
    `chunk` bytes."""

    def __init__(self, chunk: int = 32 << 20, own: int = 8 << 20,
                 enabled: bool | None = None) -> None:
        if chunk % HUGE or own > chunk:
            raise ValueError(f"PageArena: chunk {chunk} must be a multiple of {HUGE} bytes "
                             f"and at least own {own}")
        self.chunk, self.own = chunk, own
        self.enabled = (config.hugepages() if enabled is None else enabled) and \
            _advise_flag() is not None
        self._open: _Chunk | None = None
        self.mapped = 0    # bytes of the mappings made (address space, not all resident)

    def empty(self, nbytes: int) -> np.ndarray:
        """An uninitialized uint8 array of `nbytes` bytes."""
        if nbytes < 0:
            raise ValueError(f"PageArena.empty: negative size {nbytes}")
        if not self.enabled or nbytes == 0:
            return np.empty(nbytes, np.uint8)
        if nbytes >= self.own:
            return self._map(nbytes, nbytes // HUGE * HUGE)
        c = self._open
        start = -(-c.used // ALIGN) * ALIGN if c is not None else 0
        if c is None or start + nbytes > c.data.nbytes:
            c = self._open = _Chunk(self._map(self.chunk, self.chunk))
            start = 0
        c.used = start + nbytes
        return c.data[start:start + nbytes]

    def _map(self, nbytes: int, advised: int) -> np.ndarray:
        """A fresh anonymous mapping's `nbytes` from a 2 MiB boundary, its first `advised`
        bytes advised MADV_HUGEPAGE (a kernel that refuses leaves them on 4 KiB pages)."""
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(m, np.uint8)
        off = (-whole.ctypes.data) % HUGE
        if advised:
            try:
                m.madvise(_advise_flag(), off, advised)
            except OSError:
                pass   # THP off ("never") or not built in: 4 KiB pages, the same bytes
        self.mapped += nbytes + HUGE
        return whole[off:off + nbytes]
