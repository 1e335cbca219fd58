"""The graph allocator: a pure planner of tensor offsets inside one compute buffer.

This file owns the memory plan of a graph for one buffer type: which tensors the planner must
place (non-view nodes and scratch leafs; never views, weights, KV cache or leafs with host
data), when each one is live, where it lives, and the `Plan` a backend reads
(`plan.offset(t)`, `plan.address(view)`, `plan.size`, `plan.order`). Nothing here touches
memory.

Two strategies:
- "ggml" replays ggml-alloc (ggml_gallocr_alloc_graph_impl + ggml_dyn_tallocr) exactly: leafs,
  then inputs, then node by node, in-place reuse from the op's in-place flag, best fit over a
  sorted coalescing free list with the open tail used only when nothing else fits. Checked
  offset for offset against ggml-alloc.c (ggml commit d99724f) on random graphs.
- "default" tries several plans and keeps the smallest, with ggml's plan as the first candidate
  so it is never worse. Candidates combine: in-place reuse through a view at offset 0 (ggml's
  rule never reaches views: it only hands over memory it "owns", and views are never owned);
  node orders that keep every dependency, including the hidden ones of writes through views
  (a greedy one that runs the node adding the fewest bytes, and a Sethi-Ullman post-order that
  computes the hungriest source first); and offline placement (lifetimes are all known before
  placing, so blocks go largest first into the lowest gap). A candidate whose most-bytes-live
  bound cannot beat the best plan so far is skipped.

The steps live apart: ggraph.plan.alloc_trace replays the bookkeeping (when each tensor takes and
gives back memory), ggraph.plan.alloc_fit chooses offsets, ggraph.plan.alloc_order proposes node
orders;
this file checks graphs, runs the candidates and builds, reserves and reuses plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ggraph.plan.alloc_fit import Fit, fit_offline, fit_online
from ggraph.plan.alloc_order import greedy_order, subtree_order
from ggraph.plan.alloc_trace import ALLOC, Trace, live_peak, same_layout, trace_liveness
from ggraph.ir.graph import Graph, GraphCapacityError, GraphCycleError
from ggraph.ir.tensor import Flag, Tensor, fmt_ne
from ggraph.ir.types import MIB

STRATEGIES = ("default", "ggml")


# -- errors --------------------------------------------------------------------------------

class AllocError(ValueError):
    """A graph the planner cannot place. `plan` holds what was planned before the failure."""

    def __init__(self, message: str, plan: Plan | None = None,
                 tensor: Tensor | None = None) -> None:
        super().__init__(message)
        self.plan = plan
        self.tensor = tensor


class GraphOrderError(AllocError, GraphCycleError):
    """A node uses a tensor that is not computed before it (a cycle, or a mutated node list)."""


class GraphOverCapacityError(AllocError, GraphCapacityError):
    """The node or leaf list holds more tensors than the graph's capacity."""


class TensorSizeError(AllocError):
    """A tensor whose byte size cannot be computed (no type size, partial quant blocks)."""


class BufferLimitError(AllocError):
    """The plan needs more than `max_bytes`; names the first tensor that crosses the limit."""


class TopologyError(AllocError):
    """alloc() got a graph whose structure differs from the reserved one."""


class TensorGrewError(AllocError):
    """alloc() got a tensor larger than the slot reserved for it."""


# -- plan ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Placement:
    """Where one planned tensor lives and when. Steps index `Plan.order`; -1 = before node 0."""
    tensor: Tensor
    key: tuple[str, int]          # ("n", node index) or ("l", leaf index) in the graph lists
    role: str                     # "leaf" (scratch leaf), "input" or "node"
    offset: int
    size: int                     # ggml_nbytes
    alloc_size: int               # size rounded up to the alignment: the slot it occupies
    first: int                    # step at which its memory is taken
    last: int                     # last step it is live (its memory is released after it)
    freed: bool                   # False: kept to the end (outputs, tensors nobody reads)
    reused: Tensor | None = None  # parent whose memory it took over in place

    @property
    def end(self) -> int:
        return self.offset + self.alloc_size


class Failure(NamedTuple):
    """The tensor that did not fit under max_bytes, where it would have gone, and when."""
    tensor: Tensor
    offset: int
    size: int                 # its aligned size
    step: int


@dataclass
class Plan:
    """Offsets of every planned tensor of one graph in one buffer, and the execution order."""
    name: str
    alignment: int
    strategy: str
    method: str                               # which candidate won ("ggml" for ggml's own)
    size: int                                 # buffer bytes (high-water mark)
    graph: Graph = field(repr=False)
    order: list[Tensor] = field(repr=False)   # execution order the backend must use
    placements: dict[Tensor, Placement] = field(repr=False)   # tensor -> where it lives
    peak_step: int = -1                       # first step with the most bytes live
    peak_tensor: Tensor | None = None         # the tensor whose end is the high-water mark
    candidates: dict[str, int] = field(default_factory=dict, repr=False)  # label -> size
    baseline: Plan | None = field(default=None, repr=False)  # ggml's plan (default)
    complete: bool = True                     # False in the partial plan of an error
    error: str | None = None
    max_bytes: int | None = None
    failed: Failure | None = None             # partial plans: the tensor that did not fit
    _sig: list | None = field(default=None, repr=False)
    _perm: list[int] | None = field(default=None, repr=False)

    @property
    def buffer_size(self) -> int:
        return self.size

    @property
    def needed(self) -> int:
        """Bytes the whole graph needs (larger than `size` in the partial plan of an error)."""
        return min(self.candidates.values(), default=self.size) if not self.complete \
            else self.size

    @property
    def ggml_size(self) -> int:
        return self.baseline.size if self.baseline is not None else self.needed

    @property
    def reordered(self) -> bool:
        return self._perm is not None and self._perm != list(range(len(self._perm)))

    def __contains__(self, t: Tensor) -> bool:
        return t in self.placements

    def placement(self, t: Tensor) -> Placement:
        p = self.placements.get(t)
        if p is None:
            why = ("it is a view (use address())" if t.is_view else
                   "it is pre-allocated (weights, KV cache, host data)" if t.is_preallocated
                   else "it is not in the planned graph")
            raise KeyError(f"tensor {t.describe()} has no offset in the {self.name} plan: {why}")
        return p

    def offset(self, t: Tensor) -> int:
        """Byte offset of a planned (non-view, non-pre-allocated) tensor in the buffer."""
        return self.placement(t).offset

    def address(self, t: Tensor) -> int:
        """Offset of a tensor or of a view of a planned tensor: offset(view_src) + view_offs."""
        return self.offset(t.view_src) + t.view_offs if t.is_view else self.offset(t)

    def live_at(self, step: int) -> list[Placement]:
        return [p for p in self.placements.values() if p.first <= step <= p.last]


# -- sizes and checks ------------------------------------------------------------------------

def _what(t: Tensor) -> str:
    return f"{t.label} (op {t.op or 'none'}, type {t.type}, ne={fmt_ne(t.ne)})"


def tensor_size(t: Tensor) -> int:
    """ggml_nbytes of `t`, or TensorSizeError when the type has no usable size."""
    try:
        bs, ts = int(t.type.block_size), int(t.type.type_size)
    except (AttributeError, KeyError, TypeError, ValueError):
        raise TensorSizeError(f"tensor {_what(t)}: its type {t.type!r} has no type size, so "
                              f"the planner cannot size it", tensor=t) from None
    if bs <= 0 or ts <= 0:
        raise TensorSizeError(f"tensor {_what(t)}: type {t.type} has block size {bs} and type "
                              f"size {ts}; both must be positive", tensor=t)
    if t.ne[0] % bs:
        raise TensorSizeError(f"tensor {_what(t)}: ne[0]={t.ne[0]} is not a multiple of the "
                              f"block size {bs} of {t.type}, so its rows are not a whole "
                              f"number of bytes", tensor=t)
    return t.nbytes


def _planned(t: Tensor) -> bool:
    return t.view_src is None and not t.is_preallocated


def check_graph(graph: Graph) -> dict[Tensor, int]:
    """Validate order and capacity; return the byte size of every tensor the planner places."""
    nodes, leafs = graph.nodes, graph.leafs
    for kind, lst in (("nodes", nodes), ("leafs", leafs)):
        if len(lst) > graph.capacity:
            t = lst[graph.capacity]
            raise GraphOverCapacityError(
                f"graph holds {len(lst)} {kind}, over its capacity of {graph.capacity}; the "
                f"first one past it is {_what(t)}", tensor=t)
    pos: dict[Tensor, int] = {}
    for i, t in enumerate(nodes):
        if t in pos:
            raise GraphOrderError(f"node {_what(t)} appears twice in the node list "
                                  f"(at {pos[t]} and {i})", tensor=t)
        pos[t] = i
    sizes: dict[Tensor, int] = {}
    for t in leafs:
        if _planned(t):
            sizes[t] = tensor_size(t)
    leaf_set = set(leafs)
    for i, t in enumerate(nodes):
        for s in t.src:
            if s is None:
                continue
            if s.op is None:
                if _planned(s) and s not in leaf_set:
                    raise GraphOrderError(f"node {_what(t)} uses the scratch leaf {_what(s)}, "
                                          f"which is not among the graph's leafs", tensor=t)
                continue
            j = pos.get(s)
            if j is None:
                raise GraphOrderError(f"node {_what(t)} uses {_what(s)}, which is not a node "
                                      f"of the graph", tensor=t)
            if j >= i:
                raise GraphOrderError(_order_message(t, s, i, j), tensor=t)
        if _planned(t):
            sizes[t] = tensor_size(t)
    return sizes


def _order_message(t: Tensor, s: Tensor, i: int, j: int) -> str:
    # follow src edges from s: reaching t again means the graph has a cycle
    prev: dict[Tensor, Tensor | None] = {s: None}
    stack, found = [s], False
    while stack and not found:
        x = stack.pop()
        for y in x.src:
            if y is not None and y not in prev:
                prev[y] = x
                if y is t:
                    found = True
                    break
                stack.append(y)
    if not found:
        return (f"node {_what(t)} (position {i}) uses {_what(s)}, which comes later "
                f"(position {j}): the node list is not in dependency order")
    chain, x = [], prev[t]
    while x is not None:
        chain.append(x)
        x = prev[x]
    cycle = [t] + chain[::-1] + [t]
    return ("graph has a cycle: " + " uses ".join(c.label for c in cycle) +
            " (the nodes were changed after the graph was built)")


# -- planning ------------------------------------------------------------------------------------

@dataclass
class _Candidate:
    """One candidate plan: a node order, the trace of one in-place rule over it, a placement."""
    label: str
    perm: list[int]           # node indices in execution order
    trace: Trace
    fit: Fit


def _candidates(graph: Graph, sizes: dict[Tensor, int], alignment: int,
                strategy: str, keep_order: bool = False) -> list[_Candidate]:
    ident = list(range(len(graph.nodes)))
    out: list[_Candidate] = []

    def run(perm: list[int], views: bool, tag: str) -> None:
        nodes = graph.nodes if perm is ident else [graph.nodes[i] for i in perm]
        tr = trace_liveness(nodes, graph.leafs, sizes, alignment, views)
        if views and not tr.n_view_inplace:
            return            # nothing new compared with the ggml in-place rule
        bound = live_peak(tr)
        if out and bound >= min(c.fit.size for c in out):
            return            # this trace cannot beat the best plan so far
        fit = fit_online(tr)
        out.append(_Candidate("ggml" + tag, perm, tr, fit))
        if strategy == "default" and fit.size > bound:  # offline placement may close gaps
            out.append(_Candidate("offline" + tag, perm, tr, fit_offline(tr)))

    run(ident, False, "")
    if strategy == "ggml":
        return out
    run(ident, True, " + view in-place")
    if keep_order:
        return out
    seen = [ident]
    for tag, perm in ((" + greedy order", greedy_order(graph.nodes, sizes)),
                      (" + subtree order", subtree_order(graph.nodes, sizes))):
        if perm not in seen:
            seen.append(perm)
            run(perm, False, tag)
            run(perm, True, " + view in-place" + tag)
    return out


def _build_plan(graph: Graph, c: _Candidate, sizes: dict[Tensor, int], name: str,
                alignment: int, strategy: str, upto_event: int | None = None) -> Plan:
    """Placements of candidate `c`; with `upto_event`, only blocks allocated before it."""
    tr, fit = c.trace, c.fit
    keys: dict[Tensor, tuple[str, int]] = {t: ("l", j) for j, t in enumerate(graph.leafs)}
    keys.update((t, ("n", i)) for i, t in enumerate(graph.nodes))
    order = [graph.nodes[i] for i in c.perm]
    last_step = len(order) - 1
    alloc_event = [0] * len(tr.block_sizes)     # index of each block's ALLOC event
    for index, ev in enumerate(tr.events):
        if ev.kind == ALLOC:
            alloc_event[ev.block] = index
    upto = len(tr.events) if upto_event is None else upto_event
    stop = last_step if upto_event is None else tr.events[upto_event].step  # the failing step
    placements: dict[Tensor, Placement] = {}
    for life in tr.lifetimes.values():
        if life.seq >= upto:
            continue
        t, last = life.tensor, life.last
        size = sizes[t]
        role = "leaf" if t.op is None else "input" if t.flags & Flag.INPUT else "node"
        freed = last is not None and (upto_event is None or last < stop)
        placements[t] = Placement(t, keys[t], role, fit.offsets[life.block], size,
                                  (size + alignment - 1) // alignment * alignment, life.first,
                                  last if freed else stop, freed, life.reused)
    top = max((p.end for p in placements.values()), default=0)
    top_block = fit.peak_block if upto_event is None else max(
        (b for b in range(len(tr.block_sizes)) if alloc_event[b] < upto),
        key=lambda b: (fit.offsets[b] + tr.block_sizes[b], -alloc_event[b]), default=-1)
    return Plan(name=name, alignment=alignment, strategy=strategy, method=c.label,
                size=fit.size if upto_event is None else top, graph=graph, order=order,
                placements=placements, peak_step=_peak_step(placements, len(order)),
                peak_tensor=tr.block_owners[top_block] if top_block >= 0 else None,
                complete=upto_event is None, _perm=c.perm)


def _peak_step(placements: dict[Tensor, Placement], n: int) -> int:
    """The first step with the most bytes live (-1: before node 0). An in-place child shares
    its parent's bytes at the hand-over step, so it counts from the step after."""
    diff = [0] * (n + 2)
    for p in placements.values():
        start = p.first + 1 if p.reused is not None else p.first
        if start <= p.last:
            diff[start + 1] += p.alloc_size
            diff[p.last + 2] -= p.alloc_size
    best, best_step, live = -1, -1, 0
    for i in range(n + 1):
        live += diff[i]
        if live > best:
            best, best_step = live, i - 1
    return best_step


def plan_graph(graph: Graph, alignment: int = 32, strategy: str = "default",
               max_bytes: int | None = None, name: str = "CPU", keep_order: bool = False
               ) -> Plan:
    """Plan `graph` (pure: offsets only). Raises AllocError subclasses; see module doc.

    keep_order: run the nodes in the graph's order (no reordered candidates). The scheduler
    needs it: a device's graph is one piece of a larger run, and copies to and from other
    devices happen between its nodes at fixed points."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown allocation strategy {strategy!r}; expected one of "
                         f"{', '.join(STRATEGIES)}")
    sizes = check_graph(graph)
    cands = _candidates(graph, sizes, alignment, strategy, keep_order)
    best = min(cands, key=lambda c: c.fit.size)     # the first (ggml) wins ties
    plan = _build_plan(graph, best, sizes, name, alignment, strategy)
    plan.candidates = {c.label: c.fit.size for c in cands}
    plan.max_bytes = max_bytes
    if strategy == "default":
        plan.baseline = _build_plan(graph, cands[0], sizes, name, alignment, "ggml")
    plan._sig = _signature(graph)
    if max_bytes is not None and plan.size > max_bytes:
        # the partial plan comes from the smallest online candidate: it places tensors in
        # execution order, so "placed before the failure" reads naturally
        online = min((c for c in cands if c.label.startswith("ggml")), key=lambda c: c.fit.size)
        raise _limit_error(graph, online, plan, sizes, max_bytes)
    return plan


def _limit_error(graph: Graph, c: _Candidate, plan: Plan, sizes: dict[Tensor, int],
                 limit: int) -> BufferLimitError:
    tr, fit = c.trace, c.fit
    index, ev = next((i, ev) for i, ev in enumerate(tr.events) if ev.kind == ALLOC
                     and fit.offsets[ev.block] + tr.block_sizes[ev.block] > limit)
    t, offset, size = tr.block_owners[ev.block], fit.offsets[ev.block], tr.block_sizes[ev.block]
    partial = _build_plan(graph, c, sizes, plan.name, plan.alignment, plan.strategy, index)
    partial.baseline, partial.candidates, partial.max_bytes = plan.baseline, plan.candidates, limit
    partial.failed = Failure(t, offset, size, ev.step)
    ggml = f"; ggml's rules need {plan.ggml_size / MIB:.2f} MiB" if plan.baseline else ""
    msg = (f"{plan.name} compute buffer limit max_bytes={limit} ({limit / MIB:.2f} MiB) is too "
           f"small: tensor {_what(t)} needs {size} bytes at offset {offset}, "
           f"ending at byte {offset + size}; the whole graph needs "
           f"{plan.size} bytes ({plan.size / MIB:.2f} MiB, {plan.method}){ggml}")
    partial.error = msg
    return BufferLimitError(msg, plan=partial, tensor=t)


# -- reserve / alloc -----------------------------------------------------------------------------

def _signature(graph: Graph) -> list[tuple]:
    ref: dict[Tensor, tuple[str, int]] = {t: ("l", j) for j, t in enumerate(graph.leafs)}
    ref.update((t, ("n", i)) for i, t in enumerate(graph.nodes))
    sig: list[tuple] = [("leaf", _planned(t), t.view_src is not None, int(t.flags))
                        for t in graph.leafs]
    for t in graph.nodes:
        srcs = tuple(None if s is None else ref.get(s, "outside") for s in t.src)
        view = None if t.view_src is None else ref.get(t.view_src, "outside")
        sig.append((t.op, srcs, view, _planned(t), int(t.flags)))
    return sig


class BufferPlan(Protocol):
    """What a Session reads of a plan: Plan, and the conformance harness's canary and framed
    plans (ggraph/check/conformance.py). A plan without lifetimes has no tensor `in` it."""
    size: int                 # the buffer's bytes
    order: list[Tensor]       # the execution order the backend must keep

    def offset(self, t: Tensor) -> int:
        """Byte offset of planned tensor t in the buffer."""
        ...

    def __contains__(self, t: Tensor) -> bool:
        """Whether the plan knows t's lifetime (then `placement(t)` says when it is freed)."""
        ...

    def placement(self, t: Tensor) -> Placement: ...


class Allocator(Protocol):
    """What a Session asks of its allocator (GraphAllocator; the conformance harness's)."""
    name: str                 # the device's name in llama.cpp's lines (CPU, CUDA0)
    alignment: int

    def reserve(self, graph: Graph) -> BufferPlan:
        """Size the buffer on a worst-case graph."""
        ...

    def alloc(self, graph: Graph, reserve_on_growth: bool = False) -> BufferPlan:
        """Place a graph (in the reserved buffer where there is one)."""
        ...


class GraphAllocator:
    """Plans graphs for one buffer type: reserve() sizes the buffer on a worst-case graph,
    alloc() places later graphs of the same topology at the reserved offsets."""

    def __init__(self, alignment: int = 32, strategy: str = "default",
                 max_bytes: int | None = None, name: str = "CPU",
                 keep_order: bool = False) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown allocation strategy {strategy!r}; expected one of "
                             f"{', '.join(STRATEGIES)}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.alignment, self.strategy, self.max_bytes, self.name = \
            alignment, strategy, max_bytes, name
        self.keep_order = keep_order
        self.reserved: Plan | None = None

    @property
    def buffer_size(self) -> int:
        return self.reserved.size if self.reserved is not None else 0

    def plan(self, graph: Graph) -> Plan:
        """Plan without keeping anything."""
        return plan_graph(graph, self.alignment, self.strategy, self.max_bytes, self.name,
                          self.keep_order)

    def reserve(self, graph: Graph) -> Plan:
        """Plan the worst-case graph and keep its offsets for later alloc() calls."""
        self.reserved = self.plan(graph)
        return self.reserved

    def alloc(self, graph: Graph, reserve_on_growth: bool = False) -> Plan:
        """Place `graph` at the reserved offsets (reserving first if nothing is reserved).

        A graph of another topology, or with a tensor larger than its reserved slot, raises
        TopologyError / TensorGrewError naming the tensor, or re-reserves when
        `reserve_on_growth` is set (ggml re-reserves automatically)."""
        if self.reserved is None:
            return self.reserve(graph)
        try:
            return self._place(self.reserved, graph)
        except (TopologyError, TensorGrewError):
            if reserve_on_growth:
                return self.reserve(graph)
            raise

    def _place(self, res: Plan, graph: Graph) -> Plan:
        old = res.graph
        if (len(graph.nodes), len(graph.leafs)) != (len(old.nodes), len(old.leafs)):
            raise TopologyError(
                f"graph has {len(graph.nodes)} nodes and {len(graph.leafs)} leafs, the reserved "
                f"graph had {len(old.nodes)} and {len(old.leafs)}; reserve() it first")
        sig = _signature(graph)
        if sig != res._sig:
            k = next(k for k, (a, b) in enumerate(zip(sig, res._sig)) if a != b)
            nl = len(graph.leafs)
            t, o = (graph.leafs[k], old.leafs[k]) if k < nl else \
                (graph.nodes[k - nl], old.nodes[k - nl])
            where = f"leaf {k}" if k < nl else f"node {k - nl}"
            raise TopologyError(f"{where} {_what(t)} differs from the reserved graph's "
                                f"{_what(o)} (op, sources, view, pre-allocation or flags)",
                                tensor=t)
        get = {"n": graph.nodes, "l": graph.leafs}
        placements: dict[Tensor, Placement] = {}
        for p in res.placements.values():
            t = get[p.key[0]][p.key[1]]
            size = tensor_size(t)
            if size > p.size:
                raise TensorGrewError(
                    f"tensor {_what(t)} needs {size} bytes but its reserved slot holds "
                    f"{p.size} (reserved as ne={fmt_ne(p.tensor.ne)}); reserve() the larger "
                    f"graph or pass reserve_on_growth=True", tensor=t)
            reused = None
            if p.reused is not None:
                reused = t.src[p.tensor.src.index(p.reused)]
                if not same_layout(t, reused):
                    raise TopologyError(
                        f"tensor {_what(t)} runs in place on {_what(reused)} in the reserved "
                        f"plan, but their layouts now differ", tensor=t)
            placements[t] = Placement(t, p.key, p.role, p.offset, size, p.alloc_size,
                                      p.first, p.last, p.freed, reused)
        peak = None
        if res.peak_tensor is not None:
            kind, i = res.placements[res.peak_tensor].key
            peak = get[kind][i]
        perm = res._perm or list(range(len(graph.nodes)))
        return Plan(name=res.name, alignment=res.alignment, strategy=res.strategy,
                    method=res.method, size=res.size, graph=graph,
                    order=[graph.nodes[i] for i in perm], placements=placements,
                    peak_step=res.peak_step, peak_tensor=peak, candidates=dict(res.candidates),
                    baseline=res.baseline, max_bytes=res.max_bytes, _sig=sig, _perm=res._perm)


__all__ = ["Allocator", "BufferPlan", "STRATEGIES", "AllocError", "BufferLimitError", "Failure",
           "GraphAllocator", "GraphOrderError", "GraphOverCapacityError", "Placement", "Plan",
           "TensorGrewError", "TensorSizeError", "TopologyError", "check_graph", "greedy_order",
           "plan_graph", "subtree_order", "tensor_size"]
