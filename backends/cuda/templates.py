"""CUDA kernel templates: element-wise ops, norms, softmax, rope, rows, copies, sums, sorts.

Plain Python compiled per type combination by ggraph.backends.jit (`Target.bind`) with
cuda.jit; matrix products and attention are in templates_mm.py. Every tensor arrives as a 4-D
array in numpy order (see backends/shared/codecs.py). Free names are bound per role r
(a, b, d, m, k, v: the node's sources and destination) by kernels.py:
  ld_r / st_r      load / store one element as float32 (quantized: decodes its block)
  cdec_r / cenc_r  decode / encode `n` elements from element k0 of a row (a chunk)
  cdot_r           dot a chunk of a stored row with float32 values
  dot_r            dot a whole stored row (the shared codec)
  Q_r              whether r's type is quantized (a compile-time constant)
and the shared math by name (backends/shared: numeric, elementwise), among it `unflatten`, the
(i3, i2, i1, i0) of a flat index that every grid-stride loop over elements walks with.
No kernel keeps a whole row in scratch: rows are walked in chunks of CH elements (one quant
block) through cuda.local arrays, or reduced across a thread block through shared memory.
Kernels that ggml-alloc may run in place (a and d the same memory) read each element before
writing it from the same thread, with a barrier between a row's reads and its writes.
"""
import math

import numpy as np
from numba import cuda, float32, int32

from .runtime import SMALL, TARGET
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(BS, Q_a, Q_d, TS, U_FILL, binary_value, cdec, cdec_a, cenc_d, dec, dot, enc, ld_a, ld_b, ld_m,
 st_d, unary_value) = bound(
    "BS", "Q_a", "Q_d", "TS", "U_FILL", "binary_value", "cdec", "cdec_a", "cenc_d", "dec", "dot",
    "enc", "ld_a", "ld_b", "ld_m", "st_d", "unary_value")

CH = 32                          # chunk: one quant block; the unit of row-walking
EW_NT = 32 if SMALL else 256     # threads per block of element-wise kernels
ROW_NT = 8 if SMALL else 128     # threads per block of row kernels (power of two)
SORT_MAX = 2048                  # longest row argsort sorts in shared memory
SORT_NT = 8 if SMALL else 256
# for the raw kernels below (compiled from this module's globals, not bound by the Target)
unflatten = TARGET.fn("unflatten")


# ---- per-type device helpers (bound with dec/enc/dot, BS = block size, TS = bytes per
# block; element types use BS = TS = 1 because their last axis counts elements) -------------

def chunk_dec(x, i3, i2, i1, k0, n, out):
    lo = (k0 // BS) * TS
    dec(x[i3:i3 + 1, i2:i2 + 1, i1:i1 + 1, lo:lo + ((n + BS - 1) // BS) * TS],
        0, 0, 0, out, n)


def chunk_enc(v, x, i3, i2, i1, k0, n):
    lo = (k0 // BS) * TS
    enc(v, x[i3:i3 + 1, i2:i2 + 1, i1:i1 + 1, lo:lo + ((n + BS - 1) // BS) * TS],
        0, 0, 0, n)


def chunk_dot(x, i3, i2, i1, k0, n, v):
    lo = (k0 // BS) * TS
    return dot(x[i3:i3 + 1, i2:i2 + 1, i1:i1 + 1, lo:lo + ((n + BS - 1) // BS) * TS],  # noqa
               0, 0, 0, v, n)


def chunk_dec_big(x, i3, i2, i1, k0, n, out):
    """chunk_dec for types whose block is longer than a chunk (BS > CH: the K-quants, 256 per
    block): decode the whole block holding element k0 into scratch, copy the chunk's n
    elements out (chunks start at multiples of CH and never straddle a block)."""
    buf = cuda.local.array(BS, float32)
    lo = (k0 // BS) * TS
    dec(x[i3:i3 + 1, i2:i2 + 1, i1:i1 + 1, lo:lo + TS], 0, 0, 0, buf, BS)
    o = k0 % BS
    for e in range(n):
        out[e] = buf[o + e]


def chunk_dot_big(x, i3, i2, i1, k0, n, v):
    """chunk_dot for BS > CH: the chunk's elements decoded as in chunk_dec_big, then dotted."""
    buf = cuda.local.array(BS, float32)
    lo = (k0 // BS) * TS
    dec(x[i3:i3 + 1, i2:i2 + 1, i1:i1 + 1, lo:lo + TS], 0, 0, 0, buf, BS)
    o = k0 % BS
    s = float32(0.0)
    for e in range(n):
        s += buf[o + e] * v[e]
    return s


def block_load(x, i3, i2, i1, i0):
    """One element of a quantized row: decode its block (the shared decoder) and pick it."""
    buf = cuda.local.array(32, float32)
    cdec(x, i3, i2, i1, i0 - i0 % 32, 32, buf)
    return buf[i0 % 32]


def no_store(x, i3, i2, i1, i0, v):
    """Element stores into quantized rows do not exist (kernels encode whole chunks); bound
    as st_r for quantized r so that the never-taken element branch still compiles."""
    return


# ---- reductions across a thread block (ROW_NT threads, shared scratch of ROW_NT) ------------

@cuda.jit(device=True)
def block_sum(red, tid, v):
    red[tid] = v
    cuda.syncthreads()
    s = ROW_NT // 2
    while s > 0:
        if tid < s:
            red[tid] += red[tid + s]
        cuda.syncthreads()
        s //= 2
    total = red[0]
    cuda.syncthreads()  # everyone has read red[0] before the next reduction writes it
    return total


@cuda.jit(device=True)
def block_max(red, tid, v):
    red[tid] = v
    cuda.syncthreads()
    s = ROW_NT // 2
    while s > 0:
        if tid < s:
            red[tid] = max(red[tid], red[tid + s])
        cuda.syncthreads()
        s //= 2
    total = red[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def flat_at(x, k):
    """Element k of x in numpy order, whatever its shape (small parameter vectors)."""
    i3, i2, i1, i0 = unflatten(k, x.shape[1], x.shape[2], x.shape[3])
    return x[i3, i2, i1, i0]


# ---- element-wise ---------------------------------------------------------------------------

def k_unary(a, d, op, p0, p1):
    """op: a code of backends/shared/elementwise.py (U_*), p0/p1 its float32 parameters."""
    n3, n2, n1, n0 = d.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        x = p0
        if op != U_FILL:  # (fill does not read a)
            x = ld_a(a, i3, i2, i1, i0)
        st_d(d, i3, i2, i1, i0, np.float32(unary_value(op, x, p0, p1)))


def k_binary(a, b, d, op):
    """op: a code of backends/shared/elementwise.py (B_*); b broadcast by modulo."""
    n3, n2, n1, n0 = d.shape
    b3, b2, b1, b0 = b.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        x = ld_a(a, i3, i2, i1, i0)
        v = ld_b(b, i3 % b3, i2 % b2, i1 % b1, i0 % b0)
        st_d(d, i3, i2, i1, i0, np.float32(binary_value(op, x, v)))


# ---- rows reduced by one thread block each ------------------------------------------------

def k_norm(a, w1, w2, d, dn, dm, eps, rms, op1, op2, wn, wm):
    """Per row, in float32 as ggml's CUDA norm / rms_norm (eps: float32): mean, mean square.
    Then the fused chain of backends/cuda/fusion.py: with op1 >= 0 (a B_* code) the result
    is combined with float32 w1 broadcast by modulo, then with op2 >= 0 with w2 (a weight
    and a bias); the norm's value goes to dn with wn, op1's to dm with wm (someone reads
    them). Unfused: op1 = op2 = -1. Each thread reads an element of a before it writes the
    same element, so d (or dn, dm) may be a itself."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = d.shape
    u3, u2, u1, u0 = w1.shape
    v3, v2, v1, v0 = w2.shape
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        mean = np.float32(0.0)
        if not rms:
            s = np.float32(0.0)
            for i in range(tid, n0, ROW_NT):
                s += ld_a(a, i3, i2, i1, i)
            mean = block_sum(red, tid, s) / np.float32(n0)
        ss = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            c = ld_a(a, i3, i2, i1, i) - mean
            ss += c * c
        ss = block_sum(red, tid, ss)
        sc = np.float32(1.0) / math.sqrt(ss / np.float32(n0) + eps)
        for i in range(tid, n0, ROW_NT):
            y = (ld_a(a, i3, i2, i1, i) - mean) * sc
            if op1 >= 0:
                if wn:
                    dn[i3, i2, i1, i] = y
                y = np.float32(binary_value(op1, y, w1[i3 % u3, i2 % u2, i1 % u1,
                                                       i % u0]))
                if op2 >= 0:
                    if wm:
                        dm[i3, i2, i1, i] = y
                    y = np.float32(binary_value(op2, y, w2[i3 % v3, i2 % v2,
                                                           i1 % v1, i % v0]))
            st_d(d, i3, i2, i1, i, y)


def k_soft_max(a, m, sinks, d, scale, max_bias, h0, n_head, has_mask, has_sinks):
    """Per row, in float32 as ggml's CUDA soft_max (scale, max_bias: float32): w = a*scale +
    slope*mask, max, expf, sum, write."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = d.shape
    m3, m2 = m.shape[0], m.shape[1]
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        slope = alibi_slope_f32(h0 + i2, n_head, max_bias)
        mx = np.float32(-np.inf)
        for i in range(tid, n0, ROW_NT):
            w = ld_a(a, i3, i2, i1, i) * scale
            if has_mask:
                w += slope * ld_m(m, i3 % m3, i2 % m2, i1, i)
            mx = max(mx, w)
        mx = block_max(red, tid, mx)
        sink = np.float32(0.0)
        if has_sinks:
            sink = flat_at(sinks, i2)
            mx = max(mx, sink)
        s = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            w = ld_a(a, i3, i2, i1, i) * scale
            if has_mask:
                w += slope * ld_m(m, i3 % m3, i2 % m2, i1, i)
            s += math.exp(w - mx)
        s = block_sum(red, tid, s)
        if has_sinks:
            s += math.exp(sink - mx)
        inv = np.float32(1.0) / s
        for i in range(tid, n0, ROW_NT):
            w = ld_a(a, i3, i2, i1, i) * scale
            if has_mask:
                w += slope * ld_m(m, i3 % m3, i2 % m2, i1, i)
            st_d(d, i3, i2, i1, i, math.exp(w - mx) * inv)


@cuda.jit(device=True)
def alibi_slope_f32(h, n_head, max_bias):
    """ALiBi's slope of head h (the shared alibi_slope) in float32, as ggml's CUDA kernels."""
    if max_bias <= np.float32(0.0):
        return np.float32(1.0)
    n_log2 = 1
    while n_log2 * 2 <= n_head:
        n_log2 *= 2
    if h < n_log2:
        m0 = math.pow(np.float32(2.0), -max_bias / np.float32(n_log2))
        return math.pow(m0, np.float32(h + 1))
    m1 = math.pow(np.float32(2.0), -(max_bias / np.float32(2.0)) / np.float32(n_log2))
    return math.pow(m1, np.float32(2 * (h - n_log2) + 1))


def k_sum_rows(a, d, n0):
    """n0: elements per row (a quantized row's last axis counts bytes); summed in float32."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1 = a.shape[0], a.shape[1], a.shape[2]
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        s = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            s += ld_a(a, i3, i2, i1, i)
        s = block_sum(red, tid, s)
        if tid == 0:
            d[i3, i2, i1, 0] = s


def k_argsort(a, d, n0, desc, k):
    """The first k indices of each row's stable sort (descending when desc): a bitonic sort of
    (key, index) pairs in shared memory, rows of at most SORT_MAX elements."""
    keys = cuda.shared.array(SORT_MAX, float32)
    ids = cuda.shared.array(SORT_MAX, int32)
    tid = cuda.threadIdx.x
    n3, n2, n1 = a.shape[0], a.shape[1], a.shape[2]
    p = 1
    while p < n0:
        p *= 2
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        for i in range(tid, p, SORT_NT):
            if i < n0:
                x = ld_a(a, i3, i2, i1, i)
                keys[i] = -x if desc else x
            else:
                keys[i] = np.inf  # padding sorts last: key inf, index past every real one
            ids[i] = i
        cuda.syncthreads()
        size = 2
        while size <= p:
            stride = size // 2
            while stride > 0:
                for i in range(tid, p, SORT_NT):
                    j = i ^ stride
                    if j > i:
                        ki, kj = keys[i], keys[j]
                        gt = ki > kj or (ki == kj and ids[i] > ids[j])
                        if gt == ((i & size) == 0):
                            keys[i], keys[j] = kj, ki
                            t = ids[i]
                            ids[i] = ids[j]
                            ids[j] = t
                cuda.syncthreads()
                stride //= 2
            size *= 2
        for i in range(tid, k, SORT_NT):
            d[i3, i2, i1, i] = ids[i]
        cuda.syncthreads()


# ---- rope -----------------------------------------------------------------------------------

def k_rope(a, pos, ff, d, n_dims, neox, freq_base, freq_scale, ext_factor, attn_factor,
           corr_lo, corr_hi, has_ff):
    """One thread per rotated pair or copied element; a/d: (1?, T, n_head, head_dim)."""
    n3, n2, n1, n0 = d.shape
    half = n_dims // 2
    w = half + (n0 - n_dims)
    for k in range(cuda.grid(1), n3 * n2 * n1 * w, cuda.gridsize(1)):
        i3, i2, i1, it = unflatten(k, n2, n1, w)
        if it >= half:  # dims past n_dims are copied
            j = n_dims + it - half
            st_d(d, i3, i2, i1, j, ld_a(a, i3, i2, i1, j))
            continue
        i = it
        c, s = rope_cos_sin_f32(np.float32(pos[0, 0, 0, i2]), i, n_dims, freq_base, freq_scale,
                                ext_factor, attn_factor, corr_lo, corr_hi,
                                flat_at(ff, i) if has_ff else np.float32(1.0))
        j0 = i if neox else 2 * i
        j1 = i + half if neox else 2 * i + 1
        x0 = ld_a(a, i3, i2, i1, j0)
        x1 = ld_a(a, i3, i2, i1, j1)
        st_d(d, i3, i2, i1, j0, x0 * c - x1 * s)
        st_d(d, i3, i2, i1, j1, x0 * s + x1 * c)


@cuda.jit(device=True)
def rope_cos_sin_f32(p, i, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr_lo,
                     corr_hi, ff):
    """The shared rope_cos_sin in float32, as ggml's CUDA rope (all parameters float32):
    theta = p * base^(-2i/n_dims) / ff, YaRN's ramp and magnitude correction, cosf/sinf."""
    theta_extrap = p * math.pow(freq_base, np.float32(-2.0) * np.float32(i) / np.float32(n_dims)) / ff
    theta_interp = freq_scale * theta_extrap
    theta = theta_interp
    mscale = attn_factor
    if ext_factor != np.float32(0.0):
        y = (np.float32(i) - corr_lo) / max(np.float32(0.001), corr_hi - corr_lo)
        ramp = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))) * ext_factor
        theta = theta_interp * (np.float32(1.0) - ramp) + theta_extrap * ramp
        mscale *= np.float32(1.0) + np.float32(0.1) * math.log(np.float32(1.0) / freq_scale)
    return math.cos(theta) * mscale, math.sin(theta) * mscale


# ---- rows and copies ------------------------------------------------------------------------

def k_get_rows(a, idx, d):
    """One thread per chunk of an output row: decode the chunk of the picked source row."""
    vals = cuda.local.array(CH, float32)
    n3, n2, n1, n0 = d.shape
    nch = (n0 + CH - 1) // CH
    for k in range(cuda.grid(1), n3 * n2 * n1 * nch, cuda.gridsize(1)):
        i3, i2, i1, c = unflatten(k, n2, n1, nch)
        k0 = c * CH
        n = min(CH, n0 - k0)
        cdec_a(a, i3, i2, idx[0, i3, i2, i1], k0, n, vals)
        for e in range(n):
            d[i3, i2, i1, k0 + e] = vals[e]


def k_set_rows(s, idx, d):
    """One thread per chunk of a source row: encode it into the chunk of the picked row
    (quantized destinations: exactly the shared encoder's bytes)."""
    vals = cuda.local.array(CH, float32)
    n3, n2, n1, n0 = s.shape
    c2, c1 = idx.shape[1], idx.shape[2]
    nch = (n0 + CH - 1) // CH
    for k in range(cuda.grid(1), n3 * n2 * n1 * nch, cuda.gridsize(1)):
        i3, i2, i1, c = unflatten(k, n2, n1, nch)
        k0 = c * CH
        n = min(CH, n0 - k0)
        for e in range(n):
            vals[e] = ld_a(s, i3, i2, i1, k0 + e)
        cenc_d(vals, d, i3, i2, idx[0, i3 % c2, i2 % c1, i1], k0, n)


def k_copy_elem(a, d):
    """Element-order copy converting between element types (one thread per element)."""
    n3, n2, n1, n0 = a.shape
    m2, m1, m0 = d.shape[1], d.shape[2], d.shape[3]
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        j3, j2, j1, j0 = unflatten(k, m2, m1, m0)
        st_d(d, j3, j2, j1, j0, ld_a(a, i3, i2, i1, i0))


def k_copy_chunks(a, d, n0, m0):
    """Element-order copy when either side is quantized: one thread per CH elements (a block
    of the quantized side; element counts are then multiples of CH). n0, m0: elements per
    row of a and d (a quantized array's last axis counts bytes)."""
    vals = cuda.local.array(CH, float32)
    n2, n1 = a.shape[1], a.shape[2]
    m2, m1 = d.shape[1], d.shape[2]
    total = a.shape[0] * n2 * n1 * n0
    for q in range(cuda.grid(1), total // CH, cuda.gridsize(1)):
        k0 = q * CH
        if Q_a:
            i3, i2, i1, i0 = unflatten(k0, n2, n1, n0)
            cdec_a(a, i3, i2, i1, i0, CH, vals)
        else:
            for e in range(CH):
                i3, i2, i1, i0 = unflatten(k0 + e, n2, n1, n0)
                vals[e] = ld_a(a, i3, i2, i1, i0)
        if Q_d:
            j3, j2, j1, j0 = unflatten(k0, m2, m1, m0)
            cenc_d(vals, d, j3, j2, j1, j0, CH)
        else:
            for e in range(CH):
                j3, j2, j1, j0 = unflatten(k0 + e, m2, m1, m0)
                st_d(d, j3, j2, j1, j0, vals[e])


# ---- raw (type-preserving) kernels: numba specializes them on the array dtypes -------------

@cuda.jit
def k_copy_raw(a, d):
    """d's elements (or row bytes) = a's, in element order; shapes may differ."""
    n3, n2, n1, n0 = a.shape
    m2, m1, m0 = d.shape[1], d.shape[2], d.shape[3]
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        j3, j2, j1, j0 = unflatten(k, m2, m1, m0)
        d[j3, j2, j1, j0] = a[i3, i2, i1, i0]


@cuda.jit
def k_get_rows_raw(a, idx, d):
    n3, n2, n1, n0 = d.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        d[i3, i2, i1, i0] = a[i3, i2, idx[0, i3, i2, i1], i0]


@cuda.jit
def k_concat(a, b, d, axis):
    """axis in numpy order (3 - dim); quantized rows concatenate whole blocks as bytes."""
    n3, n2, n1, n0 = d.shape
    cut = a.shape[axis]
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        c = i3 if axis == 0 else (i2 if axis == 1 else (i1 if axis == 2 else i0))
        if c < cut:
            d[i3, i2, i1, i0] = a[i3, i2, i1, i0]
        elif axis == 0:
            d[i3, i2, i1, i0] = b[i3 - cut, i2, i1, i0]
        elif axis == 1:
            d[i3, i2, i1, i0] = b[i3, i2 - cut, i1, i0]
        elif axis == 2:
            d[i3, i2, i1, i0] = b[i3, i2, i1 - cut, i0]
        else:
            d[i3, i2, i1, i0] = b[i3, i2, i1, i0 - cut]


@cuda.jit
def k_repeat(a, d):
    n3, n2, n1, n0 = d.shape
    a3, a2, a1, a0 = a.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        d[i3, i2, i1, i0] = a[i3 % a3, i2 % a2, i1 % a1, i0 % a0]


@cuda.jit
def k_fill_bytes(buf, value):
    for k in range(cuda.grid(1), buf.shape[0], cuda.gridsize(1)):
        buf[k] = value
