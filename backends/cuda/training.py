"""CUDA kernels of the outer product (out_prod) and the optimizer steps (opt_step_adamw, opt_step_sgd).

out_prod is a straightforward kernel: one thread per CH consecutive outputs of a row of d,
walking the summed dimension and decoding a's chunk (a quant block) once per step. The
optimizer steps are element-wise, in float32 as ggml computes them; their hyper-parameters are
read from the params tensor on the device at every launch (written before each run).

BINDERS maps each op to its binder (node, session) -> call; backends/cuda/kernels.py makes the
table entries with the op's shared type rule."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from numba import cuda, float32

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ..base import Session
from ..shared.bound import bound
from .launch import compiled, elementwise_launch
from .templates import CH, unflatten

# names each binding supplies (backends/shared/bound.py)
cdec_a, ld_b = bound("cdec_a", "ld_b")

ZERO = np.float32(0.0)  # float32: a float64 literal would turn the arithmetic float64
ONE = np.float32(1.0)


def k_out_prod(a, b, d, n0):
    """d[i3, i2, i1, :] = sum_j a[i3 // r3, i2 // r2, j, :] * b[i3, i2, j, i1]; n0: elements
    per row of a and d (a quantized row's last axis counts bytes)."""
    vals = cuda.local.array(CH, float32)
    acc = cuda.local.array(CH, float32)
    n3, n2, nq = d.shape[0], d.shape[1], d.shape[2]
    r3, r2, nj = n3 // a.shape[0], n2 // a.shape[1], a.shape[2]
    nc = (n0 + CH - 1) // CH
    for k in range(cuda.grid(1), n3 * n2 * nq * nc, cuda.gridsize(1)):
        i3, i2, i1, c = unflatten(k, n2, nq, nc)
        k0 = c * CH
        n = min(CH, n0 - k0)
        for t in range(CH):
            acc[t] = ZERO
        for j in range(nj):
            cdec_a(a, i3 // r3, i2 // r2, j, k0, n, vals)
            bv = ld_b(b, i3, i2, j, i1)
            for t in range(n):
                acc[t] += vals[t] * bv
        for t in range(n):
            d[i3, i2, i1, k0 + t] = acc[t]


def k_adamw(w, g, m, v, p):
    """One AdamW step per element (w, m, v in place); p[0, 0, 0, :7]: alpha, beta1, beta2,
    eps, wd, beta1h, beta2h."""
    n3, n2, n1, n0 = w.shape
    alpha, b1, b2, eps = p[0, 0, 0, 0], p[0, 0, 0, 1], p[0, 0, 0, 2], p[0, 0, 0, 3]
    keep = ONE - alpha * p[0, 0, 0, 4]
    b1h, b2h = p[0, 0, 0, 5], p[0, 0, 0, 6]
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        gi = g[i3, i2, i1, i0]
        mi = m[i3, i2, i1, i0] * b1 + gi * (ONE - b1)
        vi = v[i3, i2, i1, i0] * b2 + gi * gi * (ONE - b2)
        m[i3, i2, i1, i0] = mi
        v[i3, i2, i1, i0] = vi
        w[i3, i2, i1, i0] = w[i3, i2, i1, i0] * keep - alpha * (mi * b1h) / (
            math.sqrt(vi * b2h) + eps)


def k_sgd(w, g, p):
    """One SGD step per element (w in place); p[0, 0, 0, :2]: alpha, wd."""
    n3, n2, n1, n0 = w.shape
    alpha = p[0, 0, 0, 0]
    keep = ONE - alpha * p[0, 0, 0, 1]
    for k in range(cuda.grid(1), n3 * n2 * n1 * n0, cuda.gridsize(1)):
        i3, i2, i1, i0 = unflatten(k, n2, n1, n0)
        w[i3, i2, i1, i0] = w[i3, i2, i1, i0] * keep - alpha * g[i3, i2, i1, i0]


def _out_prod(node: Tensor, s: Session):
    a, b = node.src
    work = node.ne[1] * node.ne[2] * node.ne[3] * -(-node.ne[0] // CH)
    return elementwise_launch(compiled(k_out_prod, a=a.type, b=b.type), work, s.arr(a),
                              s.arr(b), s.arr(node), a.ne[0])


def _step(template: Callable) -> Callable:
    """The binder of an optimizer step: node (a view of a), then its sources but a, in order
    (grad[, m, v], params); the constructor made them all of a's shape but params."""
    def bind(node: Tensor, s: Session):
        arrs = [s.arr(node)] + [s.arr(t) for t in node.src[1:]]
        if any(x.shape != arrs[0].shape for x in arrs[1:-1]):
            raise ValueError(f"{node.op} {node.describe()}: sources of different shapes")
        return elementwise_launch(compiled(template), node.nelements, *arrs)
    return bind


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.OUT_PROD: _out_prod,
    OpKind.OPT_STEP_ADAMW: _step(k_adamw),
    OpKind.OPT_STEP_SGD: _step(k_sgd),
}
