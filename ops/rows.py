"""Row gather and scatter: get_rows (dequantizing) and set_rows (quantize on write);
get_rows_back (ggml's gradient of get_rows: gathered rows summed back) and get_rows' rule.

set_rows is how a KV cache is written: F32 rows converted to the cache's type (any storable
type of ggraph/ir/types.py: F16, BF16, Q8_0, Q5_0, IQ4_NL, ...) land in the rows picked
by an I64/I32 index; the result is a view of the destination, so later ops read the cache
through it.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import weight_types
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import STORED, TOL_DEFAULT, WEIGHTS, Case, case
from .registry import (STORABLE, GGMLMap, OpDef, ggml_fn, new_node, new_view, register, require,
                       require_type, types_ok)

GET_ROWS = OpKind.define("get_rows", Family.COPY)
SET_ROWS = OpKind.define("set_rows", Family.COPY)
GET_ROWS_BACK = OpKind.define("get_rows_back", Family.COPY)

INDEX_TYPES = (GGMLType.I32, GGMLType.I64)
# get_rows reads rows of every stored type and every weight type: Q4_K_M files keep
# token_embd in a K-quant, which nothing stores at run time (not STORABLE) but rows are read from
GET_ROWS_SOURCES = tuple(dict.fromkeys(STORABLE + weight_types())) + (T.I32,)


def get_rows(a: Tensor, idx: Tensor, name: str = "") -> Tensor:
    """out[:, i, j, k] = a[:, idx[i, j, k], j, k]; F32 (I32 stays I32). Indices are I32, or
    I64 as set_rows takes them (ggml's get_rows takes I32 only): the gradient of a KV
    cache's set_rows gathers with the cache's own cell indices."""
    op = "get_rows"
    require_type(op, "idx", idx, INDEX_TYPES)
    require(a.rows_contiguous() or not a.type.is_quantized, op, "quantized rows must be packed",
            a=a)
    require(idx.ne[3] == 1, op, "idx must be at most 3-D", idx=idx)
    require(a.ne[2] == idx.ne[1] and a.ne[3] == idx.ne[2], op,
            f"a.ne[2:4]={list(a.ne[2:])} must equal idx.ne[1:3]={list(idx.ne[1:3])}",
            a=a, idx=idx)
    out_type = GGMLType.I32 if a.type == GGMLType.I32 else GGMLType.F32
    return new_node(OpKind.GET_ROWS, (a, idx), out_type, (a.ne[0], idx.ne[0], idx.ne[1],
                                                            idx.ne[2]), name=name)


def get_rows_back(a: Tensor, idx: Tensor, like: Tensor, name: str = "") -> Tensor:
    """ggml_get_rows_back: F32 shaped like `like` (get_rows' source, read for its shape only,
    not a source of the node, as in ggml), out[:, r, j, k] = sum of a[:, i, j, k] over the i
    with idx[i, j, k] == r: a, the gradient of get_rows(like, idx), summed into its rows."""
    op = "get_rows_back"
    kw = dict(a=a, idx=idx, like=like)
    require_type(op, "a", a, (GGMLType.F32,))
    require_type(op, "idx", idx, INDEX_TYPES)
    require(idx.ne[3] == 1, op, "idx must be at most 3-D", **kw)
    require(a.ne[1:] == idx.ne[:3], op, f"a.ne[1:4]={list(a.ne[1:])} must equal "
            f"idx.ne[0:3]={list(idx.ne[:3])}", **kw)
    require(like.ne[0] == a.ne[0] and like.ne[2:] == a.ne[2:], op,
            "like must agree with a in ne[0], ne[2] and ne[3]", **kw)
    return new_node(OpKind.GET_ROWS_BACK, (a, idx), GGMLType.F32, like.ne, name=name)


def set_rows(dst: Tensor, src: Tensor, idx: Tensor, name: str = "") -> Tensor:
    """dst[:, idx[i, j % I1, k % I2], j, k] = src[:, i, j, k], converted to dst's type."""
    op = "set_rows"
    kw = dict(dst=dst, src=src, idx=idx)
    require_type(op, "src", src, (GGMLType.F32,))
    require_type(op, "idx", idx, INDEX_TYPES)
    require(dst.type.is_float or dst.type.is_quantized, op,
            f"dst must be a float or quantized type, got {dst.type}", **kw)
    require(dst.ne[0] == src.ne[0], op, f"dst.ne[0]={dst.ne[0]} and src.ne[0]={src.ne[0]} "
            f"(row length) differ", **kw)
    require(dst.ne[2] == src.ne[2] and dst.ne[3] == src.ne[3], op,
            "dst and src must agree in ne[2] and ne[3]", **kw)
    require(src.ne[1] == idx.ne[0], op, f"src has {src.ne[1]} rows, idx has {idx.ne[0]}", **kw)
    require(idx.ne[3] == 1 and src.ne[2] % idx.ne[1] == 0 and src.ne[3] % idx.ne[2] == 0, op,
            "idx.ne[1:3] must divide src.ne[2:4] and idx must be at most 3-D", **kw)
    require(dst.rows_contiguous() and src.rows_contiguous(), op,
            "rows of dst and src must be packed", **kw)
    return new_view(OpKind.SET_ROWS, dst, dst.ne, dst.nb, 0, srcs=(dst, src, idx),
                    name=name or (f"{dst.name} (set_rows)" if dst.name else ""))


def _ref_get_rows(node: Tensor, ex) -> np.ndarray:
    a, idx = node.src
    A = ex.read(a)                               # (A3, A2, nr, ne0)
    I = ex.read(idx)                             # (1, I2, I1, n)
    _check_index(I, a.ne[1], "get_rows", a, idx)
    k = np.arange(a.ne[3])[:, None, None]
    j = np.arange(a.ne[2])[None, :, None]
    return A[k, j, I[0]]


def _ref_get_rows_back(node: Tensor, ex) -> np.ndarray:
    a, idx = node.src
    A = ex.read(a).astype(np.float64)            # (I2, I1, n, ne0)
    I = ex.read(idx)[0]                          # (I2, I1, n)
    _check_index(I, node.ne[1], "get_rows_back", node, idx)
    out = np.zeros(node.shape)
    k = np.broadcast_to(np.arange(a.ne[3])[:, None, None], I.shape)
    j = np.broadcast_to(np.arange(a.ne[2])[None, :, None], I.shape)
    np.add.at(out, (k, j, I), A)                 # repeated rows add up
    return out


def _get_rows_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """The gathered rows' gradients summed back into the source's rows; the indices get none."""
    a, idx = node.src
    return (get_rows_back(grad, idx, a) if wants[0] else None, None)


def _set_rows_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """Each written row's gradient is its destination row's (gathered with the same
    indices); the destination and the indices get none (a KV cache is never trained).
    Destinations must be distinct, as a cache's cells are: a row overwritten in the same
    call would otherwise get the gradient of the row that replaced it."""
    dst, src, idx = node.src
    if not wants[1]:
        return (None, None, None)
    require(idx.ne[1] == src.ne[2] and idx.ne[2] == src.ne[3], "set_rows",
            "the gradient of set_rows needs an index per source row (idx.ne[1:3] equal to "
            "src.ne[2:4], no broadcast)", src=src, idx=idx)
    return (None, get_rows(grad, idx), None)


def _ref_set_rows(node: Tensor, ex) -> None:
    dst, src, idx = node.src
    S = ex.read(src)                             # (S3, S2, n, ne0)
    I = ex.read(idx)[0]                          # (I2, I1, n)
    _check_index(I, dst.ne[1], "set_rows", dst, idx)
    k = np.arange(src.ne[3])[:, None, None]
    j = np.arange(src.ne[2])[None, :, None]
    i = np.arange(src.ne[1])[None, None, :]
    rows = I[k % idx.ne[2], j % idx.ne[1], i]    # (S3, S2, n) destination row per source row
    ex.write_rows(node, (np.broadcast_to(k, rows.shape), np.broadcast_to(j, rows.shape), rows), S)


def _check_index(I: np.ndarray, n: int, op: str, a: Tensor, idx: Tensor) -> None:
    if I.size and (I.min() < 0 or I.max() >= n):
        bad = I[(I < 0) | (I >= n)].flat[0]
        raise ValueError(f"{op}: row index {bad} in {idx.describe()} is outside [0, {n}) of "
                         f"{a.describe()}")


# -- conformance cases --------------------------------------------------------------------

def _get_rows_cases() -> Iterator[Case]:
    for t in WEIGHTS + (T.I32,):
        yield case(OpKind.GET_ROWS, lambda B, t=t: get_rows(
            B.inp(t, 64, 10, 3) if t != T.I32 else B.idx(T.I32, 1000, 64, 10, 3),
            B.idx(T.I32, 10, 7, 3)), TOL_DEFAULT if t != T.I32 else 0.0, type=t, n=7,
            ne=[64, 10, 3])
    yield case(OpKind.GET_ROWS, lambda B: get_rows(B.inp(T.F32, 16, 12), B.idx(T.I64, 12, 5)),
               type=T.F32, type_idx=T.I64, n=5, ne=[16, 12])


def _ggml_get_rows_index(t: Tensor) -> str | None:
    if t.src[1].type != GGMLType.I32:
        return f"ggml_get_rows takes I32 indices, got {t.src[1].type}"
    return None


def _get_rows_back_cases() -> Iterator[Case]:
    # more indices than rows: repeated rows must add up
    for ne0, nr, n, more in ((64, 10, 7, ()), (33, 4, 9, ()), (16, 6, 5, (3,)), (8, 5, 4, (2, 3))):
        yield case(OpKind.GET_ROWS_BACK, lambda B, ne0=ne0, nr=nr, n=n, more=more: get_rows_back(
            B.inp(T.F32, ne0, n, *more), B.idx(T.I32, nr, n, *more),
            B.ctx.new_tensor(T.F32, (ne0, nr) + more)), ne=[ne0, nr, *more], n=n)
    yield case(OpKind.GET_ROWS_BACK, lambda B: get_rows_back(
        B.inp(T.F32, 16, 9), B.idx(T.I64, 5, 9), B.ctx.new_tensor(T.F32, (16, 5))),
        ne=[16, 5], n=9, type_idx=T.I64)


def _get_rows_back_limits(t: Tensor) -> str | None:
    if t.src[1].type != GGMLType.I32:
        return f"ggml_get_rows_back takes I32 indices, got {t.src[1].type}"
    if t.ne[2] != 1 or t.ne[3] != 1:
        return f"ggml_get_rows_back takes matrices and an index vector, got ne={list(t.ne)}"
    return None


def _ggml_get_rows_back(lib, ctx, t: Tensor, S: list):
    """ggml reads `c` for its shape only: a bare tensor of the result's shape stands in."""
    like = lib.ggml_new_tensor_4d(ctx, int(T.F32), t.ne[0], t.ne[1], 1, 1)
    return lib.ggml_get_rows_back(ctx, S[0], S[1], like)


def _set_rows_cases() -> Iterator[Case]:
    for t in STORED:
        for it in (T.I64, T.I32):
            yield case(OpKind.SET_ROWS, lambda B, t=t, it=it: set_rows(
                B.cache(t, 64, 12, 2), B.inp(T.F32, 64, 5, 2),
                B.idx(it, 12, 5, 2, unique_rows=True)), 0.0, type=t, type_idx=it, n=5,
                ne=[64, 12, 2])
    for t in (T.F16, T.F32):  # rows of one element: a transposed V cache's cells
        yield case(OpKind.SET_ROWS, lambda B, t=t: set_rows(
            B.cache(t, 1, 300, 2), B.inp(T.F32, 1, 70, 2),
            B.idx(T.I64, 300, 70, 2, unique_rows=True)), 0.0, type=t, type_idx=T.I64, n=70,
            ne=[1, 300, 2])


def _ggml_set_rows_source(t: Tensor) -> str | None:
    if t.src[1].type not in (GGMLType.F32, GGMLType.F16):
        return f"ggml_set_rows needs an F32/F16 source, got {t.src[1].type}"
    return None


register(OpDef(OpKind.GET_ROWS, "get_rows", _ref_get_rows, cases=_get_rows_cases,
               accepts=lambda n: types_ok(n, GET_ROWS_SOURCES, INDEX_TYPES), src_labels=True,
               backward=_get_rows_grad,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_get_rows", "a", "b"), limits=_ggml_get_rows_index,
                            probe=lambda k: k.lib.ggml_get_rows(k.ctx, k.a,
                                                                k.new(T.I32, 3, 2)))))
register(OpDef(OpKind.SET_ROWS, "set_rows", _ref_set_rows, cases=_set_rows_cases,
               accepts=lambda n: types_ok(n, STORABLE, (T.F32,), (T.I32, T.I64)),
               src_labels=True, backward=_set_rows_grad,
               ggml=GGMLMap(limits=_ggml_set_rows_source,
                            cdecl=ggml_fn("ggml_set_rows", "a", "b", "c"),
                            probe=lambda k: k.lib.ggml_set_rows(k.ctx, k.a, k.a,
                                                                k.new(T.I32, 4)))))
register(OpDef(OpKind.GET_ROWS_BACK, "get_rows_back", _ref_get_rows_back,
               cases=_get_rows_back_cases,
               accepts=lambda n: types_ok(n, (T.F32,), INDEX_TYPES),
               src_labels=True,
               ggml=GGMLMap(build=_ggml_get_rows_back, limits=_get_rows_back_limits,
                            cdecl=ggml_fn("ggml_get_rows_back", "a", "b", "c"),
                            probe=lambda k: k.lib.ggml_get_rows_back(
                                k.ctx, k.new(T.F32, 64, 3), k.new(T.I32, 3), k.new(T.F32, 64, 5)))))
