"""Row normalisation: rms_norm and norm (mean/variance), each with eps."""
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


def _ref_rms_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + node.params.eps)


def _ref_norm(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + node.params.eps)


# -- conformance cases --------------------------------------------------------------------

def _cases(kind: OpKind, f: Callable[..., Tensor]) -> Callable[[], Iterator[Case]]:
    def gen() -> Iterator[Case]:
        for ne in ((64, 5, 3), (33, 2)):
            yield case(kind, lambda B, ne=ne: f(B.inp(T.F32, *ne), 1e-6), ne=list(ne))
        yield case(kind, lambda B: f(strided(B, T.F32, 16, 5), 1e-6), ne=[16, 5], src="strided")
    return gen


def _f32(n: Tensor) -> bool:
    return types_ok(n, (T.F32,))


def _ggml_norm(lib, ctx, t: Tensor, S: list):
    return getattr(lib, f"ggml_{t.op.value}")(ctx, S[0], t.params.eps)


register(OpDef(OpKind.RMS_NORM, "rms_norm", _ref_rms_norm, NormParams, inplace=True,
               cases=_cases(OpKind.RMS_NORM, rms_norm), accepts=_f32,
               ggml=GGMLMap(build=_ggml_norm, cdecl=ggml_fn("ggml_rms_norm", "a", "float eps"),
                            cpu_limits=ggml_packed_sources(0),
                            probe=lambda k: k.lib.ggml_rms_norm(k.ctx, k.a, 1e-6))))
register(OpDef(OpKind.NORM, "norm", _ref_norm, NormParams, cases=_cases(OpKind.NORM, norm),
               accepts=_f32,
               ggml=GGMLMap(build=_ggml_norm, cdecl=ggml_fn("ggml_norm", "a", "float eps"),
                            probe=lambda k: k.lib.ggml_norm(k.ctx, k.a, 1e-6))))
