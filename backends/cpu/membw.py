"""The machine's memory read bandwidth as the CPU backend's threads see it: the denominator of
every "share of the read bandwidth" the benchmarks print (`ggraph bench`, bench_kquant).

A parallel numba reduction over a buffer far larger than the caches, at a given thread count
(numba's threads are the ones ggraph's kernels run on), timed a few times; the median of the
runs is the figure, as a busy machine only slows a run down. Where the buffer starts matters
at one thread (OFFSET).
`read_pieces` reads buffers one parallel read each, as a decode step's products read their
weights: benchmarks/bench_stream.py sets it beside the products over the same pieces.
"""
from __future__ import annotations

import time
from typing import Sequence

import numba
import numpy as np
from numba import prange

from .threads import configure_openmp

BUFFER = 1 << 30   # bytes streamed per run: 32 times a 32 MiB L3
# The buffer starts 16 bytes past a cache line, so each of the reduction's 64-byte loads
# spans two lines. At one thread on Zen 4 that reads 4-9% faster than from a line boundary
# (offsets 8, 16, 32 alike; the same memory, paired rounds); at two, where the memory is the
# limit, every offset reads alike. The denominator is the faster read. numpy's 1 GiB arrays
# happened to start 16 bytes into a page (glibc's header), so this keeps the figures of
# earlier runs; the packed products read the same either way (a scratch A/B of pieces at
# offsets 0, 16 and 64).
OFFSET = 16


@numba.njit(parallel=True, cache=True)
def _read_all(a):
    v = a.view(np.uint64)
    s = np.uint64(0)
    for i in prange(v.size):
        s += v[i]
    return s


_BUF: list[np.ndarray] = []


def past_line(nbytes: int) -> np.ndarray:
    """nbytes of ones starting OFFSET bytes past a 64-byte line."""
    whole = np.ones(nbytes + 128, np.uint8)
    at = (OFFSET - whole.ctypes.data) % 64
    return whole[at:at + nbytes]


def read_bandwidth(n_threads: int, runs: int = 5) -> float:
    """GB/s read by n_threads threads summing a 1 GiB buffer (the median of `runs`)."""
    if not _BUF:
        _BUF.append(past_line(BUFFER))   # its pages made once, kept for later calls
    buf = _BUF[0]
    configure_openmp()   # before numba's threads start (threads.py)
    was = numba.get_num_threads()
    numba.set_num_threads(n_threads)
    try:
        _read_all(buf)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            _read_all(buf)
            times.append(time.perf_counter() - t0)
    finally:
        numba.set_num_threads(was)
    return buf.nbytes / float(np.median(times)) / 1e9


def read_pieces(pieces: Sequence[np.ndarray]) -> int:
    """One parallel read of each uint8 buffer in turn (its 8-byte words; a tail of fewer than
    8 bytes is skipped), at numba's current thread count: the products' reading of their
    weights without their arithmetic. Returns the bytes read."""
    n = 0
    for p in pieces:
        w = p[: p.size // 8 * 8]
        _read_all(w)
        n += w.size
    return n
