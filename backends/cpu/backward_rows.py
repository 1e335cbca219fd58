"""CPU kernels of the row-wise backward ops: soft_max_ext_back, rope_back, rms_norm_back, get_rows_back, cross_entropy_loss and cross_entropy_loss_back.

BINDERS maps each op to its binder (node, session) -> call; backends/cpu/kernels.py makes the
table entries with the op's shared type rule. Rows go through float32 scratch rows and their
sums accumulate in float64, like the forward norms and softmax (templates.py). rope_back is
rope's own kernels (templates.k_rope_table, k_rope) with the sines negated: the rotation by
-theta. get_rows_back checks its indices before a kernel addresses rows with them."""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import numpy as np
from numba import prange

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ..base import Session
from ..shared.bound import bound
from ..shared.kernel_args import rope_args
from . import templates as K
from .compile import compiled, index_checked, is_small

dec_a, dec_b, enc_d = bound("dec_a", "dec_b", "enc_d")


# -- templates (arrays 4-D in numpy order; dec_*/enc_d bound per type) -----------------------

def k_soft_max_back(a, b, d, scale):
    """a = dy, b = y: d = scale * y * (dy - sum(dy * y)) per row."""
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        g = np.empty(n0, np.float32)
        y = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, g, n0)
        dec_b(b, i3, i2, i1, y, n0)
        dot = 0.0
        for i in range(n0):
            dot += np.float64(g[i]) * np.float64(y[i])
        for i in range(n0):
            g[i] = np.float32(scale * (y[i] * (g[i] - dot)))
        enc_d(g, d, i3, i2, i1, n0)


def k_rms_norm_back(a, b, d, eps):
    """a = dy, b = x: d = r * (dy - x * sum(x*dy) / (sum(x*x) + n*eps)), r the rms's inverse."""
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        g = np.empty(n0, np.float32)
        x = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, g, n0)
        dec_b(b, i3, i2, i1, x, n0)
        sxx = 0.0
        sxg = 0.0
        for i in range(n0):
            sxx += np.float64(x[i]) * x[i]
            sxg += np.float64(x[i]) * g[i]
        rr = 1.0 / math.sqrt(sxx / n0 + eps)
        c = sxg / (sxx + n0 * eps)
        for i in range(n0):
            g[i] = np.float32(rr * (g[i] - x[i] * c))
        enc_d(g, d, i3, i2, i1, n0)


def k_get_rows_back(a, idx, d):
    """d[k, j, idx[0, k, j, i], :] += a[k, j, i, :] over i, d zeroed first; parallel over
    (k, j) only, so no two threads add into one row. idx is checked in [0, d.shape[2])."""
    n3, n2, n1, n0 = a.shape
    for r in prange(n3 * n2):
        i3, i2 = r // n2, r % n2
        for i1 in range(d.shape[2]):
            for i0 in range(n0):
                d[i3, i2, i1, i0] = 0.0
        g = np.empty(n0, np.float32)
        for i1 in range(n1):
            dec_a(a, i3, i2, i1, g, n0)
            row = idx[0, i3, i2, i1]
            for i0 in range(n0):
                d[i3, i2, row, i0] += g[i0]


def k_cross_entropy(g, a, b, d, back):
    """a = logits, b = labels. Loss (back False): d[0] = -mean over rows of
    sum(labels * log_softmax(logits)). Gradient (back True; g = the loss's gradient [1]):
    d = (softmax(logits) - labels) * g / rows."""
    n3, n2, n1, n0 = a.shape
    rows = n3 * n2 * n1
    k = np.float64(g[0, 0, 0, 0]) / rows
    total = 0.0
    for r in prange(rows):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        x = np.empty(n0, np.float32)
        p = np.empty(n0, np.float32)
        dec_a(a, i3, i2, i1, x, n0)
        dec_b(b, i3, i2, i1, p, n0)
        mx = x[0]
        for i in range(n0):
            mx = max(mx, x[i])
        s = 0.0
        for i in range(n0):
            s += math.exp(np.float64(x[i]) - mx)
        lse = mx + math.log(s)
        row = 0.0
        for i in range(n0):
            if back:
                x[i] = np.float32((math.exp(np.float64(x[i]) - lse) - p[i]) * k)
            else:
                row += np.float64(p[i]) * (np.float64(x[i]) - lse)
        if back:
            enc_d(x, d, i3, i2, i1, n0)
        total += row
    if not back:
        d[0, 0, 0, 0] = np.float32(-total / rows)


# -- binders -------------------------------------------------------------------------------

def _two_rows(template, node: Tensor, s: Session, *args: Any):
    a, b = node.src
    return partial(compiled(template, is_small(node), a=a.type, b=b.type, d=node.type),
                   s.arr(a), s.arr(b), s.arr(node), *args)


def _soft_max_back(node: Tensor, s: Session):
    return _two_rows(k_soft_max_back, node, s, np.float64(node.params.scale))


def _rms_norm_back(node: Tensor, s: Session):
    return _two_rows(k_rms_norm_back, node, s, np.float64(node.params.eps))


def _get_rows_back(node: Tensor, s: Session):
    a, idx = node.src
    k = compiled(k_get_rows_back, is_small(a), a=a.type)
    return index_checked(node, s.arr(idx), node.ne[1], "row",
                         partial(k, s.arr(a), s.arr(idx), s.arr(node)))


def _rope_back(node: Tensor, s: Session):
    a, pos, ff = node.src
    n_dims, neox, *angles = rope_args(node)
    small = is_small(node)
    cs, sn = np.empty((pos.ne[0], n_dims // 2)), np.empty((pos.ne[0], n_dims // 2))
    table = partial(compiled(K.k_rope_table, small), s.arr(pos),
                    s.arr(ff).reshape(1, 1, 1, -1) if ff is not None else _DUMMY, cs, sn,
                    n_dims, *angles, ff is not None)
    rotate = partial(compiled(K.k_rope, small, a=a.type, d=node.type), s.arr(a), cs, sn,
                     s.arr(node), n_dims, neox)
    return partial(_rope_back_run, table, sn, rotate)


_DUMMY = np.zeros((1, 1, 1, 1), np.float32)


def _rope_back_run(table: Callable[[], None], sn: np.ndarray, rotate: Callable[[], None]
                   ) -> None:
    table()
    np.negative(sn, out=sn)  # sin(-theta): the same rotation backwards
    rotate()


_ONE = np.ones((1, 1, 1, 1), np.float32)


def _loss(node: Tensor, s: Session):
    a, b = node.src
    k = compiled(k_cross_entropy, is_small(a), a=a.type, b=b.type, d=node.type)
    return partial(k, _ONE, s.arr(a), s.arr(b), s.arr(node), False)


def _loss_back(node: Tensor, s: Session):
    g, a, b = node.src
    k = compiled(k_cross_entropy, is_small(node), a=a.type, b=b.type, d=node.type)
    return partial(k, s.arr(g).reshape(1, 1, 1, 1), s.arr(a), s.arr(b), s.arr(node), True)


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.SOFT_MAX_BACK: _soft_max_back,
    OpKind.RMS_NORM_BACK: _rms_norm_back,
    OpKind.GET_ROWS_BACK: _get_rows_back,
    OpKind.ROPE_BACK: _rope_back,
    OpKind.CROSS_ENTROPY_LOSS: _loss,
    OpKind.CROSS_ENTROPY_LOSS_BACK: _loss_back,
}
