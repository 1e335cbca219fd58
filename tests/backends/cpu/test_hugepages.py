"""The 2 MiB-page arena the CPU backend's packed weights live in (backends/cpu/hugepages.py)."""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from ggraph.backends.cpu.hugepages import HUGE, PageArena
from ggraph.backends.cpu.packstore import PackStore
from ggraph.backends.cpu import qpack
from ggraph.ir.types import GGMLType

needs_advice = pytest.mark.skipif(getattr(mmap, "MADV_HUGEPAGE", None) is None,
                                  reason="no MADV_HUGEPAGE on this platform: the arena is "
                                         "plain numpy arrays there")


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `addr`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and ":" in head:
                fields[head[:-1]] = line.split(":", 1)[1].strip()
    return fields


@needs_advice
def test_small_requests_share_a_chunk_in_order_and_large_ones_map_their_own():
    a = PageArena(chunk=4 * HUGE, own=HUGE, enabled=True)
    x, y = a.empty(1000), a.empty(3000)
    # carved one after the other from one 2 MiB-aligned chunk, each on a cache line
    assert x.ctypes.data % HUGE == 0
    assert y.ctypes.data == x.ctypes.data + 1024
    z = a.empty(3 * HUGE + 5)   # its own mapping, from a 2 MiB boundary
    assert z.ctypes.data % HUGE == 0 and z.nbytes == 3 * HUGE + 5
    w = a.empty(4 * HUGE - 100)   # does not fit what the chunk has left: a new chunk
    assert w.ctypes.data % HUGE == 0 and w.ctypes.data != x.ctypes.data
    for v, fill in ((x, 1), (y, 2), (z, 3), (w, 4)):
        v[:] = fill
    assert (x == 1).all() and (y == 2).all() and (z == 3).all() and (w == 4).all()
    assert a.empty(0).nbytes == 0
    with pytest.raises(ValueError, match="negative size -1"):
        a.empty(-1)


def test_switched_off_gives_plain_arrays(monkeypatch):
    monkeypatch.setenv("GGRAPH_HUGEPAGES", "0")
    a = PageArena()
    assert not a.enabled
    v = a.empty(12345)
    assert v.dtype == np.uint8 and v.nbytes == 12345 and v.base is None and a.mapped == 0
    with pytest.raises(ValueError, match="multiple of"):
        PageArena(chunk=HUGE + 1)


@needs_advice
@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in
                    ("always", "madvise"),
                    reason="transparent huge pages are off here (or not Linux): the kernel "
                           "gives no 2 MiB pages to advise for")
def test_the_mappings_are_advised_for_huge_pages():
    """Linux marks the chunk's and a large request's whole 2 MiB pages eligible; a large
    request's tail past its last whole 2 MiB page is left unadvised."""
    a = PageArena(chunk=2 * HUGE, own=HUGE, enabled=True)
    small, large = a.empty(4096), a.empty(2 * HUGE + 4096)
    small[:] = 0
    large[:] = 0
    assert _vma_flags(small.ctypes.data).get("THPeligible") == "1"
    assert _vma_flags(large.ctypes.data).get("THPeligible") == "1"
    tail = _vma_flags(large.ctypes.data + 2 * HUGE)
    assert tail.get("THPeligible") == ("1" if _thp_mode() == "always" else "0")


def test_packs_from_the_arena_equal_packing_alone():
    """PackStore's copies carved from a shared chunk are the packer's bytes, each weight
    apart from the others."""
    rng = np.random.default_rng(0)

    class W:   # what PackStore reads of a weight tensor
        def __init__(self, rows):
            self.type, self.ne = GGMLType.Q8_0, (64, rows.shape[0], 1, 1)
            self.data = rows

    ws = [W(rng.integers(0, 256, (m, 2 * 34), dtype=np.uint8)) for m in (16, 48, 32)]
    for w in ws:   # finite f16 scales
        w.data.reshape(w.ne[1], 2, 34)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    store = PackStore(arena=PageArena(enabled=True))
    packs = [store.get(w, w.data) for w in ws]
    for w, p in zip(ws, packs):
        assert np.array_equal(p, qpack.pack(w.type, w.data))
    if store.arena.enabled:
        assert packs[1].ctypes.data >= packs[0].ctypes.data + packs[0].nbytes
        assert store.nbytes == sum(p.nbytes for p in packs)
