"""A bounded GGUF header reader for untrusted files.

GGUF files come from the internet, so every count, string length and array length in a header
is checked against the bytes left in the file before anything is allocated or looped over:
each element read consumes at least one byte, so reading a header costs O(file size) at most,
whatever the file claims. The tensor table is checked too: known type, at most 4 dimensions,
rows of whole blocks, data aligned to `general.alignment`, inside the data section, and no two
tensors overlapping. Every failure is a GGUFError naming the file, the key or tensor, and the
byte offset where the reader was.

(gguf-py's GGUFReader trusts the counts: a 2^62-element array makes it allocate and loop past
the end of the file, and it computes tensor offsets in wrapping uint64.)
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
MAX_NAME = 64          # GGML_MAX_NAME: tensor names are at most 63 bytes
MAX_DIMS = 4


class GGUFError(ValueError):
    """A GGUF file ggraph will not use: the message names the file and what is wrong."""


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12

    @property
    def is_int(self) -> bool:
        return self in _INT_TYPES

    @property
    def is_float(self) -> bool:
        return self in (ValueType.FLOAT32, ValueType.FLOAT64)

    def __str__(self) -> str:
        return self.name


_INT_TYPES = frozenset({ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16,
                        ValueType.UINT32, ValueType.INT32, ValueType.UINT64, ValueType.INT64})

# numeric scalar types: (little-endian numpy dtype, struct format)
_NUMERIC: dict[ValueType, tuple[str, str]] = {
    ValueType.UINT8: ("<u1", "<B"), ValueType.INT8: ("<i1", "<b"),
    ValueType.UINT16: ("<u2", "<H"), ValueType.INT16: ("<i2", "<h"),
    ValueType.UINT32: ("<u4", "<I"), ValueType.INT32: ("<i4", "<i"),
    ValueType.FLOAT32: ("<f4", "<f"), ValueType.BOOL: ("<u1", "<B"),
    ValueType.UINT64: ("<u8", "<Q"), ValueType.INT64: ("<i8", "<q"),
    ValueType.FLOAT64: ("<f8", "<d"),
}
_U64 = struct.Struct("<Q")   # a string's length


@dataclass(frozen=True)
class KVType:
    """The GGUF type of a metadata value: a scalar type, or ARRAY with its element type."""
    type: ValueType
    element: ValueType | None = None

    def __str__(self) -> str:
        return f"ARRAY of {self.element}" if self.type == ValueType.ARRAY else str(self.type)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    type_id: int          # ggml_type id; its sizes come from gguf.constants
    offset: int           # relative to the data section
    nbytes: int
    info_pos: int         # file offset of this tensor's record (for messages)


@dataclass
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    kv_types: dict[str, KVType]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int      # absolute file offset of the data section
    file_size: int
    mm: Any = field(default=None, repr=False)  # the read-only mapping (kept for tensor data)


def type_sizes(type_id: int) -> tuple[int, int] | None:
    """(block size, bytes per block) of a ggml type id, or None for an unknown id."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


def type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"#{type_id}"


@dataclass(frozen=True)
class HeaderField:
    """One fixed-size field the reader read (for fuzzers: where counts, lengths, type ids
    and offsets sit in a file)."""
    pos: int
    size: int
    what: str
    value: Any


class _Cursor:
    """Reads little-endian values from a buffer, refusing to pass its end."""

    def __init__(self, buf: Any, size: int, path: str,
                 trace: list[HeaderField] | None = None) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        self.where = "header"
        self.trace = trace

    def fail(self, problem: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {self.where}: {problem} (at byte "
                         f"{self.pos if at is None else at} of {self.size})")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes but only {self.left()} are left in the "
                            f"file: truncated or corrupted")

    def scalar(self, fmt: str, n: int, what: str) -> Any:
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        if self.trace is not None:
            self.trace.append(HeaderField(self.pos, n, f"{self.where}: {what}", v))
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        at = self.pos
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {e.start} of {n})", at) from None

    def strings(self, n: int) -> list[str] | None:
        """n strings read with the checks `string` makes (lengths within the file, UTF-8)
        but without naming each one: a vocabulary and its merges are 300k strings, and
        their descriptions cost more than the reading. None, the cursor where it was, on
        any problem: the caller reads them again one by one for the error."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        try:
            for _ in range(n):
                if size - pos < 8:
                    return None
                k = length(buf, pos)[0]
                pos += 8
                if k > size - pos:
                    return None
                out.append(str(buf[pos:pos + k], "utf-8"))
                pos += k
        except UnicodeDecodeError:
            return None
        self.pos = pos
        return out

    def value(self, vt: ValueType, what: str) -> Any:
        if vt == ValueType.STRING:
            return self.string(what)
        dt, fmt = _NUMERIC[vt]
        v = self.scalar(fmt, np.dtype(dt).itemsize, what)
        if vt == ValueType.BOOL:
            if v > 1:
                raise self.fail(f"{what} is a BOOL with value {v} (not 0 or 1)", self.pos - 1)
            return bool(v)
        return v

    def array(self, what: str) -> tuple[list[Any], ValueType]:
        raw_et = self.u32(f"the element type of {what}")
        et = self.value_type(raw_et, f"the elements of {what}")
        if et == ValueType.ARRAY:
            raise self.fail(f"{what} is an array of arrays, which GGUF readers refuse",
                            self.pos - 4)
        n = self.u64(f"the length of {what}")
        # bound the count by the bytes left before allocating or looping
        min_size = 8 if et == ValueType.STRING else np.dtype(_NUMERIC[et][0]).itemsize
        if n > self.left() // min_size:
            raise self.fail(f"{what} declares {n} elements of {et}, but the {self.left()} bytes "
                            f"left in the file hold at most {self.left() // min_size}",
                            self.pos - 8)
        if et == ValueType.STRING:
            fast = self.strings(n) if self.trace is None else None
            if fast is not None:
                return fast, et
            # traced, or a problem: element by element, naming the element that fails
            return [self.string(f"{what}[{i}]") for i in range(n)], et
        dt = _NUMERIC[et][0]
        arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
        self.pos += arr.nbytes
        if et == ValueType.BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                raise self.fail(f"{what}[{bad[0]}] is a BOOL with value {arr[bad[0]]}")
            return arr.astype(bool).tolist(), et
        return arr.tolist(), et

    def value_type(self, raw: int, what: str) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has GGUF value type {raw}, which does not exist "
                            f"(0..{len(ValueType) - 1})", self.pos - 4) from None


def read_header(path: str | os.PathLike, trace: list[HeaderField] | None = None
                ) -> GGUFHeader:
    """Parse and check a GGUF header and tensor table; the file stays mapped read-only.
    `trace`, when given, receives every fixed-size field read, in file order."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(mm, size, path, trace)
    magic = bytes(mm[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a readable GGUF file (magic {magic!r}, expected "
                        f"{GGUF_MAGIC!r})")
    c.pos = 4
    version = c.u32("the version")
    if version in (2 << 24, 3 << 24):
        raise GGUFError(f"{path}: a big-endian GGUF file (version {version >> 24}); ggraph "
                        f"reads little-endian files")
    if version not in (2, 3):
        raise GGUFError(f"{path}: not a readable GGUF file: version {version} (ggraph reads "
                        f"versions 2 and 3)")
    n_tensors = c.u64("the tensor count")
    n_kv = c.u64("the metadata count")
    # the smallest key/value takes 13 bytes (empty key, type, one byte); a tensor record 32
    if n_kv > c.left() // 13:
        raise c.fail(f"the header declares {n_kv} metadata entries; the file has room for at "
                     f"most {c.left() // 13}", 16)
    if n_tensors > c.left() // 32:
        raise c.fail(f"the header declares {n_tensors} tensors; the file has room for at most "
                     f"{c.left() // 32}", 8)
    metadata: dict[str, Any] = {}
    kv_types: dict[str, KVType] = {}
    for i in range(n_kv):
        c.where = f"metadata entry {i}"
        key = c.string("its key")
        c.where = f"key {key!r}"
        if key in metadata:
            raise c.fail("the key appears twice")
        vt = c.value_type(c.u32("the value type"), "the value")
        if vt == ValueType.ARRAY:
            metadata[key], et = c.array("the value")
            kv_types[key] = KVType(vt, et)
        else:
            metadata[key] = c.value(vt, "the value")
            kv_types[key] = KVType(vt)
    c.where = "general.alignment"
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and kv_types["general.alignment"].type != \
            ValueType.UINT32:
        raise c.fail(f"must be a UINT32, got {kv_types['general.alignment']}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise c.fail(f"{alignment} is not a power of two")
    infos = [_tensor_info(c, i) for i in range(n_tensors)]
    c.where = "tensor table"
    data_offset = c.pos + (-c.pos) % alignment
    if data_offset > size and infos:
        raise c.fail(f"the data section would start at byte {data_offset}, past the end of "
                     f"the file")
    _check_layout(path, infos, alignment, data_offset, size)
    return GGUFHeader(path, version, metadata, kv_types, infos, alignment, data_offset, size, mm)


def _tensor_info(c: _Cursor, i: int) -> TensorInfo:
    at = c.pos
    c.where = f"tensor {i}"
    name = c.string("its name")
    c.where = f"tensor {i} {name!r}"
    if len(name.encode()) >= MAX_NAME:
        raise c.fail(f"the name is {len(name.encode())} bytes long; ggml allows at most "
                     f"{MAX_NAME - 1}")
    n_dims = c.u32("the dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"{n_dims} dimensions (1 to {MAX_DIMS} allowed)", c.pos - 4)
    ne = tuple(c.scalar("<q", 8, f"ne[{d}]") for d in range(n_dims))
    if any(x < 0 for x in ne):
        raise c.fail(f"ne={list(ne)} has a negative dimension", c.pos - 8 * n_dims)
    type_id = c.u32("the type")
    sizes = type_sizes(type_id)
    if sizes is None:
        raise c.fail(f"type id {type_id} is not a ggml type", c.pos - 4)
    bs, ts = sizes
    if ne[0] % bs:
        raise c.fail(f"ne[0]={ne[0]} is not a multiple of the block size {bs} of "
                     f"{type_name(type_id)}")
    n = 1
    for x in ne:
        n *= x
    nbytes = n // bs * ts  # exact: Python integers do not wrap
    offset = c.u64("the data offset")
    return TensorInfo(name, ne, type_id, offset, nbytes, at)


def _check_layout(path: str, infos: list[TensorInfo], alignment: int, data_offset: int,
                  size: int) -> None:
    """Unique names; data aligned, inside the data section, and not overlapping."""
    section = size - data_offset
    seen: set[str] = set()
    for t in infos:
        what = f"{path}: tensor {t.name!r} ({type_name(t.type_id)}, ne={list(t.ne)})"
        if t.name in seen:
            raise GGUFError(f"{what}: the name appears twice in the tensor table")
        seen.add(t.name)
        if t.offset % alignment:
            raise GGUFError(f"{what}: data offset {t.offset} is not a multiple of "
                            f"general.alignment {alignment}")
        if t.offset + t.nbytes > section:
            raise GGUFError(f"{what} needs bytes {data_offset + t.offset}.."
                            f"{data_offset + t.offset + t.nbytes} but the file ends at {size}: "
                            f"truncated, or the offset is corrupted")
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in infos if t.nbytes)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise GGUFError(f"{path}: tensors {n0!r} (data bytes {s0}..{e0}) and {n1!r} "
                            f"({s1}..{e1}) overlap")
