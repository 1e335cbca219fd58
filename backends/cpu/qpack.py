"""The packed weight layout of the CPU's decode mat-vec: R rows interleaved block by block,
built once per weight (as llama.cpp's CPU_REPACK buffer is) and read as one stream.

A weight of M rows and nb blocks per row becomes ceil(M / R) groups of R rows (the last
zero-padded); a group is nb tiles, one per block, in block order, and groups follow each other.
So a thread that takes a run of groups reads one contiguous stretch of memory front to back.
A tile holds the same block of R rows, field by field:

- quant bytes interleaved by 4: 4-byte group g of every row in turn (R * 4 bytes), then group
  g + 1, ...: one 4R-byte load holds bytes 4g..4g+3 of each row (backends/cpu/qlanes.py);
- a fifth bit (Q5_0, Q5_1, Q5_K) as byte masks: for quant group g, the mask of its low
  nibbles then of its high nibbles, 4R bits each, bit 4 l + i for byte i of row l;
- per-row scales as R consecutive values of their type (f16 d, dmin, m; Q6_K's sub-block
  scales as bytes, R per sub-block; Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins as
  stored, as 12 planes of R, which the product reads four at a load and decodes:
  backends/cpu/qlanes.py's ld6);
- Q8_0's int8 quants are stored + 128 (unsigned: vpdpbusd's left side), IQ4_XS's scales as
  their signed value ls - 32.

Tiles are as large as the original blocks, a few bytes more for IQ4_XS's decoded scales (138 /
136 bytes per row and block). Q4_K's tile once held decoded scales (148 / 144), and Q5_K's
(180 / 176, its mins by pairs of sub-blocks for vpdpwssd against pairs of activation sums); as
stored, read by a tile that takes its header's lines first (qtiles.k_tile), both stream
faster cold (qtiles.k_pair and k_tile have the figures), while 512-column products decode
them again every 4 columns (Q4_K 0.95-0.975x before the header was read first, 0.999x after).
`pack(t, data)` builds the layout (numpy, vectorized per field), `unpack` restores the
original bytes (the tests check that the two are inverse); `PACKS` says which types have a
layout and where each field sits in a tile (the tile functions of backends/cpu/qtiles.py read
them).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit, prange

from ggraph.ir.types import TYPE_RECORDS
from ggraph.ir.types import GGMLType
from .qlanes import R, bytes_exact
from .qmem import load_u32

T = GGMLType


@dataclass(frozen=True)
class Pack:
    """A type's tile: its bytes per row (`row_bytes`; a tile holds r rows), and `full_u8`: its
    packed quants reach 128..255, which vpmaddubsw (no VNNI) would saturate."""
    row_bytes: int
    full_u8: bool = False

    def tile(self, r: int = R) -> int:
        return self.row_bytes * r


# bytes per row of one tile, per type (the original block size, plus decoded scales for
# IQ4_XS)
PACKS: dict[GGMLType, Pack] = {
    T.Q4_0: Pack(18), T.Q4_1: Pack(20), T.Q5_0: Pack(22), T.Q5_1: Pack(24),
    T.Q8_0: Pack(34, full_u8=True), T.Q4_K: Pack(144), T.Q5_K: Pack(176), T.Q6_K: Pack(210),
    T.IQ4_XS: Pack(138, full_u8=True),
}


def packable(t: GGMLType, ne: tuple[int, ...], r: int = R) -> bool:
    """Whether a weight of type t and shape ne (2-D, whole blocks) takes the packed layout
    of r rows on this host (types whose quants reach 128 need VNNI's products)."""
    p = PACKS.get(t)
    return p is not None and (bytes_exact(r) or not p.full_u8) and \
        all(n == 1 for n in ne[2:]) and ne[0] % TYPE_RECORDS[t].block_size == 0


def packed_nbytes(t: GGMLType, ne: tuple[int, ...], r: int = R) -> int:
    groups = -(-ne[1] // r)
    return groups * (ne[0] // TYPE_RECORDS[t].block_size) * PACKS[t].tile(r)


# ---- helpers over (G, R, nb, bytes) views ---------------------------------------------------

def _dwords(q: np.ndarray) -> np.ndarray:
    """(G, R, nb, n) quant bytes -> (G, nb, n * R) interleaved by 4 bytes."""
    g, r, nb, n = q.shape
    return q.reshape(g, r, nb, n // 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, n * r)


def _undwords(p: np.ndarray, n: int, r: int) -> np.ndarray:
    g, nb, _ = p.shape
    return p.reshape(g, nb, n // 4, r, 4).transpose(0, 3, 1, 2, 4).reshape(g, r, nb, n)


def _per_row(x: np.ndarray) -> np.ndarray:
    """(G, R, nb, k) per-row fields -> (G, nb, k * R): field j of every row in turn."""
    g, r, nb, k = x.shape
    return x.transpose(0, 2, 3, 1).reshape(g, nb, k * r)


def _unper_row(p: np.ndarray, k: int, r: int) -> np.ndarray:
    g, nb, _ = p.shape
    return p.reshape(g, nb, k, r).transpose(0, 3, 1, 2)


def _halves(x: np.ndarray, k: int) -> np.ndarray:
    """k f16 fields as bytes (G, R, nb, 2k) -> (G, nb, 2 k R): R halves of field 0, ..."""
    g, r, nb, _ = x.shape
    return x.reshape(g, r, nb, k, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, 2 * k * r)


def _unhalves(p: np.ndarray, k: int, r: int) -> np.ndarray:
    g, nb, _ = p.shape
    return p.reshape(g, nb, k, r, 2).transpose(0, 3, 1, 2, 4).reshape(g, r, nb, 2 * k)


def _masks(bits: np.ndarray) -> np.ndarray:
    """(G, R, nb, 32 * n) fifth bits, ordered as the quant bytes' nibbles (for quant byte
    group g: its 4 bytes' low-nibble values, then their high-nibble values; see _nibble_order)
    -> (G, nb, n * R) bytes: per group, the low mask then the high mask, bit 4 l + i."""
    g, r, nb, w = bits.shape
    x = bits.reshape(g, r, nb, w // 8, 2, 4).transpose(0, 2, 3, 4, 1, 5)
    return np.packbits(x.reshape(g, nb, -1, 8), axis=-1, bitorder="little").reshape(g, nb, -1)


def _unmasks(p: np.ndarray, w: int, r: int) -> np.ndarray:
    g, nb, _ = p.shape
    bits = np.unpackbits(p.reshape(g, nb, -1, 1), axis=-1, bitorder="little")
    return bits.reshape(g, nb, w // 8, 2, r, 4).transpose(0, 4, 1, 2, 3, 5).reshape(g, r, nb, w)


def _nibble_order(lo_hi: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per-weight values (G, R, nb, 16 * n) x 2 (those in low nibbles, those in high nibbles,
    each in byte order) -> (G, R, nb, 32 * n) ordered by quant byte group: 4 low, 4 high."""
    lo, hi = lo_hi
    g, r, nb, n = lo.shape
    return np.stack([lo.reshape(g, r, nb, n // 4, 4), hi.reshape(g, r, nb, n // 4, 4)],
                    axis=4).reshape(g, r, nb, 2 * n)


def _q5_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit qh (G, R, nb, 4) -> fifth bits in quant byte order."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j: weight j
    return _nibble_order((bits[..., :16], bits[..., 16:]))


def _q5_unbits(bits: np.ndarray) -> np.ndarray:
    g, r, nb, _ = bits.shape
    x = bits.reshape(g, r, nb, 4, 2, 4)
    natural = np.concatenate([x[..., 0, :].reshape(g, r, nb, 16),
                              x[..., 1, :].reshape(g, r, nb, 16)], axis=-1)
    return np.packbits(natural, axis=-1, bitorder="little")


def _q5k_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_K's 32-byte plane (G, R, nb, 32): bit j of byte i is weight 32 j + i -> fifth bits in
    quant byte order (qs byte group g = 8 p + k: weights 64 p + 4 k + i low, + 32 high)."""
    bits = np.unpackbits(qh[..., :, None], axis=-1, bitorder="little")  # (.., 32 i, 8 j)
    g, r, nb = qh.shape[:3]
    lo = bits[..., 0::2].transpose(0, 1, 2, 4, 3).reshape(g, r, nb, 128)  # sub-block 2p
    hi = bits[..., 1::2].transpose(0, 1, 2, 4, 3).reshape(g, r, nb, 128)
    return _nibble_order((lo, hi))


def _q5k_unbits(bits: np.ndarray) -> np.ndarray:
    g, r, nb, _ = bits.shape
    x = bits.reshape(g, r, nb, 32, 2, 4)                      # group, lo/hi, byte
    lo = x[..., 0, :].reshape(g, r, nb, 4, 32)                # p, i
    hi = x[..., 1, :].reshape(g, r, nb, 4, 32)
    planes = np.stack([lo, hi], axis=-2).reshape(g, r, nb, 8, 32)  # bit j = 2p + h
    return np.packbits(planes.transpose(0, 1, 2, 4, 3), axis=-1, bitorder="little")[..., 0]


# ---- per type: original block bytes (G, r, nb, size) <-> tiles (G, nb, tile) ---------------
# A tile is its header (per-row scales, read first and kept in L1 for the block) followed by
# its body in the order the tile function reads it: a sequence of steps, each the same-index
# group of one or more streams (quant bytes, fifth-bit masks, Q6_K's 2-bit plane), so a
# thread's reads run strictly forward.

def _steps(streams: list[tuple[np.ndarray, int, np.ndarray]]) -> np.ndarray:
    """Interleave streams (G, nb, groups * size) read in steps: step s holds group order[s]
    of each stream in turn (`streams`: (array, bytes per group, order))."""
    g, nb = streams[0][0].shape[:2]
    parts = [a.reshape(g, nb, -1, size)[:, :, order] for a, size, order in streams]
    return np.concatenate(parts, axis=-1).reshape(g, nb, -1)


def _unsteps(body: np.ndarray, specs: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
    """The streams of a body made by _steps, each (G, nb, groups, size) with the groups its
    order names filled, the others zero (`specs`: (bytes per group, order) of each)."""
    g, nb, _ = body.shape
    x = body.reshape(g, nb, len(specs[0][1]), sum(size for size, _ in specs))
    out, o = [], 0
    for size, order in specs:
        a = np.zeros((g, nb, int(order.max()) + 1, size), np.uint8)
        a[:, :, order] = x[..., o:o + size]
        out.append(a)
        o += size
    return out


_NAT32 = np.arange(32)
_NAT4, _NAT8 = np.arange(4), np.arange(8)
# Q6_K's steps (half n, 4-byte group k of 8): low-plane groups 16 n + k and 16 n + 8 + k,
# high-plane group 8 n + k
_Q6_A = np.array([16 * n + k for n in range(2) for k in range(8)])
_Q6_B = _Q6_A + 8
_Q6_H = np.array([8 * n + k for n in range(2) for k in range(8)])


def _layout(t: GGMLType, r: int) -> tuple[list[int], list[tuple[int, np.ndarray]]]:
    """t's tile: its header fields' bytes per row (f16 pairs such as d and dmin as one
    field of R d's then R dmin's), and its body streams (bytes per group, group order)."""
    q4 = [(4 * r, _NAT4)]
    q5 = [(4 * r, _NAT4), (r, _NAT4)]
    return {T.Q4_0: ([2], q4), T.Q4_1: ([4], q4), T.Q5_0: ([2], q5),
            T.Q5_1: ([4], q5), T.Q8_0: ([2], [(4 * r, _NAT8)]),
            T.Q4_K: ([12, 4], [(4 * r, _NAT32)]),
            T.Q5_K: ([12, 4], [(4 * r, _NAT32), (r, _NAT32)]),
            T.Q6_K: ([16, 2], [(4 * r, _Q6_A), (4 * r, _Q6_B), (4 * r, _Q6_H)]),
            T.IQ4_XS: ([8, 2], [(4 * r, _NAT32)])}[t]


def _iq4_ls(x: np.ndarray) -> np.ndarray:
    """IQ4_XS's 8 signed 6-bit scales ls - 32 per block, as bytes."""
    sh = x[..., 2].astype(np.uint16) | (x[..., 3].astype(np.uint16) << 8)
    ib = np.arange(8)
    lo = (x[..., 4 + ib // 2] >> (4 * (ib % 2))) & 15
    hi = (sh[..., None] >> (2 * ib)) & 3
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)


@njit(cache=True)
def _q5_masks(x, off):
    """_masks(_q5_bits(...)) for Q5_0/Q5_1 (the 32-bit qh at byte off), as loops: for quant
    group k, the mask of its low nibbles (bits 4k.. of each row's qh) then of its high ones
    (bits 16 + 4k..), two rows a byte."""
    g, r, nb = x.shape[0], x.shape[1], x.shape[2]
    out = np.empty((g, nb, 4 * r), np.uint8)
    for gi in range(g):
        for b in range(nb):
            for lr in range(r):
                h = (np.uint32(x[gi, lr, b, off]) | (np.uint32(x[gi, lr, b, off + 1]) << 8)
                     | (np.uint32(x[gi, lr, b, off + 2]) << 16)
                     | (np.uint32(x[gi, lr, b, off + 3]) << 24))
                for k in range(4):
                    for hi in range(2):
                        nib = (h >> (4 * k + 16 * hi)) & 15
                        o = k * r + hi * (r // 2) + lr // 2
                        if lr % 2 == 0:
                            out[gi, b, o] = nib
                        else:
                            out[gi, b, o] |= nib << 4
    return out


@njit(cache=True)
def _q5k_masks(x):
    """_masks(_q5k_bits(...)) for Q5_K, as loops: for quant group 8 p + k, bit 2p (low
    nibbles) or 2p + 1 (high) of plane bytes 4k..4k+3 of each row, two rows a byte."""
    g, r, nb = x.shape[0], x.shape[1], x.shape[2]
    out = np.empty((g, nb, 32 * r), np.uint8)
    for gi in range(g):
        for b in range(nb):
            for lr in range(r):
                for p in range(4):
                    for k in range(8):
                        for hi in range(2):
                            nib = 0
                            for i in range(4):
                                nib |= ((x[gi, lr, b, 16 + 4 * k + i] >> (2 * p + hi)) & 1) << i
                            o = (8 * p + k) * r + hi * (r // 2) + lr // 2
                            if lr % 2 == 0:
                                out[gi, b, o] = nib
                            else:
                                out[gi, b, o] |= nib << 4
    return out


# the fields of a tile that are not copies of stored bytes, per type, in the order
# _pack_blocks places them: each x (G, r, nb, size) -> its bytes (G, nb, n * r) in tile
# order, n its bytes per row
_FIELDS = {
    T.Q5_0: ((lambda x: _q5_masks(x, 2), 4),),
    T.Q5_1: ((lambda x: _q5_masks(x, 4), 4),),
    T.Q5_K: ((_q5k_masks, 32),),
    T.IQ4_XS: ((lambda x: _per_row(_iq4_ls(x)), 8),),
}
XOR = 1 << 40   # a group map entry whose byte is stored + 128 (Q8_0's quants)


def _pack_blocks(t: GGMLType, x: np.ndarray, mark: bool = False) -> np.ndarray:
    """The tiles (G, nb, tile) of x (G, r, nb, size): header fields, then the body streams
    in steps. With `mark`, x holds source indices (int64) and the result says where each
    tile byte comes from: an index (+ XOR where it is stored + 128), or -1 - f where it is
    _FIELDS[t][f]'s (computed, not copied)."""
    def field(f: int) -> np.ndarray:
        fn, n = _FIELDS[t][f]
        if not mark:
            return fn(x)
        return np.full((x.shape[0], x.shape[2], n * x.shape[1]), -1 - f, np.int64)

    head: list[np.ndarray]
    if t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1):
        nh = 2 if t in (T.Q4_1, T.Q5_1) else 1
        head = [_halves(x[..., 0:2 * nh], nh)]
        q0 = 2 * nh + (4 if t in (T.Q5_0, T.Q5_1) else 0)
        q = x[..., q0:]
        if t == T.Q8_0:
            q = q | XOR if mark else q ^ np.uint8(128)
        body = [_dwords(q)]
        if t in (T.Q5_0, T.Q5_1):
            body.append(field(0))
    elif t in (T.Q4_K, T.Q5_K):
        head = [_per_row(x[..., 4:16]), _halves(x[..., 0:4], 2)]
        q0 = 16 if t == T.Q4_K else 48
        body = [_dwords(x[..., q0:q0 + 128])]
        if t == T.Q5_K:
            body.append(field(0))
    elif t == T.Q6_K:
        head = [_per_row(x[..., 192:208]), _halves(x[..., 208:210], 1)]
        ql = _dwords(x[..., 0:128])
        body = [ql, ql, _dwords(x[..., 128:192])]
    elif t == T.IQ4_XS:
        head = [field(0), _halves(x[..., 0:2], 1)]
        body = [_dwords(x[..., 8:136])]
    else:
        raise KeyError(f"{t} has no packed layout")
    specs = _layout(t, x.shape[1])[1]
    return np.concatenate(head + [_steps([(a, size, order) for a, (size, order)
                                          in zip(body, specs)])], axis=-1)


def _unpack_blocks(t: GGMLType, p: np.ndarray, r: int) -> np.ndarray:
    size = TYPE_RECORDS[t].type_size
    g, nb, _ = p.shape
    x = np.empty((g, r, nb, size), np.uint8)
    fields, specs = _layout(t, r)
    cut = np.cumsum([0] + [n * r for n in fields])
    head = [p[..., a:b] for a, b in zip(cut[:-1], cut[1:])]
    body = [a.reshape(g, nb, -1) for a in _unsteps(p[..., cut[-1]:], specs)]
    if t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1):
        nh = 2 if t in (T.Q4_1, T.Q5_1) else 1
        x[..., :2 * nh] = _unhalves(head[0], nh, r)
        q0 = 2 * nh + (4 if t in (T.Q5_0, T.Q5_1) else 0)
        q = _undwords(body[0], size - q0, r)
        x[..., q0:] = q ^ np.uint8(128) if t == T.Q8_0 else q
        if t in (T.Q5_0, T.Q5_1):
            x[..., 2 * nh:2 * nh + 4] = _q5_unbits(_unmasks(body[1], 32, r))
    elif t in (T.Q4_K, T.Q5_K):
        x[..., 4:16] = _unper_row(head[0], 12, r)
        x[..., 0:4] = _unhalves(head[1], 2, r)
        q0 = 16 if t == T.Q4_K else 48
        x[..., q0:q0 + 128] = _undwords(body[0], 128, r)
        if t == T.Q5_K:
            x[..., 16:48] = _q5k_unbits(_unmasks(body[1], 256, r))
    elif t == T.Q6_K:
        x[..., 192:208] = _unper_row(head[0], 16, r)
        x[..., 208:210] = _unhalves(head[1], 1, r)
        ql = np.zeros((g, nb, 32 * 4 * r), np.uint8)   # its groups from the two streams
        ql[..., :body[0].shape[-1]] = body[0]
        ql[..., :body[1].shape[-1]] |= body[1]
        x[..., 0:128] = _undwords(ql, 128, r)
        x[..., 128:192] = _undwords(body[2], 64, r)
    elif t == T.IQ4_XS:
        ls = (_unper_row(head[0], 8, r).view(np.int8).astype(np.int16) + 32).astype(np.uint8)
        x[..., 0:2] = _unhalves(head[1], 1, r)
        x[..., 4:8] = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
        sh = np.zeros(ls.shape[:-1], np.uint16)
        for ib in range(8):
            sh |= ((ls[..., ib] >> 4) & 3).astype(np.uint16) << (2 * ib)
        x[..., 2] = sh & 255
        x[..., 3] = sh >> 8
        x[..., 8:136] = _undwords(body[0], 128, r)
    else:
        raise KeyError(f"{t} has no packed layout")
    return x


@lru_cache(maxsize=128)
def group_map(t: GGMLType, r: int, nb: int
              ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Where each byte of a packed group of r rows of nb blocks comes from (an index into the
    group's stored bytes, row by row; + XOR where stored + 128; < 0 where computed), the
    same per 4 bytes (_word_map), and the positions of each computed field (_FIELDS[t][f])
    in the group."""
    size = TYPE_RECORDS[t].type_size
    idx = (np.arange(r, dtype=np.int64)[:, None, None] * (nb * size)
           + np.arange(nb, dtype=np.int64)[None, :, None] * size
           + np.arange(size, dtype=np.int64)[None, None, :])[None]
    g = _pack_blocks(t, idx, mark=True).reshape(-1)
    return g, _word_map(g), tuple(np.flatnonzero(g == -1 - f)
                                  for f in range(len(_FIELDS.get(t, ()))))


def _word_map(g: np.ndarray) -> np.ndarray:
    """Per 4 bytes of a group map: the source index of its first byte where the 4 are 4
    consecutive stored bytes (+ XOR alike), else -1 (copied byte by byte, or computed)."""
    w = g.reshape(-1, 4)
    ok = (w[:, 0] >= 0) & np.all(w[:, 1:] - w[:, :-1] == 1, axis=1)
    return np.where(ok, w[:, 0], -1)


@njit(parallel=True, cache=True)
def _gather(rows, m, width, gmap, wmap, out, out32, r):
    """out[g, i] = byte gmap[i] of group g's stored rows (the rows of 1-D `rows`, m of them,
    `width` bytes each; rows past m read as zero bytes), + 128 where gmap[i] has XOR; four at
    a time where wmap says they are consecutive; entries < 0 are left for computed fields."""
    for g in prange(out.shape[0]):
        base = g * r * width
        avail = min(r, m - g * r) * width
        o, o32 = out[g], out32[g]
        for j in range(wmap.size):
            v = wmap[j]
            if v >= 0:
                src = v & (XOR - 1)
                if src + 3 < avail:
                    u = load_u32(rows, base + src)
                else:
                    u = np.uint32(0)
                o32[j] = u ^ np.uint32(0x80808080) if v >= XOR else u
                continue
            for i in range(4 * j, 4 * j + 4):
                v = gmap[i]
                if v < 0:
                    continue
                src = v & (XOR - 1)
                b = rows[base + src] if src < avail else np.uint8(0)
                o[i] = b ^ np.uint8(128) if v >= XOR else b


def pack(t: GGMLType, rows: np.ndarray, r: int = R, out: np.ndarray | None = None,
         block_chunk: int = 1 << 16) -> np.ndarray:
    """The packed layout (1-D uint8) of a weight's stored bytes `rows` (M, row bytes) in
    groups of r rows: the copied bytes gathered by one parallel pass over the group map, the
    computed fields (K-quant scales, fifth-bit masks, IQ4_XS scales) by numpy, in runs of
    groups so the temporaries stay small. `out` may provide the memory (packed_nbytes)."""
    size = TYPE_RECORDS[t].type_size
    m, width = rows.shape
    nb = width // size
    groups = -(-m // r)
    tile = PACKS[t].tile(r)
    if out is None:
        out = np.empty(groups * nb * tile, np.uint8)
    o = out.reshape(groups, nb * tile)
    gmap, wmap, fields = group_map(t, r, nb)
    _gather(np.ascontiguousarray(rows).reshape(-1), m, width, gmap, wmap, o, o.view(np.uint32), r)
    if fields:
        step = max(1, block_chunk // max(nb, 1))
        for g0 in range(0, groups, step):
            g1 = min(groups, g0 + step)
            have = rows[g0 * r:min(m, g1 * r)]
            if len(have) < (g1 - g0) * r:   # the last group: zero rows after the weight's
                x = np.zeros(((g1 - g0) * r, width), np.uint8)
                x[:len(have)] = have
                have = x
            x = have.reshape(g1 - g0, r, nb, size)
            for (fn, _), pos in zip(_FIELDS[t], fields):
                o[g0:g1, pos] = fn(x).reshape(g1 - g0, -1)
    return out


def pack_reference(t: GGMLType, rows: np.ndarray, r: int = R) -> np.ndarray:
    """pack() computed by numpy alone, field by field (what the tests compare pack with)."""
    size = TYPE_RECORDS[t].type_size
    m, width = rows.shape
    x = np.zeros((-(-m // r) * r, width), np.uint8)
    x[:m] = rows
    return _pack_blocks(t, x.reshape(-1, r, width // size, size)).reshape(-1)


def unpack(t: GGMLType, packed: np.ndarray, m: int, nb: int, r: int = R) -> np.ndarray:
    """The original stored bytes (m, nb * type_size) of a weight packed in groups of r."""
    size = TYPE_RECORDS[t].type_size
    groups = -(-m // r)
    p = packed.reshape(groups, nb, PACKS[t].tile(r))
    return _unpack_blocks(t, p, r).reshape(groups * r, nb * size)[:m]
