"""CPU kernel templates (compiled per type combination by ggraph.backends.jit).

Every tensor arrives as a 4-D array in numpy order (see backends/shared/codecs.py). Free names
are bound per call site: `dec_a`/`dec_b`/`dec_m` decode a row of a source to float32, `enc_d`
encodes a row into the destination, `dot_a` dots a stored row with float32 values; the shared
math (backends/shared: numeric, elementwise) is bound by name too. Rows are processed through
float32 scratch rows; reductions accumulate in float64 where ggml's tolerances are tight (norms,
softmax sums).
"""
import math

import numpy as np
from numba import prange
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(U_FILL, act_sums, alibi_slope, binary_row, dec_a, dec_b, dec_m, dec_r, dec_v, dot_a, dot_k,
 enc_d, enc_one, enc_r, expf, half_to_f32, norm_row, qdot_a, rope_cos_sin, round_half, rowdot_a,
 unary_row, unflatten) = bound(
    "U_FILL", "act_sums", "alibi_slope", "binary_row", "dec_a", "dec_b", "dec_m", "dec_r", "dec_v",
    "dot_a", "dot_k", "enc_d", "enc_one", "enc_r", "expf", "half_to_f32", "norm_row", "qdot_a",
    "rope_cos_sin", "round_half", "rowdot_a", "unary_row", "unflatten")
HALF_PF, prefetch = bound("HALF_PF", "prefetch")

ROW_RUN = 4096  # elements a parallel item of a short-row kernel handles (k_set_rows)


def k_unary(a, d, op, p0, p1):
    """op: a code of backends/shared/elementwise.py (U_*), p0/p1 its float32 parameters."""
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        row = np.empty(n0, np.float32)
        if op != U_FILL:  # (fill does not read a)
            dec_a(a, i3, i2, i1, row, n0)
        unary_row(op, row, p0, p1)
        enc_d(row, d, i3, i2, i1, n0)


def k_binary(a, b, d, op):
    """op: a code of backends/shared/elementwise.py (B_*); b broadcast by modulo."""
    n3, n2, n1, n0 = d.shape
    b3, b2, b1, b0 = b.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        y = np.empty(b0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        dec_b(b, i3 % b3, i2 % b2, i1 % b1, y, b0)
        binary_row(op, x, y)
        enc_d(x, d, i3, i2, i1, n0)


def k_norm(a, d, eps, rms):
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        norm_row(x, eps, rms)
        enc_d(x, d, i3, i2, i1, n0)


def k_soft_max(a, m, sinks, d, scale, max_bias, h0, n_head, has_mask, has_sinks):
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        slope = alibi_slope(h0 + i2, n_head, max_bias)
        if has_mask:
            mrow = np.empty(n0, np.float32)
            dec_m(m, i3 % m.shape[0], i2 % m.shape[1], i1, mrow, n0)
            for i in range(n0):
                x[i] = x[i] * scale + slope * mrow[i]
        else:
            for i in range(n0):
                x[i] = x[i] * scale
        mx = np.float32(-np.inf)
        for i in range(n0):
            mx = max(mx, x[i])
        sink = np.float32(0.0)
        if has_sinks:
            sink = np.float32(sinks[0, 0, 0, i2])
            mx = max(mx, sink)
        for i in range(n0):  # float32 exp (expf): the loop vectorizes
            x[i] = expf(x[i] - mx)
        s = 0.0
        for i in range(n0):
            s += x[i]
        if has_sinks:
            s += expf(sink - mx)
        inv = 1.0 / s
        for i in range(n0):
            x[i] = np.float32(x[i] * inv)
        enc_d(x, d, i3, i2, i1, n0)


def k_rope_table(pos, ff, cs, sn, n_dims, freq_base, freq_scale, ext_factor, attn_factor,
                 corr_lo, corr_hi, has_ff):
    """cs/sn[t, i]: cos and sin of pair i at position pos[0, 0, 0, t] (rope_cos_sin). The
    rope nodes of a graph with the same positions and parameters share one table (every
    layer's Q and K): computed by the first, read by all."""
    half = n_dims // 2
    for t in prange(cs.shape[0]):
        p = np.float64(pos[0, 0, 0, t])
        for i in range(half):
            cs[t, i], sn[t, i] = rope_cos_sin(p, i, n_dims, freq_base, freq_scale,
                                              ext_factor, attn_factor, corr_lo, corr_hi,
                                              np.float64(ff[0, 0, 0, i]) if has_ff else 1.0)


def k_rope(a, cs, sn, d, n_dims, neox):
    """a/d: (1?, T, n_head, head_dim) in numpy order, rotated by the table of k_rope_table."""
    n3, n2, n1, n0 = d.shape
    half = n_dims // 2
    for r in prange(n3 * n2):
        i3, i2 = r // n2, r % n2
        x = np.empty(n0, np.float32)
        for i1 in range(n1):
            dec_a(a, i3, i2, i1, x, n0)
            for i in range(half):
                c, s = cs[i2, i], sn[i2, i]
                j0 = i if neox else 2 * i
                j1 = i + half if neox else 2 * i + 1
                x0 = x[j0]
                x1 = x[j1]
                x[j0] = np.float32(x0 * c - x1 * s)
                x[j1] = np.float32(x0 * s + x1 * c)
            enc_d(x, d, i3, i2, i1, n0)


def k_get_rows(a, idx, d):
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, idx[0, i3, i2, i1], x, n0)
        enc_d(x, d, i3, i2, i1, n0)


def k_first_bad_index(idx, n):
    """The first index of 4-D idx (in memory order of its axes) outside [0, n), or -1 when
    all are inside: the check that row and expert ids come from data, in one compiled pass
    (numpy's min and max were two calls of ~1.5 us each, per node per token)."""
    n3, n2, n1, n0 = idx.shape
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                for i0 in range(n0):
                    v = idx[i3, i2, i1, i0]
                    if v < 0 or v >= n:
                        return (((i3 * n2) + i2) * n1 + i1) * n0 + i0
    return -1


def k_get_rows_int(a, idx, d):
    n3, n2, n1, n0 = d.shape
    for i3 in range(n3):
        for i2 in range(n2):
            for i1 in range(n1):
                src = idx[0, i3, i2, i1]
                for i0 in range(n0):
                    d[i3, i2, i1, i0] = a[i3, i2, src, i0]


def k_set_rows(s, idx, d):
    """Rows of s into d's rows idx. Short rows (a transposed V cache writes rows of one
    element, a cache column per channel) go in runs of about ROW_RUN elements per parallel
    item, one scratch row each, instead of an allocation per row."""
    n3, n2, n1, n0 = s.shape
    c2, c1 = idx.shape[1], idx.shape[2]
    nr = n3 * n2 * n1
    per = max(1, ROW_RUN // max(n0, 1))
    for ch in prange((nr + per - 1) // per):
        x = np.empty(n0, np.float32)
        r0 = ch * per
        i3, i2, i1 = r0 // (n2 * n1), (r0 // n1) % n2, r0 % n1
        j3, j2 = i3 % c2, i2 % c1
        for _ in range(r0, min(nr, r0 + per)):  # (i3, i2, i1) counted, not divided out
            dec_a(s, i3, i2, i1, x, n0)
            enc_d(x, d, i3, i2, idx[0, j3, j2, i1], n0)
            i1 += 1
            if i1 == n1:
                i1 = 0
                i2 += 1
                if i2 == n2:
                    i2 = 0
                    i3 += 1
                j3, j2 = i3 % c2, i2 % c1


def k_set_rows_1(s, idx, d):
    """k_set_rows for rows of one element from float32 (a transposed V cache: one cell of
    one channel each): each value converted by enc_one, in runs of ROW_RUN."""
    n3, n2, n1, _ = s.shape
    c2, c1 = idx.shape[1], idx.shape[2]
    nr = n3 * n2 * n1
    for ch in prange((nr + ROW_RUN - 1) // ROW_RUN):
        for r in range(ch * ROW_RUN, min(nr, (ch + 1) * ROW_RUN)):
            i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
            d[i3, i2, idx[0, i3 % c2, i2 % c1, i1], 0] = enc_one(s[i3, i2, i1, 0])


def k_copy(a, d, n0, m0):
    """Element-order copy with conversion; shapes may differ, element counts are equal.
    n0, m0: row lengths in elements (a quantized array's last axis counts bytes)."""
    n3, n2, n1 = a.shape[0], a.shape[1], a.shape[2]
    m3, m2, m1 = d.shape[0], d.shape[1], d.shape[2]
    flat = np.empty(n3 * n2 * n1 * n0, np.float32)
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        dec_a(a, i3, i2, i1, flat[r * n0:(r + 1) * n0], n0)
    for r in prange(m3 * m2 * m1):
        i3, i2, i1 = r // (m2 * m1), (r // m1) % m2, r % m1
        enc_d(flat[r * m0:(r + 1) * m0], d, i3, i2, i1, m0)


def k_copy_int(a, d):
    n3, n2, n1, n0 = a.shape
    m2, m1, m0 = d.shape[1], d.shape[2], d.shape[3]
    for k in range(n3 * n2 * n1 * n0):
        s3, s2, s1, s0 = unflatten(k, n2, n1, n0)
        j3, j2, j1, j0 = unflatten(k, m2, m1, m0)
        d[j3, j2, j1, j0] = a[s3, s2, s1, s0]


def k_repeat(a, d):
    n3, n2, n1, n0 = d.shape
    a3, a2, a1, a0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(a0, np.float32)
        y = np.empty(n0, np.float32)
        dec_a(a, i3 % a3, i2 % a2, i1 % a1, x, a0)
        for i in range(n0):
            y[i] = x[i % a0]
        enc_d(y, d, i3, i2, i1, n0)


def k_sum_rows(a, d):
    n3, n2, n1, n0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        s = 0.0
        for i in range(n0):
            s += x[i]
        d[i3, i2, i1, 0] = s


def k_argsort(a, d, desc, k):
    """The first k indices of each row's stable sort (descending when desc)."""
    n3, n2, n1, n0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        if desc:
            x = -x
        order = np.argsort(x, kind="mergesort")
        for i in range(k):
            d[i3, i2, i1, i] = order[i]


def k_mul_mat(a, b, d):
    """d[i3, i2, n, m] = row m of a's slice . row n of b's slice (block-repeat broadcast).

    One parallel loop over (slice, chunk of rows), so many small slices (attention heads at
    decode) cost one fork-join, not one per head."""
    n3, n2, nn, nm = d.shape
    a3, a2 = a.shape[0], a.shape[1]
    kk = b.shape[3]
    r3, r2 = n3 // a3, n2 // a2
    bs = np.empty((n3, n2, nn, kk), np.float32)
    for s in range(n3 * n2):
        for n in range(nn):
            dec_b(b, s // n2, s % n2, n, bs[s // n2, s % n2, n], kk)
    chunk = 64
    n_chunk = (nm + chunk - 1) // chunk
    for w in prange(n3 * n2 * n_chunk):
        s, c = w // n_chunk, w % n_chunk
        i3, i2 = s // n2, s % n2
        for m in range(c * chunk, min(nm, (c + 1) * chunk)):
            if kk < 0:  # never true; an exit LLVM cannot drop keeps it from vectorizing this
                break   # loop across rows (gathers): each row's dot vectorizes instead
            for n in range(nn):
                d[i3, i2, n, m] = dot_a(a, i3 // r3, i2 // r2, m, bs[i3, i2, n], kk)  # noqa


def k_dequant_rows(a, i3, i2, m0, out):
    """Rows m0 .. m0+len(out)-1 of a's slice (i3, i2) as float32 (for dequantize + BLAS)."""
    kk = out.shape[1]
    for m in prange(out.shape[0]):
        dec_a(a, i3, i2, m0 + m, out[m], kk)


def k_mul_mat_id(a, b, ids, d):
    """d[0, t, e, m] = row m of expert ids[t, e] . b[0, t, e % n_b, :]."""
    _, nt, ne, nm = d.shape
    nb = b.shape[2]
    kk = b.shape[3]
    for r in prange(nt * ne):
        t, e = r // ne, r % ne
        x = np.empty(kk, np.float32)
        dec_b(b, 0, t, e % nb, x, kk)
        ex = ids[0, 0, t, e]
        for m in range(nm):
            if kk < 0:  # never true: keeps LLVM from vectorizing across rows (see k_mul_mat)
                break
            d[0, t, e, m] = dot_a(a, 0, ex, m, x, kk)


def k_flash_attn(q, k, v, m, d, scale, max_bias, softcap, h0, n_head, has_mask):
    """q (S, H, T, Dk); k (Sk, Hkv, n_kv, Dk); v (Sk, Hkv, n_kv, Dv); d (S, T, H, Dv).
    Online softmax over n_kv; -inf mask entries are skipped."""
    ns, nh, nt, dk = q.shape
    hkv, nkv, dv = k.shape[1], k.shape[2], d.shape[3]
    rk2, rk3 = nh // hkv, ns // k.shape[0]
    for r in prange(ns * nh * nt):
        s, h, t = r // (nh * nt), (r // nt) % nh, r % nt
        qr = np.empty(dk, np.float32)
        for i in range(dk):
            qr[i] = q[s, h, t, i]
        acc = np.zeros(dv, np.float32)
        vr = np.empty(dv, np.float32)
        mrow = np.zeros(nkv, np.float32)
        if has_mask:
            dec_m(m, s % m.shape[0], h % m.shape[1], t, mrow, nkv)
        slope = alibi_slope(h0 + h, n_head, max_bias)
        mx = -np.inf
        ssum = 0.0
        ks, kh = s // rk3, h // rk2
        for j in range(nkv):
            if mrow[j] == -np.inf:
                continue
            sc = dot_k(k, ks, kh, j, qr, dk) * scale
            if softcap != 0.0:
                sc = softcap * math.tanh(sc)
            sc += slope * mrow[j]
            dec_v(v, ks, kh, j, vr, dv)
            if sc > mx:
                c = math.exp(mx - sc) if mx != -np.inf else 0.0
                for i in range(dv):
                    acc[i] = acc[i] * c + vr[i]
                ssum = ssum * c + 1.0
                mx = sc
            else:
                w = math.exp(sc - mx)
                for i in range(dv):
                    acc[i] += w * vr[i]
                ssum += w
        inv = 1.0 / ssum if ssum > 0.0 else 0.0
        for i in range(dv):
            d[s, t, h, i] = acc[i] * inv


def k_round_half_rows(b, out):
    """out = float32 b rounded to F16 and back, element by element (F16 weights' vec-dot
    type: k_round_rows without an encoded row between)."""
    n3, n2, n1, n0 = b.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        src = b[i3, i2, i1]
        dst = out[i3, i2, i1]
        for i in range(n0):
            dst[i] = round_half(src[i])


def k_round_rows(b, out, n, proto):
    """out = b's rows as ggml's dot products see them: encoded to the weights' vec-dot type
    (Q8_0 for 32-element quants, Q8_K blocks of 256 for K-quants and IQ4_XS, F16/BF16 for half
    weights) and decoded back through that type's codecs."""
    n3, n2, n1 = b.shape[0], b.shape[1], b.shape[2]
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n, np.float32)
        dec_b(b, i3, i2, i1, x, n)
        tmp = np.empty_like(proto)  # one stored row of the vec-dot type (bytes or uint16)
        enc_r(x, tmp, 0, 0, 0, n)
        dec_r(tmp, 0, 0, 0, out[i3, i2, i1], n)


def k_mul_mat_half(a, o3, o2, o1, a3, a2, nm, b, d, rnd):
    """Mat-vec products of F16 rows (the KV cache at decode, F16 weights) with a few columns.

    a: the flat uint16 memory a strided F16 tensor spans, row (j3, j2, m) starting at element
    j3*o3 + j2*o2 + m*o1 with unit stride along it, so each row is a contiguous slice whose
    conversion vectorizes (vcvtph2ps with F16C) whatever the view's other strides (K heads
    strided by a cache row, V^T channels by a cache column). Each row is read once: while in
    L1 it is dotted with every column of every b slice broadcast onto it (GQA: the query heads
    of one K/V head). One parallel loop over (i3, block of rows), each block taking the rows
    of every slice i2 in memory order (a K cache cell's heads are adjacent), asking for the
    rows HALF_PF ahead. b's values are rounded to F16 first when rnd (ggml's vec-dot type for
    F16 weights)."""
    n3, n2, nn = d.shape[0], d.shape[1], d.shape[2]
    kk = b.shape[3]
    r3, r2 = n3 // a3, n2 // a2
    bs = np.empty((n3, n2, nn, kk), np.float32)
    for s in range(n3 * n2):
        for n in range(nn):
            for i in range(kk):
                x = np.float32(b[s // n2, s % n2, n, i])
                bs[s // n2, s % n2, n, i] = round_half(x) if rnd else x
    chunk = max(1, 4096 // (kk * a2))
    n_chunk = (nm + chunk - 1) // chunk
    for w in prange(a3 * n_chunk):
        j3, c = w // n_chunk, w % n_chunk
        for m in range(c * chunk, min(nm, (c + 1) * chunk)):
            for j2 in range(a2):
                if kk < 0:  # never true: keeps LLVM from vectorizing across rows (k_mul_mat)
                    break
                o = j3 * o3 + j2 * o2 + m * o1
                for i in range(0, kk, 32):   # the row HALF_PF rows on (a hint: never faults)
                    prefetch(a, o + HALF_PF * o1 + i)
                src = a[o:o + kk]
                for i3 in range(j3 * r3, (j3 + 1) * r3):
                    for i2 in range(j2 * r2, (j2 + 1) * r2):
                        for n in range(nn):
                            v = bs[i3, i2, n]
                            acc = np.float32(0.0)
                            for i in range(kk):  # converting again beats a float32 row buffer
                                acc += half_to_f32(src[i]) * v[i]
                            d[i3, i2, n, m] = acc


def k_quant_rows(b, out, n):
    """out[i3, i2, i1] = b's row encoded to the weights' vec-dot type (Q8_0 / Q8_K blocks: the
    activations of the integer dot products), n elements."""
    n3, n2, n1 = b.shape[0], b.shape[1], b.shape[2]
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n, np.float32)
        dec_b(b, i3, i2, i1, x, n)
        enc_r(x, out, i3, i2, i1, n)


def k_mul_mat_rows(a, b, q, ys, d, kk, nb, sums):
    """d[i3, i2, n, m] = row m of a's slice . column b[i3, i2, n] (kk elements, nb blocks of
    a), as integer dots (rowdot_a: backends/cpu/qrows.py): each column is first
    encoded into q (the weights' vec-dot type: dec_b, enc_r) and, when `sums`, its per-block
    sums formed into ys (act_sums), serially (a few columns). Then one parallel loop over
    (slice, chunk of rows): numba gives each thread a contiguous run of chunks, so each streams
    its own part of the weights (and writes its own part of d); each row is dotted with every
    column while in L1."""
    n3, n2, nn, nm = d.shape
    a3, a2 = a.shape[0], a.shape[1]
    r3, r2 = n3 // a3, n2 // a2
    x = np.empty(kk, np.float32)
    for s in range(n3 * n2 * nn):  # a few columns: quantized here, in this one call
        i3, i2, n = s // (n2 * nn), (s // nn) % n2, s % nn
        dec_b(b, i3, i2, n, x, kk)
        enc_r(x, q, i3, i2, n, kk)
        if sums:
            act_sums(q[i3, i2, n], ys[i3, i2, n], kk // 32)
    chunk = 64
    n_chunk = (nm + chunk - 1) // chunk
    for w in prange(n3 * n2 * n_chunk):
        s, c = w // n_chunk, w % n_chunk
        i3, i2 = s // n2, s % n2
        for m in range(c * chunk, min(nm, (c + 1) * chunk)):
            x = a[i3 // r3, i2 // r2, m]
            for n in range(nn):
                d[i3, i2, n, m] = rowdot_a(x, q[i3, i2, n], ys[i3, i2, n], nb)


def k_mul_mat_id_q(a, q, ids, d, kk):
    """k_mul_mat_id with quantized activation rows q[0, t, e % n_b] (integer dots, qdot_a:
    backends/shared/qdot.py), kk elements per row."""
    _, nt, ne, nm = d.shape
    nb = q.shape[2]
    for r in prange(nt * ne):
        t, e = r // ne, r % ne
        ex = ids[0, 0, t, e]
        x = q[0, t, e % nb]
        for m in range(nm):
            d[0, t, e, m] = qdot_a(a, 0, ex, m, x, kk)
