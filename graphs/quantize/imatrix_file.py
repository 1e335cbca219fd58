"""Importance-matrix files: llama-imatrix's GGUF format and its legacy `.dat` format, read and
written.

Owns `ImatrixStats` (per weight: the sums of squared activations per input column, one row of
ne[0] per expert, and the count of activation rows behind each) and the two formats:

- GGUF (tools/imatrix/imatrix.cpp save_imatrix): general.type = "imatrix", imatrix.datasets
  (strings), imatrix.chunk_count and imatrix.chunk_size (u32); per weight, in name order,
  `<name>.in_sum2` F32 [ne0, n_mat] and `<name>.counts` F32 [1, n_mat].
- legacy .dat (save_imatrix_legacy): i32 entry count; per entry i32 name length, the name, i32
  ncall, i32 value count, the values as f32 (sum / count * ncall); then, optionally, i32 chunk
  count, i32 length and the dataset's name.

`load_imatrix_for_quantize` turns either into what llama-quantize hands ggml's quantizers (sums
divided by counts: common/imatrix-loader.cpp and tools/quantize/quantize.cpp load_imatrix).
Every length in a file is checked against what the file holds before it is read.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ggraph.graphs.gguf.gguf_reader import GGUF_MAGIC, ValueType, read_header
from ggraph.graphs.gguf.gguf_writer import GGUFWriter

from .quantize import Imatrix

SUM2, COUNTS = ".in_sum2", ".counts"
_F32 = 0


@dataclass
class ImatrixEntry:
    sums: np.ndarray          # float32 (n_mat * ne0,)
    counts: np.ndarray        # int64 (n_mat,) — legacy files: one value, the ncall

    @property
    def n_mat(self) -> int:
        return len(self.counts)


@dataclass
class ImatrixStats:
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False
    has_metadata: bool = False


class ImatrixError(ValueError):
    pass


def read_imatrix(path: str | os.PathLike) -> ImatrixStats:
    """Either format, told apart by the GGUF magic."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ImatrixError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return _read_gguf(path)
    return _read_legacy(path)


def _read_gguf(path: str) -> ImatrixStats:
    hdr = read_header(path)
    md = hdr.metadata
    if not hdr.tensors:
        raise ImatrixError(f"{path}: no data (no tensors)")
    out = ImatrixStats()
    ds = md.get("imatrix.datasets")
    kt = hdr.kv_types.get("imatrix.datasets")
    if kt is not None and kt.type == ValueType.ARRAY and kt.element == ValueType.STRING:
        out.datasets = list(ds)
    out.has_metadata = all(k in md for k in ("imatrix.datasets", "imatrix.chunk_count",
                                             "imatrix.chunk_size"))
    out.chunk_count = int(md.get("imatrix.chunk_count", 0))
    out.chunk_size = int(md.get("imatrix.chunk_size", 0))
    data = np.frombuffer(hdr.mm, np.uint8)
    pairs: dict[str, list] = {}
    for t in hdr.tensors:
        for suffix, slot in ((SUM2, 0), (COUNTS, 1)):
            if t.name.endswith(suffix) and len(t.name) > len(suffix):
                pairs.setdefault(t.name[:-len(suffix)], [None, None])[slot] = t
    for name in sorted(pairs):
        s, c = pairs[name]
        if s is None or c is None:
            raise ImatrixError(f"{path}: {name!r} has {'no' if s is None else 'its'} sums and "
                               f"{'no' if c is None else 'its'} counts: both are needed")
        for t in (s, c):
            if t.type_id != _F32:
                raise ImatrixError(f"{path}: tensor {t.name!r} must be F32")
        at = hdr.data_offset
        sums = data[at + s.offset:at + s.offset + s.nbytes].view(np.float32).copy()
        cnt = data[at + c.offset:at + c.offset + c.nbytes].view(np.float32)
        if cnt.size == 0 or sums.size % cnt.size:
            raise ImatrixError(f"{path}: {name!r}: {sums.size} sums do not split into "
                               f"{cnt.size} matrices")
        # common_imatrix_load: std::lround of each stored count
        counts = np.where(np.isfinite(cnt), np.floor(np.abs(cnt) + 0.5) * np.sign(cnt), 0)
        out.entries[name] = ImatrixEntry(sums, counts.astype(np.int64))
    return out


def _read_legacy(path: str) -> ImatrixStats:
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(buf):
            raise ImatrixError(f"{path}: {what} at byte {pos} needs {n} bytes; the file ends "
                               f"at {len(buf)} (neither a GGUF nor a legacy imatrix file?)")
        b = buf[pos:pos + n]
        pos += n
        return b

    def i32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    n = i32("the entry count")
    if n < 1 or n > len(buf) // 16:
        raise ImatrixError(f"{path}: {n} entries is not a legacy imatrix file's count")
    out = ImatrixStats(is_legacy=True)
    for i in range(n):
        ln = i32(f"entry {i}'s name length")
        name = take(ln, f"entry {i}'s name").split(b"\0")[0].decode("utf-8", "replace")
        ncall = i32(f"entry {name!r}'s call count")
        nval = i32(f"entry {name!r}'s value count")
        if nval < 1:
            raise ImatrixError(f"{path}: entry {name!r} has {nval} values")
        vals = np.frombuffer(take(4 * nval, f"entry {name!r}'s values"), "<f4").copy()
        out.entries[name] = ImatrixEntry(vals, np.array([ncall], np.int64))
    if pos < len(buf):
        if pos + 4 <= len(buf):
            out.chunk_count = i32("the chunk count")
            if pos + 4 <= len(buf):
                ln = i32("the dataset name's length")
                if 0 < ln <= len(buf) - pos:
                    out.datasets.append(take(ln, "the dataset name").split(b"\0")[0]
                                        .decode("utf-8", "replace"))
    return out


def write_imatrix_gguf(path: str | os.PathLike, st: ImatrixStats) -> str:
    """llama-imatrix's GGUF file (save_imatrix)."""
    w = GGUFWriter(path)
    w.add_str("general.type", "imatrix")
    w.add_array("imatrix.datasets", list(st.datasets), ValueType.STRING)
    w.add_u32("imatrix.chunk_count", st.chunk_count)
    w.add_u32("imatrix.chunk_size", st.chunk_size)
    for name in sorted(st.entries, key=str.encode):
        e = st.entries[name]
        nmat = e.n_mat
        if nmat == 0 or e.sums.size == 0:
            continue
        ne0 = e.sums.size // nmat
        # gguf writes ggml_n_dims: trailing dimensions of 1 dropped
        w.add_tensor(name + SUM2, (ne0, nmat) if nmat > 1 else (ne0,), _F32,
                     e.sums.astype(np.float32))
        w.add_tensor(name + COUNTS, (1, nmat) if nmat > 1 else (1,), _F32,
                     e.counts.astype(np.float32))
    return w.write()


def write_imatrix_dat(path: str | os.PathLike, st: ImatrixStats, dataset: str) -> str:
    """llama-imatrix's legacy file (save_imatrix_legacy): entries without data are left out."""
    path = os.fspath(path)
    chunk = max(1, st.chunk_size)
    keep = sorted((n for n, e in st.entries.items() if e.n_mat and (e.counts != 0).any()),
                  key=str.encode)
    out = bytearray(struct.pack("<i", len(keep)))
    for name in keep:
        e = st.entries[name]
        raw = name.encode()
        ncall = int((int(e.counts.max()) + chunk - 1) // chunk)
        nval = e.sums.size
        per = nval // e.n_mat
        count = np.repeat(e.counts.astype(np.float32), per)
        value = e.sums.astype(np.float32)
        zero = count == 0
        value = np.where(zero, np.float32(1), value)
        count = np.where(zero, np.float32(1), count)
        vals = (value / count) * np.float32(ncall)
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, nval)
        out += vals.astype("<f4").tobytes()
    ds = dataset.encode()
    out += struct.pack("<ii", st.chunk_count, len(ds)) + ds
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "wb") as f:
        f.write(out)
    os.replace(tmp, path)
    return path


def load_imatrix_for_quantize(path: str | os.PathLike, include: list[str] | None = None,
                              exclude: list[str] | None = None) -> Imatrix:
    """What llama-quantize passes to the quantizers: per weight, the sums divided by their
    counts (an expert never reached: weights of 1); legacy files: divided by ncall."""
    st = read_imatrix(path)
    if not st.is_legacy and not st.has_metadata:
        raise ImatrixError(f"{os.fspath(path)}: missing imatrix metadata (imatrix.datasets, "
                           f"imatrix.chunk_count, imatrix.chunk_size)")
    values: dict[str, np.ndarray] = {}
    for name, e in st.entries.items():
        if st.is_legacy:
            ncall = int(e.counts[0]) if e.counts.size else 0
            values[name] = e.sums / np.float32(ncall) if ncall > 0 else e.sums.copy()
            continue
        per = e.sums.size // e.n_mat
        v = np.empty_like(e.sums)
        for j in range(e.n_mat):
            count = np.float32(e.counts[j])
            part = e.sums[j * per:(j + 1) * per]
            v[j * per:(j + 1) * per] = part / count if count > 0 else np.float32(1)
        values[name] = v
    for name in exclude or ():
        values = {k: v for k, v in values.items() if name not in k}
    if include:
        values = {k: v for k, v in values.items() if any(n in k for n in include)}
    return Imatrix(values, os.fspath(path), list(st.datasets), st.chunk_count)
