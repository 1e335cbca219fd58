"""Row normalisation: rms_norm and norm (mean/variance), each with eps; rms_norm_back (ggml's
gradient of rms_norm) and both ops' backward rules (norm's composed: ggml has no norm_back)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import Case, case
from .registry import (GGMLMap, OpDef, ggml_fn, ggml_packed_sources, new_node, register, require,
                       require_type, types_ok)
from .views import strided

RMS_NORM = OpKind.define("rms_norm", Family.NORM)
NORM = OpKind.define("norm", Family.NORM)
RMS_NORM_BACK = OpKind.define("rms_norm_back", Family.NORM)


@dataclass(frozen=True)
class NormParams:
    eps: float = 1e-6


def _norm(kind: OpKind, a: Tensor, eps: float, name: str) -> Tensor:
    op = str(kind)
    require_type(op, "a", a, (GGMLType.F32,))
    require(eps >= 0.0, op, f"eps must be >= 0, got {eps}", a=a)
    # the mean of an empty row is 0/0: kernels would divide by zero
    require(a.ne[0] > 0 or a.nrows == 0, op, "rows must hold at least one value (ne[0] >= 1)",
            a=a)
    return new_node(kind, (a,), GGMLType.F32, a.ne, NormParams(float(eps)), name=name)


def rms_norm(a: Tensor, eps: float = 1e-6, name: str = "") -> Tensor:
    """x / sqrt(mean(x^2) + eps) per row."""
    return _norm(OpKind.RMS_NORM, a, eps, name)


def norm(a: Tensor, eps: float = 1e-5, name: str = "") -> Tensor:
    """(x - mean) / sqrt(var + eps) per row."""
    return _norm(OpKind.NORM, a, eps, name)


def rms_norm_back(dy: Tensor, x: Tensor, eps: float = 1e-6, name: str = "") -> Tensor:
    """The gradient of rms_norm(x, eps) for the gradient dy of its result, ggml_rms_norm_back
    (a = dy, b = x, as ggml's backward pass and CPU kernel use them; the comment in ggml.h
    naming a the x is stale): dx = r * (dy - x * sum(x*dy) / (sum(x*x) + n*eps)) per row,
    r = 1 / sqrt(mean(x^2) + eps)."""
    op = "rms_norm_back"
    require_type(op, "dy", dy, (GGMLType.F32,))
    require_type(op, "x", x, (GGMLType.F32,))
    require(dy.ne == x.ne, op, "dy and x must have the same shape", dy=dy, x=x)
    require(eps >= 0.0, op, f"eps must be >= 0, got {eps}", x=x)
    require(x.ne[0] > 0 or x.nrows == 0, op, "rows must hold at least one value (ne[0] >= 1)",
            x=x)
    return new_node(OpKind.RMS_NORM_BACK, (dy, x), GGMLType.F32, x.ne, NormParams(float(eps)),
                    name=name)


def _ref_rms_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + node.params.eps)


def _ref_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + node.params.eps)


def _ref_rms_norm_back(node: Tensor, ex) -> np.ndarray:
    dy = ex.read(node.src[0]).astype(np.float64)
    x = ex.read(node.src[1]).astype(np.float64)
    n = x.shape[-1]
    sxx = np.sum(x * x, axis=-1, keepdims=True)
    sxdy = np.sum(x * dy, axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(sxx / n + node.params.eps)
    return r * (dy - x * sxdy / (sxx + n * node.params.eps))


# -- backward rules ------------------------------------------------------------------------

def _rms_norm_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    return (rms_norm_back(grad, node.src[0], node.params.eps) if wants[0] else None,)


def _norm_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """norm(x) = rms_norm(c) with c = x - mean(x), and c's map is the projection P = I - 1/n
    (symmetric), so dx = P(rms_norm_back(dy, c)): two centerings around the one ggml kernel."""
    if not wants[0]:
        return (None,)
    from ggraph import ops

    def centered(t: Tensor) -> Tensor:
        return ops.add(t, ops.scale(ops.sum_rows(t), -1.0 / t.ne[0]))
    return (centered(rms_norm_back(grad, centered(node.src[0]), node.params.eps)),)


# -- conformance cases --------------------------------------------------------------------

def _cases(kind: OpKind, f: Callable[..., Tensor]) -> Callable[[], Iterator[Case]]:
    def gen() -> Iterator[Case]:
        for ne in ((64, 5, 3), (33, 2)):
            yield case(kind, lambda B, ne=ne: f(B.inp(T.F32, *ne), 1e-6), ne=list(ne))
        yield case(kind, lambda B: f(strided(B, T.F32, 16, 5), 1e-6), ne=[16, 5], src="strided")
    return gen


def _rms_norm_back_cases() -> Iterator[Case]:
    for ne in ((64, 5, 3), (33, 2)):
        yield case(OpKind.RMS_NORM_BACK, lambda B, ne=ne: rms_norm_back(
            B.inp(T.F32, *ne), B.inp(T.F32, *ne), 1e-6), ne=list(ne))
    yield case(OpKind.RMS_NORM_BACK, lambda B: rms_norm_back(
        B.inp(T.F32, 16, 5), strided(B, T.F32, 16, 5), 1e-5), ne=[16, 5], src="strided")


def _f32(n: Tensor) -> bool:
    return types_ok(n, (T.F32,))


def _ggml_norm(lib, ctx, t: Tensor, S: list):
    return getattr(lib, f"ggml_{t.op.value}")(ctx, S[0], t.params.eps)


register(OpDef(OpKind.RMS_NORM, "rms_norm", _ref_rms_norm, NormParams, inplace=True,
               cases=_cases(OpKind.RMS_NORM, rms_norm), accepts=_f32, backward=_rms_norm_grad,
               ggml=GGMLMap(build=_ggml_norm, cdecl=ggml_fn("ggml_rms_norm", "a", "float eps"),
                            cpu_limits=ggml_packed_sources(0),
                            probe=lambda k: k.lib.ggml_rms_norm(k.ctx, k.a, 1e-6))))
register(OpDef(OpKind.NORM, "norm", _ref_norm, NormParams, cases=_cases(OpKind.NORM, norm),
               accepts=_f32, backward=_norm_grad,
               ggml=GGMLMap(build=_ggml_norm, cdecl=ggml_fn("ggml_norm", "a", "float eps"),
                            probe=lambda k: k.lib.ggml_norm(k.ctx, k.a, 1e-6))))
register(OpDef(OpKind.RMS_NORM_BACK, "rms_norm_back", _ref_rms_norm_back, NormParams,
               cases=_rms_norm_back_cases, accepts=lambda n: types_ok(n, (T.F32,), (T.F32,)),
               src_labels=True,
               ggml=GGMLMap(build=lambda lib, ctx, t, S: lib.ggml_rms_norm_back(
                   ctx, S[0], S[1], t.params.eps),
                   cdecl=ggml_fn("ggml_rms_norm_back", "a", "b", "float eps"),
                   cpu_limits=ggml_packed_sources(0, 1),
                   probe=lambda k: k.lib.ggml_rms_norm_back(k.ctx, k.a, k.a, 1e-6))))
