"""CPU kernels of the outer product (out_prod) and the optimizer steps (opt_step_adamw, opt_step_sgd).

out_prod runs on BLAS through numpy, as backends/cpu/blas.py runs mul_mat: a quantized (or
F16) `a` is dequantized RUN_ROWS rows at a time by the nogil row decoder, and each chunk's
product is split into fixed blocks of output rows run on blas.py's thread pool (fixed, so the
sums never depend on the thread count). The optimizer steps are numba loops over rows, in
float32 as ggml computes them.

BINDERS maps each op to its binder (node, session) -> call; backends/cpu/kernels.py makes the
table entries with the op's shared type rule."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
from numba import prange

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ..base import Session
from .blas import RUN_ROWS, run_units
from .compile import compiled, is_small, row_decoder

Q_BLOCK = 64  # output rows (columns of b) per BLAS call: fixed, like blas.RUN_ROWS


# -- out_prod -----------------------------------------------------------------------------

def _out_prod(node: Tensor, s: Session):
    a, b = node.src
    deq = None if a.type == T.F32 else row_decoder(a.type)
    return partial(out_prod_blas, s.arr(a), s.arr(b), s.arr(node), a.ne[0], deq)


def out_prod_blas(A: np.ndarray, B: np.ndarray, D: np.ndarray, p: int,
                  deq: Callable | None) -> None:
    """D[i3, i2] = B[i3, i2]^T @ A[i3 // r3, i2 // r2] (numpy order: A (A3, A2, J, P) of
    float32, or a stored type's bytes decoded by deq(A, j3, j2, m0, out); B (B3, B2, J, Q);
    D (B3, B2, Q, P)). Each slice of A (each chunk of its rows) is decoded once for all the
    slices of B that broadcast it."""
    a3, a2, j = A.shape[0], A.shape[1], B.shape[2]
    if D.size == 0:
        return
    if j == 0:
        D[...] = 0.0
        return
    r3, r2, q = D.shape[0] // a3, D.shape[1] // a2, D.shape[2]
    step = j if deq is None else RUN_ROWS
    for j3 in range(a3):
        for j2 in range(a2):
            units = [(i3, i2, q0, min(q, q0 + Q_BLOCK))
                     for i3 in range(j3 * r3, j3 * r3 + r3) for i2 in range(j2 * r2, j2 * r2 + r2)
                     for q0 in range(0, q, Q_BLOCK)]
            for c0 in range(0, j, step):
                c1 = min(j, c0 + step)
                if deq is None:
                    rows = A[j3, j2, c0:c1]
                else:
                    rows = np.empty((c1 - c0, p), np.float32)
                    deq(A, j3, j2, c0, rows)
                run_units(partial(_out_prod_unit, B, D, rows, c0, c1), units)


def _out_prod_unit(B: np.ndarray, D: np.ndarray, rows: np.ndarray, c0: int, c1: int,
                   i3: int, i2: int, q0: int, q1: int) -> None:
    part = B[i3, i2, c0:c1, q0:q1].T
    if c0 == 0:
        np.matmul(part, rows, out=D[i3, i2, q0:q1])
    else:
        D[i3, i2, q0:q1] += part @ rows


# -- optimizer steps --------------------------------------------------------------------------

def k_adamw(w, g, m, v, p):
    """One AdamW step over rows of equal-shaped float32 arrays (w, m, v updated in place);
    p: alpha, beta1, beta2, eps, wd, beta1h, beta2h."""
    n3, n2, n1, n0 = w.shape
    alpha, b1, b2, eps = p[0], p[1], p[2], p[3]
    keep = np.float32(1.0) - alpha * p[4]
    b1h, b2h = p[5], p[6]
    c1, c2 = np.float32(1.0) - b1, np.float32(1.0) - b2
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        for i in range(n0):
            gi = g[i3, i2, i1, i]
            mi = m[i3, i2, i1, i] * b1 + gi * c1
            vi = v[i3, i2, i1, i] * b2 + gi * gi * c2
            m[i3, i2, i1, i] = mi
            v[i3, i2, i1, i] = vi
            w[i3, i2, i1, i] = w[i3, i2, i1, i] * keep - alpha * (mi * b1h) / (
                np.sqrt(vi * b2h) + eps)


def k_sgd(w, g, p):
    """One SGD step over rows (w updated in place); p: alpha, wd."""
    n3, n2, n1, n0 = w.shape
    alpha = p[0]
    keep = np.float32(1.0) - alpha * p[1]
    for r in prange(n3 * n2 * n1):
        i3, i2, i1 = r // (n2 * n1), (r // n1) % n2, r % n1
        for i in range(n0):
            w[i3, i2, i1, i] = w[i3, i2, i1, i] * keep - alpha * g[i3, i2, i1, i]


def _same_shapes(node: Tensor, arrays: list[np.ndarray]) -> None:
    """The loops index every array by w's shape (numba does not bounds-check)."""
    if any(x.shape != arrays[0].shape for x in arrays):
        raise ValueError(f"{node.op} {node.describe()}: sources of different shapes "
                         f"{[x.shape for x in arrays]}")


def _params(node: Tensor, s: Session, n: int) -> np.ndarray:
    p = s.arr(node.src[-1]).reshape(-1)  # contiguous (the constructor's rule): a view
    if p.shape[0] != n:
        raise ValueError(f"{node.op} {node.describe()}: params hold {p.shape[0]} values, "
                         f"not {n}")
    return p


def _adamw(node: Tensor, s: Session):
    _, g, m, v, _ = node.src
    arrs = [s.arr(node), s.arr(g), s.arr(m), s.arr(v)]
    _same_shapes(node, arrs)
    return partial(compiled(k_adamw, is_small(node)), *arrs, _params(node, s, 7))


def _sgd(node: Tensor, s: Session):
    arrs = [s.arr(node), s.arr(node.src[1])]
    _same_shapes(node, arrs)
    return partial(compiled(k_sgd, is_small(node)), *arrs, _params(node, s, 2))


BINDERS: dict[OpKind, Callable[..., Any]] = {
    OpKind.OUT_PROD: _out_prod,
    OpKind.OPT_STEP_ADAMW: _adamw,
    OpKind.OPT_STEP_SGD: _sgd,
}
