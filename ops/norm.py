"""Row normalisation: rms_norm and norm (mean/variance), each with eps."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggraph.opkind import OpKind
from ggraph.tensor import Tensor
from ggraph.types import GGMLType
from .registry import OpDef, new_node, register, require, require_type


@dataclass(frozen=True)
class NormParams:
    eps: float = 1e-6


def _norm(kind: OpKind, a: Tensor, eps: float, name: str) -> Tensor:
    op = str(kind)
    require_type(op, "a", a, (GGMLType.F32,))
    require(eps >= 0.0, op, f"eps must be >= 0, got {eps}", a=a)
    return new_node(kind, (a,), GGMLType.F32, a.ne, NormParams(float(eps)), name=name)


def rms_norm(a: Tensor, eps: float = 1e-6, name: str = "") -> Tensor:
    """x / sqrt(mean(x^2) + eps) per row."""
    return _norm(OpKind.RMS_NORM, a, eps, name)


def norm(a: Tensor, eps: float = 1e-5, name: str = "") -> Tensor:
    """(x - mean) / sqrt(var + eps) per row."""
    return _norm(OpKind.NORM, a, eps, name)


def _ref_rms_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + node.params.eps)


def _ref_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + node.params.eps)


register(OpDef(OpKind.RMS_NORM, "rms_norm", _ref_rms_norm, NormParams, inplace=True))
register(OpDef(OpKind.NORM, "norm", _ref_norm, NormParams))
