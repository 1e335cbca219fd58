"""A prompt's attention on the CPU, by blocks of queries that skip the cells their mask hides:
flash_attn_ext's batches of queries (here), and the math the fused non-flash group shares with
it (backends/cpu/attn_fusion.py): the visible ranges of a mask, the softmax of a block's rows,
queries rounded to F16.

A causal mask hides half of a prompt's score matrix, a sliding window most of it. Queries go
in blocks of Q_BLOCK, and each block multiplies only the cells [lo, hi) outside which the mask
is -inf for every one of its queries: those cells' weights are exactly 0, so leaving them out
changes nothing but the order of the sums. For flash_attn_ext a block's whole visible range is
one product, so its softmax is exact (no running rescale), and the query heads of one K/V
head (GQA) go together where they share a mask and a slope: one product of all their rows.

The numbers are ggml's: queries rounded to F16 for an F16 K (K's vec_dot_type), the weights
rounded to F16 for an F16 V; a row no cell is visible to gives zeros. Units of (sequence, K/V
head or query head, query block) run on the BLAS thread pool (backends/cpu/blas.py: numpy
releases the GIL in its products), each a fixed piece whatever the thread count. Single
queries (decode) keep the numba kernels, which have no BLAS call overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from .blas import run_units
from ..shared.bound import bound

# names each binding supplies (backends/shared/bound.py)
expf, round_half = bound("expf", "round_half")

Q_BLOCK = 64  # queries per unit: smaller skips more of a causal mask, larger calls BLAS less


def decode_heads(arr: np.ndarray, t: Tensor, dec) -> np.ndarray:
    """(S, H, n, row) kernel view -> float32 (S, H, n, ne0)."""
    if t.type == T.F32:
        return arr
    if t.type == T.F16:
        return arr.view(np.float16).astype(np.float32)
    out = np.empty(arr.shape[:3] + (t.ne[0],), np.float32)
    for i3 in range(arr.shape[0]):
        for i2 in range(arr.shape[1]):
            for i1 in range(arr.shape[2]):
                dec(arr, i3, i2, i1, out[i3, i2, i1], t.ne[0])
    return out


# Below this share of its [lo, hi) range actually visible to its queries, a block's product
# is mostly hidden work: several sequences' tokens in one batch (a batched decode step), each
# seeing its own cells only. Such a mask goes to the per-row kernel (attn_decode.py), which
# skips each row's hidden cells. A causal prompt sees half or more of its blocks' ranges.
SPARSE_SHARE = 0.25


def visible_ranges(M: np.ndarray, nt: int, nkv: int
                   ) -> tuple[dict[tuple[int, int, int], tuple[int, int]], float]:
    """(mask slice i3, i2, query block) -> the [lo, hi) of cells some query of the block sees
    (the whole row where none does); and the share of those ranges' (query, cell) pairs that
    are visible (1.0 when nothing is)."""
    out = {}
    seen_n = range_n = 0
    for i3 in range(M.shape[0]):
        for i2 in range(M.shape[1]):
            seen = ~np.isneginf(M[i3, i2, :nt, :nkv])
            for b in range(0, nt, Q_BLOCK):
                cols = np.flatnonzero(seen[b:b + Q_BLOCK].any(axis=0))
                out[i3, i2, b] = (int(cols[0]), int(cols[-1]) + 1) if cols.size else (0, nkv)
                if cols.size:
                    lo, hi = out[i3, i2, b]
                    seen_n += int(np.count_nonzero(seen[b:b + Q_BLOCK, lo:hi]))
                    range_n += (hi - lo) * seen[b:b + Q_BLOCK].shape[0]
    return out, (seen_n / range_n if range_n else 1.0)


@dataclass
class SharedMask:
    """A mask as the attention nodes of one graph read it, computed by the first of them each
    run (the layers share it): float32 values, each query block's visible range, and whether
    the blocks see so little of their ranges (SPARSE_SHARE) that per-row work is cheaper."""
    m: np.ndarray | None = None
    ranges: dict = field(default_factory=dict)
    sparse: bool = False

    def update(self, raw: np.ndarray, t: Tensor, nt: int, nkv: int) -> None:
        self.m = raw.view(np.float16).astype(np.float32) if t.type == T.F16 else raw
        self.ranges, share = visible_ranges(self.m, nt, nkv)
        self.sparse = share < SPARSE_SHARE


# ---- numba templates (round_half: F16C's round trip; expf: backends/cpu/fastmath.py) ------

def k_round_half(x):
    """x (2-D float32) rounded to F16 precision in place (ties to even)."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] = round_half(x[i, j])


def k_soft_max_rows(x, m, slope, scale, has_mask, to_half, empty_zero):
    """Rows of x replaced by soft_max_ext's: x * scale (+ slope * m), max, expf, the sum in
    float64, times 1 / sum; rounded to F16 precision where to_half (V is F16). A row whose
    every value is -inf becomes zeros where empty_zero (flash attention's), NaN otherwise
    (soft_max_ext's)."""
    for i in range(x.shape[0]):
        mx = np.float32(-np.inf)
        for j in range(x.shape[1]):
            v = x[i, j] * scale + (slope * m[i, j] if has_mask else np.float32(0.0))
            x[i, j] = v
            mx = max(mx, v)
        if empty_zero and mx == -np.inf:
            for j in range(x.shape[1]):
                x[i, j] = 0.0
            continue
        t = 0.0
        for j in range(x.shape[1]):
            e = expf(x[i, j] - mx)
            x[i, j] = e
            t += e
        inv = 1.0 / t
        for j in range(x.shape[1]):
            p = np.float32(x[i, j] * inv)
            x[i, j] = round_half(p) if to_half else p


@dataclass(frozen=True)
class BlockMath:
    """What a block's unit needs besides its arrays: the score scale (softcap: see
    flash_attn_args), the softcap, each query head's ALiBi slope, whether K and V are F16,
    and the compiled templates above (made to run in the pool's threads)."""
    scale: np.float32
    softcap: float
    slopes: np.ndarray
    k16: bool
    v16: bool
    round_half: Callable
    soft_max: Callable


_NO_MASK = np.zeros((1, 1), np.float32)


def flash_attn_blocks(Q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: SharedMask | None,
                      D: np.ndarray, w: BlockMath) -> None:
    """Q (S, H, T, Dk), K (Sk, Hkv, n_kv, Dk), V (Sk, Hkv, n_kv, Dv) float32; the mask's
    M (Sm, Hm, >=T, n_kv); D (S, T, H, Dv)."""
    ns, nh, nt, dk = Q.shape
    hkv, nkv = K.shape[1], K.shape[2]
    rk2, rk3 = nh // hkv, ns // K.shape[0]
    M = mask.m if mask is not None else None
    # the heads of a K/V head share one product where they share the mask and the slope
    together = (M is None or M.shape[1] == 1) and bool(np.all(w.slopes == w.slopes[0]))
    groups = [range(g * rk2, (g + 1) * rk2) for g in range(hkv)] if together else \
        [range(h, h + 1) for h in range(nh)]
    units = [(s, hs, b) for s in range(ns) for hs in groups for b in range(0, nt, Q_BLOCK)]

    def unit(s: int, heads: range, b: int) -> None:
        b1, h0 = min(nt, b + Q_BLOCK), heads[0]
        ks, kh = s // rk3, h0 // rk2
        lo, hi = (0, nkv) if M is None else mask.ranges[s % M.shape[0], h0 % M.shape[1], b]
        q = np.array(Q[s, heads.start:heads.stop, b:b1], np.float32).reshape(-1, dk)
        if w.k16:
            w.round_half(q)
        x = q @ K[ks, kh, lo:hi].T
        scale = w.scale
        if w.softcap:
            x = (np.float32(w.softcap) * np.tanh(x * w.scale)).astype(np.float32)
            scale = np.float32(1.0)
        m = _NO_MASK
        if M is not None:
            m = M[s % M.shape[0], h0 % M.shape[1], b:b1, lo:hi]
            if len(heads) > 1:
                m = np.tile(m, (len(heads), 1))
        w.soft_max(x, m, w.slopes[h0], scale, M is not None, w.v16, True)
        out = (x @ V[ks, kh, lo:hi]).reshape(len(heads), b1 - b, -1)
        for i, h in enumerate(heads):
            D[s, b:b1, h] = out[i]

    run_units(unit, units)
