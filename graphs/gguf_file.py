"""Loading GGUF files: metadata, and weights as leaf tensors over a read-only mmap.

Nothing is copied: each weight's `data` is a uint8 view of the file mapping, so the CPU backend
computes straight from the page cache. Every failure (a missing or truncated file, a corrupted
header, a tensor of a type ggraph cannot compute with, data past the end of the file) is a
GGUFError naming the file and, where known, the tensor and the byte offset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggraph.tensor import Context, Tensor
from ggraph.types import GGMLType


class GGUFError(ValueError):
    pass


@dataclass
class GGUFModel:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    ctx: Context
    file_size: int
    data_offset: int
    tensor_bytes: int = 0
    reader: Any = field(default=None, repr=False)
    # bytes of each tensor in its real format, where the Tensor's type is a stand-in (presets
    # and headers plan with placeholder types); absent names: Tensor.nbytes
    sizes: dict[str, int] = field(default_factory=dict, repr=False)

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
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing "
                            f"(the file has {len(self.tensors)} tensors)")
        return t


def _field_value(f: Any) -> Any:
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - gguf raises many kinds for odd fields
        return None


def load_gguf(path: str | os.PathLike, *, with_data: bool = True,
              progress: bool = False) -> GGUFModel:
    """Read a GGUF file's metadata and tensor table; weights map the file read-only.

    with_data=False reads only the header (planning without weights: no tensor data)."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the reader fails with numpy/struct errors
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                        f"it may be truncated or corrupted") from None
    metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    ctx = Context(os.path.basename(path))
    tensors: dict[str, Tensor] = {}
    total = 0
    items = reader.tensors
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"loading {os.path.basename(path)}", unit="tensor",
                     leave=False)
    for rt in items:
        name = rt.name
        try:
            ty = GGMLType(int(rt.tensor_type))
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has type "
                            f"{getattr(rt.tensor_type, 'name', rt.tensor_type)}, which ggraph "
                            f"cannot compute with (supported: "
                            f"{', '.join(str(t) for t in GGMLType)})") from None
        ne = [int(x) for x in rt.shape]
        t = Tensor(ctx, ty, ne or [1], name=name)
        start = int(rt.data_offset)  # absolute in the file (gguf adds the data section start)
        if start + t.nbytes > size:
            raise GGUFError(f"{path}: tensor {name!r} ({ty}, ne={ne}) needs bytes {start}.."
                            f"{start + t.nbytes} but the file ends at {size}: truncated")
        t.buffer = "model"
        if with_data:
            t.data = reader.data[start:start + t.nbytes]
        tensors[name] = t
        total += t.nbytes
    return GGUFModel(path, metadata, tensors, ctx, size, reader.data_offset, total, reader)


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
