"""CUDA kernel templates for matrix products and attention: a shared-memory tiled mul_mat
(dequantizing quantized weights block by block into the tile), a warp-per-row mat-vec that
dots stored blocks directly, mul_mat_id (experts) the same way, and flash attention with an
online softmax reading F32/F16/BF16/Q8_0/Q4_0/Q4_1 K and V through the shared codecs.

Bound names as in templates.py (ld_/cdec_/cdot_/dot_ per role, Q_a). Arrays in numpy order:
mul_mat a (A3, A2, M, K), b (B3, B2, N, K), d (B3, B2, N, M), block-repeat broadcast.
"""
import math

import numpy as np
from numba import cuda, float32

from .runtime import SMALL
from .templates import CH, alibi_slope_f32

ZERO, NEG_INF = np.float32(0.0), np.float32(-np.inf)  # float32 constants: a float64 literal
#                                                        would turn the arithmetic float64

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
# mat-vec: MV_LANES threads (a warp on a GPU) per output row, MV_WARPS rows per block
MV_LANES = 8 if SMALL else 32
MV_WARPS = 1 if SMALL else 4
MV_NT = MV_LANES * MV_WARPS
# flash attention: one block of FA_NT threads per query row; q staged in shared memory
FA_NT = 16 if SMALL else 128
FA_DMAX = 1024                 # longest K head (q row in shared memory)
FA_DV_MAX = CH * FA_NT         # longest V head: one CH-chunk of the output per thread
FA_RED = FA_NT * CH            # partial outputs of every thread, summed at the end


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
        if Q_a:  # noqa: F821  one thread decodes one row's block (the shared decoder)
            for r in range(tid, MM_TM, MM_NT):
                if m0 + r < nm:
                    cdec_a(a, j3, j2, m0 + r, k0, MM_TK, vals)  # noqa: F821
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
                    v = ld_a(a, j3, j2, m0 + r, k0 + q)  # noqa: F821
                As[q, r] = v
        for e in range(tid, MM_TN * MM_TK, MM_NT):
            r, q = e // MM_TK, e % MM_TK
            v = np.float32(0.0)
            if n0 + r < nn and k0 + q < kk:
                v = ld_b(b, i3, i2, n0 + r, k0 + q)  # noqa: F821
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


@cuda.jit(device=True)
def lane_sum(red, tid, lane, s):
    """Sum of s over the MV_LANES lanes of each row group, valid in lane 0 (every thread of
    the block calls: it holds two barriers)."""
    red[tid] = s
    cuda.syncthreads()
    total = s
    if lane == 0:
        for i in range(1, MV_LANES):
            total += red[tid + i]
    cuda.syncthreads()  # all reads done before the next item's partial sums overwrite red
    return total


def k_mul_mat_vec(a, b, d):
    """Warp w of a block computes d[i3, i2, n, m] for m = MV_WARPS*blk + w; its lanes take the
    row's CH-chunks in turn and dot them (stored blocks read directly). Blocks walk the
    (row group, n, slice) items grid-stride."""
    red = cuda.shared.array(MV_NT, float32)
    vb = cuda.local.array(CH, float32)
    n3, n2, nn, nm = d.shape
    kk = b.shape[3]
    r3, r2 = n3 // a.shape[0], n2 // a.shape[1]
    tid = cuda.threadIdx.x
    lane = tid % MV_LANES
    groups = (nm + MV_WARPS - 1) // MV_WARPS
    for o in range(cuda.blockIdx.x, groups * nn * n3 * n2, cuda.gridDim.x):
        # not `unflatten`: that walk costs this kernel ~20 more registers (ptxas, sm_90)
        m = (o % groups) * MV_WARPS + tid // MV_LANES
        n = (o // groups) % nn
        z = o // (groups * nn)
        i3, i2 = z // n2, z % n2
        s = np.float32(0.0)
        if m < nm:
            for c in range(lane, (kk + CH - 1) // CH, MV_LANES):
                k0 = c * CH
                cn = min(CH, kk - k0)
                for e in range(cn):
                    vb[e] = ld_b(b, i3, i2, n, k0 + e)  # noqa: F821
                s += cdot_a(a, i3 // r3, i2 // r2, m, k0, cn, vb)  # noqa: F821
        s = lane_sum(red, tid, lane, s)
        if lane == 0 and m < nm:
            d[i3, i2, n, m] = s


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
                    vb[q] = ld_b(b, 0, t, e % nb, k0 + q)  # noqa: F821
                s += cdot_a(a, 0, ex, m, k0, cn, vb)  # noqa: F821
        s = lane_sum(red, tid, lane, s)
        if lane == 0 and m < nm:
            d[0, t, e, m] = s


def k_flash_attn(q, k, v, m, d, scale, max_bias, softcap, h0, n_head, has_mask):
    """q (S, H, T, Dk) F32; k (Sk, Hkv, n_kv, Dk); v (Sk, Hkv, n_kv, Dv); d (S, T, H, Dv).

    One block per query row, KV in tiles of FA_NT positions: thread j scores position j (a
    whole-row dot through the shared codec, -inf mask entries skipped), the block takes the
    tile max into the running max and rescales (online softmax), then thread (c, g) adds the
    weighted V rows g, g+G, ... of its CH-chunk c of the output (a V block decoded by the
    shared decoder). Partial sums over g are added at the end. Float32 throughout, as ggml's
    CUDA flash attention (scale, max_bias, softcap arrive as float32)."""
    qs = cuda.shared.array(FA_DMAX, float32)
    ss = cuda.shared.array(FA_NT, float32)
    pp = cuda.shared.array(FA_NT, float32)
    red = cuda.shared.array(FA_RED, float32)
    acc = cuda.local.array(CH, float32)
    vals = cuda.local.array(CH, float32)
    ns, nh, nt, dk = q.shape
    hkv, nkv, dv = k.shape[1], k.shape[2], d.shape[3]
    rk2, rk3 = nh // hkv, ns // k.shape[0]
    m3, m2 = m.shape[0], m.shape[1]
    tid = cuda.threadIdx.x
    nch = (dv + CH - 1) // CH
    G = FA_NT // nch
    c, g = tid % nch, tid // nch
    cn = min(CH, dv - c * CH)
    for row in range(cuda.blockIdx.x, ns * nh * nt, cuda.gridDim.x):
        s, h, t = row // (nh * nt), (row // nt) % nh, row % nt
        ks, kh = s // rk3, h // rk2
        for i in range(tid, dk, FA_NT):
            qs[i] = q[s, h, t, i]
        for e in range(CH):
            acc[e] = ZERO
        slope = alibi_slope_f32(h0 + h, n_head, max_bias)
        mx = NEG_INF
        ssum = ZERO
        cuda.syncthreads()
        for j0 in range(0, nkv, FA_NT):
            j = j0 + tid
            sc = NEG_INF
            if j < nkv:
                mv = ZERO
                if has_mask:
                    mv = ld_m(m, s % m3, h % m2, t, j)  # noqa: F821
                if mv != NEG_INF:
                    x = dot_k(k, ks, kh, j, qs, dk) * scale  # noqa: F821
                    if softcap != ZERO:
                        x = softcap * math.tanh(x)
                    sc = x + slope * mv
            ss[tid] = sc
            cuda.syncthreads()
            tmax = NEG_INF
            for jj in range(FA_NT):
                tmax = max(tmax, ss[jj])
            mnew = max(mx, tmax)
            corr = math.exp(mx - mnew) if mx != NEG_INF else ZERO
            pp[tid] = math.exp(sc - mnew) if sc != NEG_INF else ZERO
            cuda.syncthreads()
            tsum = ZERO
            for jj in range(FA_NT):
                tsum += pp[jj]
            ssum = ssum * corr + tsum
            mx = mnew
            if g < G:
                for e in range(CH):
                    acc[e] *= corr
                for jj in range(g, FA_NT, G):
                    w = pp[jj]
                    if w > ZERO:
                        cdec_v(v, ks, kh, j0 + jj, c * CH, cn, vals)  # noqa: F821
                        for e in range(cn):
                            acc[e] += w * vals[e]
        if g < G:
            for e in range(CH):
                red[tid * CH + e] = acc[e]
        cuda.syncthreads()
        inv = np.float32(1.0) / ssum if ssum > ZERO else ZERO
        for i in range(tid, dv, FA_NT):
            tot = np.float32(0.0)
            for gg in range(G):
                tot += red[(gg * nch + i // CH) * CH + i % CH]
            d[s, t, h, i] = tot * inv
        cuda.syncthreads()
