"""Placement for the graph allocator: ggml's online best fit over a coalescing free list, and
an offline fit (all lifetimes known: largest blocks first into the lowest free gap).

Both read a liveness trace (ggraph.alloc._Trace) and return offsets; neither touches memory.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ggraph.alloc import _Trace

_HUGE = sys.maxsize // 2                # the open tail block of ggml's single chunk
_NEVER = sys.maxsize                    # free event of a block that is never freed


class _Fit:
    def __init__(self, offsets: list[int], size: int, peak_block: int) -> None:
        self.offsets, self.size, self.peak_block = offsets, size, peak_block


def _free_bytes(free: list[list[int]], off: int, size: int) -> None:
    # ggml_dyn_tallocr_free_bytes: merge with a neighbour, else insert keeping offset order
    for i, blk in enumerate(free):
        if blk[0] + blk[1] == off:
            blk[1] += size
            if i + 1 < len(free) and blk[0] + blk[1] == free[i + 1][0]:
                blk[1] += free[i + 1][1]
                del free[i + 1]
            return
        if off + size == blk[0]:
            blk[0] = off
            blk[1] += size
            if i > 0 and free[i - 1][0] + free[i - 1][1] == blk[0]:
                free[i - 1][1] += blk[1]
                del free[i]
            return
    pos = 0
    while pos < len(free) and free[pos][0] < off:
        pos += 1
    free.insert(pos, [off, size])


def _fit_online(tr: _Trace) -> _Fit:
    """ggml_dyn_tallocr over one chunk, event by event."""
    free: list[list[int]] = [[0, _HUGE]]
    offs = [0] * len(tr.bsize)
    bsz = list(tr.bsize)
    max_size, peak = 0, -1
    for kind, b, keep in tr.events:
        if kind == 0:
            size = bsz[b]
            best, best_size = -1, _HUGE
            last = len(free) - 1
            for i in range(last):
                bs = free[i][1]
                if size <= bs <= best_size:          # ties go to the later block, as in ggml
                    best, best_size = i, bs
            if best < 0:
                best = last
            blk = free[best]
            off = offs[b] = blk[0]
            blk[0] += size
            blk[1] -= size
            if blk[1] == 0:
                del free[best]
            if off + size > max_size:
                max_size, peak = off + size, b
        elif kind == 1:
            _free_bytes(free, offs[b], bsz[b])
        else:
            _free_bytes(free, offs[b] + keep, bsz[b] - keep)
            bsz[b] = keep
    return _Fit(offs, max_size, peak)


def _fit_offline(tr: _Trace) -> _Fit:
    """Largest block first, into the lowest gap left by the placed blocks live at the same
    time (on random graphs the lowest gap did as well as the tightest). Lifetimes are event
    intervals [alloc, free); a shrunk block keeps its full size. Vectorized with numpy:
    graphs hold thousands of blocks, and long-lived ones overlap most others."""
    n = len(tr.bsize)
    start = np.zeros(n, np.int64)
    stop = np.full(n, _NEVER, np.int64)
    for e, (kind, b, _) in enumerate(tr.events):
        if kind == 0:
            start[b] = e
        elif kind == 1:
            stop[b] = e
    size = np.array(tr.bsize, np.int64)
    order = sorted(range(n), key=lambda b: (-tr.bsize[b], int(start[b]) - int(stop[b]), b))
    p_start, p_stop = np.empty(n, np.int64), np.empty(n, np.int64)
    p_off, p_end = np.empty(n, np.int64), np.empty(n, np.int64)
    offs = [0] * n
    for k, b in enumerate(order):
        sz, s0, s1 = int(size[b]), start[b], stop[b]
        off = 0
        if k and sz:
            live = (p_start[:k] < s1) & (p_stop[:k] > s0) & (p_end[:k] > p_off[:k])
            if live.any():
                lo, hi = p_off[:k][live], p_end[:k][live]
                idx = np.argsort(lo, kind="stable")
                lo, hi = lo[idx], np.maximum.accumulate(hi[idx])
                gap_at = np.concatenate(([0], hi[:-1]))
                room = lo - gap_at
                fits = np.flatnonzero(room >= sz)
                off = int(gap_at[fits[0]]) if len(fits) else int(hi[-1])
        offs[b] = off
        p_start[k], p_stop[k], p_off[k], p_end[k] = s0, s1, off, off + sz
    ends = [offs[b] + tr.bsize[b] for b in range(n)]
    top = max(ends, default=0)
    peak = min((b for b in range(n) if ends[b] == top), key=lambda b: int(start[b]),
               default=-1)
    return _Fit(offs, top, peak)
