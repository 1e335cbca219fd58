"""The type combinations the kernels accept, per op: one table every backend's kernel table
starts from (a backend may add its own limits, e.g. shared-memory sizes on CUDA), so the
backends cannot drift apart on what "supported" means."""
from __future__ import annotations

from typing import Callable

from ggraph.opkind import OpKind
from ggraph.ops.attention import KV_TYPES
from ggraph.ops.matmul import WEIGHT_TYPES
from ggraph.tensor import Tensor
from ggraph.types import GGMLType as T

FLOATS = (T.F32, T.F16)
ELEM_FLOATS = (T.F32, T.F16, T.BF16)
STORABLE = ELEM_FLOATS + (T.Q4_0, T.Q4_1, T.Q8_0)
UNARY_OPS = (OpKind.SCALE, OpKind.CLAMP, OpKind.FILL, OpKind.SILU, OpKind.GELU, OpKind.SIGMOID)
BINARY_OPS = (OpKind.ADD, OpKind.MUL, OpKind.DIV, OpKind.SWIGLU)
VIEW_OPS = (OpKind.VIEW, OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE)


def types_ok(node: Tensor, *roles_ok) -> bool:
    """Each source's type is in its role's allowed set (missing optional sources pass)."""
    return all(s is None or s.type in ok for s, ok in zip(node.src, roles_ok))


def _any(node: Tensor) -> bool:
    return True


Rule = tuple[Callable[[Tensor], bool], str]

RULES: dict[OpKind, Rule] = {
    **{op: (_any, "") for op in VIEW_OPS},
    **{op: (lambda n: types_ok(n, FLOATS) and n.type in FLOATS, "F32/F16 only")
       for op in UNARY_OPS},
    **{op: (lambda n: types_ok(n, FLOATS, FLOATS), "F32/F16 only") for op in BINARY_OPS},
    OpKind.RMS_NORM: (lambda n: types_ok(n, (T.F32,)), ""),
    OpKind.NORM: (lambda n: types_ok(n, (T.F32,)), ""),
    OpKind.SOFT_MAX: (lambda n: types_ok(n, (T.F32,), FLOATS, (T.F32,)), ""),
    OpKind.ROPE: (lambda n: types_ok(n, FLOATS, (T.I32,), (T.F32,)), ""),
    OpKind.FLASH_ATTN_EXT: (lambda n: types_ok(n, (T.F32,), KV_TYPES, KV_TYPES, FLOATS), ""),
    OpKind.MUL_MAT: (lambda n: types_ok(n, WEIGHT_TYPES, FLOATS), ""),
    OpKind.MUL_MAT_ID: (lambda n: types_ok(n, WEIGHT_TYPES, FLOATS, (T.I32,)), ""),
    OpKind.GET_ROWS: (lambda n: types_ok(n, STORABLE + (T.I32,), (T.I32,)), ""),
    OpKind.SET_ROWS: (lambda n: types_ok(n, STORABLE, (T.F32,), (T.I32, T.I64)), ""),
    **{op: (_any, "") for op in (OpKind.CPY, OpKind.CONT, OpKind.CONCAT, OpKind.REPEAT,
                                 OpKind.SUM_ROWS, OpKind.ARGSORT, OpKind.TOP_K)},
}


def rule(op: OpKind, extra: Callable[[Tensor], bool] | None = None, why: str = "") -> Rule:
    """The shared rule of `op`, narrowed by a backend's own limit `extra` (stated in `why`)."""
    base, base_why = RULES[op]
    if extra is None:
        return base, base_why
    return (lambda n: base(n) and extra(n)), why or base_why
