"""flash_attn_ext for a few queries (decode) over an F16 K/V cache: the numba template.

Decode reads the whole cache once per token, so its cost is memory: each K and V row must be
read once, not once per query head. Work goes in units of (sequence, K/V head, run of CELLS
cells): a unit converts each of its K rows once and dots it with the queries of every query head
that maps to its K/V head (GQA), keeps its cells' scores, then adds each V row, converted once,
times every head's weights. Each unit leaves its heads' partial softmax (running max, sum,
weighted V sum); a second pass combines the runs of cells (the split-KV flash-attention
recurrence), or, where one run holds every cell, the unit writes its rows itself. Units of one
K/V head and sequence are consecutive, so a thread streams its own stretch of the cache; many
units keep every thread busy even where K/V heads are few. A stretch of units is `attn_unit`
(unit_template) and of output rows `attn_combine` (combine_template), functions compiled once:
the kernel's threads call them, and so do a team's (backends/cpu/team.py) through
`k_attn_team`.

kf / vf: the flat uint16 memory the K / V views span, row (s, h, j) at s*k3 + h*k2 + j*k1, each
row a contiguous slice whose F16 conversion vectorizes. The names `half_to_f32`, `expf`,
`dec_m` (the mask's row decoder), `alibi_slope`, CELLS, VB (V rows a block), SL (the lanes of
a softmax sum, a power of two), PFC (cells prefetched ahead: a long cache streams from
memory) and the head sizes DK and DV are bound per binding (backends/cpu/kernels.py).

Rows of several sequences (a batched decode step over a shared cache) each work on their own
cells: a cell hidden from a row is neither dotted with its query nor added to its sum, and a
block of V rows none of which the row sees is passed over.

A row's result does not depend on the other rows of its batch when they share its first cells
(one sequence's tokens): hidden cells add exact zeros, the softmax sum runs in fixed lanes and
every block of V rows is summed by the same code, so a token evaluated in a batch (a
speculative draft checked at once) gets the logits it gets alone. Rows of other sequences move
the unit's first cell and its blocks of V rows, so there a row's sums group its terms
differently: the same value up to float rounding.

Every sum runs in an order the source fixes: the query-key dots in qvec.py's 16 lanes, the
softmax sums in SL lanes, each V block's products in cell order; the kernel compiles without
reassociation (compile.KERNEL_ORDERED). So the serial and parallel variants, compiled in this
process or loaded from numba's cache, give the same bits (tests/backends/cpu/test_fixed_order.py):
with reassociation allowed, a freshly compiled parallel kernel and a cached one summed in
different orders, and a greedy text could change between a first run and the next.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from .qmem import prefetch, thread_count
from .qvec import f16_fma, f16_fold, f16_zero
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(CELLS, DK, DV, PFC, SL, VB, alibi_slope, attn_combine, attn_unit, dec_m, expf,
 half_to_f32) = bound("CELLS", "DK", "DV", "PFC", "SL", "VB", "alibi_slope", "attn_combine",
                      "attn_unit", "dec_m", "expf", "half_to_f32")


def k_flash_attn_decode(q, kf, k3, k2, k1, vf, v3, v2, v1, sk, hkv, nkv, m, d, scale,
                        max_bias, softcap, h0, n_head, has_mask):
    """q (S, H, T, Dk) float32; d (S, T, H, Dv); sk, hkv, nkv: K's sequences, heads, cells.
    The head sizes Dk and Dv are bound (DK, DV): loops of a known length unroll, which took a
    decode step's kernel from 40 to 34 us (SmolLM2's 3 K/V heads of 64 over 256 cells). The
    prange body uses the bound names themselves: numba passes a body the locals it reads as
    arguments, and a length that arrives as an argument is unknown to LLVM. Each unit is
    `attn_unit` (unit_template), each output row of several runs `attn_combine`."""
    ns, nh, nt = q.shape[0], q.shape[1], q.shape[2]
    nr = (nh // hkv) * nt        # the (head, query) rows of one K/V head
    runs = (nkv + CELLS - 1) // CELLS
    units = ns * hkv * runs
    # the mask's rows as float32, once (a row per sequence, head and query of the mask)
    m3, m2 = (m.shape[0], m.shape[1]) if has_mask else (1, 1)
    # np.empty: under parallel=True np.zeros is a parallel loop of its own (one more fork and
    # join a call); a mask's rows are written whole below, and without one a zero per row
    mf = np.empty((m3, m2, nt, nkv if has_mask else 1), np.float32)
    if not has_mask:
        for t in range(nt):
            mf[0, 0, t, 0] = 0.0
    if has_mask and m3 * m2 * nt >= 4:
        for w in prange(m3 * m2 * nt):
            a, b, t = w // (m2 * nt), (w // nt) % m2, w % nt
            dec_m(m, a, b, t, mf[a, b, t], nkv)
    elif has_mask:   # a decode step's one or two rows: not worth waking the threads
        for w in range(m3 * m2 * nt):
            a, b, t = w // (m2 * nt), (w // nt) % m2, w % nt
            dec_m(m, a, b, t, mf[a, b, t], nkv)
    mf2 = mf.reshape(m3 * m2 * nt, mf.shape[3])
    pm = np.empty((units, nr), np.float32)      # each unit's running max, sum, weighted sum
    ps = np.empty((units, nr), np.float32)
    pa = np.empty((units, nr, DV), np.float32)
    # each thread's stretch of the units, then of the output rows (prange's static shares)
    threads = min(units, thread_count())
    # (prange's index is unsigned: int64 bounds, as k_attn_team passes them, so each helper
    # compiles once)
    for t in prange(threads):
        i = np.int64(t)
        attn_unit(i * units // threads, (i + 1) * units // threads, q, kf, k3, k2, k1, vf, v3,
                  v2, v1, sk, hkv, nkv, d, scale, max_bias, softcap, h0, n_head, has_mask, mf2,
                  m3, m2, pm, ps, pa)
    if runs == 1:
        return
    rows = ns * hkv * nr
    threads = min(rows, thread_count())
    for t in prange(threads):
        i = np.int64(t)
        attn_combine(i * rows // threads, (i + 1) * rows // threads, q, hkv, nkv, d, pm, ps, pa)


def unit_template(u0, u1, q, kf, k3, k2, k1, vf, v3, v2, v1, sk, hkv, nkv, d, scale, max_bias,
                  softcap, h0, n_head, has_mask, mf2, m3, m2, pm, ps, pa):
    """Units u0..u1 of k_flash_attn_decode (module docstring): each unit's cells' scores with
    the queries of every head of its K/V head, their softmax's running max and sum (pm, ps)
    and weighted V sum (pa), or, where one run holds every cell, its rows of the output d.
    A function of its own (not inlined): the kernel's threads and a team's (k_attn_team)
    call the same machine code, compiled once."""
    ns, nh, nt = q.shape[0], q.shape[1], q.shape[2]
    rk2, rk3 = nh // hkv, ns // sk
    nr = rk2 * nt
    runs = (nkv + CELLS - 1) // CELLS
    for u in range(u0, u1):
        s, g, c = u // (hkv * runs), (u // runs) % hkv, u % runs
        ks = s // rk3
        j0, j1 = c * CELLS, min(nkv, (c + 1) * CELLS)
        # the unit's rows of the mask (flat, in mf2), found once: a division per cell and row
        # cost more than a short decode step's work
        mrows = np.empty(nr, np.int64)
        for r in range(nr):
            mrows[r] = ((s % m3) * m2 + (g * rk2 + r // nt) % m2) * nt + r % nt
        # The cells hidden from every row of the unit at either end are dropped, and one
        # hidden inside is skipped, its K not read nor its V added (llama.cpp's CPU kernel
        # skips a masked cell per row the same way): a decode step's cache view is padded to
        # 256 cells, most of them hidden early in a generation.
        if has_mask:
            lo, hi = j1, j0
            for r in range(nr):
                row = mf2[mrows[r]]
                a = j0
                while a < j1 and row[a] == -np.inf:
                    a += 1
                if a < j1:
                    b = j1
                    while row[b - 1] == -np.inf:
                        b -= 1
                    lo, hi = min(lo, a), max(hi, b)
            j0, j1 = (lo, hi) if lo < hi else (j0, j0)
        nc = j1 - j0
        acc = pa[u]
        for r in range(nr):
            for i in range(DV):
                acc[r, i] = 0.0
        qs = np.empty(nr * DK, np.float32)   # row r's query at r * DK (f16_fma's offsets)
        slope = np.empty(nr, np.float32)
        for r in range(nr):
            h = g * rk2 + r // nt
            slope[r] = alibi_slope(h0 + h, n_head, max_bias)
            for i in range(DK):
                qs[r * DK + i] = q[s, h, r % nt, i]
        sc = np.empty((nr, nc), np.float32)
        mr = np.empty((nr, nc), np.float32)   # each row's mask values over these cells
        live = np.empty(nc, np.bool_)
        for j in range(nc):
            live[j] = not has_mask
        for r in range(nr):
            row = mf2[mrows[r]]
            for j in range(nc):
                mr[r, j] = slope[r] * row[j0 + j] if has_mask else np.float32(0.0)
                live[j] = live[j] or mr[r, j] != -np.inf
        kr = np.empty(DK, np.float32)
        dots = np.empty(nr, np.float32)
        for j in range(nc):
            if not live[j]:
                for r in range(nr):
                    sc[r, j] = -np.inf
                continue
            o = ks * k3 + g * k2 + (j0 + j) * k1
            for i in range(0, DK, 32):   # the row PFC cells ahead (a hint: never faults)
                prefetch(kf, o + PFC * k1 + i)
            prefetch(kf, o + PFC * k1 + DK - 1)
            src = kf[o:o + DK]   # a slice: indices that cannot wrap, so loads that vectorize
            for i in range(DK):
                kr[i] = half_to_f32(src[i])
            # Each row's dot in one fixed order (qvec.py), not a loop LLVM may sum in any
            # (DK, not a local: a prange body's locals reach it as arguments, so only the
            # bound name keeps these loops' lengths known and unrolled). Rows go four (then
            # two) together: a row's 16-lane chain is DK / 16 dependent multiply-adds and a
            # fold, and interleaved chains keep the core busy where one row alone waits on
            # each (the rows of a GQA group share the K row): Qwen2.5 1.5B's 6 rows a K/V head
            # over 1000 cells, 163-170 -> 143-145 us a layer (Zen 4, one thread; bit-equal)
            r = 0
            while r + 4 <= nr:
                l0, l1, l2, l3 = f16_zero(), f16_zero(), f16_zero(), f16_zero()
                for i in range(0, DK - DK % 16, 16):
                    l0 = f16_fma(l0, kr, i, qs, r * DK + i)
                    l1 = f16_fma(l1, kr, i, qs, (r + 1) * DK + i)
                    l2 = f16_fma(l2, kr, i, qs, (r + 2) * DK + i)
                    l3 = f16_fma(l3, kr, i, qs, (r + 3) * DK + i)
                dots[r], dots[r + 1] = f16_fold(l0), f16_fold(l1)
                dots[r + 2], dots[r + 3] = f16_fold(l2), f16_fold(l3)
                r += 4
            if r + 2 <= nr:
                l0, l1 = f16_zero(), f16_zero()
                for i in range(0, DK - DK % 16, 16):
                    l0 = f16_fma(l0, kr, i, qs, r * DK + i)
                    l1 = f16_fma(l1, kr, i, qs, (r + 1) * DK + i)
                dots[r], dots[r + 1] = f16_fold(l0), f16_fold(l1)
                r += 2
            if r < nr:
                l0 = f16_zero()
                for i in range(0, DK - DK % 16, 16):
                    l0 = f16_fma(l0, kr, i, qs, r * DK + i)
                dots[r] = f16_fold(l0)
            for r in range(nr):
                if mr[r, j] == -np.inf:   # hidden from this row (another sequence's cell)
                    sc[r, j] = -np.inf
                    continue
                x = dots[r]
                for i in range(DK - DK % 16, DK):
                    x += kr[i] * qs[r * DK + i]
                x = x * scale
                if softcap != 0.0:
                    x = softcap * math.tanh(x)
                sc[r, j] = x + mr[r, j]
        # Each row's softmax sum in SL lanes, lane l taking cells j0 + l, j0 + l + SL, ...
        # in order, then a fixed tree: a hidden cell adds an exact zero, so the sum is the
        # same whichever cells other rows of the batch keep in the unit (a vectorized sum
        # over nc cells would group them by nc: a token's logits would then depend on the
        # batch it came in)
        tl = np.empty(SL, np.float32)
        for r in range(nr):
            # the row's max in SL lanes too: a max is exact in any order, but without the
            # fast-math flags LLVM only vectorizes a loop written lane by lane
            for ll in range(SL):
                tl[ll] = -np.inf
            jb = 0
            while jb + SL <= nc:
                for ll in range(SL):
                    tl[ll] = max(tl[ll], sc[r, jb + ll])
                jb += SL
            for ll in range(nc - jb):
                tl[ll] = max(tl[ll], sc[r, jb + ll])
            mx = tl[0]
            for ll in range(1, SL):
                mx = max(mx, tl[ll])
            pm[u, r] = mx
            for j in range(nc):
                x = sc[r, j]
                sc[r, j] = expf(x - mx) if x != -np.inf else np.float32(0.0)
            for ll in range(SL):
                tl[ll] = 0.0
            jb = 0
            while jb + SL <= nc:
                for ll in range(SL):
                    tl[ll] += sc[r, jb + ll]
                jb += SL
            for ll in range(nc - jb):
                tl[ll] += sc[r, jb + ll]
            w = SL
            while w > 1:
                w //= 2
                for ll in range(w):
                    tl[ll] += tl[ll + w]
            ps[u, r] = tl[0]
        # V rows VB at a time: converted into a block, then each row's weighted sum over the
        # block in one pass over its accumulator (the block loop unrolls, so the sums stay in
        # registers), not one pass per cell
        vb = np.empty((VB, DV), np.float32)
        wb = np.empty((nr, VB), np.float32)
        j = 0
        while j < nc:
            n = 0
            while n < VB and j < nc:
                if live[j]:
                    o = ks * v3 + g * v2 + (j0 + j) * v1
                    for i in range(0, DV, 32):
                        prefetch(vf, o + PFC * v1 + i)
                    prefetch(vf, o + PFC * v1 + DV - 1)
                    src = vf[o:o + DV]
                    vrow = vb[n]
                    for i in range(DV):
                        vrow[i] = half_to_f32(src[i])
                    for r in range(nr):
                        wb[r, n] = sc[r, j]
                    n += 1
                j += 1
            # a last block short of VB is padded with zero weights and rows, so that every
            # block is summed by the same code: a row's sums then do not depend on which
            # cells other rows of the batch see after its own (a token's logits are the same
            # evaluated alone or in a batch: speculative decoding's greedy output relies on it)
            for jj in range(n, VB):
                for i in range(DV):
                    vb[jj, i] = 0.0
                for r in range(nr):
                    wb[r, jj] = 0.0
            if n == 0:
                continue
            for r in range(nr):
                ar, wr = acc[r], wb[r]
                seen = False   # a row none of the block's cells is visible to adds zeros
                for jj in range(n):
                    seen = seen or wr[jj] != 0.0
                if not seen:
                    continue
                for i in range(DV):
                    a = ar[i]
                    for jj in range(VB):
                        a += wr[jj] * vb[jj, i]
                    ar[i] = a
        if runs == 1:   # the unit holds every cell: its rows are the output, no second pass
            for r in range(nr):
                inv = np.float32(1.0) / ps[u, r] if ps[u, r] > 0.0 else np.float32(0.0)
                h, t = g * rk2 + r // nt, r % nt
                for i in range(DV):
                    d[s, t, h, i] = acc[r, i] * inv


def combine_template(w0, w1, q, hkv, nkv, d, pm, ps, pa):
    """Rows w0..w1 (sequence, K/V head, row of its heads) of the output from their units'
    partial softmaxes (the split-KV recurrence), where several runs of cells hold the cells."""
    nh, nt = q.shape[1], q.shape[2]
    rk2 = nh // hkv
    nr = rk2 * nt
    runs = (nkv + CELLS - 1) // CELLS
    for w in range(w0, w1):
        s, g, r = w // (hkv * nr), (w // nr) % hkv, w % nr
        base = (s * hkv + g) * runs
        mx = np.float32(-np.inf)
        for c in range(runs):
            if ps[base + c, r] > 0.0:
                mx = max(mx, pm[base + c, r])
        out = np.zeros(DV, np.float32)
        tot = np.float32(0.0)
        if mx != -np.inf:
            for c in range(runs):
                if ps[base + c, r] > 0.0:
                    f = expf(pm[base + c, r] - mx)
                    tot += f * ps[base + c, r]
                    for i in range(DV):
                        out[i] += f * pa[base + c, r, i]
        inv = np.float32(1.0) / tot if tot > 0.0 else np.float32(0.0)
        h, t = g * rk2 + r // nt, r % nt
        for i in range(DV):
            d[s, t, h, i] = out[i] * inv


def k_attn_team(q, kf, k3, k2, k1, vf, v3, v2, v1, sk, hkv, nkv, m, d, scale, max_bias,
                softcap, h0, n_head, has_mask, mf, pm, ps, pa, part, wk, workers):
    """A team's decode attention (backends/cpu/team.py), one kernel for its parts (each
    kernel compiled is seconds of a cold start): part 0 the mask's rows decoded into mf, as
    k_flash_attn_decode decodes them; part 1 share wk of `workers` of the units; part 2
    (over several runs of cells) share wk of the output rows."""
    ns, nh, nt = q.shape[0], q.shape[1], q.shape[2]
    m3, m2 = (m.shape[0], m.shape[1]) if has_mask else (1, 1)
    if part == 0:
        if not has_mask:
            for t in range(nt):
                mf[0, 0, t, 0] = 0.0
        for w in range(m3 * m2 * nt if has_mask else 0):
            a, b, t = w // (m2 * nt), (w // nt) % m2, w % nt
            dec_m(m, a, b, t, mf[a, b, t], nkv)
    elif part == 1:
        units = ns * hkv * ((nkv + CELLS - 1) // CELLS)
        attn_unit(wk * units // workers, (wk + 1) * units // workers, q, kf, k3, k2, k1, vf, v3,
                  v2, v1, sk, hkv, nkv, d, scale, max_bias, softcap, h0, n_head, has_mask,
                  mf.reshape(m3 * m2 * nt, mf.shape[3]), m3, m2, pm, ps, pa)
    else:
        n = ns * nh * nt
        attn_combine(wk * n // workers, (wk + 1) * n // workers, q, hkv, nkv, d, pm, ps, pa)
