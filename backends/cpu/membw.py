"""The machine's memory read bandwidth as the CPU backend's threads see it: the denominator of
every "share of the read bandwidth" the benchmarks print (`ggraph bench`, bench_kquant).

A parallel numba reduction over a buffer far larger than the caches, at a given thread count
(numba's threads are the ones ggraph's kernels run on), timed a few times; the median of the
runs is the figure, as a busy machine only slows a run down.
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


@numba.njit(parallel=True, cache=True)
def _read_all(a):
    v = a.view(np.uint64)
    s = np.uint64(0)
    for i in prange(v.size):
        s += v[i]
    return s


_BUF: list[np.ndarray] = []


def read_bandwidth(n_threads: int, runs: int = 5) -> float:
    """GB/s read by n_threads threads summing a 1 GiB buffer (the median of `runs`)."""
    if not _BUF:
        _BUF.append(np.ones(BUFFER, np.uint8))   # its pages made once, kept for later calls
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
