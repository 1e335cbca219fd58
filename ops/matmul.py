"""Matrix products: mul_mat (with ggml's block-repeat broadcast), mul_mat_id (experts) and
out_prod (the outer product training's gradients use), with mul_mat's gradient rule.

mul_mat(a, b): a [K, M, A2, A3], b [K, N, B2, B3] -> F32 [M, N, B2, B3]; b's slice i2 uses
a's slice i2 // (B2 / A2), which is grouped-query attention when a holds K/V heads.
out_prod(a, b): a [P, J, A2, A3], b [Q, J, B2, B3] -> F32 [P, Q, B2, B3], the sum over dim 1
of a[:, j] b[:, j]^T, with a broadcast over b's dims 2/3 as mul_mat does (ggml_out_prod).
mul_mat_id has no gradient rule (its backward is not needed for LoRA on dense models).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import weight_types
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import TOL_MATMUL, WEIGHTS, Case, case, fit_row
from .registry import (FLOATS, GGMLMap, OpDef, ggml_fn, ggml_packed_sources, new_node,
                       register, require, require_type, types_ok)
from .views import cont, strided, transpose, view_4d

MUL_MAT = OpKind.define("mul_mat", Family.MATMUL)
MUL_MAT_ID = OpKind.define("mul_mat_id", Family.MATMUL)
OUT_PROD = OpKind.define("out_prod", Family.MATMUL)

WEIGHT_TYPES = weight_types()  # the types whose record says weight=True
ACT_TYPES = (GGMLType.F32, GGMLType.F16)


def _check_not_transposed(op: str, a: Tensor) -> None:
    require(a.nb[0] <= a.nb[1], op, "the first source must not be transposed (nb0 > nb1); "
            "use cont(transpose(x)) instead", a=a)


def mul_mat(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """out[m, n] = sum_k a[k, m] * b[k, n], per 2-D slice with block-repeat broadcast."""
    op = "mul_mat"
    require_type(op, "a", a, WEIGHT_TYPES)
    require_type(op, "b", b, ACT_TYPES)
    require(a.ne[0] == b.ne[0], op, f"a.ne[0]={a.ne[0]} must equal b.ne[0]={b.ne[0]}", a=a, b=b)
    require(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, op,
            f"b.ne[2:4]={list(b.ne[2:])} must be multiples of a.ne[2:4]={list(a.ne[2:])} "
            f"(block-repeat broadcast)", a=a, b=b)
    _check_not_transposed(op, a)
    return new_node(OpKind.MUL_MAT, (a, b), GGMLType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]),
                    name=name)


def mul_mat_id(as_: Tensor, b: Tensor, ids: Tensor, name: str = "") -> Tensor:
    """Per (expert slot e, token t): as[:, :, ids[e, t]]^T @ b[:, e % n_b, t] -> [M, n_used, T]."""
    op = "mul_mat_id"
    require_type(op, "as", as_, WEIGHT_TYPES)
    require_type(op, "b", b, ACT_TYPES)
    require_type(op, "ids", ids, (GGMLType.I32,))
    require(as_.ne[3] == 1, op, "as must be 3-D [K, M, n_expert]", **{"as": as_})
    require(b.ne[3] == 1, op, "b must be 3-D [K, n_b, T]", b=b)
    require(ids.ne[2] == 1 and ids.ne[3] == 1, op, "ids must be 2-D [n_used, T]", ids=ids)
    require(ids.ne[1] == b.ne[2], op, f"ids.ne[1]={ids.ne[1]} must equal b.ne[2]={b.ne[2]} "
            f"(one column of expert ids per token)", ids=ids, b=b)
    require(as_.ne[0] == b.ne[0], op, f"as.ne[0]={as_.ne[0]} must equal b.ne[0]={b.ne[0]}",
            **{"as": as_, "b": b})
    require(ids.ne[0] % b.ne[1] == 0, op, f"ids.ne[0]={ids.ne[0]} must be a multiple of "
            f"b.ne[1]={b.ne[1]}", ids=ids, b=b)
    _check_not_transposed(op, as_)
    return new_node(OpKind.MUL_MAT_ID, (as_, b, ids), GGMLType.F32,
                    (as_.ne[1], ids.ne[0], b.ne[2], 1), name=name)


def out_prod(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """out[p, q] = sum_j a[p, j] * b[q, j] per 2-D slice; b's slice i2 uses a's slice
    i2 // (B2 / A2) (ggml_out_prod). a: F32, F16 or a weight type (a frozen base weight,
    whose rows are dequantized); b: F32, any strides (a transposed gradient)."""
    op = "out_prod"
    require_type(op, "a", a, WEIGHT_TYPES)
    require_type(op, "b", b, (GGMLType.F32,))
    require(a.ne[1] == b.ne[1], op, f"a.ne[1]={a.ne[1]} must equal b.ne[1]={b.ne[1]} (the "
            f"summed dimension)", a=a, b=b)
    require(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, op,
            f"b.ne[2:4]={list(b.ne[2:])} must be multiples of a.ne[2:4]={list(a.ne[2:])} "
            f"(block-repeat broadcast)", a=a, b=b)
    _check_not_transposed(op, a)
    require(a.rows_contiguous() or not a.type.is_quantized, op, "quantized rows must be packed",
            a=a)
    return new_node(OpKind.OUT_PROD, (a, b), GGMLType.F32, (a.ne[0], b.ne[0], b.ne[2], b.ne[3]),
                    name=name)


def _grad_mul_mat(node: Tensor, grad: Tensor, wants: tuple[bool, ...]
                  ) -> tuple[Tensor | None, Tensor | None]:
    """mul_mat's gradient (ggml_compute_backward): b gets out_prod(a, grad^T), a (unless
    quantized: frozen weights pass gradients on but get none) gets out_prod(b, grad), summed
    over the slices of b that shared each slice of a (the block-repeat broadcast)."""
    a, b = node.src
    gb = out_prod(a, transpose(grad)) if wants[1] else None
    if not wants[0] or a.type.is_quantized:
        return None, gb
    r2, r3 = b.ne[2] // a.ne[2], b.ne[3] // a.ne[3]
    if r2 == 1 and r3 == 1:
        return out_prod(b if b.nb[0] <= b.nb[1] else cont(b), grad), gb
    # a's slice (j2, j3) met b's slices j2*r2 .. j2*r2+r2-1 (dims adjacent in memory once
    # contiguous): those fold into the summed dimension 1 as N*r2 columns, so one out_prod
    # per offset r in dim 3's group sums them all; the r3 parts are added
    bc = b if b.is_contiguous() else cont(b)
    gc = grad if grad.is_contiguous() else cont(grad)
    ga = None
    for r in range(r3):
        parts = [view_4d(t, t.ne[0], t.ne[1] * r2, a.ne[2], a.ne[3], t.nb[1], t.nb[2] * r2,
                         t.nb[3] * r3, r * t.nb[3]) for t in (bc, gc)]
        part = out_prod(*parts)
        if ga is None:
            ga = part
        else:
            from .elementwise import add  # here: an op module's rules may use each other's ops
            ga = add(ga, part)
    return ga, gb


def _ref_mul_mat(node: Tensor, ex) -> np.ndarray:
    a, b = node.src
    A = ex.read(a).astype(np.float64)             # (A3, A2, M, K)
    B = ex.read(b).astype(np.float64)             # (B3, B2, N, K)
    A = np.repeat(np.repeat(A, b.ne[3] // a.ne[3], axis=0), b.ne[2] // a.ne[2], axis=1)
    return B @ np.swapaxes(A, -1, -2)            # (B3, B2, N, M)


def _ref_mul_mat_id(node: Tensor, ex) -> np.ndarray:
    as_, b, ids = node.src
    W = ex.read(as_).astype(np.float64)[0]        # (n_expert, M, K)
    B = ex.read(b).astype(np.float64)[0]          # (T, n_b, K)
    I = ex.read(ids)[0, 0]                        # (T, n_used)
    n_expert = as_.ne[2]
    if I.size and (I.min() < 0 or I.max() >= n_expert):
        bad = I[(I < 0) | (I >= n_expert)][0]
        raise ValueError(f"mul_mat_id: expert id {bad} in {ids.describe()} is outside "
                         f"[0, {n_expert})")
    n_used, n_b = ids.ne[0], b.ne[1]
    out = np.empty((b.ne[2], n_used, as_.ne[1]))
    for t in range(b.ne[2]):
        for e in range(n_used):
            out[t, e] = W[I[t, e]] @ B[t, e % n_b]
    return out[None]


def _ref_out_prod(node: Tensor, ex) -> np.ndarray:
    a, b = node.src
    A = ex.read(a).astype(np.float64)             # (A3, A2, J, P)
    B = ex.read(b).astype(np.float64)             # (B3, B2, J, Q)
    A = np.repeat(np.repeat(A, b.ne[3] // a.ne[3], axis=0), b.ne[2] // a.ne[2], axis=1)
    return np.swapaxes(B, -1, -2) @ A            # (B3, B2, Q, P)


# -- conformance cases --------------------------------------------------------------------

def mm_flops(t: Tensor) -> float:
    a = t.src[0]
    return 2.0 * a.ne[0] * t.nelements


def _mul_mat_cases() -> Iterator[Case]:
    shapes = ((16, 1, 64, (1, 1), (1, 1)), (15, 7, 96, (1, 1), (1, 1)),
              (16, 9, 64, (1, 2), (3, 2)), (8, 17, 32, (2, 1), (4, 1)))
    for t in WEIGHTS:
        for m, n, k, ab, bb in shapes:  # ab, bb: ne[2:4] of a and b (block-repeat broadcast)
            k = fit_row(t, k)  # K-quants: whole 256-element blocks
            yield case(OpKind.MUL_MAT, lambda B, t=t, m=m, n=n, k=k, ab=ab, bb=bb: mul_mat(
                B.inp(t, k, m, *ab), B.inp(T.F32, k, n, *bb)), TOL_MATMUL, flops=mm_flops,
                type=t, m=m, n=n, k=k, bs=list(bb), nr=[bb[0] // ab[0], bb[1] // ab[1]])
        k = fit_row(t, 64)
        yield case(OpKind.MUL_MAT, lambda B, t=t, k=k: mul_mat(
            B.inp(t, k, 12), strided(B, T.F32, k, 5)), TOL_MATMUL, flops=mm_flops,
            type=t, m=12, n=5, k=k, b="strided")
    # SmolLM2-sized mat-vecs: ffn_down (k = 1536, a multiple of the K-quants' 256) per type
    mv = tuple((t, (576, 1, 1536)) for t in (T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K))
    for t, (m, n, k) in ((T.F32, (1024, 512, 1024)), (T.Q4_1, (1536, 1, 576)),
                         (T.Q8_0, (1536, 1, 576)), (T.Q4_1, (1536, 512, 576))) + mv:
        yield case(OpKind.MUL_MAT, lambda B, t=t, m=m, n=n, k=k: mul_mat(
            B.inp(t, k, m), B.inp(T.F32, k, n)), TOL_MATMUL, perf=True, flops=mm_flops,
            type=t, m=m, n=n, k=k)


def _mul_mat_id_cases() -> Iterator[Case]:
    for t in WEIGHTS:
        k = fit_row(t, 64)
        for n_b in (1, 2):
            yield case(OpKind.MUL_MAT_ID, lambda B, t=t, n_b=n_b, k=k: mul_mat_id(
                B.inp(t, k, 9, 4), B.inp(T.F32, k, n_b, 5), B.idx(T.I32, 4, 2, 5)),
                TOL_MATMUL, flops=mm_flops, type=t, n_expert=4, n_used=2, n_b=n_b, m=9, k=k)


def _out_prod_cases() -> Iterator[Case]:
    # p, q, j (summed), a.ne[2:4], b.ne[2:4]
    shapes = ((16, 5, 7, (1, 1), (1, 1)), (15, 9, 33, (1, 1), (1, 1)),
              (32, 6, 16, (1, 2), (3, 2)), (8, 3, 17, (2, 1), (4, 1)))
    for t in WEIGHTS:
        for p, q, j, ab, bb in shapes:
            p = fit_row(t, p)
            yield case(OpKind.OUT_PROD, lambda B, t=t, p=p, q=q, j=j, ab=ab, bb=bb: out_prod(
                B.inp(t, p, j, *ab), B.inp(T.F32, q, j, *bb)), TOL_MATMUL, flops=_op_flops,
                type=t, p=p, q=q, j=j, bs=list(bb), nr=[bb[0] // ab[0], bb[1] // ab[1]])
        p = fit_row(t, 64)
        yield case(OpKind.OUT_PROD, lambda B, t=t, p=p: out_prod(   # b: a transposed gradient
            B.inp(t, p, 12), strided(B, T.F32, 5, 12)), TOL_MATMUL, flops=_op_flops,
            type=t, p=p, q=5, j=12, b="strided")
    for t in (T.F32, T.Q8_0):  # LoRA-sized: a base weight's gradient pass to the activations
        yield case(OpKind.OUT_PROD, lambda B, t=t: out_prod(
            B.inp(t, 576, 1536), B.inp(T.F32, 256, 1536)), TOL_MATMUL, perf=True,
            flops=_op_flops, type=t, p=576, q=256, j=1536)


def _op_flops(t: Tensor) -> float:
    return 2.0 * t.src[0].ne[1] * t.nelements


def _ggml_out_prod_kernels(t: Tensor) -> str | None:
    """What ggml's CPU out_prod asserts on: a's packed rows, and for a quantized a no
    broadcast."""
    a, b = t.src
    if a.nb[0] != a.type.type_size:
        return f"ggml's CPU out_prod needs a with packed rows (nb0 = {a.type.type_size})"
    if a.type.is_quantized and (a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3]):
        return "ggml's CPU out_prod of a quantized a does not broadcast it"
    return None


register(OpDef(OpKind.MUL_MAT, "X", _ref_mul_mat, cases=_mul_mat_cases,
               accepts=lambda n: types_ok(n, WEIGHT_TYPES, FLOATS), src_labels=True,
               backward=_grad_mul_mat,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_mul_mat", "a", "b"),
                            cpu_limits=ggml_packed_sources(0, 1),  # ggml's CPU mul_mat asserts
                            probe=lambda k: k.lib.ggml_mul_mat(k.ctx, k.a, k.a))))
register(OpDef(OpKind.MUL_MAT_ID, "X_id", _ref_mul_mat_id, cases=_mul_mat_id_cases,
               accepts=lambda n: types_ok(n, WEIGHT_TYPES, FLOATS, (T.I32,)), src_labels=True,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_mul_mat_id", "as", "b", "ids"),
                            probe=lambda k: k.lib.ggml_mul_mat_id(k.ctx, k.a, k.a,
                                                                  k.new(T.I32, 4, 2)))))
register(OpDef(OpKind.OUT_PROD, "out_prod", _ref_out_prod, cases=_out_prod_cases,
               accepts=lambda n: types_ok(n, WEIGHT_TYPES, (T.F32,)), src_labels=True,
               doc="outer product summed over dim 1 (mul_mat's gradients)",
               ggml=GGMLMap(cdecl=ggml_fn("ggml_out_prod", "a", "b"),
                            cpu_limits=_ggml_out_prod_kernels,
                            probe=lambda k: k.lib.ggml_out_prod(k.ctx, k.a, k.a))))
