"""Tensor element types: the GGMLType enum with ggml's numeric ids, each type's record (block
layout, roles, codec), and the byte unit (MIB) that sizes are reported in.

Only the types ggraph can compute with are listed; their ids match ggml's `enum ggml_type`
so that GGUF files map onto them directly. Each type's record is registered by the codecs
layer next to its numpy code (ggraph/codecs/quants.py; K-quants and IQ4 in quants_k.py),
which `import ggraph` loads before anything else runs; sizes and every other fact are read
from the record. The IR never imports the codecs: the layers import downward only.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable

MIB = 1 << 20   # bytes in a MiB: llama.cpp reports buffer sizes in MiB, and so does ggraph


# ---- type records ------------------------------------------------------------------------
# A `TypeRecord` holds a type's block layout (elements and bytes per block, the numpy dtype of
# an element type), its numpy codec (the quantize/dequantize kernels of ggraph.codecs.quants),
# the byte offsets of the f16 scales of a block (what `first_nonfinite` reads), the names of
# its shared compiled codec functions in backends/shared/codecs*.py (which both backends
# compile), and its roles: usable as a mul_mat weight, as a KV cache type, storable by
# set_rows/cpy, and the type ggml rounds activations to for its dot products with the type
# (vec_dot_type). Every list of types the rest of ggraph uses is derived from the records,
# never written out: `BLOCK_CODECS`/`ELEM_CODECS` (backends/jit.py), `VEC_DOT_TYPE`
# (backends/cpu/kernels.py), `WEIGHT_TYPES` (ops/matmul.py), `KV_TYPES` (ops/attention.py),
# `STORABLE`/`ELEM_FLOATS` (ops/registry.py), the conformance case types
# `WEIGHTS`/`KV`/`STORED` (ops/case.py) and `CACHE_TYPES` (graphs/models/kv_cache.py).

@dataclass(frozen=True)
class TypeRecord:
    type: "GGMLType"
    block_size: int                 # elements per block along ne[0] (1: an element type)
    type_size: int                  # bytes per block
    numpy_dtype: str | None = None  # element dtype for block-size-1 types; None for blocks
    # numpy codec (ggraph.codecs.quants). Block types: kernels (nb, block_size) f32 -> out (nb,
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


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15     # the activation type of K-quant dot products (no tensor role)
    IQ4_NL = 20
    IQ4_XS = 23
    I32 = 26
    I64 = 27
    BF16 = 30

    @property
    def traits(self) -> TypeRecord:
        return TYPE_TRAITS[self]

    @property
    def block_size(self) -> int:
        return TYPE_TRAITS[self].block_size

    @property
    def type_size(self) -> int:
        return TYPE_TRAITS[self].type_size

    @property
    def is_quantized(self) -> bool:
        return TYPE_TRAITS[self].block_size > 1

    @property
    def is_float(self) -> bool:
        return TYPE_TRAITS[self].is_float

    @property
    def is_int(self) -> bool:
        return TYPE_TRAITS[self].integer

    @classmethod
    def parse(cls, name: "str | int | GGMLType") -> "GGMLType":
        """Accept `q8_0`, `Q8_0`, `f16`, an enum member or a ggml id."""
        if isinstance(name, GGMLType):
            return name
        if isinstance(name, int):
            try:
                return cls(name)
            except ValueError:
                raise ValueError(f"unsupported ggml type id {name}; ggraph knows "
                                 f"{', '.join(t.name for t in cls)}") from None
        key = str(name).strip().upper()
        try:
            return cls[key]
        except KeyError:
            raise ValueError(f"unknown type {name!r}; expected one of "
                             f"{', '.join(str(t) for t in cls)}") from None

    def __str__(self) -> str:
        """ggml's name (ggml_type_name): lower case (f16, q8_0, iq4_nl) except the K of the
        K-quants (q4_K, q8_K)."""
        low = self.name.lower()
        return low[:-1] + "K" if low.endswith("_k") else low


# TYPE_TRAITS is the records' registry under its older name (the same dict), TypeTraits the
# record class.
TypeTraits = TypeRecord
TYPE_TRAITS: dict[GGMLType, TypeRecord] = TYPE_RECORDS


def row_size(t: GGMLType, n: int) -> int:
    """Bytes of a contiguous row of `n` elements; n must be a multiple of the block size."""
    bs = t.block_size
    if n % bs:
        raise ValueError(f"a row of {n} elements of type {t} is not a multiple of its block "
                         f"size {bs}")
    return t.type_size * n // bs

