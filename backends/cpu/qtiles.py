"""Dot products of packed weight tiles (backends/cpu/qpack.py) with C activation columns, R rows
at once, and the product of a packed weight with any number of columns built on them.

Each type has one tile function, `tile_<type>(acc, w, t, q, ysb, ysi, ysf, b)` (Q4_K and Q5_K
share `tile_k`) -> acc plus block b of the tile's R rows dotted with each of the C activation
rows of q (2-D: the bytes of the weights' vec_dot_type, Q8_0 blocks of 34 bytes or Q8_K blocks
of 292), lane j R + l being row l times column j (backends/cpu/qlanes.py); each is bound for C
= 1, 2 and 4 (backends/cpu/kernels.py). Prefetches run PF bytes ahead of every step (none where
PF is 0). The integer sums are ggml's (backends/shared/qdot.py computes the same; the tests
compare them): unsigned weight values times int8 quants summed by vpdpbusd, an offset (Q4_0's
8, Q5_0's 16, Q8_0's 128, Q6_K's 32, IQ4_XS's 128) taken off as offset * sum(quants), sub-block
scales applied as integers, then one float multiply-add per block with the rows' f16 scales.
`ysi` holds the offset times each activation block's (or sub-block's) sum of quants, `ysb` each
32 elements' sum (Q8_K: 16 bytes a block, each sum as two bytes: aux_q8_k) that Q4_K and Q5_K
dot with their mins, `ysf` the f16-rounded d * sum that Q4_1 and Q5_1 add times their mins
(Q8_1's s); `aux_*` fill them.

`k_mul_mat_packed` quantizes the columns first (in parallel when there are many), then threads
take runs of row groups, so each streams its own contiguous part of the weight once, dotting
each group with the columns 4 at a time while it is in L1/L2 (cache blocks and runs of blocks:
see the kernel). A single column (a decode step) loops over its groups in the kernel itself,
without the helpers, and where a group's tiles outgrow L1 asks for each next tile's activation
bytes ahead. Each thread's runs are `packed_runs` (runs_template, a function compiled once),
which a team of threads (backends/cpu/team.py) runs too, as the shares of `k_packed_team`.
The helpers `_half_row`, `_f32_row`, `_i16_row`, `_sum_i8`, `_f16_round` are the
shared codec helpers the CPU target binds (backends/jit.py); `tile` (a type's tile function for
C columns), `dots1`, `dots2`, `dots4` (`column_dots` bound to them), `aux`, `quantize_column`,
`group_dot` (`row_group_dot` bound to the dots), R, C, PF, STEAL, TILE and the cache sizes are
bound per type.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
from numba import carray, prange

from ggraph.ir.types import GGMLType
from .qlanes import (R, bit5, cf16, cf32, dpb, fadd, ffma, ffms, fload, fmas, fstore,
                     fzero, hi2, hi4, hi4x, ladd, laddsh, ld6, ldh, ldq, lmul, lmulb, lnib, lo4,
                     lpin, lsubm, lut16, lzero)
from .qmem import (f32_ptr, fetch_add, i32_ptr, in_order, load_f32, prefetch, prefetch_l1,
                   thread_count, u8_ptr)
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(ACT_BYTES, C, HB, KC, OFF, PF, STEAL, SUB, TAIL, TILE, W_BYTES, _f16_round, _half_row,
 _i16_row, _sum_i8, aux, dec_b, dots1, dots2, dots4, enc_r, group_dot, packed_runs,
 packed_views, run_split, tile, tile1) = bound(
    "ACT_BYTES", "C", "HB", "KC", "OFF", "PF", "STEAL", "SUB", "TAIL", "TILE", "W_BYTES",
    "_f16_round", "_half_row", "_i16_row", "_sum_i8", "aux", "dec_b", "dots1", "dots2", "dots4",
    "enc_r", "group_dot", "packed_runs", "packed_views", "run_split", "tile", "tile1")

# the most runs of row groups a product is cut into for its threads: fine enough to share any
# thread count evenly and to leave a thread held back by the host little to finish, coarse
# enough that each run's counter step is spread over many groups
RUNS = 256
# and the weight bytes a run takes at least, where each thread still gets 4 runs: a run costs
# ~50 ns to start (its counter's locked add, which waits for the loads in flight, and finding
# its weight), one per 1-2 groups of a long row before; serial Q4_K 4736 x 3584 in L3 on Zen 4
# 152.5 -> 149.7 us, against 143.7 for one plain loop over the groups
RUN_BYTES = 1 << 18
# the least weight bytes of a run cut finer at the end of a share (TAIL)
FINE_BYTES = 1 << 15

# IQ4_NL's 16 values + 128: unsigned bytes for vpdpbusd (128 * sum(quants) is taken off)
IQ4_U8 = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
          + 128).astype(np.uint8)


def ahead(w, at):
    """Ask for the weight line PF bytes past byte `at`; where PF is 0 nothing is asked and
    the host's hardware prefetcher streams the weights alone (qmem.PF_DISTANCE)."""
    if PF > 0:
        prefetch(w, at + PF)


# ---- 32-element blocks (activations: Q8_0, 34 bytes a block: f16 d, 32 int8) --------------

def nib_sum(w, o, q, p, five):
    """sum of a 32-element block's nibbles times the activation quants at q[p:]: 4 steps
    from byte o of 4R quant bytes (and, where `five`, their two fifth-bit masks after)."""
    s0, s1 = lzero(R, C), lzero(R, C)
    for k in range(4):
        at = o + (4 + five) * R * k
        ahead(w, at)
        v = ldq(w, at, R)
        lo, hi = lo4(v), hi4(v)
        if five:
            lo, hi = bit5(lo, w, at + 4 * R), bit5(hi, w, at + 4 * R + R // 2)
        s0, s1 = dpb(s0, lo, q, p + 4 * k), dpb(s1, hi, q, p + 16 + 4 * k)
    return ladd(s0, s1)


def tile_q4_0(acc, w, t, q, ysb, ysi, ysf, b):
    s = lsubm(nib_sum(w, t + 2 * R, q, 34 * b + 2, 0), ysi, b)
    return ffma(acc, s, ldh(w, t, R), cf16(q, 34 * b, C))


def tile_q4_1(acc, w, t, q, ysb, ysi, ysf, b):
    s = nib_sum(w, t + 4 * R, q, 34 * b + 2, 0)
    acc = ffma(acc, s, ldh(w, t, R), cf16(q, 34 * b, C))
    return fmas(acc, ldh(w, t + 2 * R, R), cf32(ysf, b, C))


def tile_q5_0(acc, w, t, q, ysb, ysi, ysf, b):
    s = nib_sum(w, t + 2 * R, q, 34 * b + 2, 1)
    s = lsubm(s, ysi, b)
    return ffma(acc, s, ldh(w, t, R), cf16(q, 34 * b, C))


def tile_q5_1(acc, w, t, q, ysb, ysi, ysf, b):
    s = nib_sum(w, t + 4 * R, q, 34 * b + 2, 1)
    acc = ffma(acc, s, ldh(w, t, R), cf16(q, 34 * b, C))
    return fmas(acc, ldh(w, t + 2 * R, R), cf32(ysf, b, C))


def tile_q8_0(acc, w, t, q, ysb, ysi, ysf, b):
    p = 34 * b + 2
    s0, s1 = lzero(R, C), lzero(R, C)
    for k in range(0, 8, 2):
        ahead(w, t + 2 * R + 4 * R * k)
        ahead(w, t + 6 * R + 4 * R * k)
        s0 = dpb(s0, ldq(w, t + 2 * R + 4 * R * k, R), q, p + 4 * k)
        s1 = dpb(s1, ldq(w, t + 6 * R + 4 * R * k, R), q, p + 4 * k + 4)
    s = lsubm(ladd(s0, s1), ysi, b)
    return ffma(acc, s, ldh(w, t, R), cf16(q, 34 * b, C))


# ---- 256-element super-blocks (activations: Q8_K, 292 bytes: f32 d, 256 int8, 16 int16) ---
# Q4_K's and Q5_K's header (their first 4 lines where R is 16): the 12 scale bytes as planes
# of R (plane i at t + i R), R f16 d, R f16 dmin; then 32 steps of 4R quant bytes, and for
# Q5_K (HB 1) a fifth-bit mask of R bytes after each (qpack.py)

def k_pair(w, o, q, p, jp):
    """Q4_K/Q5_K: the dots of sub-blocks 2 jp and 2 jp + 1, 8 steps from byte o + 8 jp
    steps. The barrier keeps the pair's loads after the previous pair's: without it LLVM
    hoists later pairs' loads among the first pair's, and the cold stream asks for lines out
    of order. Paired cold rounds of 400 MB (Zen 4), Q4_K against its tile with decoded scales
    and no barrier: 1536 x 8960 1.06x at 1 thread, 1.03-1.06x at 2; the planes without the
    barrier 0.98-0.99x at 1 thread, 0.90-0.97x at 2; a barrier a step 1.01-1.03x; the decoded
    tile with the barrier 1.00x."""
    s0, s1 = lzero(R, C), lzero(R, C)
    in_order()
    for k in range(8):
        at = o + (4 + HB) * R * (8 * jp + k)
        ahead(w, at)
        v = ldq(w, at, R)
        y = p + 64 * jp + 4 * k
        if HB:
            s0 = dpb(s0, bit5(lo4(v), w, at + 4 * R), q, y)
            s1 = dpb(s1, bit5(hi4(v), w, at + 4 * R + R // 2), q, y + 32)
        else:
            # the high nibbles dotted where they lie (qlanes.bytes_exact): hot, one column
            # 3.5-6% faster on Zen 4, 8 columns 7-9%; not kept for the 32-element types,
            # where one column ran 1.5-3% slower (a shift per block)
            s0, s1 = dpb(s0, lo4(v), q, y), dpb(s1, hi4x(v), q, y + 32)
    # the sums pinned (qlanes.lpin): their dots stay before the next pair's loads
    return lpin(s0), lpin(s1 if HB else lnib(s1))


def k_tile(acc, w, t, q, ysb, b):
    """Q4_K/Q5_K: d * sum_j scale_j dot_j - dmin * sum_j min_j sum_j(quants). The tile's four
    header lines are read whole before its quants, as the stream brings them, and kept in
    registers: the 6-bit scales and mins four sub-blocks a load (qlanes.ld6: those of
    sub-blocks 0-3 in planes 0-3 (scales) and 4-7 (mins); of 4-7, 4 bits in planes 8-11 and 2
    in the top of 0-3 and 4-7), each pair's scales taken from them (lmulb), the mins dotted as
    bytes with the activation sums split in two bytes (aux_q8_k: sum_j min_j s_j = sum_j
    min_j lo_j + 128 sum_j min_j hi_j). Q4_K's same integers as a plane a 16-byte load, read
    as each pair's sums were scaled, the mins widened to i16 pairs (lmul6, dpw6 before),
    streamed at 82-95% of a bare read cold at 1 thread (benchmarks/q4k_tile_variants.py, the
    tile with its header unread 94-105%). Paired cold rounds in both orders against those
    (`ab_revision.py mv`, Zen 4): 8960 x 1536 1.12-1.13x at 1 thread and 1.02x at 2, 1536 x
    8960 1.01-1.05x; the same lines read as each pair is scaled ran 1.005x and 1.000x. Q5_K
    against its tile with decoded scales (180 bytes a row, the mins by pairs for vpdpwssd):
    1.09-1.16x at 1 thread, 1.00-1.18x at 2; 512 columns 0.92-0.97x (decoded per 4 columns)."""
    for o in range(0, 16 * R, 64):   # the header of the tile PF ahead (the steps cover bodies)
        ahead(w, t + o)
    o, p = t + 16 * R, 292 * b + 4
    # the header's four lines read whole, first, as the stream brings them; kept in registers
    sc03, sc47 = ld6(w, t, t, 0, R), ld6(w, t + 8 * R, t, 1, R)
    mins03, mins47 = ld6(w, t + 4 * R, t, 0, R), ld6(w, t + 8 * R, t + 4 * R, 2, R)
    d, dmin = ldh(w, t + 12 * R, R), ldh(w, t + 14 * R, R)
    s0, s1 = k_pair(w, o, q, p, 0)
    isum = ladd(lmulb(s0, sc03, 0), lmulb(s1, sc03, 1))
    s0, s1 = k_pair(w, o, q, p, 1)
    isum = ladd(isum, ladd(lmulb(s0, sc03, 2), lmulb(s1, sc03, 3)))
    s0, s1 = k_pair(w, o, q, p, 2)
    isum = ladd(isum, ladd(lmulb(s0, sc47, 0), lmulb(s1, sc47, 1)))
    s0, s1 = k_pair(w, o, q, p, 3)
    isum = ladd(isum, ladd(lmulb(s0, sc47, 2), lmulb(s1, sc47, 3)))
    m_lo = dpb(dpb(lzero(R, C), mins03, ysb, 16 * b), mins47, ysb, 16 * b + 8)
    m_hi = dpb(dpb(lzero(R, C), mins03, ysb, 16 * b + 4), mins47, ysb, 16 * b + 12)
    dq = cf32(q, 292 * b, C)
    acc = ffma(acc, isum, d, dq)
    return ffms(acc, laddsh(m_lo, m_hi, 7), dmin, dq)


def tile_k(acc, w, t, q, ysb, ysi, ysf, b):
    """Q4_K (HB 0) and Q5_K (HB 1): k_tile."""
    return k_tile(acc, w, t, q, ysb, b)


def tile_q6_k(acc, w, t, q, ysb, ysi, ysf, b):
    """Halves of 128 values: low nibbles of ql bytes l (values l, l + 64) and l + 32 (values
    l + 32, l + 96), their 2 high bits in qh byte l; sub-blocks of 16, signed scales (header:
    16 bytes a row, sub-block j at t + j R, then R f16 d); 16 steps of 12R bytes from t + 18R,
    each the two quant groups and the 2-bit group of 4 values l of each row."""
    for o in range(0, 18 * R, 64):   # the header of the tile PF ahead (the steps cover bodies)
        ahead(w, t + o)
    p = 292 * b + 4
    isum = lzero(R, C)
    for n in range(2):
        for h in range(2):
            a0, a1, a2, a3 = lzero(R, C), lzero(R, C), lzero(R, C), lzero(R, C)
            for kk in range(4):
                k = 4 * h + kk
                at = t + 18 * R + 12 * R * (8 * n + k)
                for c in range(0, 12 * R, 64):
                    ahead(w, at + c)
                va, vb, hq = ldq(w, at, R), ldq(w, at + 4 * R, R), ldq(w, at + 8 * R, R)
                yo = p + 128 * n + 4 * k
                a0 = dpb(a0, hi2(lo4(va), hq, 0), q, yo)
                a1 = dpb(a1, hi2(lo4(vb), hq, 1), q, yo + 32)
                a2 = dpb(a2, hi2(hi4(va), hq, 2), q, yo + 64)
                a3 = dpb(a3, hi2(hi4(vb), hq, 3), q, yo + 96)
            j = 8 * n + h
            sc, bs = t + j * R, 16 * b + j
            isum = ladd(isum, lmul(lsubm(a0, ysi, bs), w, sc, True))
            isum = ladd(isum, lmul(lsubm(a1, ysi, bs + 2), w, sc + 2 * R, True))
            isum = ladd(isum, lmul(lsubm(a2, ysi, bs + 4), w, sc + 4 * R, True))
            isum = ladd(isum, lmul(lsubm(a3, ysi, bs + 6), w, sc + 6 * R, True))
    return ffma(acc, isum, ldh(w, t + 16 * R, R), cf32(q, 292 * b, C))


def tile_iq4_xs(acc, w, t, q, ysb, ysi, ysf, b):
    """Header: 8 signed scale bytes a row (ls - 32), R f16 d; then 32 steps of quants."""
    for o in range(0, 10 * R, 64):   # the header of the tile PF ahead (the steps cover bodies)
        ahead(w, t + o)
    p = 292 * b + 4
    isum = lzero(R, C)
    for j in range(8):
        s0, s1 = lzero(R, C), lzero(R, C)
        for k in range(4):
            ahead(w, t + 10 * R + 4 * R * (4 * j + k))
            v = ldq(w, t + 10 * R + 4 * R * (4 * j + k), R)
            s0 = dpb(s0, lut16(lo4(v), IQ4_U8, 0), q, p + 32 * j + 4 * k)
            s1 = dpb(s1, lut16(hi4(v), IQ4_U8, 0), q, p + 32 * j + 16 + 4 * k)
        s = lsubm(ladd(s0, s1), ysi, 8 * b + j)
        isum = ladd(isum, lmul(s, w, t + j * R, True))
    return ffma(acc, isum, ldh(w, t + 8 * R, R), cf32(q, 292 * b, C))


# ---- activation sums ----------------------------------------------------------------------

def aux_q8_0(q, ysb, ysi, ysf, kk):
    """Per Q8_0 block b: OFF times its quants' sum (ysi[b], the weights' offset taken off
    as one vector subtraction) and Q8_1's f16-rounded d * sum (ysf[b])."""
    for b in range(kk // 32):
        s = _sum_i8(q, 34 * b + 2, 32)
        ysi[b] = OFF * s
        ysf[b] = _f16_round(np.float32(_half_row(q, 34 * b) * np.float32(s)))


def aux_q8_k(q, ysb, ysi, ysf, kk):
    """Per SUB elements of Q8_K blocks (16 or 32): OFF times their sum (ysi). Per block b,
    16 bytes of ysb from 16 b: the sums s of its 8 sub-blocks of 32, each split into bytes
    lo = s & 127 and hi = s >> 7 (s = lo + 128 hi, |s| <= 4096): lo of sub-blocks 0-3, hi
    of 0-3, lo of 4-7, hi of 4-7 (Q4_K and Q5_K dot them with their mins as bytes: k_tile)."""
    for j in range(kk // 16):
        o = 292 * (j // 16) + 260 + 2 * (j % 16)
        s = _i16_row(q, o)
        if j % 2 == 1:
            s2 = _i16_row(q, o - 2) + s
            sb = (j // 2) % 8
            at = 16 * (j // 16) + 8 * (sb // 4)
            ysb[at + sb % 4] = s2 & 127
            ysb[at + 4 + sb % 4] = (s2 >> 7) & 255
            if SUB == 32:
                ysi[j // 2] = OFF * s2
        if SUB == 16:
            ysi[j] = OFF * s


# ---- the product ---------------------------------------------------------------------------

def k_mul_mat_packed(b, meta, kk, nb):
    """ds[p][i3, i2, n, :ms[0, p]] = packed weight ws[p] (ms[0, p] rows, nb blocks of kk / nb
    elements) times column b[i3, i2, n], plus the float32 bias row at address ms[1, p] where it
    is not 0, for each weight p of the 3 (repeats of the last where fewer): one product, or
    several that read the same columns (a layer's FFN gate and up: backends/cpu/fusion.py),
    their row groups numbered one weight after the other from starts[p] (starts[-1]: all).
    The bias is added to the rounded product, as the add node it stands for adds it (the same
    float32 sum).
    Every array but b comes by address in `meta` (kernels.packed_call keeps the arrays
    alive): each array argument costs a call its unboxing, and a decode step's
    ~130 products find those objects cold after the weights streamed by (in a Qwen2.5 1.5B
    decode step at 2 threads, a call of 13 arrays took ~2.4 us before its kernel started, of
    2 arrays ~1.0).
    The columns are quantized first (in parallel when there are many), then threads take
    runs of row groups, each streaming its own share of the weights (then, where STEAL, the
    runs left in the others' shares) and dotting every group
    with the columns 4 at a time (`tile4`: each weight load serves 4 columns), then 2
    (`tile2`: a batched decode step of 2 or 3 sequences), then one (`tile1`), while the
    group is in L1/L2. A column's sums are the same whichever tile takes it, and a weight's
    the same alone or beside others."""
    # meta's words (kernels.packed_call writes them; numbers in the source, which keys the
    # compiled kernel): 0-3 the row groups' starts, 4-6 each weight's rows, 7-9 its bias row's
    # address (0: none), 10-12 its address, 13-15 its bytes, 16-18 its result's address, 19-22
    # the quantization buffers' addresses, 23-25 the columns' dimensions (n3, n2, n1), 26-29
    # each buffer's length a column
    starts, ms, ws, ds, q, ysb, ysi, ysf = packed_views(meta)
    n2, nn = meta[24], meta[25]
    cols = meta[23] * n2 * nn
    if cols >= 8:
        for s in prange(cols):
            quantize_column(b, q, ysb, ysi, ysf, s // (n2 * nn), (s // nn) % n2, s % nn,  # noqa
                            kk)
    else:
        for s in range(cols):
            quantize_column(b, q, ysb, ysi, ysf, s // (n2 * nn), (s // nn) % n2, s % nn,  # noqa
                            kk)
    q2, yb, yi = q.reshape(cols, q.shape[3]), ysb.reshape(cols, ysb.shape[3]), \
        ysi.reshape(cols, ysi.shape[3])
    yf = ysf.reshape(cols, ysf.shape[3])
    # 3 columns left over (a batched decode step of 3 or 7 sequences) take one 4-column tile
    # with the last column repeated: one pass over the weights, not a tile2 and a tile1
    pad = 1 if cols % 4 == 3 else 0
    if pad:
        q2 = np.concatenate((q2, q2[cols - 1:cols]))
        yb = np.concatenate((yb, yb[cols - 1:cols]))
        yi = np.concatenate((yi, yi[cols - 1:cols]))
        yf = np.concatenate((yf, yf[cols - 1:cols]))
    # Prompt-sized batches are blocked for the caches: the columns in chunks whose quantized
    # activations for kc blocks stay in L2, and each group's rows kc blocks at a time, which
    # stay in L1 while every column block of the chunk passes over them. A run of at most KC
    # blocks is summed apart and then added to the group's sums in `part`: two short chains of
    # float additions round less than one of a whole row (a row of 280 Q4_0 blocks), which kept
    # ggraph's logits further from llama.cpp's. A decode step (< 4 columns) streams each
    # group's rows in that order too, one run after the other.
    kc = KC if cols < 4 else max(1, min(KC, W_BYTES // TILE))
    chunk = cols if cols < 4 else max(4, ACT_BYTES // ((q.shape[3] // nb) * kc) // 4 * 4)  # noqa
    # each thread's runs: packed_runs, a function of its own
    threads = thread_count()
    per, n_runs = run_split(starts, nb, threads)
    workers = max(1, min(n_runs, threads))
    pfa = q2.shape[1] // nb if nb * TILE > W_BYTES else 0
    for c0 in range(0, cols, chunk):
        c1 = min(cols, c0 + chunk)
        ce = c1 + pad if c1 == cols else c1   # the columns computed, the repeated one too
        # zeroed by a plain loop: under parallel=True np.zeros is a parallel loop of its own,
        # one more fork and join (~1 us) a call
        taken = np.empty(8 * workers, np.int64)
        for i in range(8 * workers):
            taken[i] = 0
        # (int64 arguments: prange's index is unsigned, and packed_runs compiles once for
        # the kernel and k_packed_team alike)
        for wk in prange(workers):
            packed_runs(np.int64(wk), workers, taken, ws, ds, ms, starts, q2, yb, yi, yf, nb,
                        np.int64(kc), np.int64(c0), c1, ce, pfa, per, n_runs, n2, nn)


def views_template(meta):
    """(starts, ms, ws, ds, q, ysb, ysi, ysf): the row groups' starts, each weight's rows and
    bias row address (ms[0], ms[1]), the weights, their results and the quantization buffers,
    from their addresses in k_mul_mat_packed's `meta`."""
    starts = meta[0:4]
    ms = np.empty((2, 3), np.int64)
    for p in range(3):
        ms[0, p], ms[1, p] = meta[4 + p], meta[7 + p]
    ws = (carray(u8_ptr(meta[10]), meta[13]), carray(u8_ptr(meta[11]), meta[14]),
          carray(u8_ptr(meta[12]), meta[15]))
    n3, n2, nn = meta[23], meta[24], meta[25]
    ds = (carray(f32_ptr(meta[16]), (n3, n2, nn, ms[0, 0])),
          carray(f32_ptr(meta[17]), (n3, n2, nn, ms[0, 1])),
          carray(f32_ptr(meta[18]), (n3, n2, nn, ms[0, 2])))
    q = carray(u8_ptr(meta[19]), (n3, n2, nn, meta[26]))
    ysb = carray(u8_ptr(meta[20]), (n3, n2, nn, meta[27]))
    ysi = carray(i32_ptr(meta[21]), (n3, n2, nn, meta[28]))
    ysf = carray(f32_ptr(meta[22]), (n3, n2, nn, meta[29]))
    return starts, ms, ws, ds, q, ysb, ysi, ysf


def split_template(starts, nb, threads):
    """(groups a run, runs): the row groups cut into at most RUNS runs (of RUN_BYTES or more
    where there are enough for 4 a thread)."""
    per = max(1, -(-starts[-1] // RUNS),
              min(-(-RUN_BYTES // (nb * TILE)), starts[-1] // (4 * threads)))  # noqa
    return per, -(-starts[-1] // per)


def runs_template(wk, workers, taken, ws, ds, ms, starts, q2, yb, yi, yf, nb, kc, c0, c1, ce,
                  pfa, per, n_runs, n2, nn):
    """Worker wk's share of a product's runs (k_mul_mat_packed's columns c0..ce), then,
    where STEAL, the runs left in the others' shares. Each worker owns an equal share of the
    runs and takes them front to back (one contiguous stream); one that has finished its share
    goes on to take the next runs of the others', so a thread the host holds back keeps the
    product waiting for its current run, not for the rest of its share (counters `taken` 64
    bytes apart: no line shared between them)."""
    full = c0 + (ce - c0) // 4 * 4
    i3, i2, i1 = c0 // (n2 * nn), (c0 // nn) % n2, c0 % nn
    # one column (a decode step) takes the loop below, written out here: through the
    # inlined helpers, every group assigned their array arguments, views and slices, an
    # atomic reference count taken and dropped for each (~11 NRT calls, ~40 ns a group:
    # a Q4_K 8960 x 1536 product with its weights in cache took 147 us, now 123)
    one = ce - c0 == 1
    # Its activation blocks are read once a group, and between two reads of a block a
    # long row's weights (a whole group of tiles) stream through L1 and push it out. Where
    # a group's tiles outgrow the L1 budget (W_BYTES), each tile asks for the next one's
    # activation bytes (pfa a block) ahead: cold, Q4_K 1536 x 8960 (35 tiles a group)
    # read 24-25 GB/s without, 26-27 with (Zen 4, one thread). A shorter group finds the
    # block still in L1, and there the hint only costs: 8960 x 1536 (6 tiles) in cache
    # 127 us without, 139 with; cold 28.2-28.6 GB/s without, 26.2-26.7 with.
    # The partial sums are allocated once a call, not once a group (numba does not hoist the
    # allocation: ~50k of them in a 1.5B decode step at 2 threads, ~1 ms of its ~54)
    part = np.empty((ce - c0, R), np.float32)
    qc, bc, ic, fc = q2[c0:c0 + 1], yb[c0:c0 + 1], yi[c0:c0 + 1], yf[c0:c0 + 1]
    qrow = q2[c0]
    for v in range(workers if STEAL else 1):
        owner = (wk + v) % workers
        lo, hi = owner * n_runs // workers, (owner + 1) * n_runs // workers
        glo, ghi = lo * per, min(starts[-1], hi * per)
        # the share's last TAIL runs' groups go in runs a quarter the size, where
        # those still hold FINE_BYTES: the thread that finishes first waits for the
        # other's last run, and while it waits one stream reads (at 2 threads on
        # Zen 4 in a fast spell, half the memory's speed); shorter runs would cost
        # more in starts than they save
        fine = max(1, per // 4)
        tail = min(ghi - glo, TAIL * per) if fine * nb * TILE >= FINE_BYTES else 0
        big = ghi - glo - tail
        n_big = -(-big // per)
        claimed = 0
        while True:
            # alone, a thread takes its runs in turn: a locked add waits for every
            # load in flight (the weights streaming) before the next can issue
            if workers == 1:
                u = claimed
                claimed += 1
            else:
                u = fetch_add(taken, 8 * owner, 1)
            if u < n_big:
                g, g_end = glo + u * per, min(glo + big, glo + (u + 1) * per)
            else:
                g = glo + big + (u - n_big) * fine
                g_end = min(ghi, g + fine)
            if g >= ghi:
                break
            while one and g < g_end:   # the run's groups, weight by weight
                p = 0
                while g >= starts[p + 1]:
                    p += 1
                w, d, g1 = ws[p], ds[p], min(g_end, starts[p + 1])
                bias = ms[1, p]
                for gg in range(g - starts[p], g1 - starts[p]):
                    # runs of kc blocks summed apart, joined in turn: row_group_dot's
                    # sums, kept in registers (no store and load a run)
                    acc, tot, at, nxt = fzero(R, 1), fzero(R, 1), gg * nb * TILE, kc
                    for blk in range(nb):
                        if blk == nxt:
                            tot = acc if blk == kc else fadd(tot, acc)
                            acc, nxt = fzero(R, 1), nxt + kc
                        for o in range(pfa * (blk + 1), pfa * (blk + 2), 64):
                            prefetch_l1(qrow, o)
                        acc = tile1(acc, w, at, qc, bc, ic, fc, blk)
                        at += TILE  # noqa: TILE is bound
                    fstore(part, 0, 0, fadd(tot, acc) if nb > kc else acc)
                    for r in range(min(R, ms[0, p] - gg * R)):  # no views: no NRT calls
                        if bias:
                            d[i3, i2, i1, gg * R + r] = part[0, r] + load_f32(bias,
                                                                              gg * R + r)
                        else:
                            d[i3, i2, i1, gg * R + r] = part[0, r]
                g = g1
            for g in range(g, g_end):
                group_dot(ws, starts, q2, yb, yi, yf, ds, nb, ms, part, g, c0, c1, ce,
                          full, kc, n2, nn)



def k_packed_team(b, meta, kk, nb, taken, wk, workers):
    """A team's product (backends/cpu/team.py) of up to 3 columns, one kernel for its parts
    (each kernel compiled is seconds of a cold start): wk < 0 the first part, the columns
    quantized and the share counters `taken` zeroed; then share wk of `workers`,
    k_mul_mat_packed's runs as its thread wk takes them, so the rows are the same."""
    starts, ms, ws, ds, q, ysb, ysi, ysf = packed_views(meta)
    n2, nn = meta[24], meta[25]
    cols = meta[23] * n2 * nn
    if wk < 0:
        for s in range(cols):
            quantize_column(b, q, ysb, ysi, ysf, s // (n2 * nn), (s // nn) % n2, s % nn, kk)
        for i in range(taken.size):
            taken[i] = 0
        return
    per, n_runs = run_split(starts, nb, workers)
    used = max(1, min(n_runs, workers))
    if wk < used:
        packed_runs(wk, used, taken, ws, ds, ms, starts, q.reshape(cols, q.shape[3]),
                    ysb.reshape(cols, ysb.shape[3]), ysi.reshape(cols, ysi.shape[3]),
                    ysf.reshape(cols, ysf.shape[3]), nb, np.int64(KC), np.int64(0), cols, cols,
                    q.shape[3] // nb if nb * TILE > W_BYTES else 0, per, n_runs, n2, nn)


def row_group_dot(ws, starts, q2, yb, yi, yf, ds, nb, ms, part, g, c0, c1, ce, full, kc, n2, nn):
    """Row group g (of the weights numbered one after the other from starts) times the
    quantized columns c0..ce (4, then 2, then 1 at a time; kc blocks at a time, summed in
    part) into ds, plus the weight's bias row (at address ms[1, p]) where it has one, for the
    columns up to c1 (ce - c1: the repeated padding column)."""
    p = 0
    while g >= starts[p + 1]:
        p += 1
    w = ws[p]
    base, r0 = (g - starts[p]) * nb * TILE, (g - starts[p]) * R
    pair = full + (ce - full) // 2 * 2
    for k0 in range(0, nb, kc):
        k1 = min(nb, k0 + kc)
        dots4(w, base, q2, yb, yi, yf, part, c0, full, c0, k0, k1)
        dots2(w, base, q2, yb, yi, yf, part, full, pair, c0, k0, k1)
        dots1(w, base, q2, yb, yi, yf, part, pair, ce, c0, k0, k1)
    rows = min(R, ms[0, p] - r0)
    dp, bias = ds[p], ms[1, p]
    for j in range(c1 - c0):
        c = c0 + j
        if bias:
            for r in range(rows):
                dp[c // (n2 * nn), (c // nn) % n2, c % nn, r0 + r] = part[j, r] + load_f32(
                    bias, r0 + r)
        else:
            dp[c // (n2 * nn), (c // nn) % n2, c % nn, r0:r0 + rows] = part[j, :rows]


def column_dots(w, base, q2, yb, yi, yf, part, lo, hi, c0, k0, k1):
    """Columns lo..hi of the quantized activations, C at a time (`tile`: tile1, tile2 or
    tile4), times blocks k0..k1 of the row group at byte `base` of w, added to their sums in
    part (row c - c0) after the first run of blocks (k0 == 0) stores them."""
    for c in range(lo, hi, C):
        acc = fzero(R, C)
        qc, bc, ic, fc = q2[c:c + C], yb[c:c + C], yi[c:c + C], yf[c:c + C]
        for blk in range(k0, k1):
            acc = tile(acc, w, base + blk * TILE, qc, bc, ic, fc, blk)  # noqa
        fstore(part, c - c0, 0, acc if k0 == 0 else fadd(fload(part, c - c0, R, C), acc))

def quantize_column(b, q, ysb, ysi, ysf, i3, i2, n, kk):
    """Column b[i3, i2, n] encoded to the weights' vec_dot_type (q) and its sums (aux)."""
    x = np.empty(kk, np.float32)
    dec_b(b, i3, i2, n, x, kk)
    enc_r(x, q, i3, i2, n, kk)
    aux(q[i3, i2, n], ysb[i3, i2, n], ysi[i3, i2, n], ysf[i3, i2, n], kk)


@dataclass(frozen=True)
class Tile:
    """A packed type's tile function, the activation sums it reads (aux, bound with the
    weights' offset OFF and, for Q8_K activations, the SUB elements of each sum it takes
    off), the helper templates it calls (bound in order, each seeing the ones before), and
    constants its tile and helpers read (`names`: Q4_K and Q5_K share k_tile, HB apart)."""
    fn: Callable
    aux: Callable
    helpers: tuple[Callable, ...] = ()
    off: int = 0
    sub: int = 32
    names: Mapping[str, int] = field(default_factory=dict)


T = GGMLType
TILES: dict[GGMLType, Tile] = {
    T.Q4_0: Tile(tile_q4_0, aux_q8_0, (nib_sum,), off=8),
    T.Q4_1: Tile(tile_q4_1, aux_q8_0, (nib_sum,)),
    T.Q5_0: Tile(tile_q5_0, aux_q8_0, (nib_sum,), off=16),
    T.Q5_1: Tile(tile_q5_1, aux_q8_0, (nib_sum,)),
    T.Q8_0: Tile(tile_q8_0, aux_q8_0, off=128),
    T.Q4_K: Tile(tile_k, aux_q8_k, (k_pair, k_tile), names={"HB": 0}),
    T.Q5_K: Tile(tile_k, aux_q8_k, (k_pair, k_tile), names={"HB": 1}),
    T.Q6_K: Tile(tile_q6_k, aux_q8_k, off=32, sub=16),
    T.IQ4_XS: Tile(tile_iq4_xs, aux_q8_k, off=128),
}
