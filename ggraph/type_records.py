"""One record per storage type: everything ggraph knows about a tensor type, in one place.

A `TypeRecord` holds a type's block layout (elements and bytes per block, the numpy dtype of an
element type), its numpy codec (the quantize/dequantize kernels of `ggraph.quants`), the byte
offsets of the f16 scales of a block (what `first_nonfinite` reads), the names of its shared
compiled codec functions in backends/shared/codecs*.py (which both backends compile), and its
roles: usable as a mul_mat weight, as a KV cache type, storable by set_rows/cpy, and the type
ggml rounds activations to for its dot products with the type (vec_dot_type).

Each type registers its record with `register_type(...)` next to its numpy code in
ggraph/quants.py (K-quants and IQ4 in ggraph/quants_k.py), as gguf-py's quant classes register
themselves. Every list of types the rest of ggraph uses is derived from the records, never
written out: `TYPE_TRAITS` (ggraph.types), `BLOCK_CODECS`/`ELEM_CODECS` (backends/jit.py),
`VEC_DOT_TYPE` (backends/cpu/kernels.py), `WEIGHT_TYPES` (ops/matmul.py),
`KV_TYPES` (ops/attention.py), `STORABLE`/`ELEM_FLOATS` (ops/registry.py), the conformance
case types `WEIGHTS`/`KV`/`STORED` (ops/case.py) and `CACHE_TYPES` (graphs/kv_cache.py).

This module imports nothing of ggraph, so ggraph.types can import it at the top; importing
ggraph.types imports ggraph.quants, which registers every type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from .types import GGMLType

__all__ = ["TypeRecord", "register_type", "TYPE_RECORDS", "record", "types_where",
           "weight_types", "kv_types", "storable_types", "element_floats"]


@dataclass(frozen=True)
class TypeRecord:
    type: "GGMLType"
    block_size: int                 # elements per block along ne[0] (1: an element type)
    type_size: int                  # bytes per block
    numpy_dtype: str | None = None  # element dtype for block-size-1 types; None for blocks
    # numpy codec (ggraph.quants). Block types: kernels (nb, block_size) f32 -> out (nb,
    # type_size) uint8 and back. Float element types: whole-array converters f32 -> the
    # stored little-endian array, and stored bytes (uint8) -> f32. None: not convertible.
    quantize: Callable[..., Any] | None = None
    dequantize: Callable[..., Any] | None = None
    scale_fields: tuple[int, ...] = ()   # byte offsets of each block's f16 scales
    float_bits: tuple[str, int] | None = None  # float element types: (unsigned view, exp mask)
    # names in backends/shared/codecs.py: (dec, enc, dot) for block types, (load, store,
    # load1) for element types
    codecs: tuple[str, str, str] = ("", "", "")
    # name in backends/shared/qdot.py of the integer dot of a stored row with vec_dot_type
    # activation blocks (ggml's quantized dot); "" where only the float dot exists
    qdot: str = ""
    integer: bool = False   # an integer element type (indices)
    weight: bool = False    # accepted as mul_mat / mul_mat_id weights (`a`)
    kv: bool = False        # accepted as flash_attn_ext K/V, hence as a KV cache type
    storable: bool = False  # a destination of set_rows / cpy (get_rows source too)
    # ggml's vec_dot_type (ggml-cpu.c type_traits_cpu): the type ggml's CPU dot products round
    # the activations to before multiplying with a weight of this type; None: not a weight
    vec_dot_type: "GGMLType | None" = None

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    @property
    def is_float(self) -> bool:
        return self.block_size == 1 and not self.integer


# registration order is the order of every derived list
TYPE_RECORDS: dict["GGMLType", TypeRecord] = {}


def register_type(t: "GGMLType", block_size: int, type_size: int, **facts: Any) -> TypeRecord:
    """Record storage type `t` (once); the facts are TypeRecord's fields."""
    if t in TYPE_RECORDS:
        raise ValueError(f"type {t} is already registered")
    rec = TypeRecord(t, block_size, type_size, **facts)
    if rec.is_quantized and rec.numpy_dtype is not None:
        raise ValueError(f"block type {t} has no numpy_dtype (its blocks are bytes)")
    if not rec.is_quantized and rec.numpy_dtype is None:
        raise ValueError(f"element type {t} needs a numpy_dtype")
    TYPE_RECORDS[t] = rec
    return rec


def record(t: "GGMLType") -> TypeRecord:
    return TYPE_RECORDS[t]


def types_where(pred: Callable[[TypeRecord], bool]) -> tuple["GGMLType", ...]:
    """The types whose record satisfies pred, in registration order."""
    return tuple(t for t, r in TYPE_RECORDS.items() if pred(r))


def weight_types() -> tuple["GGMLType", ...]:
    return types_where(lambda r: r.weight)


def kv_types() -> tuple["GGMLType", ...]:
    return types_where(lambda r: r.kv)


def storable_types() -> tuple["GGMLType", ...]:
    return types_where(lambda r: r.storable)


def element_floats() -> tuple["GGMLType", ...]:
    return types_where(lambda r: r.is_float)
