"""Reductions, selection and layout: sum_rows, sum, mean, argsort, top_k, concat, repeat,
and the inverses gradients need: repeat_back (a tiled tensor's tiles summed), acc (a tensor
added into a strided window of a copy of another), with `reduce_to` (a broadcast operand's
gradient) and `zeros` (F32 zeros of a tensor's shape) for the backward rules of every module.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import Case, any_values, case
from .elementwise import fill, scale
from .registry import (GGMLMap, OpDef, can_repeat, ggml_fn, ggml_packed_sources, new_node,
                       register, require, require_type)
from .views import cont, strided, view_1d, view_4d

SUM_ROWS = OpKind.define("sum_rows", Family.REDUCE)
ARGSORT = OpKind.define("argsort", Family.REDUCE)
TOP_K = OpKind.define("top_k", Family.REDUCE)
CONCAT = OpKind.define("concat", Family.COPY)
REPEAT = OpKind.define("repeat", Family.COPY)
SUM = OpKind.define("sum", Family.REDUCE)
MEAN = OpKind.define("mean", Family.REDUCE)
REPEAT_BACK = OpKind.define("repeat_back", Family.REDUCE)
ACC = OpKind.define("acc", Family.ARITHMETIC)


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


@dataclass(frozen=True)
class AccParams:
    """The window of acc's result that b is added into: strides and start in bytes."""
    nb1: int
    nb2: int
    nb3: int
    offset: int


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


def sum(a: Tensor, name: str = "") -> Tensor:  # noqa: A001 (ggml's name)
    """The sum of every element: ne [1] (ggml_sum)."""
    require_type("sum", "a", a, (GGMLType.F32,))
    return new_node(OpKind.SUM, (a,), GGMLType.F32, (1,), name=name)


def mean(a: Tensor, name: str = "") -> Tensor:
    """The mean of each row: [1, ne1, ne2, ne3] (ggml_mean)."""
    require_type("mean", "a", a, (GGMLType.F32,))
    return new_node(OpKind.MEAN, (a,), GGMLType.F32, (1,) + a.ne[1:], name=name)


def repeat_back(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """a's tiles of b's shape summed into b's shape, the inverse of repeat(b, a)
    (ggml_repeat_back; b's values are not read, and b is no source of the node)."""
    require_type("repeat_back", "a", a, (GGMLType.F32,))
    require(can_repeat(b, a), "repeat_back", f"b.ne={list(b.ne)} must divide a.ne="
            f"{list(a.ne)}", a=a, b=b)
    return new_node(OpKind.REPEAT_BACK, (a,), GGMLType.F32, b.ne, name=name)


def acc(a: Tensor, b: Tensor, nb1: int, nb2: int, nb3: int, offset: int, name: str = ""
        ) -> Tensor:
    """A copy of a with b added into the view of it with b's ne, strides (nb0, nb1, nb2, nb3)
    and start `offset`, in bytes (ggml_acc; not in place)."""
    op = "acc"
    require_type(op, "a", a, (GGMLType.F32,))
    require_type(op, "b", b, (GGMLType.F32,))
    require(a.is_contiguous(), op, "a must be contiguous", a=a, b=b)
    nb = (int(nb1), int(nb2), int(nb3))
    es = a.type.type_size
    require(all(x >= 0 and x % es == 0 for x in nb) and offset >= 0 and offset % es == 0, op,
            f"nb1..nb3={list(nb)} and offset={offset} must be whole elements, >= 0", a=a, b=b)
    last = offset  # the window's last element (b's strides: es, nb1, nb2, nb3)
    for n, x in zip(b.ne, (es,) + nb):
        last += max(n - 1, 0) * x
    require(b.nelements == 0 or last + es <= a.nbytes, op,
            f"the window of ne={list(b.ne)} nb1..nb3={list(nb)} at offset {offset} ends at "
            f"byte {last + es}, past a's {a.nbytes} bytes", a=a, b=b)
    return new_node(OpKind.ACC, (a, b), GGMLType.F32, a.ne, AccParams(*nb, int(offset)),
                    name=name)


def reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """The gradient of a source `like` that an op broadcast by modulo to grad's shape: grad
    itself when the shapes agree, else its tiles summed (repeat_back)."""
    return grad if grad.ne == like.ne else repeat_back(grad, like)


def zeros(like: Tensor, f32: Tensor | None = None, name: str = "") -> Tensor:
    """F32 zeros of like's ne: the base a gradient covering part of its source (a view's) is
    added into. A fill of `like` itself when it is F32 (fill keeps its source's type and never
    reads its values); for another type, one element of the F32 tensor `f32` (any: a rule
    passes its incoming gradient) filled with zero and repeated to like's shape."""
    if like.type == GGMLType.F32:
        return fill(like, 0.0, name=name)
    require(f32 is not None and f32.type == GGMLType.F32 and f32.nelements > 0, "zeros",
            "a non-F32 tensor's zeros need an F32 tensor to make them from", like=like, f32=f32)
    return repeat(fill(view_1d(f32, 1, 0), 0.0), like, name=name)


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


def _ref_repeat_back(node: Tensor, ex) -> np.ndarray:
    A = ex.read(node.src[0]).astype(np.float64)
    tiled = []  # (tiles, n) per axis: element j of A's axis is tile j // n, position j % n
    for a, n in zip(A.shape, node.shape):
        tiled += [a // n, n]
    return A.reshape(tiled).sum(axis=(0, 2, 4, 6))


def _acc_index(node: Tensor) -> np.ndarray:
    """The flat element of acc's result each element of b (numpy order) is added into."""
    b, p, es = node.src[1], node.params, node.type.type_size
    i3, i2, i1, i0 = np.indices(b.shape)
    return (p.offset + i3 * p.nb3 + i2 * p.nb2 + i1 * p.nb1) // es + i0


def _ref_acc(node: Tensor, ex) -> np.ndarray:
    d = ex.read(node.src[0]).astype(np.float64).reshape(-1).copy()
    np.add.at(d, _acc_index(node).reshape(-1), ex.read(node.src[1]).astype(np.float64).reshape(-1))
    return d.reshape(node.shape)


# -- backward rules (ops/registry.py: Backward) -------------------------------------------

def _bw_spread(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    """sum_rows, sum, repeat_back: each element of the source reached the result once."""
    return (repeat(g, n.src[0]) if w[0] else None,)


def _bw_mean(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    a = n.src[0]
    return (repeat(scale(g, 1.0 / max(a.ne[0], 1)), a) if w[0] else None,)


def _bw_repeat(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    return (repeat_back(g, n.src[0]) if w[0] else None, None)  # b: only its shape is used


def _part(g: Tensor, ne: tuple[int, ...], nb: tuple[int, ...], offset: int) -> Tensor:
    """A contiguous copy of the window of g with ne, strides nb1..nb3 and start offset."""
    return cont(view_4d(g, *ne, *nb, offset))


def _bw_concat(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    a, b = n.src
    d = n.params.dim
    return (_part(g, a.ne, g.nb[1:], 0) if w[0] else None,
            _part(g, b.ne, g.nb[1:], a.ne[d] * g.nb[d]) if w[1] else None)


def _bw_acc(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    p = n.params
    gc = g if g.is_contiguous() else cont(g)  # the window's strides are those of a's layout
    return (g if w[0] else None,
            _part(gc, n.src[1].ne, (p.nb1, p.nb2, p.nb3), p.offset) if w[1] else None)


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


def _sum_cases(kind: OpKind, f) -> Iterator[Case]:
    for ne in _SHAPES:
        yield case(kind, lambda B, ne=ne: f(B.inp(T.F32, *ne)), ne=list(ne))
    yield case(kind, lambda B: f(strided(B, T.F32, 16, 5)), src="strided")


def _repeat_back_cases() -> Iterator[Case]:
    for ne_a, ne_b in (((16, 4, 3, 2), (8, 1, 3, 1)), ((16, 4, 3, 2), (16, 4, 3, 2)),
                       ((7, 6), (1, 3))):
        yield case(OpKind.REPEAT_BACK, lambda B, a=ne_a, b=ne_b: repeat_back(
            B.inp(T.F32, *a), B.inp(T.F32, *b)), ne_a=list(ne_a), ne_b=list(ne_b))
    yield case(OpKind.REPEAT_BACK, lambda B: repeat_back(strided(B, T.F32, 16, 6),
                                                         B.inp(T.F32, 4, 3)), a="strided")


def _acc_cases() -> Iterator[Case]:

    def window(B, b):  # b into rows 1.. and planes 1.. of a, from element 2 of each row
        a = B.inp(T.F32, 16, 5, 3)
        return acc(a, b, a.nb[1], a.nb[2], a.nb[3], 2 * a.nb[0] + a.nb[1] + a.nb[2])
    yield case(OpKind.ACC, lambda B: window(B, B.inp(T.F32, 9, 4, 2)), b=[9, 4, 2])
    yield case(OpKind.ACC, lambda B: window(B, strided(B, T.F32, 9, 4)), b="strided")
    yield case(OpKind.ACC, lambda B: acc(B.inp(T.F32, 16, 5), B.inp(T.F32, 30), 120, 120, 120,
                                         8), b=[30], window="flat")
    yield case(OpKind.ACC, lambda B: acc(B.inp(T.F32, 16, 5), B.inp(T.F32, 4, 5), 16, 80, 80,
                                         0), b=[4, 5], window="packed")


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


def _f32(n: Tensor) -> bool:
    return all(s.type == T.F32 for s in n.src) and n.type == T.F32


register(OpDef(OpKind.SUM_ROWS, "sum_rows", lambda n, ex: ex.read(n.src[0]).astype(
    np.float64).sum(axis=-1, keepdims=True), cases=_sum_rows_cases, backward=_bw_spread,
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
               src_labels=True, backward=_bw_concat,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_concat", "a", "b", "int dim"),
                            build=lambda lib, ctx, t, S: lib.ggml_concat(ctx, S[0], S[1],
                                                                          t.params.dim),
                            probe=lambda k: k.lib.ggml_concat(k.ctx, k.a, k.a, 1))))
register(OpDef(OpKind.REPEAT, "repeat", _ref_repeat, cases=_repeat_cases, backward=_bw_repeat,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_repeat", "a", "b"),
                            probe=lambda k: k.lib.ggml_repeat(k.ctx, k.a, k.a))))
register(OpDef(OpKind.SUM, "sum", lambda n, ex: np.full(
    n.shape, ex.read(n.src[0]).astype(np.float64).sum()),
    cases=lambda: _sum_cases(OpKind.SUM, sum), accepts=_f32, accepts_why="F32 only",
    backward=_bw_spread,
    ggml=GGMLMap(cdecl=ggml_fn("ggml_sum", "a"), cpu_limits=ggml_packed_sources(0),
                 probe=lambda k: k.lib.ggml_sum(k.ctx, k.a))))
register(OpDef(OpKind.MEAN, "mean", lambda n, ex: ex.read(n.src[0]).astype(
    np.float64).mean(axis=-1, keepdims=True),
    cases=lambda: _sum_cases(OpKind.MEAN, mean), accepts=_f32, accepts_why="F32 only",
    backward=_bw_mean,
    ggml=GGMLMap(cdecl=ggml_fn("ggml_mean", "a"), cpu_limits=ggml_packed_sources(0),
                 probe=lambda k: k.lib.ggml_mean(k.ctx, k.a))))
register(OpDef(OpKind.REPEAT_BACK, "repeat_back", _ref_repeat_back, cases=_repeat_back_cases,
               accepts=_f32, accepts_why="F32 only", backward=_bw_spread,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_repeat_back", "a", "b"),
                            build=lambda lib, ctx, t, S: lib.ggml_repeat_back(
                                ctx, S[0], lib.ggml_new_tensor_4d(ctx, int(T.F32), *t.ne)),
                            probe=lambda k: k.lib.ggml_repeat_back(k.ctx, k.a,
                                                                   k.new(T.F32, 64, 1, 1, 1)),
                            cpu_limits=ggml_packed_sources(0))))
register(OpDef(OpKind.ACC, "acc", _ref_acc, AccParams, cases=_acc_cases, src_labels=True,
               accepts=_f32, accepts_why="F32 only", backward=_bw_acc,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_acc", "a", "b", "size_t nb1", "size_t nb2",
                                          "size_t nb3", "size_t offset"),
                            build=lambda lib, ctx, t, S: lib.ggml_acc(
                                ctx, S[0], S[1], t.params.nb1, t.params.nb2, t.params.nb3,
                                t.params.offset),
                            probe=lambda k: k.lib.ggml_acc(k.ctx, k.a, k.a, 256, 1024, 2048, 0),
                            cpu_limits=ggml_packed_sources(1))))
