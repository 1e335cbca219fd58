"""Typed, strided numpy views of tensors inside byte buffers, and value conversion.

Every executor (the numpy reference, the numba CPU backend) keeps tensor memory in flat uint8
buffers and reaches a tensor through a zero-copy view at `offset` with the tensor's own strides.
Floats are converted to and from each type exactly as ggml does (through f32), quantized rows
through ggraph.quants.
"""
from __future__ import annotations

import numpy as np

from ggraph import quants
from ggraph.tensor import Tensor
from ggraph.types import GGMLType


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
        return values.astype(t.traits.numpy_dtype)
    f32 = values.astype(np.float32)  # ggml converts through f32
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
    values = np.broadcast_to(np.asarray(values), t.shape)
    raw_view(buf, offset, t)[...] = encode_rows(t.type, values)


def encode(t: Tensor, values: np.ndarray) -> np.ndarray:
    """Contiguous bytes (length t.nbytes) of `values` stored as tensor `t`."""
    values = np.asarray(values)
    if values.size != t.nelements:
        raise ValueError(f"tensor {t.describe()} holds {t.nelements} elements, got an array of "
                         f"shape {values.shape}")
    enc = encode_rows(t.type, values.reshape(t.shape))
    return np.frombuffer(np.ascontiguousarray(enc).tobytes(), dtype=np.uint8).copy()


def feed_inputs(graph, inputs, write) -> None:
    """Write each leaf's value from `inputs` (keys: tensors or names) with `write(leaf, values)`;
    a graph input (INPUT flag, no host data) without a value, or a value of the wrong size, is
    an error naming the tensor. Shared by every executor so they agree on what an input is."""
    by_name = {k: v for k, v in inputs.items() if isinstance(k, str)}
    by_id = {id(k): v for k, v in inputs.items() if not isinstance(k, str)}
    for leaf in graph.leafs:
        v = by_id.get(id(leaf))
        if v is None and leaf.name in by_name:
            v = by_name[leaf.name]
        if v is not None:
            v = np.asarray(v)
            if v.size != leaf.nelements:
                raise ValueError(f"input for {leaf.describe()} has shape {v.shape} "
                                 f"({v.size} elements), expected {leaf.nelements}")
            write(leaf, v.reshape(leaf.shape))
        elif leaf.is_input and leaf.data is None:
            raise ValueError(f"graph input {leaf.describe()} was given no value")
