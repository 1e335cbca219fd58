"""Integer matrix products of quantized weights with a batch of activation columns (prompt
ubatches) on the CPU: the activations quantized to the weights' vec_dot_type and every
product summed in integers, as ggml's vec_dot functions do, in tiles of 2 weight rows by 4
columns, so each loaded weight vector serves 4 columns and each activation vector 2 rows.

Both sides are first rewritten into one layout, whatever the weight type ("unpacked"):
- a row is cut into sub-blocks of SUB elements (32: the 32-element quants, Q4_K and Q5_K,
  whose scales are per 32; 16: Q6_K, whose scales are per 16), and sub-blocks into groups of
  8, zero-padded at the row's end;
- per sub-block j the weights are unsigned integers u (at most 8 bits) with a float scale
  ws_j and offset wm_j, w = ws_j * u + wm_j; the activations are int8 quants a with a scale
  as_j and am_j = as_j * sum(a) over the sub-block (Q4_1/Q5_1: Q8_1's f16-rounded sum);
- a group's integers are interleaved by 4 bytes: byte 32 t + 4 j + i holds element 4 t + i
  of sub-block j, so one vpdpbusd over 32 bytes adds 4 products to each of 8 lanes, lane j
  summing sub-block j. After SUB / 4 steps, lane j holds sub-block j's whole integer dot, and
  one vector step applies the 8 sub-blocks' scales: acc += float(dot) * ws * as + wm * am.

So sum(w * x) over a sub-block is ws * as * sum(u * a) + wm * am: the integer sum ggml forms
(ggml subtracts Q4_0's 8 or Q6_K's 32 inside the integers; here it is the float wm * am term)
times the same scales. Each thread unpacks a chunk of CHUNK weight rows into its own scratch
(L2-sized) once, then sweeps every column through it. All sums run in a fixed order per output
element, whatever the thread count.

Per weight type, `unpack_<type>(row, nsub, qn, wf)` writes row's integers in natural order
into qn and its (ws, wm) pairs into wf (group g's 8 ws at 16 g, its 8 wm at 16 g + 8); per
activation type, `acts_<type>(e, nsub, qn, af)` does the same from one column encoded by the
type's codec (e). `interleave` then reorders a natural row into the layout. The helpers
`_half_row`, `_f32_row`, `_k4_scale`, `_k4_min`, `_f16_round` are the shared codec helpers the
CPU target binds (backends/jit.py); SUB, ROUND_SUMS, unpack, acts and the codecs are bound per
type (backends/cpu/kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit, prange

from ggraph.ir.types import GGMLType
from .qvec import AVX2, VNNI, dot4_acc, f8_blk, f8_sum, f8_zero, i32_zero, ld32, ldf8
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
(ROUND_SUMS, SUB, _f16_round, _f32_row, _half_row, _k4_min, _k4_scale, acts, dec_b, enc_r,
 unpack) = bound(
    "ROUND_SUMS", "SUB", "_f16_round", "_f32_row", "_half_row", "_k4_min", "_k4_scale", "acts",
    "dec_b", "enc_r", "unpack")

CHUNK = 64  # weight rows a thread unpacks and sweeps all columns through (fixed: see above)


@njit(inline="always")
def _put(wf, j, ws, wm):
    """Sub-block j's weight scale and offset into the row's float part."""
    o = 16 * (j // 8) + j % 8
    wf[o] = ws
    wf[o + 8] = wm


# ---- weights: one stored row to unsigned integers (natural order) and (ws, wm) per sub-block

@njit(inline="always")
def _q4_fill(row, o, qn, j):
    """A 32-element block of 4-bit values: 16 bytes at o, low nibbles first."""
    for i in range(16):
        v = row[o + i]
        qn[32 * j + i] = v & 15
        qn[32 * j + 16 + i] = v >> 4


def unpack_q4_0(row, nsub, qn, wf):
    for j in range(nsub):
        _q4_fill(row, 18 * j + 2, qn, j)
        d = _half_row(row, 18 * j)
        _put(wf, j, d, np.float32(-8.0) * d)


def unpack_q4_1(row, nsub, qn, wf):
    for j in range(nsub):
        _q4_fill(row, 20 * j + 4, qn, j)
        _put(wf, j, _half_row(row, 20 * j), _half_row(row, 20 * j + 2))


@njit(inline="always")
def _q5_fill(row, o, hb, qn, j):
    """A 32-element block of 5-bit values: 16 bytes of nibbles at o, the fifth bits in the
    little-endian 32-bit word at hb."""
    h = (np.uint32(row[hb]) | (np.uint32(row[hb + 1]) << 8) | (np.uint32(row[hb + 2]) << 16)
         | (np.uint32(row[hb + 3]) << 24))
    for i in range(16):
        v = row[o + i]
        qn[32 * j + i] = (v & 15) | (((h >> i) & 1) << 4)
        qn[32 * j + 16 + i] = (v >> 4) | (((h >> (i + 16)) & 1) << 4)


def unpack_q5_0(row, nsub, qn, wf):
    for j in range(nsub):
        o = 22 * j
        _q5_fill(row, o + 6, o + 2, qn, j)
        d = _half_row(row, o)
        _put(wf, j, d, np.float32(-16.0) * d)


def unpack_q5_1(row, nsub, qn, wf):
    for j in range(nsub):
        o = 24 * j
        _q5_fill(row, o + 8, o + 4, qn, j)
        _put(wf, j, _half_row(row, o), _half_row(row, o + 2))


def unpack_q8_0(row, nsub, qn, wf):
    """Signed int8 weights as u = q + 128 (u8), wm = -128 d."""
    for j in range(nsub):
        o = 34 * j
        for i in range(32):
            qn[32 * j + i] = row[o + 2 + i] ^ 128
        d = _half_row(row, o)
        _put(wf, j, d, np.float32(-128.0) * d)


def k_nibbles(row, nsub, qn, wf, size, qoff):
    """Q4_K / Q5_K super-blocks of `size` bytes, their nibbles from byte qoff: 64 values per
    32 bytes (low nibbles, then high), scales and mins at byte 4, f16 d and dmin first."""
    for b in range(nsub // 8):
        o = size * b
        d, dmin = _half_row(row, o), _half_row(row, o + 2)
        for p in range(4):
            q, e = o + qoff + 32 * p, 256 * b + 64 * p
            for i in range(32):
                v = row[q + i]
                qn[e + i] = v & 15
                qn[e + 32 + i] = v >> 4
        for j in range(8):
            _put(wf, 8 * b + j, d * _k4_scale(row, o + 4, j),
                 -(dmin * _k4_min(row, o + 4, j)))


def unpack_q4_k(row, nsub, qn, wf):
    k_nibbles(row, nsub, qn, wf, 144, 16)


def unpack_q5_k(row, nsub, qn, wf):
    """Q4_K's nibbles with a fifth bit from the 32-byte plane at byte 16: bit 2p + h of byte
    i for value i of sub-block 2p + h."""
    k_nibbles(row, nsub, qn, wf, 176, 48)
    for b in range(nsub // 8):
        for j in range(8):
            e = 256 * b + 32 * j
            for i in range(32):
                qn[e + i] |= ((row[176 * b + 16 + i] >> j) & 1) << 4


def unpack_q6_k(row, nsub, qn, wf):
    """Sub-blocks of 16: u = the 6-bit value, ws = d * scale, wm = -32 ws."""
    for b in range(nsub // 16):
        o = 210 * b
        d = _half_row(row, o + 208)
        for nn in range(2):
            lo, ho, e = o + 64 * nn, o + 128 + 32 * nn, 256 * b + 128 * nn
            for i in range(32):
                a, c, h = row[lo + i], row[lo + 32 + i], row[ho + i]
                qn[e + i] = (a & 15) | ((h & 3) << 4)
                qn[e + 32 + i] = (c & 15) | (((h >> 2) & 3) << 4)
                qn[e + 64 + i] = (a >> 4) | (((h >> 4) & 3) << 4)
                qn[e + 96 + i] = (c >> 4) | (((h >> 6) & 3) << 4)
        for i in range(16):
            ws = d * np.float32(np.int8(row[o + 192 + i]))
            _put(wf, 16 * b + i, ws, np.float32(-32.0) * ws)


# ---- activations: one encoded column to int8 quants (natural order) and (as, am) ----------

def acts_q8_0(e, nsub, qn, af, sub):
    """Q8_0 blocks (f16 d, 32 int8): as = d, am = d * sum, rounded to f16 where ROUND_SUMS
    (Q4_1 / Q5_1 weights: the sum Q8_1 stores)."""
    for j in range(nsub):
        o = 34 * j
        t = 0
        for i in range(32):
            v = e[o + 2 + i]
            qn[32 * j + i] = v
            t += np.int32(np.int8(v))
        d = _half_row(e, o)
        am = np.float32(d * np.float32(t))
        _put(af, j, d, _f16_round(am) if ROUND_SUMS else am)


def acts_q8_k(e, nsub, qn, af, sub):
    """Q8_K blocks (f32 d, 256 int8, 16 int16 sums of 16), sub-blocks of sub (16 or 32)."""
    per = 256 // sub
    for b in range(nsub // per):
        o = 292 * b
        for i in range(256):
            qn[256 * b + i] = e[o + 4 + i]
        d = _f32_row(e, o)
        for j in range(per):
            t = 0
            for h in range(sub // 16):
                k = o + 260 + 2 * (j * (sub // 16) + h)
                t += np.int32(np.int16(np.uint16(e[k]) | (np.uint16(e[k + 1]) << 8)))
            _put(af, per * b + j, d, d * np.float32(t))


def layout_width(nsub: int, sub: int) -> int:
    """Bytes of a row of nsub sub-blocks of sub elements in the GEMM layout: whole groups of
    8 sub-blocks, a last group of at most 4 packed into half the steps (below), zero-padded."""
    rem = nsub % 8
    return (nsub // 8) * 8 * sub + (0 if rem == 0 else 4 * sub if rem <= 4 else 8 * sub)


@njit(inline="always")
def interleave(qn, out, f, nsub, st):
    """Row qn (natural order, sub-blocks of 4 st bytes) into the GEMM layout: 32-bit word t
    of sub-block j of a group goes to word 8 t + j. A last group of at most 4 sub-blocks
    takes half the steps: word t of sub-block j goes to lane j (t < st / 2) or j + 4 (the
    rest), so f (that row's floats) gets ws copied to lanes 4-7 (their wm stays 0: each
    sub-block's offset counted once)."""
    src, dst = qn.view(np.uint32), out.view(np.uint32)
    full, rem = nsub // 8, nsub % 8
    for g in range(full + (rem > 4)):
        base = 8 * st * g
        for t in range(st):
            for j in range(8):
                dst[base + 8 * t + j] = src[base + st * j + t]
    if 0 < rem <= 4:
        base, hs = 8 * st * full, st // 2
        for t in range(hs):
            for j in range(8):
                dst[base + 8 * t + j] = src[base + st * (j % 4) + t + hs * (j // 4)]
        for j in range(4):
            f[16 * full + 4 + j] = f[16 * full + j]


# ---- the kernels ------------------------------------------------------------------------

def k_gemm_acts(b, aq, af, kk, nsub, ebytes, sub):
    """Every column of b (kk elements) encoded by the activation codec (dec_b, enc_r) and
    unpacked into aq (integers, GEMM layout, sub-blocks of sub) and af (as, am)."""
    n3, n2, nn = aq.shape[0], aq.shape[1], aq.shape[2]
    for s in prange(n3 * n2 * nn):
        i3, i2, n = s // (n2 * nn), (s // nn) % n2, s % nn
        x = np.empty(kk, np.float32)
        dec_b(b, i3, i2, n, x, kk)
        e = np.empty((1, 1, 1, ebytes), np.uint8)
        enc_r(x, e, 0, 0, 0, kk)
        qn = np.zeros(8 * sub * -(-nsub // 8), np.uint8)
        af[i3, i2, n, :] = 0.0
        acts(e[0, 0, 0], nsub, qn, af[i3, i2, n], sub)
        interleave(qn, aq[i3, i2, n], af[i3, i2, n], nsub, sub // 4)


def k_gemm(a, aq, af, d, nsub):
    """d[i3, i2, n, m] = row m of a's slice . column n, from aq/af (k_gemm_acts)."""
    n3, n2, nn, nm = d.shape
    a3, a2 = a.shape[0], a.shape[1]
    r3, r2 = n3 // a3, n2 // a2
    width = aq.shape[3]
    full, rem = nsub // 8, nsub % 8
    ng = full + (rem > 0)
    steps = SUB // 4
    n_chunk = (nm + CHUNK - 1) // CHUNK
    for w in prange(n3 * n2 * n_chunk):
        s, c = w // n_chunk, w % n_chunk
        i3, i2 = s // n2, s % n2
        m0 = c * CHUNK
        rows = min(nm, m0 + CHUNK) - m0
        wq = np.empty((rows, width), np.uint8)
        wf = np.zeros((rows, 16 * ng), np.float32)
        qn = np.zeros(8 * SUB * ng, np.uint8)
        for r in range(rows):
            unpack(a[i3 // r3, i2 // r2, m0 + r], nsub, qn, wf[r])
            interleave(qn, wq[r], wf[r], nsub, steps)
        for c0 in range(0, nn, 4):
            c1, c2, c3 = min(c0 + 1, nn - 1), min(c0 + 2, nn - 1), min(c0 + 3, nn - 1)
            x0, x1, x2, x3 = aq[i3, i2, c0], aq[i3, i2, c1], aq[i3, i2, c2], aq[i3, i2, c3]
            f0, f1, f2, f3 = af[i3, i2, c0], af[i3, i2, c1], af[i3, i2, c2], af[i3, i2, c3]
            for r in range(0, rows, 2):
                rb = min(r + 1, rows - 1)
                w0, w1, v0, v1 = wq[r], wq[rb], wf[r], wf[rb]
                s00, s01, s02, s03 = f8_zero(), f8_zero(), f8_zero(), f8_zero()
                s10, s11, s12, s13 = f8_zero(), f8_zero(), f8_zero(), f8_zero()
                for g in range(ng):
                    i00, i01, i02, i03 = i32_zero(), i32_zero(), i32_zero(), i32_zero()
                    i10, i11, i12, i13 = i32_zero(), i32_zero(), i32_zero(), i32_zero()
                    for t in range(steps if g < full or rem > 4 else steps // 2):
                        p = 8 * SUB * g + 32 * t
                        y0, y1, y2, y3 = ld32(x0, p), ld32(x1, p), ld32(x2, p), ld32(x3, p)
                        q = ld32(w0, p)
                        i00, i01 = dot4_acc(i00, q, y0), dot4_acc(i01, q, y1)
                        i02, i03 = dot4_acc(i02, q, y2), dot4_acc(i03, q, y3)
                        q = ld32(w1, p)
                        i10, i11 = dot4_acc(i10, q, y0), dot4_acc(i11, q, y1)
                        i12, i13 = dot4_acc(i12, q, y2), dot4_acc(i13, q, y3)
                    h = 16 * g
                    a0, a1, a2_, a3_ = ldf8(f0, h), ldf8(f1, h), ldf8(f2, h), ldf8(f3, h)
                    m0_, m1_ = ldf8(f0, h + 8), ldf8(f1, h + 8)
                    m2_, m3_ = ldf8(f2, h + 8), ldf8(f3, h + 8)
                    ws, wm = ldf8(v0, h), ldf8(v0, h + 8)
                    s00, s01 = f8_blk(s00, i00, ws, a0, wm, m0_), f8_blk(s01, i01, ws, a1, wm, m1_)
                    s02, s03 = f8_blk(s02, i02, ws, a2_, wm, m2_), f8_blk(s03, i03, ws, a3_, wm, m3_)
                    ws, wm = ldf8(v1, h), ldf8(v1, h + 8)
                    s10, s11 = f8_blk(s10, i10, ws, a0, wm, m0_), f8_blk(s11, i11, ws, a1, wm, m1_)
                    s12, s13 = f8_blk(s12, i12, ws, a2_, wm, m2_), f8_blk(s13, i13, ws, a3_, wm, m3_)
                m = m0 + r
                d[i3, i2, c0, m] = f8_sum(s00)
                if c0 + 1 < nn:
                    d[i3, i2, c1, m] = f8_sum(s01)
                if c0 + 2 < nn:
                    d[i3, i2, c2, m] = f8_sum(s02)
                if c0 + 3 < nn:
                    d[i3, i2, c3, m] = f8_sum(s03)
                if r + 1 < rows:
                    d[i3, i2, c0, m + 1] = f8_sum(s10)
                    if c0 + 1 < nn:
                        d[i3, i2, c1, m + 1] = f8_sum(s11)
                    if c0 + 2 < nn:
                        d[i3, i2, c2, m + 1] = f8_sum(s12)
                    if c0 + 3 < nn:
                        d[i3, i2, c3, m + 1] = f8_sum(s13)


# ---- which weight types the GEMM takes ---------------------------------------------------

@dataclass(frozen=True)
class Gemm:
    """A weight type's unpacker, its sub-block size and its activations' unpacker (with
    Q8_1's f16-rounded sums where `round_sums`)."""
    unpack: Callable
    sub: int
    acts: Callable
    round_sums: bool = False


T = GGMLType
GEMMS: dict[GGMLType, Gemm] = {
    T.Q4_0: Gemm(unpack_q4_0, 32, acts_q8_0), T.Q4_1: Gemm(unpack_q4_1, 32, acts_q8_0, True),
    T.Q5_0: Gemm(unpack_q5_0, 32, acts_q8_0), T.Q5_1: Gemm(unpack_q5_1, 32, acts_q8_0, True),
    T.Q4_K: Gemm(unpack_q4_k, 32, acts_q8_k), T.Q5_K: Gemm(unpack_q5_k, 32, acts_q8_k),
    T.Q6_K: Gemm(unpack_q6_k, 16, acts_q8_k),
}
# Q8_0's u = q + 128 reaches 255: AVX2's vpmaddubsw (no VNNI) would saturate its i16 pairs
if VNNI or not AVX2:
    GEMMS[T.Q8_0] = Gemm(unpack_q8_0, 32, acts_q8_0)
