"""Views and copies: view_1d..4d, reshape, permute, transpose, cont, cpy.

Views compute nothing: the result aliases its source (`view_src` is always the root owner).
`cpy` writes its first source into the memory of its second and returns a view of it, which
is how older ggml code wrote a KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggraph.opkind import OpKind
from ggraph.tensor import Tensor, fmt_ne
from .registry import OpDef, new_node, new_view, register, require


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
    """Copy a's elements (in ggml's element order) into b, converting types; a view of b."""
    require(a.nelements == b.nelements, "cpy",
            f"source has {a.nelements} elements, destination {b.nelements}", a=a, b=b)
    require(not a.type.is_quantized, "cpy", "the source must not be quantized", a=a, b=b)
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


for _kind, _sym in ((OpKind.VIEW, "view"), (OpKind.RESHAPE, "reshape"),
                    (OpKind.PERMUTE, "permute"), (OpKind.TRANSPOSE, "transpose")):
    register(OpDef(_kind, _sym, None, PermuteParams if _kind == OpKind.PERMUTE else None))
register(OpDef(OpKind.CONT, "cont", _ref_cont))
register(OpDef(OpKind.CPY, "x->y", _ref_cpy))
