"""Writing GGUF files: the one writer the tiny model writers use, and that quantize, imatrix and
LoRA adapters are to share.

Owns `GGUFWriter`: metadata entries in the order added, the tensor table in the order added,
then each tensor's data in that order, every tensor padded to `general.alignment` — the layout
of llama.cpp's gguf_write_to_file and gguf-py's writer, byte for byte
(tests/graphs/gguf/test_gguf_writer.py compares them). It refuses what the reader
(graphs/gguf/gguf_reader.py) refuses, naming the key or tensor: a key twice, a value its type
cannot hold, an array of arrays or of mixed types, a tensor name of 64 bytes or more or twice,
more than 4 dimensions, rows that are not whole blocks, data whose size is not the shape's.
Tensor data may come at write time, one tensor at a time (`write(source=...)`), so memory stays
near one tensor; the file appears under its name only once it is complete.

    w = GGUFWriter("out.gguf", arch="llama")
    w.add_u32("llama.block_count", 2)
    w.add_tensor("output_norm.weight", (576,), GGMLType.F32, np.ones(576, np.float32))
    w.write()
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .gguf_reader import (GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, MAX_NAME, GGUFError,
                          ValueType, type_name, type_sizes)

_FMT = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H",
        ValueType.INT16: "<h", ValueType.UINT32: "<I", ValueType.INT32: "<i",
        ValueType.FLOAT32: "<f", ValueType.BOOL: "<?", ValueType.UINT64: "<Q",
        ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}
_DT = {ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2",
       ValueType.INT16: "<i2", ValueType.UINT32: "<u4", ValueType.INT32: "<i4",
       ValueType.FLOAT32: "<f4", ValueType.UINT64: "<u8", ValueType.INT64: "<i8",
       ValueType.FLOAT64: "<f8"}
VERSION = 3


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the table: ne in ggml order (ne[0] the row length)."""
    name: str
    ne: tuple[int, ...]
    type_id: int
    nbytes: int


def _pad(n: int, alignment: int) -> int:
    return n + (-n) % alignment


class GGUFWriter:
    def __init__(self, path: str | os.PathLike, arch: str | None = None,
                 alignment: int = GGUF_DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment {alignment} is not a power of two")
        self.path = os.fspath(path)
        self.arch = arch          # the prefix of the model's keys ("llama.block_count")
        self.alignment = alignment
        self._kv: dict[str, bytes] = {}
        self._tensors: dict[str, TensorSpec] = {}
        self._data: dict[str, Any] = {}
        if arch is not None:
            self.add_str("general.architecture", arch)
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.add_u32("general.alignment", alignment)

    # -- metadata ---------------------------------------------------------------------------
    def _fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def _value(self, key: str, v: Any, vt: ValueType) -> bytes:
        if vt == ValueType.STRING:
            if not isinstance(v, str):
                raise self._fail(f"key {key!r}: a STRING must be text, got {type(v).__name__}")
            raw = v.encode("utf-8", "surrogatepass")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise self._fail(f"key {key!r}: the text is not valid UTF-8 (a lone "
                                 f"surrogate)") from None
            return struct.pack("<Q", len(raw)) + raw
        if vt == ValueType.BOOL and not isinstance(v, (bool, np.bool_)):
            raise self._fail(f"key {key!r}: a BOOL must be True or False, got {v!r}")
        if vt != ValueType.BOOL and not vt.is_float and (
                isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer))):
            raise self._fail(f"key {key!r}: a {vt} must be an integer, got {v!r}")
        try:
            return struct.pack(_FMT[vt], v)
        except (struct.error, TypeError, OverflowError):
            raise self._fail(f"key {key!r}: {v!r} does not fit a {vt}") from None

    def add(self, key: str, value: Any, vtype: ValueType,
            element: ValueType | None = None) -> None:
        """A metadata entry of GGUF type `vtype` (ARRAY: of `element`), in the order added."""
        if not isinstance(key, str) or not key:
            raise self._fail(f"a metadata key must be non-empty text, got {key!r}")
        if key in self._kv:
            raise self._fail(f"key {key!r} is added twice")
        vt = ValueType(vtype)
        out = struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vt)
        if vt == ValueType.ARRAY:
            if element is None or ValueType(element) == ValueType.ARRAY:
                raise self._fail(f"key {key!r}: an array needs an element type other than "
                                 f"ARRAY")
            et = ValueType(element)
            values = list(value)
            out += struct.pack("<IQ", et, len(values))
            arr = np.asarray(values) if et in _DT and values else None
            if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iuf":
                out += self._packed(key, arr, et)
            else:   # text, booleans, or anything odd: element by element, naming the one
                out += b"".join(self._value(f"{key}[{i}]", v, et) for i, v in enumerate(values))
        else:
            out += self._value(key, value, vt)
        self._kv[key] = out

    def _packed(self, key: str, arr: np.ndarray, et: ValueType) -> bytes:
        """A numeric array at once (a vocabulary's 150k scores), range-checked."""
        dt = np.dtype(_DT[et])
        if et.is_int:
            if not np.issubdtype(arr.dtype, np.integer):
                raise self._fail(f"key {key!r}: a {et} array must hold integers")
            info = np.iinfo(dt)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise self._fail(f"key {key!r}: values outside {et}'s range")
        return arr.astype(dt).tobytes()

    def add_str(self, key: str, value: str) -> None:
        self.add(key, value, ValueType.STRING)

    def add_u32(self, key: str, value: int) -> None:
        self.add(key, value, ValueType.UINT32)

    def add_i32(self, key: str, value: int) -> None:
        self.add(key, value, ValueType.INT32)

    def add_u64(self, key: str, value: int) -> None:
        self.add(key, value, ValueType.UINT64)

    def add_f32(self, key: str, value: float) -> None:
        self.add(key, value, ValueType.FLOAT32)

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, value, ValueType.BOOL)

    def add_array(self, key: str, values: Sequence[Any], element: ValueType) -> None:
        self.add(key, values, ValueType.ARRAY, element)

    # -- tensors ----------------------------------------------------------------------------
    def add_tensor(self, name: str, ne: Sequence[int], type_id: int,
                   data: np.ndarray | bytes | None = None) -> TensorSpec:
        """A tensor of the table (ne in ggml order), with its data now or at write()."""
        what = f"tensor {name!r}"
        if not isinstance(name, str) or len(name.encode()) >= MAX_NAME:
            raise self._fail(f"{what}: a name must be text of at most {MAX_NAME - 1} bytes")
        if name in self._tensors:
            raise self._fail(f"{what} is added twice")
        ne = tuple(int(x) for x in ne)
        if not 1 <= len(ne) <= MAX_DIMS or any(x < 0 for x in ne):
            raise self._fail(f"{what}: ne={list(ne)} (1 to {MAX_DIMS} dimensions, none "
                             f"negative)")
        sizes = type_sizes(int(type_id))
        if sizes is None:
            raise self._fail(f"{what}: type id {type_id} is not a ggml type")
        bs, ts = sizes
        if ne[0] % bs:
            raise self._fail(f"{what}: ne[0]={ne[0]} is not a multiple of the block size {bs} "
                             f"of {type_name(int(type_id))}")
        n = 1
        for x in ne:
            n *= x
        spec = TensorSpec(name, ne, int(type_id), n // bs * ts)
        self._tensors[name] = spec
        if data is not None:
            self._data[name] = self._bytes(spec, data)
        return spec

    def _bytes(self, spec: TensorSpec, data: np.ndarray | bytes) -> memoryview:
        raw = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray)
                         else data).cast("B")
        if raw.nbytes != spec.nbytes:
            raise self._fail(f"tensor {spec.name!r} ({type_name(spec.type_id)}, "
                             f"ne={list(spec.ne)}) needs {spec.nbytes} bytes of data, got "
                             f"{raw.nbytes}")
        return raw

    @property
    def tensors(self) -> list[TensorSpec]:
        return list(self._tensors.values())

    def header_bytes(self) -> bytes:
        """Everything before the data section, padding included."""
        out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", VERSION, len(self._tensors),
                                                 len(self._kv)))
        for kv in self._kv.values():
            out += kv
        offset = 0
        for t in self._tensors.values():
            raw = t.name.encode()
            out += struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(t.ne))
            out += struct.pack(f"<{len(t.ne)}q", *t.ne)
            out += struct.pack("<IQ", t.type_id, offset)
            offset += _pad(t.nbytes, self.alignment)
        out += bytes(_pad(len(out), self.alignment) - len(out))
        return bytes(out)

    def file_size(self) -> int:
        return len(self.header_bytes()) + sum(_pad(t.nbytes, self.alignment)
                                              for t in self._tensors.values())

    def write(self, source: Callable[[TensorSpec], np.ndarray | bytes] | None = None,
              progress: Callable[[TensorSpec], None] | None = None, data: bool = True) -> str:
        """Write the file; tensors added without data get theirs from `source(spec)`, one at
        a time in table order. Written beside the path (NAME.PID.part) and renamed when
        complete. `data=False`: the header, and the data section a hole of its full size (a
        sparse file of zeros: the layout without the cost)."""
        tmp = f"{self.path}.{os.getpid()}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(self.header_bytes())
                if not data:
                    f.truncate(self.file_size())
                for spec in self._tensors.values() if data else ():
                    raw = self._data.get(spec.name)
                    if raw is None:
                        if source is None:
                            raise self._fail(f"tensor {spec.name!r} has no data and no source "
                                             f"was given")
                        raw = self._bytes(spec, source(spec))
                    f.write(raw)
                    f.write(bytes(_pad(spec.nbytes, self.alignment) - spec.nbytes))
                    if progress is not None:
                        progress(spec)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return self.path

