"""Graphs across a process boundary: a device graph pickled for a remote stage, with its
preallocated tensors (weights, KV caches, leafs with host data) sent by reference.

The host's `WireRegistry` numbers each preallocated root tensor the first time a pickled graph
reaches it and pickles it as that number (pickle's persistent ids); the tensor's description
(`LeafSpec`: name, type, shape, strides, buffer, and its values or the GGUF tensor it maps) is
sent once. The stage's `StageTensors` makes one tensor per number and resolves every later
graph's references to it, so a stage keeps one KV cache across the graphs of a sequence, and
weights are mapped or received once. Everything else (nodes, views, sources, op parameters)
is plain pickled data: a stage never executes anything the host sends but ggraph's own ops.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ggraph.ir.tensor import Context, Flag, Tensor
from ggraph.ir.types import GGMLType


@dataclass(frozen=True)
class LeafSpec:
    """A preallocated tensor as a stage recreates it."""
    key: int
    name: str
    type: GGMLType
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    flags: int
    buffer: str | None
    gguf_name: str | None      # a model weight the stage may map from its own copy of the file
    has_data: bool             # the host holds values (weights, constants) to send or map


def _preallocated(obj: Any) -> bool:
    return type(obj) is Tensor and obj.view_src is None and (obj.data is not None
                                                             or obj.buffer is not None)


class WireRegistry:
    """Host side: numbers of the preallocated tensors already described to a stage."""

    def __init__(self) -> None:
        self._keys: dict[Tensor, int] = {}

    def dumps(self, obj: Any, weights: set[Tensor] | None = None
              ) -> tuple[bytes, list[tuple[LeafSpec, Tensor]]]:
        """obj pickled, and the (spec, tensor) of each preallocated tensor it reaches for the
        first time; `weights` are the tensors a stage may map from the GGUF by name."""
        new: list[tuple[LeafSpec, Tensor]] = []
        keys = self._keys

        class _Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> int | None:
                if not _preallocated(o):
                    return None
                k = keys.get(o)
                if k is None:
                    k = keys[o] = len(keys)
                    new.append((LeafSpec(k, o.name, o.type, tuple(o.ne), tuple(o.nb),
                                         int(o.flags), o.buffer,
                                         o.name if weights and o in weights else None,
                                         o.data is not None), o))
                return k

        buf = io.BytesIO()
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue(), new


class StageTensors:
    """Stage side: the tensors the host described, by number."""

    def __init__(self) -> None:
        self.ctx = Context("stage")
        self.by_key: dict[int, Tensor] = {}

    def add(self, spec: LeafSpec, data: np.ndarray | None) -> Tensor:
        t = Tensor(self.ctx, spec.type, spec.ne, name=spec.name, nb=spec.nb)
        t.flags = Flag(spec.flags)
        t.buffer = spec.buffer
        if spec.has_data:
            if data is None:
                raise ValueError(f"stage: no values for tensor {spec.name!r}")
            arr = np.asarray(data)
            if arr.nbytes != t.nbytes:
                raise ValueError(f"stage: tensor {spec.name!r} needs {t.nbytes} bytes, got "
                                 f"{arr.nbytes}")
            t.data = arr
        self.by_key[spec.key] = t
        return t

    def loads(self, blob: bytes) -> Any:
        tensors = self.by_key

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Tensor:
                t = tensors.get(pid)
                if t is None:
                    raise pickle.UnpicklingError(f"stage: tensor #{pid} was never described")
                return t

            def find_class(self, module: str, name: str) -> Any:
                # only ggraph's own types, numpy's and the standard library's containers: the
                # host sends data, never code to run
                if module.split(".")[0] in ("ggraph", "numpy", "builtins", "collections",
                                            "enum", "copyreg", "_codecs"):
                    return super().find_class(module, name)
                raise pickle.UnpicklingError(f"stage: refusing to load {module}.{name}")

        return _Unpickler(io.BytesIO(blob)).load()


def tensor_table(nodes: Sequence[Tensor], leafs: Sequence[Tensor]) -> list[Tensor]:
    """Every tensor a device graph reaches (nodes, leafs, their sources and view roots), in a
    fixed order: host and stage name tensors by their index in it."""
    seen: dict[Tensor, None] = {}
    stack = list(reversed([*nodes, *leafs]))
    while stack:
        t = stack.pop()
        if t is None or t in seen:
            continue
        seen[t] = None
        stack.extend(reversed([s for s in (*t.src, t.view_src) if s is not None]))
    return list(seen)
