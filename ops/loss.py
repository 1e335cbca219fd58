"""Loss functions: cross_entropy_loss (ggml's: a [1] scalar) and its gradient,
cross_entropy_loss_back, with the loss's backward rule.

ggml's loss is the mean over rows of -sum(labels * log_softmax(logits)); its gradient,
(softmax(logits) - labels) * dloss / rows, assumes each row of labels sums to 1 (the exact
gradient is softmax * sum(labels) - labels): labels are probabilities, as in ggml-opt.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import TOL_SOFTMAX, Case, CaseBuilder, case
from .registry import GGMLMap, OpDef, ggml_fn, new_node, register, require, require_type, types_ok

CROSS_ENTROPY_LOSS = OpKind.define("cross_entropy_loss", Family.REDUCE)
CROSS_ENTROPY_LOSS_BACK = OpKind.define("cross_entropy_loss_back", Family.REDUCE)


def _require_pair(op: str, logits: Tensor, labels: Tensor) -> None:
    require_type(op, "logits", logits, (GGMLType.F32,))
    require_type(op, "labels", labels, (GGMLType.F32,))
    require(logits.ne == labels.ne, op, "logits and labels must have the same shape",
            logits=logits, labels=labels)
    # a row's softmax divides by a sum over the row, and the mean by the number of rows
    require(logits.ne[0] > 0 and logits.nrows > 0, op, "logits must hold at least one value",
            logits=logits)


def cross_entropy_loss(logits: Tensor, labels: Tensor, name: str = "") -> Tensor:
    """ggml_cross_entropy_loss(a = logits, b = labels): [1], the mean over rows of
    -sum(labels * log_softmax(logits))."""
    _require_pair("cross_entropy_loss", logits, labels)
    return new_node(OpKind.CROSS_ENTROPY_LOSS, (logits, labels), GGMLType.F32, (1,), name=name)


def cross_entropy_loss_back(grad: Tensor, logits: Tensor, labels: Tensor,
                            name: str = "") -> Tensor:
    """ggml_cross_entropy_loss_back(a = grad, b = logits, c = labels), the order ggml's
    constructor asserts on (a scalar) and its backward pass uses (ggml.h's comments name a
    the logits and c the gradient: stale): (softmax(logits) - labels) * grad / rows."""
    op = "cross_entropy_loss_back"
    _require_pair(op, logits, labels)
    require_type(op, "grad", grad, (GGMLType.F32,))
    require(grad.nelements == 1, op, "grad must be a scalar (the loss's gradient)", grad=grad)
    return new_node(OpKind.CROSS_ENTROPY_LOSS_BACK, (grad, logits, labels), GGMLType.F32,
                    logits.ne, name=name)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _ref_loss(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    p = ex.read(node.src[1]).astype(np.float64)
    rows = x.size // x.shape[-1]
    return np.array([-np.sum(p * _log_softmax(x)) / rows])


def _ref_loss_back(node: Tensor, ex) -> np.ndarray:
    g = float(ex.read(node.src[0]).reshape(-1)[0])
    x = ex.read(node.src[1]).astype(np.float64)
    p = ex.read(node.src[2]).astype(np.float64)
    rows = x.size // x.shape[-1]
    return (np.exp(_log_softmax(x)) - p) * (g / rows)


def _loss_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """The logits' gradient (cross_entropy_loss_back); the labels get none, as in ggml."""
    logits, labels = node.src
    return (cross_entropy_loss_back(grad, logits, labels) if wants[0] else None, None)


# -- conformance cases --------------------------------------------------------------------

def _labels(B: CaseBuilder, *ne: int) -> Tensor:
    """Labels that are probabilities: each row positive and summing to 1."""
    t = B.ctx.new_tensor(T.F32, ne)
    p = B.rng.uniform(0.0, 1.0, t.shape)
    return t.set_data(p / p.sum(axis=-1, keepdims=True))


_SHAPES = ((33, 5), (64, 3, 2), (7, 1))


def _loss_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        yield case(OpKind.CROSS_ENTROPY_LOSS, lambda B, ne=ne: cross_entropy_loss(
            B.inp(T.F32, *ne, lo=-4.0, hi=4.0), _labels(B, *ne)), TOL_SOFTMAX, ne=list(ne))


def _loss_back_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        yield case(OpKind.CROSS_ENTROPY_LOSS_BACK, lambda B, ne=ne: cross_entropy_loss_back(
            B.inp(T.F32, 1), B.inp(T.F32, *ne, lo=-4.0, hi=4.0), _labels(B, *ne)),
            TOL_SOFTMAX, ne=list(ne))


def _ggml_contiguous(t: Tensor) -> str | None:
    if not all(s.is_contiguous() for s in t.src):
        return f"ggml's CPU {t.op} needs contiguous sources"
    return None


register(OpDef(OpKind.CROSS_ENTROPY_LOSS, "xent", _ref_loss, cases=_loss_cases,
               accepts=lambda n: types_ok(n, (T.F32,), (T.F32,)), src_labels=True,
               backward=_loss_grad,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_cross_entropy_loss", "a", "b"),
                            cpu_limits=_ggml_contiguous,
                            probe=lambda k: k.lib.ggml_cross_entropy_loss(k.ctx, k.a, k.a))))
register(OpDef(OpKind.CROSS_ENTROPY_LOSS_BACK, "xent_back", _ref_loss_back, cases=_loss_back_cases,
               accepts=lambda n: types_ok(n, (T.F32,), (T.F32,), (T.F32,)), src_labels=True,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_cross_entropy_loss_back", "a", "b", "c"),
                            cpu_limits=_ggml_contiguous,
                            probe=lambda k: k.lib.ggml_cross_entropy_loss_back(
                                k.ctx, k.new(T.F32, 1), k.a, k.a))))
