"""Tensor element types: the GGMLType enum with ggml's numeric ids, block and type sizes, and
the byte unit (MIB) that sizes are reported in.

Only the types ggraph can compute with are listed; their ids match ggml's `enum ggml_type`
so that GGUF files map onto them directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

MIB = 1 << 20   # bytes in a MiB: llama.cpp reports buffer sizes in MiB, and so does ggraph


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    I32 = 26
    I64 = 27
    BF16 = 30

    @property
    def traits(self) -> "TypeTraits":
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
        return self in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)

    @property
    def is_int(self) -> bool:
        return self in (GGMLType.I32, GGMLType.I64)

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
                             f"{', '.join(t.name.lower() for t in cls)}") from None

    def __str__(self) -> str:  # ggml prints types in lower case: f16, q8_0
        return self.name.lower()


@dataclass(frozen=True)
class TypeTraits:
    block_size: int  # elements per block along ne[0]
    type_size: int   # bytes per block
    numpy_dtype: str | None  # element dtype for block-size-1 types; None for blocks


TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    GGMLType.F32: TypeTraits(1, 4, "float32"),
    GGMLType.F16: TypeTraits(1, 2, "float16"),
    GGMLType.BF16: TypeTraits(1, 2, "uint16"),  # raw bits; quants.py converts
    GGMLType.Q4_0: TypeTraits(32, 18, None),
    GGMLType.Q4_1: TypeTraits(32, 20, None),
    GGMLType.Q8_0: TypeTraits(32, 34, None),
    GGMLType.I32: TypeTraits(1, 4, "int32"),
    GGMLType.I64: TypeTraits(1, 8, "int64"),
}


def row_size(t: GGMLType, n: int) -> int:
    """Bytes of a contiguous row of `n` elements; n must be a multiple of the block size."""
    bs = t.block_size
    if n % bs:
        raise ValueError(f"a row of {n} elements of type {t} is not a multiple of its block "
                         f"size {bs}")
    return t.type_size * n // bs
