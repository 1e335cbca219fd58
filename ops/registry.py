"""The op registry: one OpDef record per OpKind, and the helpers op constructors share.

An OpDef holds everything ggraph knows about an op apart from backend kernels: its params
dataclass, its shape/type rule (run by the constructor, raising ValueError that names the op,
the tensors and their ne), its numpy reference (run by ggraph.check.reference with wide
accumulation), whether ggml-alloc may run it in place, how pictures label its edges, its
conformance cases, and (GGMLMap) how the real libggml builds, probes and limits it. The
modules that use the records (ggraph.check.ggml_ref, ggraph.check.ggml_cdefs, ggraph.pictures.dot)
iterate them and
hold no per-op branches. This module also holds ggml's layout predicates those limits use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor, contiguous_strides, fmt_ne
from ggraph.ir.types import element_floats, storable_types
from ggraph.ir.types import GGMLType


class Executor(Protocol):
    """What a reference function may ask of the executor running it."""

    def read(self, t: Tensor) -> np.ndarray: ...            # values, numpy order, float64/int
    def write(self, t: Tensor, values: np.ndarray) -> None: ...
    def write_rows(self, t: Tensor, rows: np.ndarray, values: np.ndarray) -> None: ...


RefFn = Callable[[Tensor, Executor], "np.ndarray | None"]


def _any_types(node: Tensor) -> bool:
    return True


class GGMLProbe(Protocol):
    """What an op's enum probe (GGMLMap.probe) is handed by ggraph.check.ggml_cdefs: libggml's
    functions, a no-alloc context, C NULL, an F32 tensor `a` of ne [64, 4, 2, 1], and `new`
    for any other tensor the constructor needs. ops/ never imports cffi: these are objects."""
    lib: Any
    ctx: Any
    null: Any
    a: Any

    def new(self, type: GGMLType, *ne: int) -> Any: ...


Limit = Callable[[Tensor], "str | None"]   # a reason ggml cannot do the node, or None

# How gradients flow back through an op (ggraph.autodiff builds backward graphs from these):
# backward(node, grad, wants) gets the node, the gradient of the loss with respect to it (an
# F32 tensor of the node's ne) and, per source, whether that source wants a gradient; it
# returns one entry per source: an F32 tensor of that source's ne (its share of the
# gradient; autodiff adds up the shares of a source used more than once), or None where the
# source wants none or has none (indices, masks, positions). The rule only records nodes.
Backward = Callable[[Tensor, Tensor, "tuple[bool, ...]"], "Sequence[Tensor | None]"]


@dataclass(frozen=True)
class GGMLMap:
    """How an op appears in the real libggml (the `ggml-compare` reference and its checks):
    ggml's op name (default: the kind's name), its unary/GLU sub-op where it has one, and
    `build(lib, ctx, node, srcs)` calling ggml's constructor with the node's params (srcs: the
    sources' ggml tensors; default: `ggml_<op>(ctx, *srcs)`)."""
    op: str | None = None
    sub: str | None = None
    build: Callable[[Any, Any, Tensor, list[Any]], Any] | None = None
    # the C declaration of the constructor, for an op whose constructor ggml_cdefs.py does not
    # declare (cffi binds only declared functions)
    cdecl: str | None = None
    # what ggml's constructor cannot express for a node (a param, type or layout ggml lacks):
    # the reason, or None. Checked before building, so ggml never sees such a node
    limits: Limit | None = None
    # what ggml's CPU kernels assert on (GGML_ASSERT aborts the process): the reason, or None
    cpu_limits: Limit | None = None
    # builds one tensor with ggml's constructor, from which ggml_cdefs reads the op's enum
    # values (never hard-coded). Default for element-wise ops: `ggml_<op>(ctx, a[, a])`
    probe: Callable[[GGMLProbe], Any] | None = None
    # ggml's result put in ggraph's form where ggml leaves it free (top_k's order):
    # canonical(node, ggml's value of node, ggml's values of node's sources)
    canonical: Callable[[Tensor, np.ndarray, list[np.ndarray]], np.ndarray] | None = None

    @classmethod
    def unary(cls, sub: str, **fields: Any) -> "GGMLMap":
        """An op of ggml's UNARY family (sub: its ggml_unary_op name), whose kernels need
        packed rows; `fields`: any other GGMLMap field (cdecl, build, probe)."""
        return cls("UNARY", sub, limits=_ggml_unary_rows, **fields)

    def reason(self, t: Tensor, kernels: bool = True) -> str | None:
        """Why ggml cannot build node t (or, with `kernels`, run it on its CPU); None if it can."""
        for check in (self.limits, self.cpu_limits if kernels else None):
            why = check(t) if check is not None else None
            if why:
                return why
        return None


@dataclass(frozen=True)
class OpDef:
    """Everything ggraph knows about an op apart from backend kernels."""
    kind: OpKind
    symbol: str                      # short form for graph pictures (ggml_op_symbol)
    reference: RefFn | None          # None for views (no computation)
    params_type: type | None = None
    inplace: bool = False            # ggml-alloc may give a parent's memory to the result
    cases: Callable[[], Iterable[Any]] | None = None  # conformance cases (ggraph.check.conformance)
    # the source/result types every backend's kernels accept (a backend may narrow it), and
    # what the coverage table says where it refuses
    accepts: Callable[[Tensor], bool] = _any_types
    accepts_why: str = ""
    # element-wise ops the shared unary/binary kernels run ("unary": one source, "binary":
    # b broadcast over a by modulo); their op codes follow registration order
    elementwise: str | None = None
    ggml: GGMLMap | None = None
    # pictures (ggraph dot) label this op's edges src0, src1, ...: its sources play different
    # roles the drawing must tell apart (mul_mat's weight and activations, a rope's positions).
    # Commutative ops (add, mul) and one-source ops leave it False
    src_labels: bool = False
    # the gradient rule (Backward above); None: gradients do not flow through this op, and
    # ggraph.autodiff refuses a parameter whose path to the loss crosses it, naming the op
    backward: Backward | None = None
    doc: str = ""

    @property
    def family(self) -> Family:
        return self.kind.family

    @property
    def ggml_op(self) -> tuple[str, str | None] | None:
        """(ggml op name, sub-op name or None); None where ggml has no such op."""
        if self.ggml is None:
            return None
        return self.ggml.op or self.kind.name, self.ggml.sub

    def ggml_build(self, lib: Any, ctx: Any, node: Tensor, srcs: list[Any]) -> Any:
        """The ggml tensor computing `node` in libggml (`lib`: its functions)."""
        if self.ggml is None:
            raise ValueError(f"op {self.kind} has no ggml counterpart")
        if self.ggml.build is not None:
            return self.ggml.build(lib, ctx, node, srcs)
        return getattr(lib, f"ggml_{self.kind.value}")(ctx, *srcs)


REGISTRY: dict[OpKind, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.kind in REGISTRY:
        raise ValueError(f"op {opdef.kind} registered twice")
    if opdef.elementwise not in (None, "unary", "binary"):
        raise ValueError(f"op {opdef.kind}: elementwise must be 'unary', 'binary' or None")
    REGISTRY[opdef.kind] = opdef
    return opdef


def get_op(kind: OpKind) -> OpDef:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise KeyError(f"op {kind} has no record in the registry") from None


def ops_where(pred: Callable[[OpDef], bool]) -> tuple[OpKind, ...]:
    """The kinds whose record satisfies pred, in registration order (families, the
    element-wise groups and their op codes are derived this way, never listed)."""
    return tuple(k for k, d in REGISTRY.items() if pred(d))


def types_ok(node: Tensor, *roles_ok: Sequence[GGMLType]) -> bool:
    """Each source's type is in its role's allowed set (missing optional sources pass)."""
    return all(s is None or s.type in ok for s, ok in zip(node.src, roles_ok))


# type groups the accepts rules use
FLOATS = (GGMLType.F32, GGMLType.F16)
ELEM_FLOATS = element_floats()   # from the type records (ggraph/ir/types.py)
STORABLE = storable_types()      # set_rows / cpy destinations: records with storable=True


# -- ggml's layout predicates (for GGMLMap.limits / cpu_limits) -----------------------------

def ggml_packed_rows(t: Tensor) -> bool:
    """Elements (or blocks) of a row are adjacent: nb0 is the type size (or one block a row)."""
    return t.ne[0] == t.type.block_size or t.nb[0] == t.type.type_size


def ggml_contiguous_from(t: Tensor, m: int) -> bool:
    """ggml_is_contiguous_m_n(t, m, 4): packed rows, and dims above m contiguous."""
    if not ggml_packed_rows(t):
        return False
    nxt = t.type.type_size * (t.ne[0] // t.type.block_size)
    for i in range(1, 4):
        if i > m:
            if t.ne[i] != 1 and t.nb[i] != nxt:
                return False
            nxt *= t.ne[i]
        else:
            nxt = t.ne[i] * t.nb[i]
    return True


def ggml_packed_sources(*roles: int, types: Sequence[GGMLType] | None = None) -> Limit:
    """A cpu_limits rule: ggml's CPU kernel asserts nb0 == type size on these sources (on
    sources of `types` only, when given)."""
    def check(t: Tensor) -> str | None:
        for i in roles:
            s = t.src[i]
            if s is not None and (types is None or s.type in types) and \
                    s.nb[0] != s.type.type_size:
                return (f"ggml's CPU {t.op} needs source {i} with packed rows (nb0 = "
                        f"{s.type.type_size}), got nb0={s.nb[0]}")
        return None
    return check


def ggml_fn(name: str, *params: str) -> str:
    """The C declaration of ggml constructor `name` (for GGMLMap.cdecl): it returns a tensor
    and takes the context, then `params`; a bare name is a tensor (`"b"`: `struct ggml_tensor
    * b`). ggml's enum arguments are declared int (C passes them as int)."""
    ps = ["struct ggml_context * ctx"] + [p if " " in p else f"struct ggml_tensor * {p}"
                                          for p in params]
    return f"struct ggml_tensor * {name}({', '.join(ps)});"


def _ggml_unary_rows(t: Tensor) -> str | None:
    if not ggml_packed_rows(t.src[0]):
        return f"ggml's unary {t.op} needs packed rows (nb0 = type size)"
    return None


# -- errors -------------------------------------------------------------------------------

def op_error(op: str, problem: str, **tensors: Tensor | None) -> ValueError:
    """ValueError: `op: problem (a='x' f32 ne=[..], b=...)`."""
    parts = [f"{k}={t.describe()}" for k, t in tensors.items() if t is not None]
    return ValueError(f"{op}: {problem}" + (f" ({', '.join(parts)})" if parts else ""))


def require(cond: bool, op: str, problem: str, **tensors: Tensor | None) -> None:
    if not cond:
        raise op_error(op, problem, **tensors)


def require_type(op: str, role: str, t: Tensor, allowed: Sequence[GGMLType]) -> None:
    require(t.type in allowed, op,
            f"{role} must be of type {'/'.join(str(a) for a in allowed)}, got {t.type}",
            **{role: t})


def can_repeat(small: Tensor, big: Tensor) -> bool:
    """ggml_can_repeat: `small` tiles `big` by modulo in every dimension."""
    if small.nelements == 0:  # ggml: an empty tensor only repeats into an empty one
        return big.nelements == 0
    return all(b % s == 0 for s, b in zip(small.ne, big.ne))


# -- node construction ------------------------------------------------------------------

def _require_blocks(kind: OpKind, type: GGMLType, ne: Sequence[int], **tensors: Tensor | None
                    ) -> None:
    """A quantized result needs whole blocks per row: name the op and sources, not just ne."""
    require(not type.is_quantized or int(ne[0]) % type.block_size == 0, str(kind),
            f"a {type} result of ne={fmt_ne(ne)} has rows of {int(ne[0])} elements, not a "
            f"multiple of the block size {type.block_size}", **tensors)


def new_node(kind: OpKind, srcs: Sequence[Tensor | None], type: GGMLType,
             ne: Sequence[int], params: Any = None, name: str = "") -> Tensor:
    """A fresh (non-view) result tensor, contiguous. Sources may come from different contexts
    (weights live in the model's); the result joins the context of its last source, usually
    the activations'."""
    ctx = [s for s in srcs if s is not None][-1].ctx
    _require_blocks(kind, type, ne, **{f"src{i}": s for i, s in enumerate(srcs)})
    return Tensor(ctx, type, ne, op=kind, params=params, src=srcs, name=name)


def new_view(kind: OpKind, a: Tensor, ne: Sequence[int], nb: Sequence[int] | None,
             offset: int, params: Any = None, name: str = "",
             srcs: Sequence[Tensor | None] | None = None) -> Tensor:
    """A tensor aliasing `a`'s memory at byte `offset` (relative to `a`).

    When `a` is itself a view, the offset may be negative as long as the result starts inside
    the root owner: builders use this to take a full view of a buffer through the last view
    that wrote into it, which orders the view after that write.

    Every byte the view can address must lie inside its root: strides are >= 0 (a negative
    stride would let a kernel walk into a neighbour's memory), a VIEW keeps its source's nb0
    (ggml's rule), and [offset, offset + nbytes) lies within the root. With strides >= 0 the
    lowest addressed byte is the view's start and the highest is start + nbytes - 1, so a
    permute or transpose of a legal view (same strides, reordered) stays legal. The start and
    the strides nb1..nb3 are whole elements (whole blocks for a quantized type): a GPU cannot
    load a misaligned element."""
    op = str(kind)
    what = f"view {name!r}" if name else "a view"
    _require_blocks(kind, a.type, ne, a=a)
    if nb is not None:
        nb = tuple(int(x) for x in nb)
        require(len(nb) == 4, op, f"{what} needs 4 strides, got nb={list(nb)}", a=a)
        require(all(x >= 0 for x in nb), op,
                f"{what} has a negative stride nb={list(nb)}: strides must be >= 0", a=a)
        require(kind != OpKind.VIEW or nb[0] == a.nb[0], op,
                f"{what} has nb0={nb[0]}; a view inherits its source's nb0={a.nb[0]}", a=a)
    t = Tensor(a.ctx, a.type, ne, nb=nb if nb is not None else contiguous_strides(a.type, ne),
               op=kind, params=params, src=srcs if srcs is not None else (a,),
               view_src=a, view_offs=offset, name=name)
    root = a.owner
    end = t.view_offs + t.nbytes
    unit = a.type.type_size  # an element's bytes, or a quantized block's
    if t.view_offs % unit or any(x % unit for x in t.nb[1:]):
        # a GPU faults on a misaligned element (a sticky error); numpy on the host does not
        raise op_error(op, f"{what} at offset {offset} (byte {t.view_offs} of its root) with "
                       f"nb={list(t.nb)} is not aligned to {a.type.name}'s {unit}-byte "
                       f"{'element' if a.type.block_size == 1 else 'block'}", a=a)
    if t.view_offs < 0:
        raise op_error(op, f"{what} at offset {offset} starts {-t.view_offs} bytes before its "
                       f"root tensor {root.label}", a=a)
    if t.view_offs > root.nbytes:
        raise op_error(op, f"{what} at offset {offset} starts at byte {t.view_offs}, past the "
                       f"end of its root tensor {root.label} ({root.nbytes} bytes)", a=a)
    if t.nelements and end > root.nbytes:
        raise op_error(op, f"{what} of ne={fmt_ne(ne)} nb={list(t.nb)} ({t.nbytes} bytes) at "
                       f"offset {offset} ends at byte {offset + t.nbytes}, past the end of its "
                       f"source ({root.nbytes - (t.view_offs - offset)} bytes)", a=a)
    if not name:
        t.name = f"{a.name} ({'view' if kind == OpKind.VIEW else str(kind) + 'd'})" \
            if a.name else ""
    return t


__all__ = ["OpDef", "GGMLMap", "Backward", "GGMLProbe", "Limit", "ggml_packed_rows", "ggml_contiguous_from",
           "ggml_packed_sources", "ggml_fn", "REGISTRY", "register", "get_op", "ops_where",
           "types_ok",
           "FLOATS", "ELEM_FLOATS", "STORABLE", "op_error", "require", "require_type",
           "can_repeat", "new_node", "new_view", "fmt_ne", "Executor", "Family"]
