"""Views and copies: view_1d..4d, reshape, permute, transpose, cont, cpy.

Views compute nothing: the result aliases its source (`view_src` is always the root owner).
`cpy` writes its first source into the memory of its second and returns a view of it, which
is how older ggml code wrote a KV cache. The backward rules of all of them are here: a view's
gradient is its source's gradient seen the other way (reshaped, permuted back, or added into
zeros of the source's shape at the window the view saw).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor, fmt_ne
from ggraph.ir.types import GGMLType as T
from .case import (QUANT_STORED, STORED, TOL_DEFAULT, TOL_QUANT_COPY, Case, CaseBuilder, any_values,
                   case)
from .registry import GGMLMap, OpDef, ggml_fn, new_node, new_view, register, require

VIEW = OpKind.define("view", Family.VIEW)
RESHAPE = OpKind.define("reshape", Family.VIEW)
PERMUTE = OpKind.define("permute", Family.VIEW)
TRANSPOSE = OpKind.define("transpose", Family.VIEW)
CPY = OpKind.define("cpy", Family.COPY)
CONT = OpKind.define("cont", Family.COPY)


@dataclass(frozen=True)
class PermuteParams:
    axes: tuple[int, int, int, int]


def view_4d(a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int, nb1: int, nb2: int, nb3: int,
            offset: int, name: str = "") -> Tensor:
    """A strided window of `a`; nb0 is inherited, offsets are in bytes from `a`'s start."""
    return new_view(OpKind.VIEW, a, (ne0, ne1, ne2, ne3), (a.nb[0], nb1, nb2, nb3), offset,
                    name=name)


def view_3d(a: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int,
            name: str = "") -> Tensor:
    return view_4d(a, ne0, ne1, ne2, 1, nb1, nb2, nb2 * ne2, offset, name)


def view_2d(a: Tensor, ne0: int, ne1: int, nb1: int, offset: int, name: str = "") -> Tensor:
    return view_4d(a, ne0, ne1, 1, 1, nb1, nb1 * ne1, nb1 * ne1, offset, name)


def view_1d(a: Tensor, ne0: int, offset: int, name: str = "") -> Tensor:
    rs = a.type.type_size * ne0 // a.type.block_size
    return view_4d(a, ne0, 1, 1, 1, rs, rs, rs, offset, name)


def reshape(a: Tensor, *ne: int, name: str = "") -> Tensor:
    """The same contiguous memory seen with another shape (ne order)."""
    if len(ne) == 1 and isinstance(ne[0], (tuple, list)):
        ne = tuple(ne[0])
    n = int(np.prod(ne))
    require(a.is_contiguous(), "reshape", "the source must be contiguous (use cont first)", a=a)
    require(n == a.nelements, "reshape",
            f"cannot reshape {a.nelements} elements into ne={fmt_ne(ne)} ({n} elements)", a=a)
    return new_view(OpKind.RESHAPE, a, ne, None, 0, name=name)


def reshape_1d(a: Tensor, ne0: int) -> Tensor:
    return reshape(a, ne0)


def reshape_2d(a: Tensor, ne0: int, ne1: int) -> Tensor:
    return reshape(a, ne0, ne1)


def reshape_3d(a: Tensor, ne0: int, ne1: int, ne2: int) -> Tensor:
    return reshape(a, ne0, ne1, ne2)


def reshape_4d(a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int) -> Tensor:
    return reshape(a, ne0, ne1, ne2, ne3)


def permute(a: Tensor, p0: int, p1: int, p2: int = 2, p3: int = 3, name: str = "") -> Tensor:
    """Input dimension i becomes output dimension p_i (ggml_permute)."""
    return _permute(a, (p0, p1, p2, p3), OpKind.PERMUTE, name)


def transpose(a: Tensor, name: str = "") -> Tensor:
    """Swap dimensions 0 and 1 (a view; use cont to make it contiguous)."""
    return _permute(a, (1, 0, 2, 3), OpKind.TRANSPOSE, name)


def _permute(a: Tensor, axes: tuple[int, int, int, int], kind: OpKind, name: str) -> Tensor:
    require(sorted(axes) == [0, 1, 2, 3], str(kind),
            f"axes {list(axes)} must be a permutation of 0..3", a=a)
    require(not a.type.is_quantized or axes[0] == 0, str(kind),
            "the blocks of a quantized tensor cannot leave dimension 0", a=a)
    ne = [0] * 4
    nb = [0] * 4
    for i, p in enumerate(axes):
        ne[p], nb[p] = a.ne[i], a.nb[i]
    return new_view(kind, a, ne, nb, 0, PermuteParams(axes), name=name)


def cont(a: Tensor, *ne: int, name: str = "") -> Tensor:
    """A contiguous copy of `a`, optionally with a new shape of the same element count."""
    shape = tuple(ne) if ne else a.ne
    n = int(np.prod(shape))
    require(n == a.nelements, "cont",
            f"cannot make {a.nelements} elements contiguous as ne={fmt_ne(shape)}", a=a)
    require(a.rows_contiguous() or not a.type.is_quantized, "cont",
            "quantized rows must be packed", a=a)
    return new_node(OpKind.CONT, (a,), a.type, shape,
                    name=name or (f"{a.name} (cont)" if a.name else ""))


def cpy(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """Copy a's elements (in ggml's element order) into b, converting types; a view of b. A
    quantized source copies only into its own type with rows of the same length (its blocks
    as they are: ggml's dup_bytes)."""
    require(a.nelements == b.nelements, "cpy",
            f"source has {a.nelements} elements, destination {b.nelements}", a=a, b=b)
    require(not a.type.is_quantized or (a.type == b.type and a.ne[0] == b.ne[0]
                                        and a.rows_contiguous()), "cpy",
            "a quantized source copies only into its own type, rows of the same length", a=a,
            b=b)
    require(a.type.is_int == b.type.is_int, "cpy",
            "cannot convert between integer and float types", a=a, b=b)
    if b.type.is_quantized:
        require(b.rows_contiguous(), "cpy", "a quantized destination needs packed rows", b=b)
    nm = name or (f"{b.name} (copy of {a.name})" if b.name else f"{a.name} (copy)")
    return new_view(OpKind.CPY, b, b.ne, b.nb, 0, name=nm, srcs=(a, b))


# -- references ---------------------------------------------------------------------------

def _ref_cont(node: Tensor, ex) -> np.ndarray:
    return ex.read(node.src[0]).reshape(node.shape)


def _ref_cpy(node: Tensor, ex) -> None:
    a, b = node.src
    ex.write(node, ex.read(a).reshape(node.shape))


# -- backward rules (ops/registry.py: Backward) -------------------------------------------

def _dense(g: Tensor) -> Tensor:
    return g if g.is_contiguous() else cont(g)


def _bw_view(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    """The source's gradient is g inside the window the view saw and zero outside it: g added
    (acc) into F32 zeros of the source's shape, at the window's place in a contiguous F32
    copy of the source (its strides and offset scaled from the source's type to F32)."""
    # acc and zeros (ops/reduce.py) build on this module: reached through the package, whose
    # modules have all loaded by the time a rule runs (no import cycle between the modules)
    from ggraph import ops
    if not w[0]:
        return (None,)
    src = n.src[0]
    require(src.is_contiguous() and not src.type.is_quantized, "view",
            "the gradient of a view needs a contiguous, non-quantized source", a=src, view=n)
    # view_offs counts from the root owner; the window's place counts from the source
    rel = n.view_offs - (src.view_offs if src.view_src is not None else 0)
    require(rel >= 0, "view", f"the gradient of a view starting {-rel} bytes before its "
            "source is not defined", a=src, view=n)
    es = src.type.type_size
    f32 = T.F32.type_size
    return (ops.acc(ops.zeros(src, g), g, *(x // es * f32 for x in n.nb[1:]),
                    rel // es * f32),)


def _bw_reshape(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    return (reshape(_dense(g), n.src[0].ne) if w[0] else None,)


def _bw_permute(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    if not w[0]:
        return (None,)
    axes = n.params.axes  # source dim i went to p_i: g's dim p_i goes back to i
    back = [0] * 4
    for i, p in enumerate(axes):
        back[p] = i
    return (cont(permute(g, *back)),)


def _bw_cont(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    """cont and cpy keep ggml's element order: the source's gradient is g in its shape."""
    src, rest = n.src[0], (None,) * (len(n.src) - 1)  # cpy's destination gets none
    if not w[0]:
        return (None,) + rest
    return (g if g.ne == src.ne else reshape(_dense(g), src.ne),) + rest


# -- conformance cases --------------------------------------------------------------------

def _view_cases() -> Iterator[Case]:
    # views compute nothing; they are checked through a copy of the viewed window
    for kind, f in ((OpKind.VIEW, lambda a: view_3d(a, 8, 3, 2, a.nb[1], a.nb[2], a.nb[1])),
                    (OpKind.RESHAPE, lambda a: reshape(a, 40, 3)),
                    (OpKind.PERMUTE, lambda a: permute(a, 2, 0, 1, 3)),
                    (OpKind.TRANSPOSE, lambda a: transpose(a))):
        yield case(kind, lambda B, f=f: cont(f(B.inp(T.F32, 8, 5, 3))), 0.0)


def _cpy_cases() -> Iterator[Case]:
    for src in (T.F32, T.F16, T.BF16):
        for dst in STORED:
            tol = TOL_QUANT_COPY.get(dst, 0.0 if src == dst or dst == T.F32 else TOL_DEFAULT)
            if src == T.F32 and dst in (T.F16, T.BF16):
                tol = 0.0  # one rounding, identical everywhere
            yield case(OpKind.CPY, lambda B, s=src, d=dst: cpy(
                B.inp(s, 64, 6, 2), B.cache(d, 64, 12)), tol, type_src=src, type_dst=dst)
        yield case(OpKind.CPY, lambda B, s=src: cpy(
            strided(B, s, 32, 6), B.cache(T.F16, 32, 6)), TOL_DEFAULT, type_src=src,
            type_dst=T.F16, src="strided")
    for t in (T.I32, T.I64):
        yield case(OpKind.CPY, lambda B, t=t: cpy(any_values(B, t, 16, 6), B.cache(t, 96)),
                   0.0, type_src=t, type_dst=t)
    for t in QUANT_STORED:   # a block type into itself: the blocks as they are
        yield case(OpKind.CPY, lambda B, t=t: cpy(B.inp(t, 64, 6, 2), B.cache(t, 64, 12)),
                   0.0, type_src=t, type_dst=t)


def _cont_cases() -> Iterator[Case]:
    for t in (T.F32, T.F16, T.BF16, T.I32, T.I64):
        yield case(OpKind.CONT, lambda B, t=t: cont(transpose(any_values(B, t, 8, 5, 3))),
                   0.0, type=t, src="transposed")
    for t in QUANT_STORED:
        yield case(OpKind.CONT, lambda B, t=t: cont(permute(B.inp(t, 64, 5, 3), 0, 2, 1, 3)),
                   0.0, type=t, src="permuted")


def _one_kind(kind: OpKind):
    return lambda: (c for c in _view_cases() if c.op == kind)


def _ggml_view(lib, ctx, t: Tensor, S: list):
    src = t.src[0]
    rel = (t.view_offs - (src.view_offs if src.view_src is not None else 0)) % (1 << 64)
    return lib.ggml_view_4d(ctx, S[0], *t.ne, *t.nb[1:], rel)


# probes: ggml's constructors on the probe tensor `a` (F32, ne [64, 4, 2, 1]); ggml_view_4d
# and ggml_reshape_4d are declared by ggraph/check/ggml_cdefs.py, which uses them itself
register(OpDef(OpKind.VIEW, "view", None, cases=_one_kind(OpKind.VIEW), backward=_bw_view,
               ggml=GGMLMap(build=_ggml_view, probe=lambda k: k.lib.ggml_view_4d(
                   k.ctx, k.a, 64, 4, 1, 1, 256, 1024, 1024, 0))))
register(OpDef(OpKind.RESHAPE, "reshape", None, cases=_one_kind(OpKind.RESHAPE),
               backward=_bw_reshape,
               ggml=GGMLMap(build=lambda lib, ctx, t, S: lib.ggml_reshape_4d(ctx, S[0], *t.ne),
                            probe=lambda k: k.lib.ggml_reshape_4d(k.ctx, k.a, 64, 8, 1, 1))))
register(OpDef(OpKind.PERMUTE, "permute", None, PermuteParams,
               cases=_one_kind(OpKind.PERMUTE), backward=_bw_permute,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_permute", "a", "int axis0", "int axis1",
                                          "int axis2", "int axis3"),
                            build=lambda lib, ctx, t, S: lib.ggml_permute(ctx, S[0],
                                                                           *t.params.axes),
                            probe=lambda k: k.lib.ggml_permute(k.ctx, k.a, 0, 2, 1, 3))))
register(OpDef(OpKind.TRANSPOSE, "transpose", None, cases=_one_kind(OpKind.TRANSPOSE),
               backward=_bw_permute,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_transpose", "a"),
                            probe=lambda k: k.lib.ggml_transpose(k.ctx, k.a))))
register(OpDef(OpKind.CONT, "cont", _ref_cont, cases=_cont_cases, backward=_bw_cont,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_cont_4d", "a", "int64_t ne0", "int64_t ne1",
                                          "int64_t ne2", "int64_t ne3"),
                            build=lambda lib, ctx, t, S: lib.ggml_cont_4d(ctx, S[0], *t.ne),
                            probe=lambda k: k.lib.ggml_cont_4d(k.ctx, k.a, 64, 8, 1, 1))))
register(OpDef(OpKind.CPY, "x->y", _ref_cpy, cases=_cpy_cases, src_labels=True,
               backward=_bw_cont,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_cpy", "a", "b"),
                            probe=lambda k: k.lib.ggml_cpy(k.ctx, k.a, k.a))))


def strided(B: CaseBuilder, type: T, *ne: int) -> Tensor:
    """A case input that is a non-contiguous view with ne: a transposed, padded source (dims 0
    and 1 swapped), for the cases of ops that must read strided sources."""
    big = B.inp(type, ne[1] + 3, ne[0], *ne[2:])
    v = view_4d(big, ne[1], ne[0], *(tuple(ne[2:]) + (1, 1))[:2], big.nb[1], big.nb[2],
                big.nb[3], 0) if len(ne) >= 2 else big
    return transpose(v)
