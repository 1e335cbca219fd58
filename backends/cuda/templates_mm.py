"""CUDA kernel templates for matrix products: a shared-memory tiled mul_mat (dequantizing
quantized weights block by block into the tile), a warp-per-row mat-vec that dots stored
blocks directly, and mul_mat_id (experts) the same way. Flash attention: templates_attn.py.

Bound names as in templates.py (ld_/cdec_/cdot_/dot_ per role, Q_a). Arrays in numpy order:
mul_mat a (A3, A2, M, K), b (B3, B2, N, K), d (B3, B2, N, M), block-repeat broadcast.
"""
import numpy as np
from numba import cuda, float32

from .runtime import SIM, SMALL
from .templates import CH
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(B_ADD, B_SWIGLU, Q_a, binary_value, cdec_a, cdot_a, ld_a, ld_b) = bound(
    "B_ADD", "B_SWIGLU", "Q_a", "binary_value", "cdec_a", "cdot_a", "ld_a", "ld_b")

ZERO = np.float32(0.0)  # float32: a float64 literal would turn the arithmetic float64

# tiled mul_mat: a block computes a TM x TN tile of d; each of its (TM/RM)*(TN/RN) threads
# RM x RN outputs; K advances TK (= one quant block) at a time through shared memory
MM_TM = 8 if SMALL else 64
MM_TN = 8 if SMALL else 64
MM_RM = 2 if SMALL else 4
MM_RN = 2 if SMALL else 4
MM_TK = CH
MM_TX = MM_TM // MM_RM
MM_TY = MM_TN // MM_RN
MM_NT = MM_TX * MM_TY
MM_AS = (MM_TK, MM_TM + 1)   # shared tile shapes (+1 column against bank conflicts)
MM_BS = (MM_TK, MM_TN + 1)
MM_ACC = (MM_RM, MM_RN)
# mat-vec: MV_LANES threads (a warp on a GPU) per output row, MV_WARPS rows per block, up to
# MV_NMAX columns of b per launch (more take the tiled kernel)
MV_LANES = 8 if SMALL else 32
MV_WARPS = 1 if SMALL else 4
MV_NT = MV_LANES * MV_WARPS
MV_NMAX = 8
MV_ACC = 2 * MV_NMAX  # the sums of both weights of a fused GLU or pair
MV_PAIR = -2           # k_mul_mat_vec's op for two products of one input
FULL_MASK = 0xFFFFFFFF


def k_mul_mat_tiled(a, b, d):
    """grid (ceil(M/TM), ceil(N/TN), B3*B2)."""
    As = cuda.shared.array(MM_AS, float32)  # As[k, m]
    Bs = cuda.shared.array(MM_BS, float32)
    acc = cuda.local.array(MM_ACC, float32)
    vals = cuda.local.array(CH, float32)
    n3, n2, nn, nm = d.shape
    kk = b.shape[3]
    r3, r2 = n3 // a.shape[0], n2 // a.shape[1]
    tid = cuda.threadIdx.x
    tx, ty = tid % MM_TX, tid // MM_TX
    m0, n0 = cuda.blockIdx.x * MM_TM, cuda.blockIdx.y * MM_TN
    i3, i2 = cuda.blockIdx.z // n2, cuda.blockIdx.z % n2
    j3, j2 = i3 // r3, i2 // r2
    for i in range(MM_RM):
        for j in range(MM_RN):
            acc[i, j] = 0.0
    for k0 in range(0, kk, MM_TK):
        if Q_a:  # one thread decodes one row's block (the shared decoder)
            for r in range(tid, MM_TM, MM_NT):
                if m0 + r < nm:
                    cdec_a(a, j3, j2, m0 + r, k0, MM_TK, vals)
                    for q in range(MM_TK):
                        As[q, r] = vals[q]
                else:
                    for q in range(MM_TK):
                        As[q, r] = 0.0
        else:  # consecutive threads load consecutive k of a row: coalesced
            for e in range(tid, MM_TM * MM_TK, MM_NT):
                r, q = e // MM_TK, e % MM_TK
                v = np.float32(0.0)
                if m0 + r < nm and k0 + q < kk:
                    v = ld_a(a, j3, j2, m0 + r, k0 + q)
                As[q, r] = v
        for e in range(tid, MM_TN * MM_TK, MM_NT):
            r, q = e // MM_TK, e % MM_TK
            v = np.float32(0.0)
            if n0 + r < nn and k0 + q < kk:
                v = ld_b(b, i3, i2, n0 + r, k0 + q)
            Bs[q, r] = v
        cuda.syncthreads()
        for q in range(MM_TK):
            for i in range(MM_RM):
                av = As[q, tx + i * MM_TX]
                for j in range(MM_RN):
                    acc[i, j] += av * Bs[q, ty + j * MM_TY]
        cuda.syncthreads()
    for j in range(MM_RN):
        n = n0 + ty + j * MM_TY
        for i in range(MM_RM):
            m = m0 + tx + i * MM_TX
            if m < nm and n < nn:
                d[i3, i2, n, m] = acc[i, j]


if SIM:
    @cuda.jit(device=True)
    def warp_sum(red, tid, lane, s):
        """The simulator has no warp shuffles: the same sum through shared memory, valid in
        lane 0 (every thread of the block calls: it holds two barriers)."""
        red[tid] = s
        cuda.syncthreads()
        total = s
        if lane == 0:
            for i in range(1, MV_LANES):
                total += red[tid + i]
        cuda.syncthreads()  # all reads done before the next sum overwrites red
        return total
else:
    @cuda.jit(device=True)
    def warp_sum(red, tid, lane, s):
        """Sum of s over the warp's lanes by shuffles (no shared memory, no barrier), valid in
        lane 0; every lane of the warp calls."""
        off = MV_LANES // 2
        while off > 0:
            s += cuda.shfl_down_sync(FULL_MASK, s, off)
            off //= 2
        return s


def k_mul_mat_vec(a, a2, b, c, d, op):
    """d[i3, i2, n, m] = row m of a . b[i3, i2, n, :] for every column n of b (at most
    MV_NMAX), with the node after it fused (backends/cuda/fusion.py) by `op`, a B_* code:
    B_ADD adds c[i3, i2, n, m] (the residual), B_SWIGLU gives silu(row m of a . b) * (row m
    of a2 . b) (the FFN's gate and up products and their GLU); MV_PAIR stores row m of
    a2 . b into c as well (the gate and up products, each to its own tensor); -1 none.

    Warp w of a block takes row m = MV_WARPS*item + w and reads it once for all columns.
    Float weights: lanes read consecutive elements (coalesced loads of a and b); quantized:
    lanes take consecutive blocks, each decoded once (the shared decoder) and dotted with
    every column. Lanes' partial sums are added by warp shuffles. Blocks walk the (row
    group, slice) items grid-stride."""
    red = cuda.shared.array(MV_NT, float32)
    acc = cuda.local.array(MV_ACC, float32)
    vals = cuda.local.array(CH, float32)
    n3, n2, nn, nm = d.shape
    kk = b.shape[3]
    r3, r2 = n3 // a.shape[0], n2 // a.shape[1]
    glu = op == B_SWIGLU
    two = glu or op == MV_PAIR
    nw = 2 if two else 1
    tid = cuda.threadIdx.x
    lane = tid % MV_LANES
    groups = (nm + MV_WARPS - 1) // MV_WARPS
    for o in range(cuda.blockIdx.x, groups * n3 * n2, cuda.gridDim.x):
        m = (o % groups) * MV_WARPS + tid // MV_LANES
        z = o // groups
        i3, i2 = z // n2, z % n2
        j3, j2 = i3 // r3, i2 // r2
        for j in range(MV_ACC):
            acc[j] = ZERO
        if m < nm:
            for w in range(nw):
                x = a if w == 0 else a2
                if Q_a:
                    for ch in range(lane, (kk + CH - 1) // CH, MV_LANES):
                        k0 = ch * CH
                        cn = min(CH, kk - k0)
                        cdec_a(x, j3, j2, m, k0, cn, vals)
                        for j in range(nn):
                            s = ZERO
                            for e in range(cn):
                                s += vals[e] * ld_b(b, i3, i2, j, k0 + e)
                            acc[w * MV_NMAX + j] += s
                else:
                    for k in range(lane, kk, MV_LANES):
                        v = ld_a(x, j3, j2, m, k)
                        for j in range(nn):
                            acc[w * MV_NMAX + j] += v * ld_b(b, i3, i2, j, k)
        for j in range(nn):
            s = warp_sum(red, tid, lane, acc[j])
            u = warp_sum(red, tid, lane, acc[MV_NMAX + j]) if two else ZERO
            if lane == 0 and m < nm:
                if op == B_ADD:
                    s += c[i3, i2, j, m]
                elif glu:
                    s = np.float32(binary_value(op, s, u))
                elif two:
                    c[i3, i2, j, m] = u
                d[i3, i2, j, m] = s


def k_mul_mat_id(a, b, ids, d):
    """d[0, t, e, m] = row m of expert ids[t, e] . b[0, t, e % n_b, :], one warp per output as
    in k_mul_mat_vec, blocks walking (row group, e, t) grid-stride."""
    red = cuda.shared.array(MV_NT, float32)
    vb = cuda.local.array(CH, float32)
    _, nt, nu, nm = d.shape
    nb, kk = b.shape[2], b.shape[3]
    tid = cuda.threadIdx.x
    lane = tid % MV_LANES
    groups = (nm + MV_WARPS - 1) // MV_WARPS
    for o in range(cuda.blockIdx.x, groups * nu * nt, cuda.gridDim.x):
        m = (o % groups) * MV_WARPS + tid // MV_LANES
        e = (o // groups) % nu
        t = o // (groups * nu)
        ex = ids[0, 0, t, e]
        s = np.float32(0.0)
        if m < nm:
            for c in range(lane, (kk + CH - 1) // CH, MV_LANES):
                k0 = c * CH
                cn = min(CH, kk - k0)
                for q in range(cn):
                    vb[q] = ld_b(b, 0, t, e % nb, k0 + q)
                s += cdot_a(a, 0, ex, m, k0, cn, vb)
        s = warp_sum(red, tid, lane, s)
        if lane == 0 and m < nm:
            d[0, t, e, m] = s
