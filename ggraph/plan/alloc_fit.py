"""Placement for the graph allocator: ggml's online best fit over a coalescing free list, and
an offline fit (all lifetimes known: largest blocks first into the lowest free gap).

Both read a liveness trace (ggraph.plan.alloc_trace.Trace) and return offsets by block; neither
touches memory.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ggraph.plan.alloc_trace import ALLOC, FREE, Trace

_HUGE = sys.maxsize // 2                # the open tail block of ggml's single chunk
_NEVER = sys.maxsize                    # free event of a block that is never freed


@dataclass
class Fit:
    """Offsets of the blocks of one trace."""
    offsets: list[int]        # by block
    size: int                 # buffer bytes: the highest block end
    peak_block: int           # the block whose end is the high-water mark (-1: none)


@dataclass(slots=True)
class _Gap:
    """A free range of ggml_dyn_tallocr's free list."""
    offset: int
    size: int


def _free_bytes(free: list[_Gap], offset: int, size: int) -> None:
    # ggml_dyn_tallocr_free_bytes: merge with a neighbour, else insert keeping offset order
    for i, gap in enumerate(free):
        if gap.offset + gap.size == offset:
            gap.size += size
            if i + 1 < len(free) and gap.offset + gap.size == free[i + 1].offset:
                gap.size += free[i + 1].size
                del free[i + 1]
            return
        if offset + size == gap.offset:
            gap.offset = offset
            gap.size += size
            if i > 0 and free[i - 1].offset + free[i - 1].size == gap.offset:
                free[i - 1].size += gap.size
                del free[i]
            return
    pos = 0
    while pos < len(free) and free[pos].offset < offset:
        pos += 1
    free.insert(pos, _Gap(offset, size))


def fit_online(tr: Trace) -> Fit:
    """ggml_dyn_tallocr over one chunk, event by event: best fit over the free list, the open
    tail only when nothing else fits."""
    free: list[_Gap] = [_Gap(0, _HUGE)]
    offsets = [0] * len(tr.block_sizes)
    sizes = list(tr.block_sizes)          # shrunk in place by SHRINK events
    max_size, peak = 0, -1
    for ev in tr.events:
        block = ev.block
        if ev.kind == ALLOC:
            size = sizes[block]
            best, best_size = -1, _HUGE
            tail = len(free) - 1
            for i in range(tail):
                gap_size = free[i].size
                if size <= gap_size <= best_size:    # ties go to the later gap, as in ggml
                    best, best_size = i, gap_size
            if best < 0:
                best = tail
            gap = free[best]
            offset = offsets[block] = gap.offset
            gap.offset += size
            gap.size -= size
            if gap.size == 0:
                del free[best]
            if offset + size > max_size:
                max_size, peak = offset + size, block
        elif ev.kind == FREE:
            _free_bytes(free, offsets[block], sizes[block])
        else:
            _free_bytes(free, offsets[block] + ev.keep, sizes[block] - ev.keep)
            sizes[block] = ev.keep
    return Fit(offsets, max_size, peak)


def fit_offline(tr: Trace) -> Fit:
    """Largest block first, into the lowest gap left by the placed blocks live at the same
    time (on random graphs the lowest gap did as well as the tightest). Lifetimes are event
    intervals [alloc, free); a shrunk block keeps its full size. Vectorized with numpy:
    graphs hold thousands of blocks, and long-lived ones overlap most others."""
    block_sizes = tr.block_sizes
    n = len(block_sizes)
    start = np.zeros(n, np.int64)
    stop = np.full(n, _NEVER, np.int64)
    for index, ev in enumerate(tr.events):
        if ev.kind == ALLOC:
            start[ev.block] = index
        elif ev.kind == FREE:
            stop[ev.block] = index
    size = np.array(block_sizes, np.int64)
    order = sorted(range(n), key=lambda b: (-block_sizes[b], int(start[b]) - int(stop[b]), b))
    # the blocks placed so far, in placement order: their lifetimes and byte ranges
    placed_start, placed_stop = np.empty(n, np.int64), np.empty(n, np.int64)
    placed_lo, placed_hi = np.empty(n, np.int64), np.empty(n, np.int64)
    offsets = [0] * n
    for k, b in enumerate(order):
        block_size, born, dies = int(size[b]), start[b], stop[b]
        offset = 0
        if k and block_size:
            live = (placed_start[:k] < dies) & (placed_stop[:k] > born) & \
                (placed_hi[:k] > placed_lo[:k])
            if live.any():
                lo, hi = placed_lo[:k][live], placed_hi[:k][live]
                idx = np.argsort(lo, kind="stable")
                lo, hi = lo[idx], np.maximum.accumulate(hi[idx])
                gap_at = np.concatenate(([0], hi[:-1]))
                room = lo - gap_at
                fits = np.flatnonzero(room >= block_size)
                offset = int(gap_at[fits[0]]) if len(fits) else int(hi[-1])
        offsets[b] = offset
        placed_start[k], placed_stop[k] = born, dies
        placed_lo[k], placed_hi[k] = offset, offset + block_size
    ends = [offsets[b] + block_sizes[b] for b in range(n)]
    top = max(ends, default=0)
    peak = min((b for b in range(n) if ends[b] == top), key=lambda b: int(start[b]),
               default=-1)
    return Fit(offsets, top, peak)


__all__ = ["Fit", "fit_offline", "fit_online"]
