"""Reductions, selection and layout: sum_rows, argsort, top_k, concat, repeat."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import Case, any_values, case
from .registry import GGMLMap, OpDef, can_repeat, ggml_fn, new_node, register, require, require_type

SUM_ROWS = OpKind.define("sum_rows", Family.REDUCE)
ARGSORT = OpKind.define("argsort", Family.REDUCE)
TOP_K = OpKind.define("top_k", Family.REDUCE)
CONCAT = OpKind.define("concat", Family.COPY)
REPEAT = OpKind.define("repeat", Family.COPY)


class SortOrder(IntEnum):
    ASC = 0
    DESC = 1


@dataclass(frozen=True)
class ArgsortParams:
    order: SortOrder


@dataclass(frozen=True)
class TopKParams:
    k: int


@dataclass(frozen=True)
class ConcatParams:
    dim: int


def sum_rows(a: Tensor, name: str = "") -> Tensor:
    """Sum of each row: [1, ne1, ne2, ne3]."""
    require_type("sum_rows", "a", a, (GGMLType.F32,))
    return new_node(OpKind.SUM_ROWS, (a,), GGMLType.F32, (1,) + a.ne[1:], name=name)


def argsort(a: Tensor, order: SortOrder | int = SortOrder.ASC, name: str = "") -> Tensor:
    """I32 indices that sort each row (stable: ties keep index order)."""
    require_type("argsort", "a", a, (GGMLType.F32,))
    return new_node(OpKind.ARGSORT, (a,), GGMLType.I32, a.ne,
                    ArgsortParams(SortOrder(int(order))), name=name)


def top_k(a: Tensor, k: int, name: str = "") -> Tensor:
    """I32 indices of the k largest values of each row, largest first (ties: lower index)."""
    require_type("top_k", "a", a, (GGMLType.F32,))
    require(0 < k <= a.ne[0], "top_k", f"k={k} must be in 1..a.ne[0]={a.ne[0]}", a=a)
    return new_node(OpKind.TOP_K, (a,), GGMLType.I32, (k,) + a.ne[1:], TopKParams(int(k)),
                    name=name)


def concat(a: Tensor, b: Tensor, dim: int, name: str = "") -> Tensor:
    """Join a and b along `dim`; all other dimensions equal."""
    op = "concat"
    require(0 <= dim < 4, op, f"dim={dim} must be in 0..3", a=a, b=b)
    require(a.type == b.type, op, f"types differ ({a.type} and {b.type})", a=a, b=b)
    require(not a.type.is_quantized, op, "quantized tensors cannot be concatenated", a=a)
    require(all(a.ne[i] == b.ne[i] for i in range(4) if i != dim), op,
            f"a and b must have equal ne except in dim {dim}", a=a, b=b)
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return new_node(OpKind.CONCAT, (a, b), a.type, ne, ConcatParams(dim), name=name)


def repeat(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """Tile a to b's shape (b's values are not read)."""
    require(can_repeat(a, b), "repeat", f"a.ne={list(a.ne)} must divide b.ne={list(b.ne)}",
            a=a, b=b)
    require(not a.type.is_quantized, "repeat", "quantized tensors cannot be repeated", a=a)
    return new_node(OpKind.REPEAT, (a, b), a.type, b.ne, name=name)


def _ref_argsort(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    key = -x if node.params.order == SortOrder.DESC else x
    return np.argsort(key, axis=-1, kind="stable")


def _ref_top_k(node: Tensor, ex) -> np.ndarray:
    x = ex.read(node.src[0]).astype(np.float64)
    return np.argsort(-x, axis=-1, kind="stable")[..., : node.params.k]


def _ref_concat(node: Tensor, ex) -> np.ndarray:
    a, b = node.src
    return np.concatenate([ex.read(a), ex.read(b)], axis=3 - node.params.dim)


def _ref_repeat(node: Tensor, ex) -> np.ndarray:
    a, b = node.src
    return np.tile(ex.read(a), tuple(x // y for x, y in zip(b.shape, a.shape)))


# -- conformance cases --------------------------------------------------------------------

_SHAPES = ((64, 5, 3), (7, 2))


def _sum_rows_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        yield case(OpKind.SUM_ROWS, lambda B, ne=ne: sum_rows(B.inp(T.F32, *ne)), ne=list(ne))


def _argsort_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        for order in (SortOrder.ASC, SortOrder.DESC):
            yield case(OpKind.ARGSORT, lambda B, ne=ne, o=order: argsort(B.inp(T.F32, *ne), o),
                       0.0, ne=list(ne), order=order.name)


def _top_k_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        yield case(OpKind.TOP_K, lambda B, ne=ne: top_k(B.inp(T.F32, *ne), 4), 0.0,
                   ne=list(ne), k=4)


_LAYOUT_TYPES = (T.F32, T.F16, T.BF16, T.I32, T.I64)


def _concat_cases() -> Iterator[Case]:
    for t in _LAYOUT_TYPES:
        for dim in range(4):
            yield case(OpKind.CONCAT, lambda B, t=t, d=dim: concat(
                any_values(B, t, 6, 5, 4, 3), any_values(B, t, *[(2 if i == d else x) for i, x in
                                                               enumerate((6, 5, 4, 3))]), d),
                0.0, type=t, dim=dim)


def _repeat_cases() -> Iterator[Case]:
    for t in _LAYOUT_TYPES:
        yield case(OpKind.REPEAT, lambda B, t=t: repeat(
            any_values(B, t, 8, 1, 3), any_values(B, t, 16, 4, 3, 2)), 0.0, type=t)


def _ggml_top_k_order(node: Tensor, idx: np.ndarray, srcs: list[np.ndarray]) -> np.ndarray:
    """ggml_top_k returns the k indices in no particular order; sort each row as ggraph does:
    by value, largest first, ties by lower index."""
    v = np.take_along_axis(srcs[0].astype(np.float64), idx.astype(np.int64), axis=-1)
    flat_i = idx.reshape(-1, idx.shape[-1])
    flat_v = v.reshape(-1, idx.shape[-1])
    out = np.empty_like(flat_i)
    for r in range(flat_i.shape[0]):
        order = np.lexsort((flat_i[r], -flat_v[r]))
        out[r] = flat_i[r][order]
    return out.reshape(idx.shape)


register(OpDef(OpKind.SUM_ROWS, "sum_rows", lambda n, ex: ex.read(n.src[0]).astype(
    np.float64).sum(axis=-1, keepdims=True), cases=_sum_rows_cases,
    ggml=GGMLMap(cdecl=ggml_fn("ggml_sum_rows", "a"),
                 probe=lambda k: k.lib.ggml_sum_rows(k.ctx, k.a))))
register(OpDef(OpKind.ARGSORT, "argsort", _ref_argsort, ArgsortParams, cases=_argsort_cases,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_argsort", "a", "int order"),
                            build=lambda lib, ctx, t, S: lib.ggml_argsort(
                   ctx, S[0], int(t.params.order)),
                   probe=lambda k: k.lib.ggml_argsort(k.ctx, k.a, 0))))
register(OpDef(OpKind.TOP_K, "top_k", _ref_top_k, TopKParams, cases=_top_k_cases,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_top_k", "a", "int k"),
                            build=lambda lib, ctx, t, S: lib.ggml_top_k(ctx, S[0], t.params.k),
                            probe=lambda k: k.lib.ggml_top_k(k.ctx, k.a, 4),
                            canonical=_ggml_top_k_order)))
register(OpDef(OpKind.CONCAT, "concat", _ref_concat, ConcatParams, cases=_concat_cases,
               src_labels=True,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_concat", "a", "b", "int dim"),
                            build=lambda lib, ctx, t, S: lib.ggml_concat(ctx, S[0], S[1],
                                                                          t.params.dim),
                            probe=lambda k: k.lib.ggml_concat(k.ctx, k.a, k.a, 1))))
register(OpDef(OpKind.REPEAT, "repeat", _ref_repeat, cases=_repeat_cases,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_repeat", "a", "b"),
                            probe=lambda k: k.lib.ggml_repeat(k.ctx, k.a, k.a))))
