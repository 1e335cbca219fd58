"""The op registry: one OpDef record per OpKind, and the helpers op constructors share.

An OpDef holds everything ggraph knows about an op apart from backend kernels: its params
dataclass, its shape/type rule (run by the constructor, raising ValueError that names the op,
the tensors and their ne), its numpy reference (run by ggraph.reference with wide
accumulation), whether ggml-alloc may run it in place, and its conformance cases.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from ggraph.opkind import OpKind
from ggraph.tensor import Tensor, contiguous_strides, fmt_ne
from ggraph.types import GGMLType


class Executor(Protocol):
    """What a reference function may ask of the executor running it."""

    def read(self, t: Tensor) -> np.ndarray: ...            # values, numpy order, float64/int
    def write(self, t: Tensor, values: np.ndarray) -> None: ...
    def write_rows(self, t: Tensor, rows: np.ndarray, values: np.ndarray) -> None: ...


RefFn = Callable[[Tensor, Executor], "np.ndarray | None"]


@dataclass(frozen=True)
class OpDef:
    kind: OpKind
    symbol: str                      # short form for graph pictures (ggml_op_symbol)
    reference: RefFn | None          # None for views (no computation)
    params_type: type | None = None
    inplace: bool = False            # ggml-alloc may give a parent's memory to the result
    cases: Callable[[], Iterable[Any]] | None = None  # conformance cases (ggraph.conformance)
    doc: str = ""


REGISTRY: dict[OpKind, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.kind in REGISTRY:
        raise ValueError(f"op {opdef.kind} registered twice")
    REGISTRY[opdef.kind] = opdef
    return opdef


def get_op(kind: OpKind) -> OpDef:
    try:
        return REGISTRY[kind]
    except KeyError:
        raise KeyError(f"op {kind} has no record in the registry") from None


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


def require_same_ctx(op: str, *tensors: Tensor | None) -> None:
    ctxs = {id(t.ctx) for t in tensors if t is not None}
    if len(ctxs) > 1:
        raise op_error(op, "tensors come from different contexts",
                       **{f"src{i}": t for i, t in enumerate(tensors)})


def can_repeat(small: Tensor, big: Tensor) -> bool:
    """ggml_can_repeat: `small` tiles `big` by modulo in every dimension."""
    return all(s > 0 and b % s == 0 for s, b in zip(small.ne, big.ne)) or small.nelements == 0


# -- node construction ------------------------------------------------------------------

def new_node(kind: OpKind, srcs: Sequence[Tensor | None], type: GGMLType,
             ne: Sequence[int], params: Any = None, name: str = "") -> Tensor:
    """A fresh (non-view) result tensor, contiguous."""
    first = next(s for s in srcs if s is not None)
    require_same_ctx(str(kind), *srcs)
    return Tensor(first.ctx, type, ne, op=kind, params=params, src=srcs, name=name)


def new_view(kind: OpKind, a: Tensor, ne: Sequence[int], nb: Sequence[int] | None,
             offset: int, params: Any = None, name: str = "",
             srcs: Sequence[Tensor | None] | None = None) -> Tensor:
    """A tensor aliasing `a`'s memory at byte `offset` (relative to `a`).

    When `a` is itself a view, the offset may be negative as long as the result starts inside
    the root owner: builders use this to take a full view of a buffer through the last view
    that wrote into it, which orders the view after that write."""
    t = Tensor(a.ctx, a.type, ne, nb=nb if nb is not None else contiguous_strides(a.type, ne),
               op=kind, params=params, src=srcs if srcs is not None else (a,),
               view_src=a, view_offs=offset, name=name)
    root = a.owner
    end = t.view_offs + t.nbytes
    if t.view_offs < 0:
        raise op_error(str(kind), f"view offset {offset} starts {-t.view_offs} bytes before its "
                       f"root tensor {root.label}", a=a)
    if t.nelements and end > root.nbytes:
        raise op_error(str(kind), f"a view of ne={fmt_ne(ne)} ({t.nbytes} bytes) at offset "
                       f"{offset} ends at byte {offset + t.nbytes}, past the end of its source "
                       f"({root.nbytes - (t.view_offs - offset)} bytes)", a=a)
    if not name:
        t.name = f"{a.name} ({'view' if kind == OpKind.VIEW else str(kind) + 'd'})" \
            if a.name else ""
    return t


__all__ = ["OpDef", "REGISTRY", "register", "get_op", "op_error", "require", "require_type",
           "can_repeat", "new_node", "new_view", "fmt_ne", "Executor"]
