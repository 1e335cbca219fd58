"""The CPU fusion pass's attention group: the non-flash attention of a prompt ubatch,

    kq = mul_mat(k, q)  ->  p = soft_max_ext(kq, mask, scale, max_bias)  ->  kqv = mul_mat(v, p)

(three consecutive nodes of the planned graph, kq and p read by nothing else), run as one
call that skips the key/value cells the mask hides. A causal mask hides half of a prompt's
K*Q matrix; the unfused nodes multiply, exponentiate and sum every cell of it. Here queries go
in blocks of Q_BLOCK, and each block multiplies only the cells [lo, hi) outside which the
mask is -inf for every one of its queries: those cells' softmax weights are exactly 0, so
leaving them out changes nothing but the summation order of the sums.

The numbers are the unfused nodes': K*Q and V*p are products of F16 caches with activations
rounded to F16 (the vec_dot_type ggml converts them to), the softmax is soft_max_ext's
(x * scale + slope * mask, max, exp, sum in float64, times 1 / sum). Units of (sequence, head,
query block) run on the BLAS thread pool (backends/cpu/blas.py: numpy releases the GIL in its
products and exps), each a fixed piece whatever the thread count. The blockwise math (visible
ranges, the row softmax) is flash attention's too: backends/cpu/attention.py.

An observed run (backends/observe.py) that reads K*Q or the softmax gets them from host arrays
the call fills as it goes (`Watch`): K*Q over every cell (one more product per unit, with the
same F16-rounded queries), the softmax's float32 weights (before the F16 rounding V*p takes)
with the hidden cells' exact zeros. The output is computed as without them, bit for bit; the
values handed may differ from the unfused nodes' in their last bits (another product's order
of sums for K*Q, attention.py's expf for the softmax).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph.ops.attention import alibi_slopes
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ..shared.kernel_args import soft_max_args
from .attention import Q_BLOCK, SharedMask, k_round_half, k_soft_max_rows
from .blas import run_units
MIN_QUERIES = 16  # fewer (decode) keep the unfused nodes: their numba mat-vecs beat BLAS calls
CACHE_TYPES = (T.F16, T.F32)


def match(seq: list[Tensor], i: int) -> list[Tensor]:
    """[kq, p, kqv] when seq[i:i + 3] is the attention chain over float caches, else []."""
    if i + 2 >= len(seq):
        return []
    kq, sm, kqv = seq[i], seq[i + 1], seq[i + 2]
    if kq.op != OpKind.MUL_MAT or sm.op != OpKind.SOFT_MAX or kqv.op != OpKind.MUL_MAT:
        return []
    k, q = kq.src
    v = kqv.src[0]
    _, mask, sinks = sm.src
    if sm.src[0] is not kq or kqv.src[1] is not sm or sinks is not None or (
            q.ne[1] < MIN_QUERIES):
        return []
    if k.type not in CACHE_TYPES or v.type not in CACHE_TYPES or q.type != T.F32:
        return []
    if any(t.type != T.F32 for t in (kq, sm, kqv)) or (
            mask is not None and mask.type not in (T.F16, T.F32)):
        return []
    return [kq, sm, kqv]


def _floats(arr: np.ndarray, t: Tensor) -> np.ndarray:
    """A kernel view of an F16 or F32 tensor as float32."""
    return arr.view(np.float16).astype(np.float32) if t.type == T.F16 else arr


@dataclass(frozen=True)
class Watch:
    """Host arrays an observed group fills with its K*Q and softmax, float32 in numpy order
    (S, H, T, n_kv): the bytes of the (contiguous, F32) nodes they stand for. None: not
    observed."""
    kq: np.ndarray | None = None
    sm: np.ndarray | None = None

    @classmethod
    def of(cls, kq: Tensor | None, sm: Tensor | None, memo: dict) -> "Watch":
        """Arrays for the nodes watched, shared by the groups of one binding (`memo`, its
        bind_memo): they run one after another, and each group's values are handed over
        before the next runs (backends/observe.py)."""
        return cls(*(None if t is None else memo.setdefault(
            ("attn watch", role, t.shape), np.zeros(t.shape, np.float32))
            for role, t in (("kq", kq), ("sm", sm))))

    def held(self, kq: Tensor, sm: Tensor) -> dict[Tensor, np.ndarray]:
        """node -> its bytes (Group.held) for the nodes watched."""
        return {t: a.reshape(-1).view(np.uint8) for t, a in ((kq, self.kq), (sm, self.sm))
                if a is not None}


def bind(chain: list[Tensor], s: Any, apart: bool, nogil_for: Callable[[Callable], Any],
         watch: Watch = Watch()) -> Callable[[], None]:
    """The group's call: reads k, q, v and the mask where the run finds them, writes kqv.
    Unless `apart` (kqv overlaps none of them), kqv is written to a scratch array first and
    copied at the end: the plan may give kqv the memory of q, free once K*Q has read it,
    which the unfused nodes finish reading before kqv is written and the units here do not.
    `nogil_for(template)`: a template of this module compiled to run in the pool's threads.
    `watch`: where an observer's K*Q and softmax go."""
    kq, sm, kqv = chain
    k, q = kq.src
    v, mask = kqv.src[0], sm.src[1]
    D = s.arr(kqv)
    if not apart:  # one scratch for the groups of a graph: they run one after another
        D = s.bind_memo.setdefault(("attn scratch", D.shape), np.empty(D.shape, np.float32))
    shared = first = None
    if mask is not None:  # the layers share their mask: the first group of a run reads it
        key = ("attn mask", mask, q.ne[1], k.ne[1])  # its ranges are for these query/cell counts
        first = key not in s.bind_memo
        shared = s.bind_memo.setdefault(key, SharedMask())
    K_, Q_, V_, M_, out = (s.arr(k), s.arr(q), s.arr(v),
                           s.arr(mask) if mask is not None else None, s.arr(kqv))
    scale, max_bias, h0, n_head = soft_max_args(sm)
    work = _Work(np.float32(scale), alibi_slopes(kq.ne[2], max_bias, h0, n_head).astype(
        np.float32), k.type == T.F16, v.type == T.F16, nogil_for(k_round_half),
        nogil_for(k_soft_max_rows))

    def call() -> None:
        if first:
            shared.update(M_, mask, Q_.shape[2], K_.shape[2])
        run(_floats(K_, k), Q_, _floats(V_, v), shared, D, work, watch)
        if D is not out:
            out[...] = D
    return call


@dataclass(frozen=True)
class _Work:
    scale: np.float32
    slopes: np.ndarray
    k16: bool                 # K is F16: ggml multiplies it by queries rounded to F16
    v16: bool                 # V is F16: the same for the softmax's weights
    round_half: Callable
    soft_max: Callable


_NO_MASK = np.zeros((1, 1), np.float32)


def run(K: np.ndarray, Q: np.ndarray, V: np.ndarray, mask: SharedMask | None, D: np.ndarray,
        w: _Work, watch: Watch = Watch()) -> None:
    """K (S, Hkv, n_kv, Dk), Q (S, H, T, Dk), V (S, Hkv, Dv, n_kv) float32 (V transposed, as
    the non-flash cache stores it); the mask's M (Sm, Hm, >=T, n_kv); D (S, H, T, Dv)."""
    ns, nh, nt, _ = Q.shape
    nkv = K.shape[2]
    M = mask.m if mask is not None else None
    units = [(i3, h, b) for i3 in range(ns) for h in range(nh) for b in range(0, nt, Q_BLOCK)]

    def unit(i3: int, h: int, b: int) -> None:
        j3, jh = i3 // (ns // K.shape[0]), h // (nh // K.shape[1])
        b1 = min(nt, b + Q_BLOCK)
        lo, hi = (0, nkv) if M is None else mask.ranges[i3 % M.shape[0], h % M.shape[1], b]
        q = np.array(Q[i3, h, b:b1], np.float32, order="C")  # a copy: rounded in place
        if w.k16:
            w.round_half(q)
        if watch.kq is not None:  # every cell, as the node holds it (the hidden ones too)
            np.matmul(q, K[j3, jh].T, out=watch.kq[i3, h, b:b1])
        x = q @ K[j3, jh, lo:hi].T
        m = M[i3 % M.shape[0], h % M.shape[1], b:b1, lo:hi] if M is not None else _NO_MASK
        if watch.sm is not None:
            _watched_soft_max(x, m, h, M is not None, w, lo, hi, watch.sm[i3, h, b:b1])
        w.soft_max(x, m, w.slopes[h], w.scale, M is not None, w.v16, False)
        np.matmul(x, V[j3, jh, :, lo:hi].T, out=D[i3, h, b:b1])

    run_units(unit, units)


def _watched_soft_max(x: np.ndarray, m: np.ndarray, h: int, has_mask: bool, w: _Work, lo: int,
                      hi: int, out: np.ndarray) -> None:
    """The softmax node's rows for an observer: soft_max_ext's float32 weights over the
    visible cells [lo, hi) (not rounded to F16: that is V*p's), exact zeros elsewhere (the
    mask's -inf there), NaN across a row no cell is visible to (soft_max_ext's)."""
    y = np.array(x, np.float32, order="C")
    w.soft_max(y, m, w.slopes[h], w.scale, has_mask, False, False)
    out[...] = 0.0
    out[:, lo:hi] = y
    out[np.isnan(y).any(axis=1)] = np.nan
