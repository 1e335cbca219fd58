"""Compute graphs: ggml's post-order (build_forward_expand), nodes and leafs, fixed capacity.

The order in which tensors are expanded is the execution order: a depth-first post-order over
`src[0], src[1], ...`, skipping tensors already in the graph. Tensors without an op are leafs,
everything else (views included) is a node.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from ggraph.ir.tensor import Tensor

DEFAULT_CAPACITY = 2048  # GGML_DEFAULT_GRAPH_SIZE


class GraphCapacityError(ValueError):
    """Raised when a graph would hold more nodes or leafs than it was created for."""


class GraphCycleError(ValueError):
    """Raised when a tensor is (indirectly) its own source."""


class Graph:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"graph capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._visited: set[Tensor] = set()   # nodes and leafs already in the graph
        self._by_name: dict[str, Tensor] = {}
        self._no_data: tuple[int, tuple[Tensor, ...]] | None = None   # leafs_without_data's

    @classmethod
    def from_lists(cls, nodes: Sequence[Tensor], leafs: Sequence[Tensor]) -> "Graph":
        """A graph over node and leaf lists already in execution order, with just enough
        capacity (the scheduler's device graphs: clones, copies and dependency views)."""
        g = cls(max(len(nodes), len(leafs), 1))
        g.nodes, g.leafs = list(nodes), list(leafs)
        g._visited = set(g.nodes) | set(g.leafs)
        return g

    def __len__(self) -> int:
        return len(self.nodes)

    def leafs_without_data(self) -> tuple[Tensor, ...]:
        """The leafs that had no host data when this was last worked out (again each time a
        leaf is added), in order: the only ones a run can find unfed. Data is set on a leaf,
        never taken away, so a caller asks `data is None` again of these; feeding a decode
        step walked every leaf, weights included (401 for Qwen2.5 1.5B), every token."""
        if self._no_data is None or self._no_data[0] != len(self.leafs):
            self._no_data = (len(self.leafs), tuple(t for t in self.leafs if t.data is None))
        return self._no_data[1]

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_leafs(self) -> int:
        return len(self.leafs)

    def build_forward_expand(self, tensor: Tensor) -> "Graph":
        """Append `tensor` and every source not yet in the graph, sources first."""
        # iterative DFS: model graphs are thousands of nodes deep, past Python's recursion limit
        if not isinstance(tensor, Tensor):
            raise TypeError(f"a graph is built from Tensors (the outputs), got "
                            f"{type(tensor).__name__} {repr(tensor)[:60]}")
        on_stack: set[Tensor] = set()
        stack: list[tuple[Tensor, int]] = [(tensor, 0)]
        if tensor in self._visited:
            return self
        on_stack.add(tensor)
        while stack:
            t, i = stack[-1]
            if i < len(t.src):
                stack[-1] = (t, i + 1)
                s = t.src[i]
                if s is None or s in self._visited:
                    continue
                if s in on_stack:
                    path = " -> ".join(x.label for x, _ in stack) + " -> " + s.label
                    raise GraphCycleError(f"graph has a cycle: {path}")
                on_stack.add(s)
                stack.append((s, 0))
                continue
            stack.pop()
            on_stack.discard(t)
            self._visited.add(t)
            self._add(t)
        return self

    def _add(self, t: Tensor) -> None:
        target, kind = (self.leafs, "leafs") if t.op is None else (self.nodes, "nodes")
        if len(target) >= self.capacity:
            raise GraphCapacityError(
                f"graph capacity of {self.capacity} {kind} exceeded while adding "
                f"{t.describe()} (op {t.op or 'none'}); create the graph with a larger capacity, "
                f"e.g. Graph(capacity={self.capacity * 2})")
        target.append(t)
        if t.name and t.name not in self._by_name:
            self._by_name[t.name] = t

    def get_tensor(self, name: str) -> Tensor:
        """The first node or leaf with this name (names set after expanding are found too)."""
        t = self._by_name.get(name)
        if t is not None and t.name == name:
            return t
        for t in self.nodes + self.leafs:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in this graph of {self.n_nodes} nodes and "
                       f"{self.n_leafs} leafs")

    def __contains__(self, t: Tensor) -> bool:
        return t in self._visited

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.nodes)

    def __repr__(self) -> str:
        return f"Graph(n_nodes={self.n_nodes}, n_leafs={self.n_leafs}, capacity={self.capacity})"


def build_graph(*outputs: Tensor, capacity: int = DEFAULT_CAPACITY) -> Graph:
    """A graph that expands each output in turn."""
    g = Graph(capacity)
    for t in outputs:
        g.build_forward_expand(t)
    return g
