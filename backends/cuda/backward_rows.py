"""CUDA kernels of the row-wise backward ops: soft_max_ext_back, rope_back, rms_norm_back, get_rows_back, cross_entropy_loss and cross_entropy_loss_back.

BINDERS maps each op to its binder (node, session) -> call; backends/cuda/kernels.py makes the
table entries with the op's shared type rule. Row kernels take one thread block per row and
reduce through shared memory (templates.block_sum / block_max), in float32 as the forward
softmax and norms. rope_back is rope's own kernel (templates.k_rope) run on the negated
positions: theta is linear in the position, so that is the rotation by -theta.
get_rows_back compares indices and never addresses memory through one: one thread per
result element sums the gradient rows whose index names its row (deterministic, no atomics);
an index outside the rows names no row and adds nothing (the CPU backend and the reference
refuse it)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from numba import cuda, float32

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType as T
from ..base import Session
from ..shared.bound import bound
from ..shared.kernel_args import rope_args
from . import runtime as R
from . import templates as K
from .launch import compiled, elementwise_launch, n_rows, per_row_launch
from .templates import ROW_NT, block_max, block_sum

ld_a, ld_b, st_d, unflatten = bound("ld_a", "ld_b", "st_d", "unflatten")


# -- templates (ld_*/st_d bound per type; arrays 4-D in numpy order) --------------------------

def k_soft_max_back(a, b, d, scale):
    """a = dy, b = y: d = scale * y * (dy - sum(dy * y)) per row. Each thread reads the
    elements it writes, after the row's sum: d may be a or b (in place)."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = d.shape
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        s = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            s += ld_a(a, i3, i2, i1, i) * ld_b(b, i3, i2, i1, i)
        s = block_sum(red, tid, s)
        for i in range(tid, n0, ROW_NT):
            y = ld_b(b, i3, i2, i1, i)
            st_d(d, i3, i2, i1, i, scale * y * (ld_a(a, i3, i2, i1, i) - s))


def k_rms_norm_back(a, b, d, eps):
    """a = dy, b = x: d = r * (dy - x * sum(x*dy) / (sum(x*x) + n*eps)) per row."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = d.shape
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        sxx = np.float32(0.0)
        sxg = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            x = ld_b(b, i3, i2, i1, i)
            sxx += x * x
            sxg += x * ld_a(a, i3, i2, i1, i)
        sxx = block_sum(red, tid, sxx)
        sxg = block_sum(red, tid, sxg)
        rr = np.float32(1.0) / math.sqrt(sxx / np.float32(n0) + eps)
        c = sxg / (sxx + np.float32(n0) * eps)
        for i in range(tid, n0, ROW_NT):
            x = ld_b(b, i3, i2, i1, i)
            st_d(d, i3, i2, i1, i, rr * (ld_a(a, i3, i2, i1, i) - x * c))


def k_get_rows_back(a, idx, d):
    """One thread per element d[k, j, r, e]: the sum of a[k, j, i, e] over i with
    idx[0, k, j, i] == r."""
    n3, n2, nr, n0 = d.shape
    n1 = a.shape[2]
    for k in range(cuda.grid(1), n3 * n2 * nr * n0, cuda.gridsize(1)):
        i3, i2, row, i0 = unflatten(k, n2, nr, n0)
        s = np.float32(0.0)
        for i1 in range(n1):
            if idx[0, i3, i2, i1] == row:
                s += ld_a(a, i3, i2, i1, i0)
        d[i3, i2, row, i0] = s


def k_cross_entropy(g, a, b, d, back):
    """a = logits, b = labels. Loss (back False, one block walks every row): d[0] = -mean
    over rows of sum(labels * log_softmax(logits)). Gradient (back True, g = the loss's
    gradient [1], a block per row): d = (softmax(logits) - labels) * g / rows."""
    red = cuda.shared.array(ROW_NT, float32)
    tid = cuda.threadIdx.x
    n3, n2, n1, n0 = a.shape
    k = g[0, 0, 0, 0] / np.float32(n3 * n2 * n1)
    total = np.float32(0.0)
    for r in range(cuda.blockIdx.x, n3 * n2 * n1, cuda.gridDim.x):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        mx = np.float32(-np.inf)
        for i in range(tid, n0, ROW_NT):
            mx = max(mx, ld_a(a, i3, i2, i1, i))
        mx = block_max(red, tid, mx)
        e = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            e += math.exp(ld_a(a, i3, i2, i1, i) - mx)
        lse = mx + math.log(block_sum(red, tid, e))
        s = np.float32(0.0)
        for i in range(tid, n0, ROW_NT):
            x = ld_a(a, i3, i2, i1, i)
            if back:
                st_d(d, i3, i2, i1, i, (math.exp(x - lse) - ld_b(b, i3, i2, i1, i)) * k)
            else:
                s += ld_b(b, i3, i2, i1, i) * (x - lse)
        if not back:
            total += block_sum(red, tid, s)
    if not back and tid == 0:
        d[0, 0, 0, 0] = -total / np.float32(n3 * n2 * n1)


def k_negate(x, out):
    for k in range(cuda.grid(1), out.shape[3], cuda.gridsize(1)):
        out[0, 0, 0, k] = -x[0, 0, 0, k]


# -- binders -------------------------------------------------------------------------------

def _rows2(template, node: Tensor, s: Session, *args: Any):
    a, b = node.src
    k = compiled(template, a=a.type, b=b.type, d=node.type)
    return per_row_launch(k, n_rows(node), ROW_NT, s.arr(a), s.arr(b), s.arr(node), *args)


def _soft_max_back(node: Tensor, s: Session):
    return _rows2(k_soft_max_back, node, s, np.float32(node.params.scale))


def _rms_norm_back(node: Tensor, s: Session):
    return _rows2(k_rms_norm_back, node, s, np.float32(node.params.eps))


def _get_rows_back(node: Tensor, s: Session):
    a, idx = node.src
    return elementwise_launch(compiled(k_get_rows_back, a=a.type), node.nelements, s.arr(a),
                              s.arr(idx), s.arr(node))


def _rope_back(node: Tensor, s: Session):
    a, pos, ff = node.src
    neg_t = Context().new_tensor(T.I32, (pos.ne[0],))
    buf = R.alloc_bytes(neg_t.nbytes)
    neg = R.view(buf, 0, neg_t)
    negate = elementwise_launch(compiled(k_negate), pos.ne[0],
                                s.arr(pos), neg)
    n_dims = node.params.n_dims
    work = n_rows(node) * (n_dims // 2 + node.ne[0] - n_dims)
    rotate = elementwise_launch(
        compiled(K.k_rope, a=a.type, d=node.type), work, s.arr(a), neg,
        s.arr(ff) if ff is not None else R.dummy(np.float32), s.arr(node),
        *(np.float32(x) if isinstance(x, float) else x for x in rope_args(node)), ff is not None)
    if negate is None or rotate is None:
        return None

    def both(buf: Any = buf) -> None:  # in order on the binding's stream; keeps buf alive
        negate()
        rotate()
    return both


def _loss(node: Tensor, s: Session):
    a, b = node.src
    k = compiled(k_cross_entropy, a=a.type, b=b.type, d=node.type)
    # g unused by the loss: a dummy stands in
    return per_row_launch(k, 1, ROW_NT, R.dummy(np.float32), s.arr(a), s.arr(b), s.arr(node),
                          False)


def _loss_back(node: Tensor, s: Session):
    g, a, b = node.src
    k = compiled(k_cross_entropy, a=a.type, b=b.type, d=node.type)
    return per_row_launch(k, n_rows(node), ROW_NT, s.arr(g), s.arr(a), s.arr(b), s.arr(node),
                          True)


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.SOFT_MAX_BACK: _soft_max_back,
    OpKind.RMS_NORM_BACK: _rms_norm_back,
    OpKind.GET_ROWS_BACK: _get_rows_back,
    OpKind.ROPE_BACK: _rope_back,
    OpKind.CROSS_ENTROPY_LOSS: _loss,
    OpKind.CROSS_ENTROPY_LOSS_BACK: _loss_back,
}
