"""CUDA flash attention: the kernel templates and the host-side choice of how to launch them.

One template, `k_flash_attn_tile`, runs an online softmax over a range of KV positions for QT
query rows (consecutive t of one sequence s and head h) in FA_NT threads, reading
F32/F16/BF16/Q8_0/Q4_0/... K and V through the per-role codec helpers bound by kernels.py
(dot_k, cdec_k, cdec_v, ld_m; see templates.py). It is compiled with two geometries:

- `k_flash_attn_split` (QT = 1), for few query rows (decode: 1 token x 9 heads is 9 rows, on a
  GPU of 132 SMs): the KV positions are cut into `splits` chunks, grid (rows, splits); each
  block writes its chunk's running max, running sum and unnormalized output (Dv floats) to a
  float32 scratch buffer, and `k_flash_attn_combine` merges the chunks of each row into d.
  With one chunk it writes d directly (as one block per row did before).
- `k_flash_attn_tile` (QT = FA_QT), for many query rows (prefill): each K row and V block a
  block decodes serves all QT rows of its tile.

`fa_plan` picks the geometry for a node, `fa_scratch` allocates the partials. Float32
throughout (no float64: every constant is an np.float32), as ggml's CUDA flash attention.
Arrays in numpy order: q (S, H, T, Dk) F32; k (Sk, Hkv, n_kv, Dk); v (Sk, Hkv, n_kv, Dv);
d (S, T, H, Dv); part (1, rows, splits, Dv + 2), rows numbered (s * H + h) * T + t.
"""
import math
import types

import numpy as np
from numba import cuda, float32

from ggraph.ir.tensor import Context
from ggraph.ir.types import GGMLType
from . import runtime as R
from .runtime import SMALL
from .templates import CH, alibi_slope_f32
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
cdec_k, cdec_v, dot_k, ld_m = bound("cdec_k", "cdec_v", "dot_k", "ld_m")

ZERO, ONE, NEG_INF = np.float32(0.0), np.float32(1.0), np.float32(-np.inf)

FA_NT = 16 if SMALL else 128   # threads per block; a KV tile is FA_NT positions, one each
FA_DMAX = 1024                 # longest K head (the q rows live in shared memory)
FA_DV_MAX = CH * FA_NT         # longest V head: one CH-chunk of the output per thread
FA_RED = FA_NT * CH            # partial outputs of every thread, summed at the end
FA_QT = 2 if SMALL else 4      # query rows per block of the tile kernel
# a tile's row max in two steps: FA_SEG threads per row take FA_NT / FA_SEG scores each, then
# one thread per row takes the FA_SEG partial maxima (instead of every thread reading FA_NT)
FA_SEG = 4 if SMALL else 16
# launch choice (fa_plan). A GPU of FA_SMS SMs holds about two of these blocks per SM (their
# registers), so fewer query rows than FA_SPLIT_ROWS leave it idle: those split the KV
# positions into chunks of at least FA_MIN_CHUNK until about FA_TARGET_BLOCKS blocks run. The
# simulator's numbers are small so that its tiny test shapes take every path.
FA_SMS = 132
FA_SPLIT_ROWS = 8 if SMALL else 2 * FA_SMS
FA_TARGET_BLOCKS = 8 if SMALL else 2 * FA_SMS
FA_MIN_CHUNK = FA_NT if SMALL else 2 * FA_NT
FA_MAX_SPLITS = 8 if SMALL else 64


def _geometry(qt: int) -> dict:
    """The compile-time sizes of k_flash_attn_tile for qt query rows per block."""
    return {"QT": qt, "QS": qt * FA_DMAX, "SS": (2, qt, FA_NT), "PM": (qt, FA_SEG),
            "RM": (qt, 2), "ACC": qt * CH}


_TILE = _geometry(FA_QT)
QT, QS, SS, PM, RM, ACC = (_TILE[n] for n in ("QT", "QS", "SS", "PM", "RM", "ACC"))
assert FA_NT % FA_SEG == 0 and FA_QT * FA_SEG <= FA_NT and FA_QT <= CH


def k_flash_attn_tile(q, k, v, m, d, part, scale, max_bias, softcap, h0, n_head, has_mask,
                      chunk):
    """grid (items, splits): blocks walk the items (s, h, QT consecutive t) grid-stride, and
    block y takes the KV positions [y * chunk, (y + 1) * chunk).

    Per KV tile of FA_NT positions: thread j scores position j against the QT rows (mask
    entries of -inf skip it; QT = 1 dots the stored K row directly, else it decodes the row
    chunk by chunk once for all rows), the rows' tile maxima go into their running maxima
    (two-step reduction through shared memory), and thread (c, g) rescales its accumulators
    and adds the weighted V rows g, g+G, ... of its CH-chunk c of the output, one V block
    decoded for all QT rows. The running sums stay per thread (each over its own positions,
    rescaled like the outputs) and are added once at the end, as are the partial outputs over
    g. One chunk (gridDim.y == 1) writes d; several write part, which k_flash_attn_combine
    merges. Three barriers per tile: the scores live in two buffers by tile parity, so the next
    tile's scores never overwrite the ones slower threads still weigh V with."""
    qs = cuda.shared.array(QS, float32)     # q row r of the tile at r * FA_DMAX
    ss = cuda.shared.array(SS, float32)     # [tile parity, r, position] scores
    pm = cuda.shared.array(PM, float32)     # [r, segment] partial maxima of a tile
    rm = cuda.shared.array(RM, float32)     # [r]: running max, its correction this tile
    red = cuda.shared.array(FA_RED, float32)
    acc = cuda.local.array(ACC, float32)    # row r's CH-chunk of the output at r * CH
    vals = cuda.local.array(CH, float32)
    sc = cuda.local.array(QT, float32)      # this thread's scores, then its V weights
    mk = cuda.local.array(QT, float32)      # mask entries of this thread's position
    lp = cuda.local.array(QT, float32)      # running sums over this thread's positions
    mr = cuda.local.array(QT, float32)      # the rows' running maxima
    ns, nh, nt, dk = q.shape
    hkv, nkv, dv = k.shape[1], k.shape[2], d.shape[3]
    rk2, rk3 = nh // hkv, ns // k.shape[0]
    m3, m2 = m.shape[0], m.shape[1]
    tid = cuda.threadIdx.x
    nch = (dv + CH - 1) // CH
    G = FA_NT // nch
    c, g = tid % nch, tid // nch
    cn = min(CH, dv - c * CH)
    ntile = (nt + QT - 1) // QT
    split, nsplit = cuda.blockIdx.y, cuda.gridDim.y
    jb = split * chunk
    je = min(nkv, jb + chunk)
    for item in range(cuda.blockIdx.x, ns * nh * ntile, cuda.gridDim.x):
        s, h, t0 = item // (nh * ntile), (item // ntile) % nh, (item % ntile) * QT
        nr = min(QT, nt - t0)  # rows of this tile (the last tile of a sequence may be short)
        ks, kh = s // rk3, h // rk2
        for r in range(nr):
            for i in range(tid, dk, FA_NT):
                qs[r * FA_DMAX + i] = q[s, h, t0 + r, i]
        for e in range(ACC):
            acc[e] = ZERO
        for r in range(QT):
            lp[r] = ZERO
        if tid < QT:
            rm[tid, 0] = NEG_INF
        slope = alibi_slope_f32(h0 + h, n_head, max_bias)
        cuda.syncthreads()
        par = 0
        for j0 in range(jb, je, FA_NT):
            j = j0 + tid
            live = False
            for r in range(QT):
                mv = NEG_INF
                if r < nr and j < je:
                    mv = ZERO
                    if has_mask:
                        mv = ld_m(m, s % m3, h % m2, t0 + r, j)
                mk[r] = mv
                sc[r] = ZERO
                live = live or mv != NEG_INF
            if live:
                if QT == 1:
                    sc[0] = dot_k(k, ks, kh, j, qs, dk)
                else:
                    for k0 in range(0, dk, CH):
                        kn = min(CH, dk - k0)
                        cdec_k(k, ks, kh, j, k0, kn, vals)
                        for e in range(kn):
                            x = vals[e]
                            for r in range(QT):
                                sc[r] += x * qs[r * FA_DMAX + k0 + e]
            for r in range(QT):
                x = NEG_INF
                if mk[r] != NEG_INF:
                    x = sc[r] * scale
                    if softcap != ZERO:
                        x = softcap * math.tanh(x)
                    x += slope * mk[r]
                sc[r] = x
                ss[par, r, tid] = x
            cuda.syncthreads()
            if tid < QT * FA_SEG:
                r, sg = tid // FA_SEG, tid % FA_SEG
                x = NEG_INF
                for jj in range(sg * (FA_NT // FA_SEG), (sg + 1) * (FA_NT // FA_SEG)):
                    x = max(x, ss[par, r, jj])
                pm[r, sg] = x
            cuda.syncthreads()
            if tid < QT:
                mold = rm[tid, 0]
                mnew = mold
                for sg in range(FA_SEG):
                    mnew = max(mnew, pm[tid, sg])
                rm[tid, 0] = mnew
                rm[tid, 1] = math.exp(mold - mnew) if mold != NEG_INF else ZERO
            cuda.syncthreads()
            for r in range(QT):
                mr[r] = rm[r, 0]
                corr = rm[r, 1]
                x = sc[r]
                lp[r] = lp[r] * corr + (math.exp(x - mr[r]) if x != NEG_INF else ZERO)
                if g < G:
                    for e in range(CH):
                        acc[r * CH + e] *= corr
            if g < G:
                for jj in range(g, FA_NT, G):
                    live = False
                    for r in range(QT):
                        x = ss[par, r, jj]
                        w = math.exp(x - mr[r]) if x != NEG_INF else ZERO
                        sc[r] = w
                        live = live or w > ZERO
                    if live:
                        cdec_v(v, ks, kh, j0 + jj, c * CH, cn, vals)
                        for e in range(cn):
                            x = vals[e]
                            for r in range(QT):
                                acc[r * CH + e] += sc[r] * x
            par = 1 - par
        # the rows' sums: every thread's partial, added by one thread per row
        for r in range(QT):
            red[r * FA_NT + tid] = lp[r]
        cuda.syncthreads()
        if tid < QT:
            x = ZERO
            for i in range(FA_NT):
                x += red[tid * FA_NT + i]
            rm[tid, 1] = x
        cuda.syncthreads()
        for r in range(nr):
            if g < G:
                for e in range(CH):
                    red[tid * CH + e] = acc[r * CH + e]
            cuda.syncthreads()
            lsum = rm[r, 1]
            inv = ONE / lsum if lsum > ZERO else ZERO
            row = (s * nh + h) * nt + t0 + r
            for i in range(tid, dv, FA_NT):
                tot = ZERO
                for gg in range(G):
                    tot += red[(gg * nch + i // CH) * CH + i % CH]
                if nsplit == 1:
                    d[s, t0 + r, h, i] = tot * inv
                else:
                    part[0, row, split, i] = tot
            if nsplit > 1 and tid == 0:
                part[0, row, split, dv] = rm[r, 0]
                part[0, row, split, dv + 1] = lsum
            cuda.syncthreads()


def k_flash_attn_combine(part, d):
    """d[s, t, h, :] = sum_i o_i * exp(m_i - M) / sum_i l_i * exp(m_i - M) over the chunks i
    of a row (M: their largest max; a chunk whose every position was masked has m_i = -inf,
    l_i = 0 and weighs nothing; a row masked everywhere gives 0, as ggml). One block of FA_NT
    threads per row, grid-stride; consecutive threads write consecutive outputs."""
    fs = cuda.shared.array(FA_MAX_SPLITS, float32)
    ns, nt, nh, dv = d.shape
    nsp = part.shape[2]
    tid = cuda.threadIdx.x
    for row in range(cuda.blockIdx.x, ns * nh * nt, cuda.gridDim.x):
        s, h, t = row // (nh * nt), (row // nt) % nh, row % nt
        mx = NEG_INF
        for i in range(nsp):
            mx = max(mx, part[0, row, i, dv])
        for i in range(tid, nsp, FA_NT):
            x = part[0, row, i, dv]
            fs[i] = math.exp(x - mx) if x != NEG_INF else ZERO
        cuda.syncthreads()
        lsum = ZERO
        for i in range(nsp):
            lsum += fs[i] * part[0, row, i, dv + 1]
        inv = ONE / lsum if lsum > ZERO else ZERO
        for e in range(tid, dv, FA_NT):
            tot = ZERO
            for i in range(nsp):
                tot += fs[i] * part[0, row, i, e]
            d[s, t, h, e] = tot * inv
        cuda.syncthreads()  # fs read by all before the next row's factors overwrite it


def _specialized(fn, name: str, **consts):
    """A copy of template `fn` named `name` whose globals give `consts` other values: numba
    takes global ints and tuples as compile-time constants (array shapes, branches on QT)."""
    glb = dict(fn.__globals__)
    glb.update(consts)
    nf = types.FunctionType(fn.__code__, glb, name, fn.__defaults__, fn.__closure__)
    nf.__qualname__, nf.__module__, nf.__doc__ = name, fn.__module__, fn.__doc__
    return nf


# one query row per block: the decode geometry, split over KV chunks
k_flash_attn_split = _specialized(k_flash_attn_tile, "k_flash_attn_split", **_geometry(1))


# -- launch choice (host side) ---------------------------------------------------------------

def fa_plan(rows: int, nt: int, nkv: int) -> tuple[int, int, int]:
    """(query rows per block, KV splits, positions per split) for `rows` query rows of which
    `nt` consecutive ones share (s, h), over nkv positions. Many rows: tiles of FA_QT rows
    when a sequence has that many, else one row per block. Few rows: one row per block, the
    KV positions split into chunks (whole KV tiles of at least FA_MIN_CHUNK positions) until
    about FA_TARGET_BLOCKS blocks run, at most FA_MAX_SPLITS per row."""
    whole = (1, 1, max(nkv, 1))
    if rows >= FA_SPLIT_ROWS:
        return (FA_QT, 1, max(nkv, 1)) if nt >= FA_QT else whole
    splits = min(FA_MAX_SPLITS, -(-FA_TARGET_BLOCKS // max(rows, 1)), nkv // FA_MIN_CHUNK)
    if splits <= 1:
        return whole
    chunk = -(-nkv // splits)
    chunk = -(-chunk // FA_NT) * FA_NT
    return 1, -(-nkv // chunk), chunk


def fa_scratch(rows: int, splits: int, dv: int) -> tuple:
    """(device buffer, kernels' float32 view (1, rows, splits, dv + 2)) for the partial
    results of the split kernel: per row and chunk, the unnormalized output, then the chunk's
    running max and sum. The bound launch keeps the buffer alive."""
    t = Context().new_tensor(GGMLType.F32, (dv + 2, splits, rows))
    buf = R.alloc_bytes(t.nbytes)
    return buf, R.view(buf, 0, t)
