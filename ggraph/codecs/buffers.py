"""Typed, strided numpy views of tensors inside byte buffers, and value conversion.

Every executor (the numpy reference, the numba CPU backend) keeps tensor memory in flat uint8
buffers and reaches a tensor through a zero-copy view at `offset` with the tensor's own strides.
Floats are converted to and from each type exactly as ggml does (through f32), quantized rows
through ggraph.codecs.quants.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ggraph.codecs import quants
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor, install_value_encoder
from ggraph.ir.types import GGMLType


def _check_bounds(buf: np.ndarray, offset: int, t: Tensor) -> None:
    if offset < 0 or offset + t.nbytes > buf.nbytes:
        raise ValueError(f"tensor {t.describe()} at offset {offset} spans {t.nbytes} bytes, "
                         f"past the end of its buffer of {buf.nbytes} bytes")


def raw_view(buf: np.ndarray, offset: int, t: Tensor, half_bits: bool = False) -> np.ndarray:
    """A zero-copy view of `t` in `buf`.

    Block-size-1 types give an array of the element dtype with shape (ne3, ne2, ne1, ne0)
    (F16 as uint16 bits when `half_bits`, as kernels without a float16 type need);
    quantized types give the bytes of each row, shape (ne3, ne2, ne1, row_bytes), which
    requires the blocks of a row to be packed (nb0 == type_size).
    """
    _check_bounds(buf, offset, t)
    _check_strides(t)  # nbytes would understate a negative stride's span: never wander
    tr = t.type.traits
    ne3, ne2, ne1, ne0 = t.shape
    nb0, nb1, nb2, nb3 = t.nb
    if t.nelements == 0:
        return np.zeros(t.shape if tr.numpy_dtype else (ne3, ne2, ne1, 0),
                        dtype=tr.numpy_dtype or np.uint8)
    if tr.numpy_dtype is not None:
        dtype = np.uint16 if half_bits and t.type == GGMLType.F16 else tr.numpy_dtype
        return np.ndarray((ne3, ne2, ne1, ne0), dtype=dtype, buffer=buf,
                          offset=offset, strides=(nb3, nb2, nb1, nb0))
    if nb0 != tr.type_size:
        raise ValueError(f"tensor {t.describe()}: the blocks of a quantized row must be packed "
                         f"(nb0 = {tr.type_size}), got nb0 = {nb0}")
    return np.ndarray((ne3, ne2, ne1, t.row_bytes), dtype=np.uint8, buffer=buf,
                      offset=offset, strides=(nb3, nb2, nb1, 1))


def decode_rows(t: GGMLType, raw: np.ndarray, ne0: int) -> np.ndarray:
    """Values of raw elements or row bytes: float32 for float/quantized types, ints as is."""
    if t == GGMLType.F32 or t.is_int:
        return np.array(raw)
    if t == GGMLType.F16:
        return raw.astype(np.float32)
    if t == GGMLType.BF16:
        return quants.bf16_bits_to_f32(np.ascontiguousarray(raw))
    return quants.dequantize(t, np.ascontiguousarray(raw), ne0)


def encode_rows(t: GGMLType, values: np.ndarray) -> np.ndarray:
    """float or int values (..., ne0) -> raw elements (block-size-1 types) or row bytes."""
    values = np.asarray(values)
    if t.is_int:
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            raise ValueError(f"cannot store non-finite values in an {t} tensor")
        return values.astype(t.traits.numpy_dtype, copy=False)
    f32 = values.astype(np.float32, copy=False)  # ggml converts through f32
    if t == GGMLType.F32:
        return f32
    if t == GGMLType.F16:
        return f32.astype(np.float16)
    if t == GGMLType.BF16:
        return quants.f32_to_bf16_bits(f32)
    return quants.quantize(t, f32)


def read(buf: np.ndarray, offset: int, t: Tensor) -> np.ndarray:
    """Values of `t` in numpy order (ne3, ne2, ne1, ne0); a copy."""
    return decode_rows(t.type, raw_view(buf, offset, t), t.ne[0])


def write(buf: np.ndarray, offset: int, t: Tensor, values: np.ndarray) -> None:
    """Store values (broadcastable to t.shape) into `t`, converting to its type."""
    values = np.asarray(values)
    if values.shape != t.shape:
        values = np.broadcast_to(values, t.shape)
    raw_view(buf, offset, t)[...] = encode_rows(t.type, values)


def encode(t: Tensor, values: np.ndarray) -> np.ndarray:
    """Contiguous bytes (length t.nbytes) of `values` stored as tensor `t`."""
    values = np.asarray(values)
    if values.size != t.nelements:
        raise ValueError(f"tensor {t.describe()} holds {t.nelements} elements, got an array of "
                         f"shape {values.shape}")
    enc = encode_rows(t.type, values.reshape(t.shape))
    return np.frombuffer(np.ascontiguousarray(enc).tobytes(), dtype=np.uint8).copy()


def check_layout(t: Tensor) -> None:
    """Refuse a tensor whose strides could reach memory outside its own: a negative stride, or
    a view whose bytes [view_offs, view_offs + nbytes) leave its root. Op constructors refuse
    these at build time; executors check again because Tensor fields can be set directly."""
    _check_strides(t)
    root = t.view_src
    if root is not None:
        start, n, have = t.view_offs, t.nbytes, root.nbytes
        if start < 0 or start > have or start + n > have:
            raise ValueError(f"view {t.describe()} spans bytes [{start}, {start + n}) outside "
                             f"its root {root.describe()} of {have} bytes")


def _check_strides(t: Tensor) -> None:
    if min(t.nb) < 0:
        raise ValueError(f"tensor {t.describe()} has a negative stride nb={list(t.nb)}: "
                         f"strides must be >= 0")


def _expected_shape(t: Tensor) -> tuple[int, ...]:
    """t.shape without its leading 1-dims: the shortest value shape feed_inputs accepts."""
    shape = t.shape
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def check_input(t: Tensor, value: object) -> np.ndarray:
    """`value` as an array ready to store in `t`, or a ValueError naming `t`.

    The shape must be t.shape (numpy order) with leading 1-dims optionally left out, so a
    transposed or flattened array of the right size is an error rather than silently
    reshaped. A conversion that would lose information is refused: float, complex or
    non-numeric values into an integer tensor, integers outside its type's range, complex
    values into a float tensor. Floats into F16/BF16/quantized types round as ggml does."""
    if value is None:
        raise ValueError(f"input for {t.describe()} is None")
    v = np.asarray(value)
    if v.ndim > len(t.shape) or (1,) * (len(t.shape) - v.ndim) + v.shape != t.shape:
        raise ValueError(f"input for {t.describe()} has shape {v.shape} ({v.size} elements), "
                         f"expected {t.nelements} elements in shape {_expected_shape(t)} "
                         f"(numpy order; leading 1-dims may be left out)")
    kind = v.dtype.kind
    if t.type.is_int:
        if kind not in "biu":
            raise ValueError(f"input for {t.describe()} has {v.dtype} values; an {t.type} "
                             f"tensor takes integers (convert them explicitly, e.g. "
                             f".astype(np.{t.type.traits.numpy_dtype}))")
        info = np.iinfo(t.type.traits.numpy_dtype)
        # values of a type whose every value the tensor's type holds need no range check
        # (numpy's min and max are ~3 us a call; a decode step feeds several index inputs)
        if v.size and kind != "b" and not np.can_cast(v.dtype, info.dtype, "safe"):
            lo, hi = v.min(), v.max()
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise ValueError(f"input for {t.describe()} holds {bad}, outside the range "
                                 f"[{info.min}, {info.max}] of {t.type}")
    elif kind not in "biuf":
        raise ValueError(f"input for {t.describe()} has {v.dtype} values; a {t.type} tensor "
                         f"takes real numbers")
    return v


def _names(ts: list[Tensor], limit: int = 8) -> str:
    shown = ", ".join(repr(t.name) if t.name else t.label for t in ts[:limit])
    return shown + (f", ... ({len(ts)} in all)" if len(ts) > limit else "") if ts else "none"


def feed_inputs(graph: Any, inputs: Mapping[Tensor | str, Any],
                write: Callable[[Tensor, np.ndarray], None]) -> None:
    """Write each leaf's value from `inputs` (keys: tensors or names) with `write(leaf, values)`.

    Every value is checked by check_input before anything is written. Errors name the
    tensor: a graph input (INPUT flag, no host data) without a value, a key that is neither
    a leaf of `graph` nor the name of one (the message lists the graph's inputs), a value of
    the wrong shape or one whose conversion would lose information. A name given to several
    leafs feeds each of them; a tensor key wins over its name. Shared by every executor so
    they agree on what an input is. Where a fed leaf carries host data, the executor's
    `write` must not store into that array (Session copies it on write)."""
    leafs = graph.leafs
    # what keys are checked against, made only for the kinds of keys given: a decode step
    # feeds a few tensors of a graph of hundreds of leafs, every token (a Graph answers `in`
    # from its own set of members; a leaf is a member without an op)
    names: set[str] | None = None
    known: Any = graph if isinstance(graph, Graph) else None
    by_name: dict[str, Any] = {}
    by_tensor: dict[Tensor, Any] = {}
    for k, v in inputs.items():
        if isinstance(k, str):
            if names is None:
                names = {leaf.name for leaf in leafs if leaf.name}
            if k not in names:
                raise ValueError(f"input name {k!r} is not the name of a leaf of the graph; "
                                 f"its inputs are {_names(_inputs_of(leafs))}")
            by_name[k] = v
        elif isinstance(k, Tensor):
            if known is None:
                known = set(leafs)
            if k.op is not None or k not in known:
                raise ValueError(f"input {k.describe()} is not a leaf of the graph"
                                 f"{' (it is computed by op ' + str(k.op) + ')' if k.op else ''}"
                                 f"; its inputs are {_names(_inputs_of(leafs))}")
            by_tensor[k] = v
        else:
            raise ValueError(f"input keys must be tensors or names, got {type(k).__name__} "
                             f"{k!r}")
    values: list[tuple[Tensor, np.ndarray]] = []
    # keyed by tensors only (a decode step), a Graph's leafs without data are the only ones
    # to ask whether an input went unfed: not every weight of the model, every token
    scan = graph.leafs_without_data() if isinstance(graph, Graph) and not by_name else leafs
    for leaf in scan:
        if leaf in by_tensor:
            v = by_tensor[leaf]
        elif leaf.name in by_name:
            v = by_name[leaf.name]
        else:
            if leaf.data is None and leaf.is_input:  # weights (data) skip the flag test
                raise ValueError(f"graph input {leaf.describe()} was given no value")
            continue
        values.append((leaf, check_input(leaf, v)))
    if scan is not leafs:   # the other tensor keys: leafs with data (checked as leafs above)
        seen = {leaf for leaf, _ in values}
        values += [(leaf, check_input(leaf, v)) for leaf, v in by_tensor.items()
                   if leaf not in seen]
    for leaf, v in values:  # nothing is written unless every value is good
        write(leaf, v.reshape(leaf.shape))


def _inputs_of(leafs: list[Tensor]) -> list[Tensor]:
    """The leafs a caller is expected to feed: graph inputs, else anything without memory."""
    flagged = [t for t in leafs if t.is_input]
    return flagged or [t for t in leafs if t.data is None and t.buffer is None]


install_value_encoder(encode)   # Tensor.set_data's conversion (the IR cannot import this layer)
