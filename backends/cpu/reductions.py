"""CPU kernels of the reductions and accumulations training needs: sum, mean, repeat_back, acc.

BINDERS maps each op to its binder (node, session) -> call; backends/cpu/kernels.py makes the
table entries with the op's shared type rule (F32 only: the templates index the float32
arrays directly, no codecs). Sums accumulate in float64, as ggml's (ggml_float).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
from numba import prange

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ..base import Session
from .compile import compiled_for


# -- templates (4-D float32 arrays in numpy order, any strides) -----------------------------

def k_sum(a, d):
    n3, n2, n1, n0 = a.shape
    s = 0.0
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        for i in range(n0):
            s += a[i3, i2, i1, i]
    d[0, 0, 0, 0] = s


def k_mean(a, d):
    n3, n2, n1, n0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        s = 0.0
        for i in range(n0):
            s += a[i3, i2, i1, i]
        d[i3, i2, i1, 0] = s / n0


def k_repeat_back(a, d):
    """d's element i of each axis sums a's elements i, i + n, i + 2n, ... (n: d's size)."""
    n3, n2, n1, n0 = d.shape
    a3, a2, a1, a0 = a.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        row = np.zeros(n0, np.float64)
        for j3 in range(i3, a3, n3):
            for j2 in range(i2, a2, n2):
                for j1 in range(i1, a1, n1):
                    for j0 in range(a0):
                        row[j0 % n0] += a[j3, j2, j1, j0]
        for i in range(n0):
            d[i3, i2, i1, i] = row[i]


def k_acc(a, b, d, flat, nb1, nb2, nb3, off):
    """d = a, then b added at flat[off + i3 nb3 + i2 nb2 + i1 nb1 + i0] (flat: d's elements;
    strides and start in elements, checked by the binder). The adds run in one thread: a
    window's rows may overlap."""
    n3, n2, n1, n0 = d.shape
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        for i in range(n0):
            d[i3, i2, i1, i] = a[i3, i2, i1, i]
    m3, m2, m1, m0 = b.shape
    for i3 in range(m3):
        for i2 in range(m2):
            for i1 in range(m1):
                at = off + i3 * nb3 + i2 * nb2 + i1 * nb1
                for i in range(m0):
                    flat[at + i] += b[i3, i2, i1, i]


# -- binders --------------------------------------------------------------------------------

def _one_source(template) -> Callable[[Tensor, Session], Any]:
    def bind(node: Tensor, s: Session):
        return partial(compiled_for(template, node), s.arr(node.src[0]), s.arr(node))
    return bind


def _acc(node: Tensor, s: Session):
    a, b = node.src
    p, es = node.params, node.type.type_size
    D = s.arr(node)
    flat = D.reshape(-1)  # the result is contiguous: a view of its memory, not a copy
    nb1, nb2, nb3, off = p.nb1 // es, p.nb2 // es, p.nb3 // es, p.offset // es
    last = off + sum((n - 1) * x for n, x in zip(b.ne, (1, nb1, nb2, nb3)))
    if not np.shares_memory(flat, D):
        raise ValueError(f"acc: the result {node.describe()} is not contiguous in memory")
    if b.nelements and not (off >= 0 and last < flat.shape[0]):
        raise ValueError(f"acc: the window of b (ne={list(b.ne)}) at element {off} ends at "
                         f"{last}, outside the result's {flat.shape[0]} elements")
    return partial(compiled_for(k_acc, node), s.arr(a), s.arr(b), D, flat, nb1, nb2, nb3,
                   off)


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.SUM: _one_source(k_sum),
    OpKind.MEAN: _one_source(k_mean),
    OpKind.REPEAT_BACK: _one_source(k_repeat_back),
    OpKind.ACC: _acc,
}
