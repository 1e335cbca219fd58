"""CUDA kernels of the reductions and accumulations training needs: sum, mean, repeat_back, acc.

BINDERS maps each op to its binder (node, session) -> launch; backends/cuda/kernels.py makes
the table entries with the op's shared type rule (F32 only: the templates index the float32
device arrays directly). Sums run in float32 across a thread block (templates.block_sum), as
sum_rows does.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from numba import cuda, float32

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ..base import Session
from ..shared.bound import bound
from .launch import compiled, elementwise_launch, n_rows, per_row_launch
from .templates import ROW_NT, block_sum

# bound by the Target (backends/shared/elementwise.py)
unflatten = bound("unflatten")


# -- templates (4-D float32 device arrays in numpy order, any strides) ------------------------

def k_sum(a, d):
    """One thread block: every element of a, summed into d's one element."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = a.shape
    s = np.float32(0.0)
    for k in range(tid, n3 * n2 * n1 * n0, ROW_NT):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        s += a[i3, i2, i1, i0]
    s = block_sum(red, tid, s)
    if tid == 0 and cuda.blockIdx.x == 0:
        d[0, 0, 0, 0] = s


def k_mean(a, d):
    """One thread block per row (grid-stride over rows)."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = a.shape
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        s = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            s += a[i3, i2, i1, i]
        s = block_sum(red, tid, s)
        if tid == 0:
            d[i3, i2, i1, 0] = s / np.float32(n0)


def k_repeat_back(a, d):
    """A thread per element of d: the sum of a's elements it tiles (i, i + n, ... per axis)."""
    n3, n2, n1, n0 = d.shape
    a3, a2, a1, a0 = a.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        s = np.float32(0.0)
        for j3 in range(i3, a3, n3):
            for j2 in range(i2, a2, n2):
                for j1 in range(i1, a1, n1):
                    for j0 in range(i0, a0, n0):
                        s += a[j3, j2, j1, j0]
        d[i3, i2, i1, i0] = s


def k_copy_f32(a, d):
    n3, n2, n1, n0 = d.shape
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        d[i3, i2, i1, i0] = a[i3, i2, i1, i0]


def k_acc_add(b, d, nb1, nb2, nb3, off):
    """A thread per element of b, added atomically (a window's rows may overlap) into d's
    element off + i3 nb3 + i2 nb2 + i1 nb1 + i0 (d contiguous; checked by the binder)."""
    m3, m2, m1, m0 = b.shape
    n2, n1, n0 = d.shape[1], d.shape[2], d.shape[3]
    for k in range(cuda.grid(1), m3 * m2 * m1 * m0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, m2, m1, m0)
        j3, j2, j1, j0 = unflatten(off + i3 * nb3 + i2 * nb2 + i1 * nb1 + i0, n2, n1, n0)
        cuda.atomic.add(d, (j3, j2, j1, j0), b[i3, i2, i1, i0])


# -- binders --------------------------------------------------------------------------------

def _sum(node: Tensor, s: Session):
    return per_row_launch(compiled(k_sum), 1, ROW_NT, s.arr(node.src[0]), s.arr(node))


def _mean(node: Tensor, s: Session):
    a = node.src[0]
    return per_row_launch(compiled(k_mean), n_rows(a), ROW_NT, s.arr(a), s.arr(node))


def _repeat_back(node: Tensor, s: Session):
    return elementwise_launch(compiled(k_repeat_back), node.nelements, s.arr(node.src[0]),
                              s.arr(node))


def _acc(node: Tensor, s: Session):
    a, b = node.src
    p, es = node.params, node.type.type_size
    nb1, nb2, nb3, off = p.nb1 // es, p.nb2 // es, p.nb3 // es, p.offset // es
    last = off + sum((n - 1) * x for n, x in zip(b.ne, (1, nb1, nb2, nb3)))
    if b.nelements and not (off >= 0 and last < node.nelements):
        raise ValueError(f"acc: the window of b (ne={list(b.ne)}) at element {off} ends at "
                         f"{last}, outside the result's {node.nelements} elements")
    D = s.arr(node)
    copy = elementwise_launch(compiled(k_copy_f32), node.nelements, s.arr(a), D)
    add = elementwise_launch(compiled(k_acc_add), b.nelements, s.arr(b), D, nb1, nb2, nb3,
                             off)

    def run() -> None:  # one stream: the adds follow the copy
        for launch in (copy, add):
            if launch is not None:
                launch()
    return run


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.SUM: _sum,
    OpKind.MEAN: _mean,
    OpKind.REPEAT_BACK: _repeat_back,
    OpKind.ACC: _acc,
}
