"""What every backend shares: arenas, the kernel table, `supports(node)`, and running a graph
node by node inside an allocator plan.

A backend only hands out memory (aligned arenas) and kernels; where each tensor lives is the
allocator's plan. Pre-allocated tensors live elsewhere: leafs with host data are used in place
(a weight in a read-only mmap stays there), leafs with a `buffer` name but no data (a KV cache)
get zeroed static memory that a Session keeps between runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ggraph import buffers
from ggraph.graph import Graph
from ggraph.opkind import OpKind
from ggraph.tensor import Tensor

KernelFn = Callable[[Tensor, "Session"], None]


@dataclass(frozen=True)
class Kernel:
    fn: KernelFn
    accepts: Callable[[Tensor], bool] = lambda node: True
    why_not: str = ""  # shown by the coverage table when `accepts` refuses
    # bind=True: fn(node, session) runs nothing and returns a zero-argument callable with the
    # node's arrays bound (None for views); a graph that runs again reuses those calls
    bind: bool = False


class UnsupportedOpError(ValueError):
    pass


def aligned_empty(nbytes: int, alignment: int) -> np.ndarray:
    """A uint8 array of nbytes whose first byte is aligned (numpy only promises 16)."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


class Backend:
    """A device: a name, an alignment, and a kernel table keyed by OpKind."""

    name = "base"
    alignment = 32
    kernels: dict[OpKind, Kernel] = {}

    def supports(self, node: Tensor) -> bool:
        if node.op is None:
            return True
        k = self.kernels.get(node.op)
        return k is not None and k.accepts(node)

    def alloc_arena(self, nbytes: int) -> Any:
        return aligned_empty(max(nbytes, 1), self.alignment)

    def view(self, buf: Any, offset: int, t: Tensor) -> Any:
        """The kernel's view of `t` at `offset` in `buf` (F16 as uint16 bits)."""
        return buffers.raw_view(buf, offset, t, half_bits=True)

    def run_context(self) -> Any:
        """Entered around each graph run (the CPU backend quiets BLAS threads there)."""
        return contextlib.nullcontext()

    def session(self, **kw: Any) -> "Session":
        return Session(self, **kw)

    # -- memory hooks: the CPU computes in host numpy arrays; a device backend (CUDA)
    # overrides these to upload leaf data, copy values back and fill device memory --------
    def upload(self, t: Tensor) -> Any:
        """Memory kernels use for leaf `t`'s host data (`t.data`): the array itself here."""
        return t.data

    def fill(self, buf: Any, byte: int) -> None:
        buf[...] = byte

    def to_host(self, buf: Any) -> np.ndarray:
        return np.asarray(buf)

    def read(self, buf: Any, offset: int, t: Tensor) -> np.ndarray:
        return buffers.read(np.asarray(buf), offset, t)

    def write(self, buf: Any, offset: int, t: Tensor, values: np.ndarray) -> None:
        buffers.write(buf, offset, t, values)

    def synchronize(self) -> None:
        """Wait for queued work (nothing to wait for on the CPU)."""

    def read_bytes(self, buf: Any, offset: int, n: int) -> np.ndarray:
        """n raw bytes of `buf` from `offset`, on the host."""
        return np.array(np.asarray(buf)[offset:offset + n])

    def write_bytes(self, buf: Any, offset: int, data: np.ndarray) -> None:
        buf[offset:offset + data.nbytes] = data


class Session:
    """Runs graphs on one backend: holds the compute arena, static (cache) buffers and the
    plan of the last graph. Reuse one Session for graphs of the same topology (decode steps)."""

    def __init__(self, backend: Backend, allocator: Any = None) -> None:
        self.backend = backend
        if allocator is None:
            from ggraph.alloc import GraphAllocator

            allocator = GraphAllocator(alignment=backend.alignment, name=backend.name.upper())
        self.allocator = allocator
        self.arena: Any = None
        self.plan: Any = None
        self.static: dict[int, Any] = {}
        self._graph: Graph | None = None          # the graph whose calls are bound
        self._calls: list[Callable[[], None]] | None = None

    # -- memory ---------------------------------------------------------------------------
    def storage(self, t: Tensor) -> tuple[Any, int]:
        """(buffer, byte offset) holding t: its host data, static memory, or the arena."""
        return self._storage(t)

    def _storage(self, t: Tensor) -> tuple[Any, int]:
        root = t.owner
        if root.data is not None:
            return self.backend.upload(root), t.view_offs
        if root.buffer is not None:
            buf = self.static.get(id(root))
            if buf is None:
                buf = self.static[id(root)] = self._zeros(root.nbytes)
            return buf, t.view_offs
        if self.plan is None:
            raise RuntimeError(f"tensor {t.describe()} has no memory: no plan is active")
        return self.arena, self.plan.offset(root) + t.view_offs

    def _zeros(self, nbytes: int) -> Any:
        buf = self.backend.alloc_arena(nbytes)
        self.backend.fill(buf, 0)
        return buf

    def arr(self, t: Tensor) -> Any:
        buf, off = self._storage(t)
        return self.backend.view(buf, off, t)

    def read(self, t: Tensor) -> np.ndarray:
        """Values of t as numpy (float32 / ints), numpy order."""
        buf, off = self._storage(t)
        return self.backend.read(buf, off, t)

    def write(self, t: Tensor, values: np.ndarray) -> None:
        buf, off = self._storage(t)
        self.backend.write(buf, off, t, values)

    def fill_arena(self, byte: int) -> None:
        """Fill the compute arena (conformance canaries)."""
        self.backend.fill(self.arena, byte)

    def host_arena(self) -> np.ndarray:
        """The compute arena's bytes on the host."""
        return self.backend.to_host(self.arena)

    def synchronize(self) -> None:
        """Wait for queued work."""
        self.backend.synchronize()

    # -- running --------------------------------------------------------------------------
    def prepare(self, graph: Graph) -> Any:
        """Plan `graph` (reserving a larger arena when it outgrows the current one)."""
        for node in graph.nodes:
            if not self.backend.supports(node):
                raise UnsupportedOpError(
                    f"backend {self.backend.name} cannot run {node.op} on {node.describe()} "
                    f"(sources: {', '.join(s.describe() for s in node.src if s is not None)})")
        self._calls = None
        self.plan = self.allocator.alloc(graph, reserve_on_growth=True)
        need = self.plan.size
        if self.arena is None or self.arena.nbytes < need:
            self.arena = self.backend.alloc_arena(need)
        return self.plan

    def run(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None
            ) -> "Session":
        if graph is not self._graph or self._calls is None:
            self.prepare(graph)
            self._calls = self._bind(graph)  # views into the arena: valid until the next plan
            self._graph = graph
        self._feed(graph, inputs or {})
        with self.backend.run_context():
            for call in self._calls:
                call()
        return self

    def _bind(self, graph: Graph) -> list[Callable[[], None]]:
        return self.bind(self.plan_order(graph))

    def bind(self, nodes: list[Tensor]) -> list[Callable[[], None]]:
        """Zero-argument calls running `nodes` (of the prepared graph) in order; views add
        none. The scheduler binds each split of a device's graph separately."""
        kernels = self.backend.kernels
        calls = []
        for node in nodes:
            k = kernels[node.op]
            if k.bind:
                c = k.fn(node, self)
                if c is not None:
                    calls.append(c)
            else:
                calls.append(lambda k=k, node=node: k.fn(node, self))
        return calls

    def plan_order(self, graph: Graph) -> list[Tensor]:
        order = getattr(self.plan, "order", None)
        return list(order) if order is not None else graph.nodes

    def _feed(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray]) -> None:
        buffers.feed_inputs(graph, inputs, self.write)
