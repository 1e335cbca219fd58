"""Tensors as metadata, and the Context that creates them.

A Tensor records ggml's fields (name, type, ne, nb, op, typed params, sources, view_src,
view_offs, flags) and nothing else: creating one never touches tensor memory, so the graph of a
671B-parameter model costs a few kilobytes per tensor. Data lives in backend buffers; a leaf may
carry host bytes in `Tensor.data` (weights loaded by a user, test inputs).
"""
from __future__ import annotations

from enum import IntFlag
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph.ir.types import GGMLType, row_size

# Values become a type's stored bytes in the codecs layer (ggraph/codecs/buffers.py), above the
# IR: it installs its encoder here when it loads, and `import ggraph` loads it before anything
# runs, so Tensor.set_data quantizes without the IR importing the codecs.
VALUE_ENCODERS: list[Callable[["Tensor", np.ndarray], np.ndarray]] = []


def install_value_encoder(fn: Callable[["Tensor", np.ndarray], np.ndarray]) -> None:
    """Make `fn(tensor, values) -> bytes` the encoder Tensor.set_data uses."""
    VALUE_ENCODERS[:] = [fn]

MAX_DIMS = 4
INT64_MAX = (1 << 63) - 1  # ggml_nelements and ggml_nbytes are 64-bit


class Flag(IntFlag):
    NONE = 0
    INPUT = 1   # graph input: placed first by the allocator, never overlapping
    OUTPUT = 2  # graph output: never freed, never overwritten
    PARAM = 4   # trainable parameter: ggraph.autodiff gives it a gradient


_INPUT, _OUTPUT = int(Flag.INPUT), int(Flag.OUTPUT)


def fmt_ne(ne: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(x)) for x in ne) + "]"


def contiguous_strides(t: GGMLType, ne: Sequence[int]) -> tuple[int, int, int, int]:
    ne = normalize_ne(ne)
    nb0 = t.type_size
    nb1 = nb0 * (ne[0] // t.block_size)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def normalize_ne(ne: Iterable[int], what: str = "ne") -> tuple[int, int, int, int]:
    ne = tuple(int(x) for x in ne)
    if not 1 <= len(ne) <= MAX_DIMS:
        raise ValueError(f"{what} must have 1 to {MAX_DIMS} dimensions, got {list(ne)}")
    if any(x < 0 for x in ne):
        raise ValueError(f"{what} {list(ne)} has a negative dimension")
    return ne + (1,) * (MAX_DIMS - len(ne))  # type: ignore[return-value]


class Tensor:
    """One node or leaf of a graph (ggml_tensor). Metadata only."""

    __slots__ = ("ctx", "id", "type", "ne", "nb", "op", "params", "src", "view_src",
                 "view_offs", "name", "flags", "data", "buffer", "__weakref__")

    def __init__(self, ctx: "Context", type: GGMLType, ne: Sequence[int],
                 nb: Sequence[int] | None = None, op: OpKind | None = None,
                 params: Any = None, src: Sequence["Tensor | None"] = (),
                 view_src: "Tensor | None" = None, view_offs: int = 0, name: str = ""):
        self.ctx = ctx
        self.id = ctx._next_id()
        self.type = GGMLType.parse(type)
        self.ne: tuple[int, int, int, int] = normalize_ne(ne)
        if self.type.is_quantized and self.ne[0] % self.type.block_size:
            raise ValueError(f"tensor {name!r}: ne[0]={self.ne[0]} is not a multiple of the "
                             f"block size {self.type.block_size} of type {self.type}")
        n = self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]
        if n > INT64_MAX or (n and row_size(self.type, self.ne[0]) * (n // self.ne[0]) >
                             INT64_MAX):
            # ggml counts elements and bytes in int64: past that, sizes wrap
            raise ValueError(f"tensor {name!r}: ne={list(self.ne)} holds {n} elements of "
                             f"{self.type}; ggml counts elements and bytes in 64-bit signed "
                             f"integers (at most 2^63 - 1)")
        self.nb: tuple[int, int, int, int] = (tuple(int(x) for x in nb) if nb is not None
                                               else contiguous_strides(self.type, self.ne))
        self.op = op
        self.params = params
        self.src: tuple[Tensor | None, ...] = tuple(src)
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs  # a view always points at the root owner
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = int(view_offs)
        self.name = name
        self.flags = Flag.NONE
        self.data: np.ndarray | None = None
        # name of the buffer that already holds this leaf ("model", "kv_cache", ...); such
        # tensors are pre-allocated and never planned by the graph allocator
        self.buffer: str | None = None

    # -- geometry -------------------------------------------------------------------------
    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def row_bytes(self) -> int:
        return row_size(self.type, self.ne[0])

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the tensor, following its strides (ggml_nbytes)."""
        if any(x == 0 for x in self.ne):
            return 0
        bs = self.type.block_size
        if bs == 1:
            n = self.type.type_size
            for i in range(MAX_DIMS):
                n += (self.ne[i] - 1) * self.nb[i]
        else:
            n = self.ne[0] * self.nb[0] // bs
            for i in range(1, MAX_DIMS):
                n += (self.ne[i] - 1) * self.nb[i]
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy shape: ne reversed, (ne3, ne2, ne1, ne0)."""
        return tuple(reversed(self.ne))

    @property
    def n_dims(self) -> int:
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] != 1:
                return i + 1
        return 1

    def is_contiguous(self) -> bool:
        return self.nb == contiguous_strides(self.type, self.ne) or self.nelements <= 1 and \
            self.nb[0] == self.type.type_size

    def rows_contiguous(self) -> bool:
        """Elements of each row are packed (nb0 = type size); rows may be strided."""
        return self.nb[0] == self.type.type_size

    # -- graph role -----------------------------------------------------------------------
    @property
    def is_leaf(self) -> bool:
        return self.op is None

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def owner(self) -> "Tensor":
        """The tensor whose memory this one uses (itself unless it is a view)."""
        return self.view_src if self.view_src is not None else self

    def set_name(self, name: str) -> "Tensor":
        self.name = name
        return self

    def set_input(self) -> "Tensor":
        self.flags |= Flag.INPUT
        return self

    def set_output(self) -> "Tensor":
        self.flags |= Flag.OUTPUT
        if self.view_src is not None:  # an output view keeps its memory owner alive too
            self.view_src.flags |= Flag.OUTPUT
        return self

    def set_param(self) -> "Tensor":
        """Mark a leaf as a trainable parameter (ggml_set_param): ggraph.autodiff.grad gives
        every parameter the loss depends on a gradient."""
        if not self.is_leaf:
            raise ValueError(f"tensor {self.describe()}: only leafs can be parameters (it is "
                             f"computed by {self.op})")
        self.flags |= Flag.PARAM
        return self

    @property
    def is_param(self) -> bool:
        return bool(self.flags & Flag.PARAM)

    @property
    def is_preallocated(self) -> bool:
        """Memory owned outside the compute buffer: weights, caches, leafs with host data."""
        o = self.owner
        return o.buffer is not None or o.data is not None

    # plain int arithmetic: IntFlag's own `&` is Python code (~2.5 us), and feeding a graph
    # asks every unfed leaf, every token
    @property
    def is_input(self) -> bool:
        return (int(self.flags) & _INPUT) != 0

    @property
    def is_output(self) -> bool:
        return (int(self.flags) & _OUTPUT) != 0

    # -- host data for leafs ---------------------------------------------------------------
    def set_data(self, values: np.ndarray) -> "Tensor":
        """Attach host values to a leaf, converted (quantized) to the tensor's type."""
        if not self.is_leaf or self.is_view:
            raise ValueError(f"tensor {self.label}: only leaf tensors that own memory carry "
                             f"host data")
        if not VALUE_ENCODERS:
            raise RuntimeError("no value encoder installed: import ggraph (it loads ggraph.codecs)")
        self.data = VALUE_ENCODERS[-1](self, values)
        return self

    # -- display --------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Name for messages: the name if set, else `#id` and the op."""
        if self.name:
            return repr(self.name)
        return f"#{self.id} ({self.op or 'leaf'})"

    def describe(self) -> str:
        return f"{self.label} {self.type} ne={fmt_ne(self.ne)}"

    def __repr__(self) -> str:
        op = f" op={self.op}" if self.op else ""
        view = f" view_of={self.view_src.label}+{self.view_offs}" if self.view_src else ""
        return f"Tensor({self.describe()}{op}{view})"


class Context:
    """Creates tensors. Metadata only: nothing here allocates tensor data (ggml no_alloc)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._count = 0

    def _next_id(self) -> int:
        self._count += 1
        return self._count

    @property
    def n_tensors(self) -> int:
        return self._count

    def new_tensor(self, type: GGMLType | str, ne: Sequence[int], name: str = "") -> Tensor:
        return Tensor(self, GGMLType.parse(type), ne, name=name)

    def new_tensor_1d(self, type: GGMLType | str, ne0: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0,), name)

    def new_tensor_2d(self, type: GGMLType | str, ne0: int, ne1: int, name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1), name)

    def new_tensor_3d(self, type: GGMLType | str, ne0: int, ne1: int, ne2: int,
                      name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1, ne2), name)

    def new_tensor_4d(self, type: GGMLType | str, ne0: int, ne1: int, ne2: int, ne3: int,
                      name: str = "") -> Tensor:
        return self.new_tensor(type, (ne0, ne1, ne2, ne3), name)

    def from_numpy(self, values: np.ndarray, type: GGMLType | str = GGMLType.F32,
                   name: str = "") -> Tensor:
        """A leaf with the values of a numpy array (shape (ne3, ne2, ne1, ne0) or fewer dims)."""
        values = np.asarray(values)
        t = self.new_tensor(type, tuple(reversed(values.shape)) or (1,), name)
        return t.set_data(values)
