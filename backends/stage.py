"""One pipeline stage of a model split across processes or hosts: a ggraph backend and its
Session over the device graphs the host sends (backends/tensor_wire.py), its layers' weights
(mapped from its own copy of the GGUF when it has the same file, otherwise received once), its
slice of the KV cache (static buffers kept across graphs), and the splits it runs.

`StageServer` is plain Python: backends/ray_stages.py runs one per Ray actor, and tests run it
in process. Tensors are named by their index in the graph's tensor table; a split's inputs
arrive as arrays (or lists of arrays: another stage's outputs), its outputs leave as arrays.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ggraph.plan.alloc import GraphAllocator
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from .tensor_wire import LeafSpec, StageTensors


@dataclass
class StageGraph:
    """A device graph as the stage holds it."""
    graph: Graph
    table: list[Tensor]
    splits: dict[int, list[int]] = field(default_factory=dict)   # split -> node indices
    calls: dict[int, list[Callable[[], None]]] | None = None


class StageServer:
    def __init__(self, backend: str = "cpu", name: str = "stage", threads: int | None = None,
                 strategy: str = "default") -> None:
        from ggraph.backends import get_backend, registry

        kw = {"n_threads": threads} if registry.kind(backend).threads and threads else {}
        self.name = name
        self.backend = get_backend(backend, **kw)
        self.session = self.backend.session(allocator=GraphAllocator(
            alignment=self.backend.buffers.alignment, strategy=strategy, name=name,
            keep_order=True))
        self.tensors = StageTensors()
        self.model: Any = None
        self.graphs: dict[int, StageGraph] = {}
        self.active: int | None = None

    # -- setup ------------------------------------------------------------------------------
    def has_file(self, path: str, size: int, load: Callable[[str], Any]) -> bool:
        """Whether this stage's machine holds the GGUF at `path` with the host's size: its
        weights are then mapped from it by `load` (the model side's reader, passed down so
        that a backend never imports it: read and checked as the host reads it)."""
        if not (os.path.isfile(path) and os.path.getsize(path) == size):
            return False
        self.model = load(path)
        return True

    def add_tensors(self, specs: Sequence[LeafSpec], *data: Any) -> int:
        """Describe tensors; data[i] are the values of the i-th spec that has values and is
        not mapped from this stage's GGUF (in order)."""
        it = iter(data)
        for spec in specs:
            values = None
            if spec.has_data:
                mapped = self.model.get(spec.gguf_name) if (self.model is not None and
                                                            spec.gguf_name) else None
                values = mapped.data if mapped is not None else next(it)
            self.tensors.add(spec, values)
        return len(self.tensors.by_key)

    def wants_values(self, specs: Sequence[LeafSpec]) -> list[bool]:
        """For each spec, whether the host must send its values (not mappable here)."""
        return [s.has_data and (self.model is None or not s.gguf_name
                                or self.model.get(s.gguf_name) is None) for s in specs]

    def load_graph(self, key: int, blob: bytes) -> int:
        graph, table = self.tensors.loads(blob)
        self.graphs[key] = StageGraph(graph, table)
        while len(self.graphs) > 8:  # the host keeps a few graphs too (prompt, decode)
            self.graphs.pop(next(iter(self.graphs)))
        return len(table)

    def set_split(self, key: int, k: int, nodes: list[int]) -> None:
        g = self.graphs[key]
        g.splits[k] = nodes
        g.calls = None

    def reserve(self, key: int) -> int:
        """Size this stage's compute buffer on the (worst-case) graph; its bytes."""
        self.active = None
        return self.session.reserve(self.graphs[key].graph)[0].size

    # -- running ----------------------------------------------------------------------------
    def _activate(self, key: int) -> StageGraph:
        g = self.graphs[key]
        if self.active != key or g.calls is None:
            self.session.prepare(g.graph)
            g.calls = {k: self.session.bind([g.table[i] for i in nodes])
                       for k, nodes in g.splits.items()}
            for other in self.graphs.values():   # their bound calls hold the old plan
                if other is not g:
                    other.calls = None
            self.active = key
        return g

    def run_split(self, key: int, k: int, inputs: Sequence[tuple[int, int, int]],
                  outputs: Sequence[int], *args: Any) -> tuple[list[np.ndarray], float]:
        """Copy the inputs in (tensor index, argument, item of a list argument or -1), run
        split k, and return the outputs' bytes and the seconds the split's kernels took."""
        g = self._activate(key)
        s = self.session
        for idx, arg, item in inputs:
            data = args[arg] if item < 0 else args[arg][item]
            buf, off = s.storage(g.table[idx])
            self.backend.buffers.write_bytes(buf, off, np.ascontiguousarray(data).reshape(-1).view(
                np.uint8))
        t0 = time.perf_counter()
        with s.running(), self.backend.executor.run_context():
            for call in g.calls[k]:
                call()
        s.synchronize()
        busy = time.perf_counter() - t0
        out = []
        for idx in outputs:
            t = g.table[idx]
            buf, off = s.storage(t)
            out.append(self.backend.buffers.read_bytes(buf, off, t.nbytes))
        return out, busy

    def read(self, key: int, idx: int) -> np.ndarray:
        return self.session.read(self.graphs[key].table[idx])

    def ping(self) -> str:
        return self.name
