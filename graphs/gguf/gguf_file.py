"""Loading GGUF files: metadata, and weights as leaf tensors over a read-only mmap.

Nothing is copied: each weight's `data` is a uint8 view of the file mapping, so the CPU backend
computes straight from the page cache. Every failure (a missing or truncated file, a corrupted
header, a tensor of a type ggraph cannot compute with, data past the end of the file) is a
GGUFError naming the file and, where known, the tensor and the byte offset.

A mapping dies with SIGBUS when the file shrinks under it: `GGUFModel.check_unchanged` (one
fstat of the file kept open, called before every evaluation) refuses to go on once the file's
size or modification time changed. `mmap=False` (llama.cpp's --no-mmap) reads the file into
memory instead, so nothing done to the file afterwards can reach the weights; `lock_memory`
(--mlock) keeps the weights in RAM.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.gguf.gguf_reader import GGUFError, KVType, read_header, type_name

__all__ = ["GGUFError", "GGUFModel", "load_gguf", "touch_pages"]


@dataclass
class GGUFModel:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    ctx: Context
    file_size: int
    data_offset: int
    tensor_bytes: int = 0
    # the GGUF type of each metadata value (hyperparameters are checked against it)
    kv_types: dict[str, KVType] = field(default_factory=dict, repr=False)
    # bytes of each tensor in its real format, where the Tensor's type is a stand-in (presets
    # and headers plan with placeholder types); absent names: Tensor.nbytes
    sizes: dict[str, int] = field(default_factory=dict, repr=False)
    # names of the tensors an architecture asked for (check_all_used compares with the file)
    used: set[str] = field(default_factory=set, repr=False)
    # a descriptor of the file whose mapping the weights view, and its (size, mtime) when
    # loaded: None when the weights were read into memory or not loaded at all
    mapped: int | None = field(default=None, repr=False)
    identity: tuple[int, int] = (0, 0)
    buffer: Any = field(default=None, repr=False)   # the weights' bytes (mapping or memory)
    mm: Any = field(default=None, repr=False)       # the mapping itself (mmap.mmap), if mapped

    def check_unchanged(self) -> None:
        """GGUFError when the mapped file's size or modification time changed since it was
        loaded: reading a weight past a truncated file's end kills the process (SIGBUS)."""
        if self.mapped is None:
            return
        st = os.fstat(self.mapped)
        if (st.st_size, st.st_mtime_ns) != self.identity:
            raise GGUFError(f"{self.path}: the model file changed after it was loaded (size "
                            f"{self.identity[0]} -> {st.st_size} bytes, modified at "
                            f"{st.st_mtime_ns} ns); its weights are mapped from it: load it "
                            f"again, or read it into memory (--no-mmap)")

    def read_rows(self, t: Tensor, row0: int, out: np.ndarray) -> None:
        """Rows row0 .. row0 + len(out) - 1 of weight t's stored bytes into out (rows x row
        bytes): read from the file where the weights are mapped (no page of the mapping is
        touched, so none is faulted in or kept resident), else copied from memory."""
        n = out.shape[0]
        row = t.nbytes // t.ne[1] if len(t.ne) > 1 and t.ne[1] else t.nbytes
        if self.mapped is None or t.data is None:
            out[...] = np.asarray(t.data).reshape(-1, row)[row0:row0 + n]
            return
        start = self._file_offset(t) + row0 * row
        got = os.preadv(self.mapped, [memoryview(out).cast("B")], start)
        if got != n * row:
            raise GGUFError(f"{self.path}: tensor {t.name!r}: read {got} of {n * row} bytes at "
                            f"offset {start}: the file changed after it was loaded")

    def release(self, t: Tensor) -> None:
        """Drop weight t's pages from this process's mapping (its bytes stay in the page cache
        and come back on the next read): for weights a backend keeps its own copy of. Does
        nothing where the weights were read into memory."""
        if self.mapped is None or t.data is None or self.mm is None:
            return
        page = mmap.PAGESIZE
        start = self._file_offset(t)
        lo, hi = -(-start // page) * page, (start + t.nbytes) // page * page
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _file_offset(self, t: Tensor) -> int:
        """Where t's bytes start in the file (its data is a view of the whole buffer)."""
        base = np.asarray(self.buffer)
        return int(np.asarray(t.data).ctypes.data - base.ctypes.data)

    def tensor_size(self, name: str) -> int:
        n = self.sizes.get(name)
        return n if n is not None else self.tensors[name].nbytes

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture key")
        return arch

    def tensor(self, name: str) -> Tensor:
        t = self.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing "
                            f"(the file has {len(self.tensors)} tensors)")
        return t

    def get(self, name: str) -> Tensor | None:
        """The tensor `name` (None when absent), counted as used by the model."""
        t = self.tensors.get(name)
        if t is not None:
            self.used.add(name)
        return t

    def find(self, name: str, ne: tuple[int, ...], optional: bool) -> Tensor | None:
        """The tensor an architecture asks for by name and expected shape (tensor_names'
        expect_tensor checks the shape); a file answers with its own tensor or None. Models
        without a file (graphs/deploy/presets.py) answer with a placeholder of that shape."""
        return self.get(name)

    def check_all_used(self) -> None:
        """llama.cpp refuses a file with tensors its architecture does not use ("wrong number
        of tensors"): a block_count lower than the layers in the file would silently drop
        layers."""
        extra = [n for n in self.tensors if n not in self.used]
        if extra:
            raise GGUFError(f"{self.path}: wrong number of tensors; expected {len(self.used)}, "
                            f"got {len(self.tensors)}: {len(extra)} not used by "
                            f"{self.arch} with these hyperparameters, the first "
                            f"{extra[0]!r}")


def load_gguf(path: str | os.PathLike, *, with_data: bool = True,
              progress: bool = False, mmap: bool = True) -> GGUFModel:
    """Read a GGUF file's metadata and tensor table (bounded and checked: gguf_reader);
    weights map the file read-only, or with mmap=False are read into memory (the memory
    available is checked first).

    with_data=False reads only the header (planning without weights: no tensor data)."""
    path = os.fspath(path)
    hdr = read_header(path)
    data = None
    if with_data:
        data = np.frombuffer(hdr.mm, dtype=np.uint8) if mmap else _read_all(path, hdr.file_size)
    ctx = Context(os.path.basename(path))
    tensors: dict[str, Tensor] = {}
    total = 0
    items: Any = hdr.tensors
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"loading {os.path.basename(path)}", unit="tensor",
                     leave=False)
    for info in items:
        try:
            ty = GGMLType(info.type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {info.name!r} has type {type_name(info.type_id)}, "
                            f"which ggraph cannot compute with (supported: "
                            f"{', '.join(str(t) for t in GGMLType)})") from None
        t = Tensor(ctx, ty, info.ne, name=info.name)
        t.buffer = "model"
        if data is not None:
            start = hdr.data_offset + info.offset
            t.data = data[start:start + info.nbytes]
        tensors[info.name] = t
        total += info.nbytes
    model = GGUFModel(path, hdr.metadata, tensors, ctx, hdr.file_size, hdr.data_offset, total,
                      kv_types=hdr.kv_types, buffer=data,
                      mm=hdr.mm if with_data and mmap else None)
    if with_data and mmap:
        fd = os.open(path, os.O_RDONLY)   # kept open: check_unchanged fstat()s it
        weakref.finalize(model, os.close, fd)
        st = os.fstat(fd)
        model.mapped, model.identity = fd, (st.st_size, st.st_mtime_ns)
        if st.st_size != hdr.file_size:
            raise GGUFError(f"{path}: the file changed while it was read ({hdr.file_size} -> "
                            f"{st.st_size} bytes)")
    return model


def _read_all(path: str, size: int) -> np.ndarray:
    """The whole file in memory (llama.cpp's --no-mmap), its size checked against the memory
    available before the buffer is allocated."""
    from ggraph.plan.host_memory import check_buffers

    check_buffers([("model (--no-mmap)", size)])
    buf = np.empty(size, dtype=np.uint8)
    with open(path, "rb") as f:
        got = f.readinto(memoryview(buf))
    if got != size:
        raise GGUFError(f"{path}: read {got} of {size} bytes: the file changed while it was "
                        f"read")
    buf.flags.writeable = False  # as read-only as the mapping: a Session copies before writing
    return buf


def lock_memory(model: GGUFModel) -> str | None:
    """mlock the weights' bytes (llama.cpp's --mlock): they stay in RAM, never swapped out or
    dropped from the page cache. None when locked, else llama.cpp's warning (the lock is an
    optimization: a refusal, e.g. under RLIMIT_MEMLOCK, does not stop the run)."""
    buf = model.buffer
    if buf is None or buf.nbytes == 0:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mlock(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(buf.nbytes)) == 0:
        return None
    err = ctypes.get_errno()
    return (f"warning: failed to mlock {buf.nbytes}-byte buffer: {os.strerror(err)}; try "
            f"increasing RLIMIT_MEMLOCK ('ulimit -l' as root)")


def touch_pages(model: GGUFModel, progress: bool = True) -> None:
    """Read every weight page once (with a progress bar) so the first inference does not stall
    on page faults."""
    items = list(model.tensors.values())
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=model.tensor_bytes, unit="B", unit_scale=True,
                   desc=f"mapping {os.path.basename(model.path)}", leave=False)
    for t in items:
        if t.data is not None:
            np.add.reduce(t.data[::4096], dtype=np.uint64)
        if progress:
            bar.update(t.nbytes)
    if progress:
        bar.close()
