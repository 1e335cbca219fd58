"""Tensor element types: the GGMLType enum with ggml's numeric ids, block and type sizes, and
the byte unit (MIB) that sizes are reported in.

Only the types ggraph can compute with are listed; their ids match ggml's `enum ggml_type`
so that GGUF files map onto them directly. Each has a record (ggraph/type_records.py)
registered in ggraph/quants.py (K-quants and IQ4 in ggraph/quants_k.py): sizes and every
other fact are read from it.
"""
from __future__ import annotations

from enum import IntEnum

from .type_records import TYPE_RECORDS, TypeRecord

MIB = 1 << 20   # bytes in a MiB: llama.cpp reports buffer sizes in MiB, and so does ggraph


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


# A type's facts (block layout, numpy codec, compiled codec names, roles) are its record in
# ggraph/type_records.py, registered next to its numpy code in ggraph/quants.py; TYPE_TRAITS
# is that registry (the same dict), TypeTraits its record class.
TypeTraits = TypeRecord
TYPE_TRAITS: dict[GGMLType, TypeRecord] = TYPE_RECORDS


def row_size(t: GGMLType, n: int) -> int:
    """Bytes of a contiguous row of `n` elements; n must be a multiple of the block size."""
    bs = t.block_size
    if n % bs:
        raise ValueError(f"a row of {n} elements of type {t} is not a multiple of its block "
                         f"size {bs}")
    return t.type_size * n // bs


from . import quants as _quants  # noqa: E402,F401  (registers every type's record)
