"""A GGUF file as editable parts (metadata entries, tensor records, the data section) and
their bytes, for fuzzers and tests that need files no converter would write.

Owns writing GGUF bytes without judging them: a metadata value of any GGUF type (an integer
key as a string, a per-layer array, a NaN), a key twice, tensor records whose shapes, types or
offsets disagree with their data, misaligned or overlapping offsets. The `gguf` package's
writer refuses most of these; the reader (graphs/gguf/gguf_reader.py) must not.

    parts = GGUFParts.read("model.gguf")
    parts.set("llama.block_count", 0, ValueType.INT32)
    open("bad.gguf", "wb").write(parts.to_bytes())
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from ggraph.graphs.gguf.gguf_reader import ValueType, read_header, type_sizes

_FMT = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H",
        ValueType.INT16: "<h", ValueType.UINT32: "<I", ValueType.INT32: "<i",
        ValueType.FLOAT32: "<f", ValueType.BOOL: "<B", ValueType.UINT64: "<Q",
        ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}


@dataclass
class KV:
    """One metadata entry: its value, GGUF type and, for arrays, the element type."""
    key: str
    value: Any
    type: ValueType
    element: ValueType | None = None


@dataclass
class TensorRecord:
    """One tensor record: offset is relative to the data section (as in the file)."""
    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes its shape and type take (0 for an unknown type)."""
        sizes = type_sizes(self.type_id)
        if sizes is None:
            return 0
        n = 1
        for x in self.ne:
            n *= x
        return n // sizes[0] * sizes[1]


@dataclass
class GGUFParts:
    kvs: list[KV]
    tensors: list[TensorRecord]
    data: bytes                     # the data section, from its first byte
    alignment: int = 32
    version: int = 3
    arch: str = field(default="")

    @classmethod
    def read(cls, path: str | os.PathLike) -> "GGUFParts":
        """The parts of a valid GGUF file (read through the checked reader)."""
        hdr = read_header(path)
        kvs = [KV(k, v, hdr.kv_types[k].type, hdr.kv_types[k].element)
               for k, v in hdr.metadata.items()]
        tensors = [TensorRecord(t.name, tuple(t.ne), t.type_id, t.offset) for t in hdr.tensors]
        data = bytes(hdr.mm[hdr.data_offset:])
        arch = hdr.metadata.get("general.architecture", "")
        return cls(kvs, tensors, data, hdr.alignment, hdr.version, arch)

    def copy(self) -> "GGUFParts":
        return GGUFParts([replace(kv) for kv in self.kvs], [replace(t) for t in self.tensors],
                         self.data, self.alignment, self.version, self.arch)

    # -- metadata -----------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def set(self, key: str, value: Any, vtype: ValueType,
            element: ValueType | None = None) -> None:
        """Replace the entry `key` in place (or append it)."""
        kv = self.get(key)
        if kv is None:
            self.kvs.append(KV(key, value, vtype, element))
        else:
            kv.value, kv.type, kv.element = value, vtype, element

    def drop(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv.key != key]

    # -- tensors ------------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorRecord | None:
        return next((t for t in self.tensors if t.name == name), None)

    def tensor_bytes(self, t: TensorRecord) -> bytes:
        return self.data[t.offset:t.offset + t.nbytes]

    def relayout(self, contents: dict[str, bytes] | None = None) -> None:
        """Pack every tensor anew at aligned offsets, each with its own bytes cut or padded
        (with zeros) to what its shape and type now take, padded by at most 16 MiB (a shape
        of 2^31 rows is left claiming more than the file holds); `contents` gives new bytes
        by name."""
        contents = contents or {}
        out = bytearray()
        records = []
        for t in self.tensors:
            raw = contents.get(t.name)
            if raw is None:
                raw = self.tensor_bytes(t)
            n = t.nbytes
            raw = raw[:n] + bytes(min(max(0, n - len(raw)), 1 << 24))
            out += bytes((-len(out)) % self.alignment)
            records.append(replace(t, offset=len(out)))
            out += raw
        self.tensors, self.data = records, bytes(out)

    # -- bytes --------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The file: header, metadata, tensor records, padding to the alignment, data."""
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs))
        for kv in self.kvs:
            out += _string(kv.key) + struct.pack("<I", int(kv.type))
            out += _value(kv.type, kv.value, kv.element)
        for t in self.tensors:
            out += _string(t.name) + struct.pack("<I", len(t.ne))
            out += b"".join(struct.pack("<q", x) for x in t.ne)
            out += struct.pack("<IQ", t.type_id & 0xFFFFFFFF, t.offset & (2**64 - 1))
        align = self.alignment if self.alignment > 0 else 32
        out += bytes((-len(out)) % align)
        return bytes(out) + self.data


def _string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(b)) + b


def _value(vtype: ValueType, value: Any, element: ValueType | None) -> bytes:
    if vtype == ValueType.ARRAY:
        assert element is not None
        items = list(value)
        return struct.pack("<IQ", int(element), len(items)) + \
            b"".join(_value(element, x, None) for x in items)
    if vtype == ValueType.STRING:
        return _string(value)
    fmt = _FMT[vtype]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, float(value))
    bits = struct.calcsize(fmt) * 8
    v = int(value) & ((1 << bits) - 1)   # any integer, as its two's complement bits
    return v.to_bytes(bits // 8, "little")
