"""Lane versions of ggml's quantizer scale searches: every group of a row searched at once.

This module owns `to_lanes` and the lane searches (make_qkx_quants_lanes, make_qx_quants_lanes,
iq4_scale_lanes) that the row kernels (backends/cpu/quantize_rows.py, quantize_rows_k.py) use
where the search dominates their time. Each is its scalar counterpart in
backends/cpu/quant_search.py (whose docstring lists what bit-exactness with libggml rests on),
operation for operation per group; only the loop nest differs.
"""
from __future__ import annotations

import numpy as np

from .quant_search import F32, GROUP_MAX_EPS, JIT, ONE, TENTH, ZERO, iq4_nl_index, nearest_clamped

__all__ = ["to_lanes", "make_qkx_quants_lanes", "make_qx_quants_lanes", "iq4_scale_lanes"]

_jit = JIT
_MINUS_127 = F32(-127.0)


# ----------------------------------------------------------------------------- lane searches
#
# The same searches on G independent groups at once: xt[i, k] is value i of group k (a row cut
# into groups and transposed, see to_lanes), L[i, k] its quant as a float32 integer. Every
# group's arithmetic is its scalar counterpart's, operation for operation and sum for sum in
# element order; only the loop nest changes (elements outside, groups inside, decisions as
# selects), so that LLVM's loop vectorizer runs 8 groups per instruction. The group count must
# stay a run-time value: a literal trip count gets the group loop fully unrolled, and numba
# leaves LLVM's SLP vectorizer off, so nothing would be vectorized. Groups the C code leaves
# early (all zero, flat) are computed anyway and overwritten at the end.

@_jit
def to_lanes(x, n, xt):
    """xt[i, k] = x[n*k + i]: x (G*n,) cut into G groups of n, one group per column."""
    for k in range(xt.shape[1]):
        for i in range(n):
            xt[i, k] = x[n * k + i]


@_jit
def make_qkx_quants_lanes(xt, wt, nmax, rmin, rdelta, nstep, use_mad, L, scale, the_min):
    """make_qkx2_quants / make_qkx3_quants (weights wt, nstep >= 1) on every group: fills
    scale[k], the_min[k] and L[:, k] (0..nmax) as the scalar search does for group k."""
    n, G = xt.shape
    st = np.empty((14, G), np.float32)
    Laux = np.empty((n, G), np.float32)
    vmin, vmax, sum_w, sum_x, best = st[0], st[1], st[2], st[3], st[4]
    iscale, sum_l, sum_l2, sum_xl, cur = st[5], st[6], st[7], st[8], st[9]
    tscale, tmin, win, vmin0 = st[10], st[11], st[12], st[13]
    fnmax = F32(nmax)
    for k in range(G):
        vmin[k] = xt[0, k]
        vmax[k] = xt[0, k]
        sum_w[k] = wt[0, k]
        sum_x[k] = wt[0, k] * xt[0, k]
    for i in range(1, n):
        for k in range(G):
            v = xt[i, k]
            vmin[k] = v if v < vmin[k] else vmin[k]
            vmax[k] = v if v > vmax[k] else vmax[k]
            w = wt[i, k]
            sum_w[k] += w
            sum_x[k] += w * v
    for k in range(G):
        m = ZERO if vmin[k] > ZERO else vmin[k]
        vmin[k] = m
        vmin0[k] = m
        iscale[k] = fnmax / (vmax[k] - m)
        scale[k] = ONE / iscale[k]
        best[k] = ZERO
    for i in range(n):
        for k in range(G):
            fl = nearest_clamped(iscale[k] * (xt[i, k] - vmin[k]), ZERO, fnmax)
            L[i, k] = fl
            diff = scale[k] * fl + vmin[k] - xt[i, k]
            diff = abs(diff) if use_mad else diff * diff
            best[k] += wt[i, k] * diff
    for step in range(nstep + 1):
        c = rmin + rdelta * F32(step) + fnmax
        for k in range(G):
            iscale[k] = c / (vmax[k] - vmin[k])
            sum_l[k] = ZERO
            sum_l2[k] = ZERO
            sum_xl[k] = ZERO
            cur[k] = ZERO
        for i in range(n):
            for k in range(G):
                fl = nearest_clamped(iscale[k] * (xt[i, k] - vmin[k]), ZERO, fnmax)
                Laux[i, k] = fl
                w = wt[i, k]
                sum_l[k] += w * fl
                sum_l2[k] += w * fl * fl
                sum_xl[k] += w * fl * xt[i, k]
        for k in range(G):
            D = sum_w[k] * sum_l2[k] - sum_l[k] * sum_l[k]
            ts = (sum_w[k] * sum_xl[k] - sum_x[k] * sum_l[k]) / D
            tm = (sum_l2[k] * sum_x[k] - sum_l[k] * sum_xl[k]) / D
            pos = tm > ZERO
            tscale[k] = sum_xl[k] / sum_l2[k] if pos else ts
            tmin[k] = ZERO if pos else tm
            win[k] = ONE if D > ZERO else ZERO
        for i in range(n):
            for k in range(G):
                diff = tscale[k] * Laux[i, k] + tmin[k] - xt[i, k]
                diff = abs(diff) if use_mad else diff * diff
                cur[k] += wt[i, k] * diff
        for k in range(G):
            u = (win[k] > ZERO) & (cur[k] < best[k])      # & not `and`: no branch
            win[k] = ONE if u else ZERO
            best[k] = cur[k] if u else best[k]
            scale[k] = tscale[k] if u else scale[k]
            vmin[k] = tmin[k] if u else vmin[k]
        for i in range(n):
            for k in range(G):
                L[i, k] = Laux[i, k] if win[k] > ZERO else L[i, k]
    for k in range(G):                               # flat groups: C returns before searching
        flat = vmax[k] <= vmin0[k]
        scale[k] = ZERO if flat else scale[k]
        the_min[k] = -vmin0[k] if flat else -vmin[k]
        vmin0[k] = ONE if flat else ZERO
    for i in range(n):
        for k in range(G):
            L[i, k] = ZERO if vmin0[k] > ZERO else L[i, k]


@_jit
def make_qx_quants_lanes(xt, wt, nmax, L, scale):
    """make_qx_quants(n, nmax, x, L, 1, qw) on every group, weights wt (qw, or x*x where C
    passes NULL: the same value C computes at each use): fills scale[k] and L[:, k]
    (0..2*nmax-1) as the scalar make_qx_quants does for group k."""
    n, G = xt.shape
    st = np.empty((8, G), np.float32)
    Laux = np.empty((n, G), np.float32)
    vmax, amax, iscale, sumlx, suml2, best, win = st[0], st[1], st[2], st[3], st[4], st[5], st[6]
    fnmax = F32(nmax)
    lo = -fnmax
    hi = fnmax - ONE
    for k in range(G):
        vmax[k] = ZERO
        amax[k] = ZERO
    for i in range(n):
        for k in range(G):
            v = xt[i, k]
            u = abs(v) > amax[k]
            amax[k] = abs(v) if u else amax[k]
            vmax[k] = v if u else vmax[k]
    for k in range(G):
        iscale[k] = lo / vmax[k]
        sumlx[k] = ZERO
        suml2[k] = ZERO
    for i in range(n):
        for k in range(G):
            fl = nearest_clamped(iscale[k] * xt[i, k], lo, hi)
            L[i, k] = fl + fnmax
            w = wt[i, k]
            sumlx[k] += w * xt[i, k] * fl
            suml2[k] += w * fl * fl
    for k in range(G):
        scale[k] = sumlx[k] / suml2[k] if suml2[k] != ZERO else ZERO
        best[k] = scale[k] * sumlx[k]
    for step in range(-9, 10):
        if step == 0:
            continue
        c = -(fnmax + TENTH * F32(step))
        for k in range(G):
            iscale[k] = c / vmax[k]
            sumlx[k] = ZERO
            suml2[k] = ZERO
        for i in range(n):
            for k in range(G):
                fl = nearest_clamped(iscale[k] * xt[i, k], lo, hi)
                Laux[i, k] = fl + fnmax
                w = wt[i, k]
                sumlx[k] += w * xt[i, k] * fl
                suml2[k] += w * fl * fl
        for k in range(G):
            u = (suml2[k] > ZERO) & (sumlx[k] * sumlx[k] > best[k] * suml2[k])
            win[k] = ONE if u else ZERO
            scale[k] = sumlx[k] / suml2[k] if u else scale[k]
            best[k] = scale[k] * sumlx[k] if u else best[k]
        for i in range(n):
            for k in range(G):
                L[i, k] = Laux[i, k] if win[k] > ZERO else L[i, k]
    for k in range(G):                               # all-zero groups: C returns 0, L = 0
        z = amax[k] < GROUP_MAX_EPS
        scale[k] = ZERO if z else scale[k]
        win[k] = ONE if z else ZERO
    for i in range(n):
        for k in range(G):
            L[i, k] = ZERO if win[k] > ZERO else L[i, k]


@_jit
def iq4_scale_lanes(xt, wt, d):
    """iq4_block_scale on every group (32 values each): fills d[k]."""
    n, G = xt.shape
    st = np.empty((7, G), np.float32)
    vmax, amax, inv, sumqx, sumq2, best = st[0], st[1], st[2], st[3], st[4], st[5]
    for k in range(G):
        vmax[k] = ZERO
        amax[k] = ZERO
    for i in range(n):
        for k in range(G):
            v = xt[i, k]
            u = abs(v) > amax[k]
            amax[k] = abs(v) if u else amax[k]
            vmax[k] = v if u else vmax[k]
    for k in range(G):
        inv[k] = ONE / (-vmax[k] / _MINUS_127)
        sumqx[k] = ZERO
        sumq2[k] = ZERO
    for i in range(n):
        for k in range(G):
            _, q = iq4_nl_index(inv[k] * xt[i, k])
            w = wt[i, k]
            sumqx[k] += w * q * xt[i, k]
            sumq2[k] += w * q * q
    for k in range(G):
        d[k] = sumqx[k] / sumq2[k] if sumq2[k] > ZERO else ZERO
        best[k] = d[k] * sumqx[k]
    for itry in range(-7, 8):
        c = F32(itry - 127)
        for k in range(G):
            inv[k] = c / vmax[k]
            sumqx[k] = ZERO
            sumq2[k] = ZERO
        for i in range(n):
            for k in range(G):
                _, q = iq4_nl_index(inv[k] * xt[i, k])
                w = wt[i, k]
                sumqx[k] += w * q * xt[i, k]
                sumq2[k] += w * q * q
        for k in range(G):
            u = (sumq2[k] > ZERO) & (sumqx[k] * sumqx[k] > best[k] * sumq2[k])
            d[k] = sumqx[k] / sumq2[k] if u else d[k]
            best[k] = d[k] * sumqx[k] if u else best[k]
    for k in range(G):
        d[k] = ZERO if amax[k] < GROUP_MAX_EPS else d[k]

