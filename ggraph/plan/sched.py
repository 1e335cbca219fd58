"""The scheduler's plan: which device runs each node of a graph, where the graph is cut into
splits, what is copied across each cut, and one graph per device for its allocator.

In the spirit of ggml_backend_sched (ggml-backend.c), as a pure planner over metadata:

1. Fixed assignments. A node writing into pre-allocated memory (set_rows into a KV cache)
   runs where that memory lives. A node reading a placed weight runs where the weight lives
   ("weights decide where their ops run"). Graph inputs start on the host.
2. Expansion. Unassigned nodes take the device of their neighbours in execution order:
   device (non-host) assignments spread down then up first, then the host's, so that e.g. the
   rms_norm before a layer's first matmul joins that layer's device rather than the host.
3. Fallback. A node its device cannot run (the device's `supports` says no) moves to the first
   device that can, in priority order (the host last); none is an UnsupportedOpError.
4. Views run where their root lives: they compute nothing and alias its memory.
5. Splits. The node list is cut where the device changes (views never cut it). A split's
   inputs are the sources living on another device; each is copied once per device, at the
   start of the first split that needs it, into a copy tensor in that device's compute buffer
   (kept for the whole graph, as ggml keeps split inputs). On the source device a
   dependency view at that point keeps the original alive until it has been copied.
6. Device graphs. Each device gets a graph of clones of its nodes (sources rewired to local
   clones and copies), in execution order, which its own allocator plans with `keep_order`.

Nothing here touches memory or imports a backend: `backends/multi.py` runs a Schedule, and
`graphs/deploy/placement.py` plans virtual devices with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ggraph.ir.graph import Graph
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Context, Flag, Tensor
from ggraph.ir.types import MIB

Supports = Callable[[Tensor], bool]


class SchedulerError(ValueError):
    """A graph the scheduler cannot place (an op no device runs, a bad placement)."""


@dataclass
class Split:
    """A run of consecutive nodes on one device, with the tensors copied in before it."""
    device: int
    nodes: list[Tensor] = field(default_factory=list)        # originals, execution order
    inputs: list[Tensor] = field(default_factory=list)       # originals copied in first


@dataclass
class Schedule:
    """The plan of one graph over devices; its maps are keyed by the original tensors."""
    graph: Graph
    names: list[str]                       # device names; the host is `host`
    host: int
    node_device: dict[Tensor, int]         # original node -> device
    splits: list[Split]
    copies: dict[tuple[Tensor, int], Tensor]  # (original, device) -> its copy there
    clones: dict[Tensor, Tensor]           # original node -> clone in its device graph
    device_graphs: list[Graph]             # per device (empty graphs for idle devices)
    moved: list[tuple[Tensor, int, int]]   # (node, wanted device, device that runs it)
    device_fn: Callable[[Tensor], int] = field(repr=False)   # original tensor -> its device
    n_copies: int = 1                      # pipeline copies of inputs (memory only)
    pipeline_bytes: list[int] = field(default_factory=list)   # their bytes per device

    def device_of(self, t: Tensor) -> int:
        """The device holding original t's values."""
        return self.device_fn(t)

    def local(self, t: Tensor, device: int) -> Tensor:
        """The tensor standing for original `t` on `device`: its clone, its copy, or itself."""
        c = self.copies.get((t, device))
        if c is not None:
            return c
        return self.clones.get(t, t)

    def copy_bytes(self) -> list[int]:
        """Bytes copied into each device per run of the graph."""
        out = [0] * len(self.names)
        for (_, d), c in self.copies.items():
            out[d] += c.nbytes
        return out

    @property
    def n_splits(self) -> int:
        return len(self.splits)


def _is_pure_view(n: Tensor) -> bool:
    return n.op is not None and n.op.is_view


def schedule_graph(graph: Graph, names: Sequence[str], supports: Sequence[Supports],
                   placement: Mapping[Tensor, int], host: int | None = None,
                   n_copies: int = 1) -> Schedule:
    """Plan `graph` over devices `names` (priority order; the host defaults to the last).

    placement: pre-allocated leaf -> device for weights and caches. Every other leaf (graph
    inputs, scratch leafs, constants with host data) lives on the host.
    n_copies: ggml's pipeline parallelism keeps this many copies of the graph inputs and of
    every split input, so that the next ubatch's inputs can be written while the devices
    still run the current one (llama.cpp uses 4 with several devices and every layer
    offloaded). The extra copies only take memory in the device graphs: runs use copy 0."""
    if n_copies < 1:
        raise SchedulerError(f"n_copies must be >= 1, got {n_copies}")
    n_dev = len(names)
    if n_dev == 0 or len(supports) != n_dev:
        raise SchedulerError(f"{n_dev} device names and {len(supports)} support tables: give "
                             f"one table per device")
    host = n_dev - 1 if host is None else host
    if not 0 <= host < n_dev:
        raise SchedulerError(f"host device {host} is not one of the {n_dev} devices")
    for d in placement.values():
        if not 0 <= d < n_dev:
            raise SchedulerError(f"a tensor is placed on device {d}; there are {n_dev} devices")
    nodes = graph.nodes
    dev: dict[Tensor, int] = {}          # node -> device
    moved: list[tuple[Tensor, int, int]] = []

    def leaf_device(t: Tensor) -> int:
        d = placement.get(t.owner)
        return host if d is None else d

    def tensor_device(t: Tensor) -> int:
        return dev[t] if t.op is not None else leaf_device(t)

    def movable(n: Tensor) -> bool:
        # a node that owns its memory, or a view of a graph input / scratch leaf (which can
        # run next to its consumers, reading a copy of the leaf there, as ggml copies inputs)
        o = n.owner
        return o is n or (_is_pure_view(n) and o.op is None and o.data is None
                          and o.buffer is None)

    def ok(d: int, n: Tensor) -> bool:
        return supports[d](n)

    # 1. fixed: writes into pre-allocated memory, then weights
    for n in nodes:
        o = n.owner
        if not movable(n) and o.op is None:
            d = leaf_device(o)
            if not _is_pure_view(n) and not ok(d, n):
                raise SchedulerError(
                    f"node {n.describe()} ({n.op}) writes into {o.describe()} on {names[d]}, "
                    f"which cannot run {n.op}: place that tensor on a device that can")
            dev[n] = d
            continue
        if o is not n:
            continue                         # views of nodes: step 4; views of inputs: 2
        for s in n.src:
            if s is None or s.owner.op is not None:
                continue
            d = placement.get(s.owner)
            if d is not None:
                if ok(d, n):
                    dev[n] = d
                else:
                    moved.append((n, d, -1))
                break

    compute = [n for n in nodes if movable(n)]

    # 2. expansion: devices first (down, up), then everything (down, up)
    def expand(seq: Sequence[Tensor], with_host: bool) -> None:
        cur: int | None = None
        for n in seq:
            d = dev.get(n)
            if d is not None:
                cur = d if (with_host or d != host) else None
            elif cur is not None and ok(cur, n):
                dev[n] = cur

    expand(compute, False)
    expand(compute[::-1], False)
    expand(compute, True)
    expand(compute[::-1], True)

    # 3. fallback in priority order (devices first, the host last)
    order = [d for d in range(n_dev) if d != host] + [host]
    for n in compute:
        if n in dev:
            continue
        d = next((d for d in order if ok(d, n)), None)
        if d is None:
            raise SchedulerError(f"no device can run {n.op} on {n.describe()} (devices: "
                                 f"{', '.join(names)})")
        dev[n] = d
    moved = [(n, want, dev[n]) for n, want, _ in moved]

    # 4. views of nodes, and nodes writing into another node's memory, run where it lives
    for n in nodes:
        o = n.owner
        if o is not n and o.op is not None:
            d = dev[n] = dev[o]
            if not _is_pure_view(n) and not ok(d, n):
                raise SchedulerError(
                    f"node {n.describe()} ({n.op}) writes into {o.describe()} on {names[d]}, "
                    f"which cannot run {n.op}")

    return _split(graph, list(names), host, dev, moved, tensor_device, n_copies)


def _split(graph: Graph, names: list[str], host: int, dev: dict[Tensor, int],
           moved: list[tuple[Tensor, int, int]],
           tensor_device: Callable[[Tensor], int], n_copies: int) -> Schedule:
    n_dev = len(names)
    splits: list[Split] = []
    last_on: dict[int, Split] = {}             # device -> its latest split
    copies: dict[tuple[Tensor, int], Tensor] = {}
    clones: dict[Tensor, Tensor] = {}
    dev_nodes: list[list[Tensor]] = [[] for _ in range(n_dev)]
    dev_leafs: list[list[Tensor]] = [[] for _ in range(n_dev)]
    leaf_seen: list[set[Tensor]] = [set() for _ in range(n_dev)]
    ctx = Context("sched")
    pending: dict[int, Split] = {}             # device -> split opened by views, not yet run

    def add_leaf(d: int, t: Tensor) -> None:
        if t not in leaf_seen[d]:
            leaf_seen[d].add(t)
            dev_leafs[d].append(t)

    # every scratch leaf and input of the graph belongs to its device's graph, used there or not
    for leaf in graph.leafs:
        if leaf.data is None and leaf.buffer is None:
            add_leaf(tensor_device(leaf), leaf)

    def local_src(s: Tensor, d: int, split: Split) -> Tensor:
        sd = tensor_device(s)
        if sd == d:
            if s.op is None:
                add_leaf(d, s)
                return s
            return clones[s]
        key = (s, d)
        c = copies.get(key)
        if c is None:
            c = Tensor(ctx, s.type, s.ne, nb=s.nb, name=f"{names[d]}#{s.name or s.id}#0")
            c.flags = Flag.INPUT | Flag.OUTPUT    # allocated first, never freed (as ggml)
            copies[key] = c
            split.inputs.append(s)
            add_leaf(d, c)
            if s.owner.data is None and s.owner.buffer is None:   # planned on its device:
                src = clones[s] if s.op is not None else s          # keep it alive until now
                dep = Tensor(ctx, src.type, src.ne, nb=src.nb, op=OpKind.VIEW, src=(src,),
                             view_src=src, view_offs=0, name=f"{src.name} (dep)")
                dev_nodes[sd].append(dep)
        return c

    for n in graph.nodes:
        d = dev[n]
        root, pure = n.owner, _is_pure_view(n)
        if pure:
            # views compute nothing, so they never cut: they join the device's last split, or
            # its next one (a view before any split of its device only views a leaf)
            split = last_on.get(d) or pending.setdefault(d, Split(d))
        else:
            if not splits or splits[-1].device != d:
                splits.append(pending.pop(d, None) or Split(d))
                last_on[d] = splits[-1]
            split = splits[-1]
        split.nodes.append(n)
        if pure and root.op is None:           # a view of a leaf: of the leaf here or its copy
            vs = local_src(root, d, split)
            src = tuple(None if s is None else
                        clones[s] if s.op is not None and dev[s] == d else vs
                        for s in n.src)
        else:
            src = tuple(None if s is None else local_src(s, d, split) for s in n.src)
            vs = None
            if n.view_src is not None:
                vs = n.view_src if n.view_src.op is None else clones[n.view_src]
                if vs.op is None:
                    add_leaf(d, vs)
        c = Tensor(n.ctx, n.type, n.ne, nb=n.nb, op=n.op, params=n.params, src=src,
                   view_src=vs, view_offs=n.view_offs, name=n.name)
        c.flags = n.flags
        clones[n] = c
        dev_nodes[d].append(c)

    splits.extend(pending.values())           # views of leafs no split of theirs followed
    extra = [0] * n_dev
    if n_copies > 1:                          # pipeline copies of graph and split inputs
        for d in range(n_dev):
            for t in list(dev_leafs[d]):
                if t.flags & Flag.INPUT and t.data is None and t.buffer is None:
                    for c in range(1, n_copies):
                        x = Tensor(ctx, t.type, t.ne, nb=t.nb, name=f"{t.name}#copy{c}")
                        x.flags = Flag.INPUT | Flag.OUTPUT
                        dev_leafs[d].append(x)
                        extra[d] += x.nbytes
    graphs = [Graph.from_lists(dev_nodes[d], dev_leafs[d]) for d in range(n_dev)]
    return Schedule(graph, names, host, dev, splits, copies,
                    clones, graphs, moved, tensor_device, n_copies, extra)


def describe(sch: Schedule, limit: int = 20) -> list[str]:
    """One line per split: device, node range, inputs copied in (like GGML_SCHED_DEBUG)."""
    lines = [f"graph splits = {sch.n_splits}"]
    for i, s in enumerate(sch.splits[:limit]):
        first, last = s.nodes[0], s.nodes[-1]
        ins = ", ".join(f"{t.name or t.id} [{t.nbytes / MIB:.2f} MiB]" for t in s.inputs)
        lines.append(f"  split {i}: {sch.names[s.device]}, {len(s.nodes)} nodes "
                     f"({first.name or first.op} .. {last.name or last.op})"
                     + (f"; inputs: {ins}" if ins else ""))
    if sch.n_splits > limit:
        lines.append(f"  ... {sch.n_splits - limit} more splits")
    for n, want, got in sch.moved:
        lines.append(f"  {n.describe()} ({n.op}) runs on {sch.names[got]}: "
                     f"{sch.names[want]}, where its weight lives, cannot run it")
    return lines
