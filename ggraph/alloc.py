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
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


from ggraph.graph import Graph, GraphCapacityError, GraphCycleError
from ggraph.ops.registry import get_op
from ggraph.tensor import Flag, Tensor, fmt_ne
from ggraph.alloc_fit import _Fit, _fit_offline, _fit_online
from ggraph.alloc_order import greedy_order, subtree_order

ALIGNMENTS = {"cpu": 32, "cuda": 128}   # ggml CPU TENSOR_ALIGNMENT, CUDA buffer alignment
STRATEGIES = ("default", "ggml")
MIB = 1 << 20


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
    placements: dict[int, Placement] = field(repr=False)  # id(tensor) -> placement
    peak_step: int = -1                       # first step with the most bytes live
    peak_tensor: Tensor | None = None         # the tensor whose end is the high-water mark
    candidates: dict[str, int] = field(default_factory=dict, repr=False)  # label -> size
    baseline: Plan | None = field(default=None, repr=False)  # ggml's plan (default)
    complete: bool = True                     # False in the partial plan of an error
    error: str | None = None
    max_bytes: int | None = None
    failed: tuple[Tensor, int, int, int] | None = None  # partial plans: (tensor, offset,
    #                                           size, step) of the tensor that did not fit
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
        return id(t) in self.placements

    def placement(self, t: Tensor) -> Placement:
        p = self.placements.get(id(t))
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


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def check_graph(graph: Graph) -> dict[int, int]:
    """Validate order and capacity; return the byte size of every tensor the planner places."""
    nodes, leafs = graph.nodes, graph.leafs
    for kind, lst in (("nodes", nodes), ("leafs", leafs)):
        if len(lst) > graph.capacity:
            t = lst[graph.capacity]
            raise GraphOverCapacityError(
                f"graph holds {len(lst)} {kind}, over its capacity of {graph.capacity}; the "
                f"first one past it is {_what(t)}", tensor=t)
    pos: dict[int, int] = {}
    for i, t in enumerate(nodes):
        if id(t) in pos:
            raise GraphOrderError(f"node {_what(t)} appears twice in the node list "
                                  f"(at {pos[id(t)]} and {i})", tensor=t)
        pos[id(t)] = i
    sizes: dict[int, int] = {}
    for t in leafs:
        if _planned(t):
            sizes[id(t)] = tensor_size(t)
    leaf_ids = {id(t) for t in leafs}
    for i, t in enumerate(nodes):
        for s in t.src:
            if s is None:
                continue
            if s.op is None:
                if _planned(s) and id(s) not in leaf_ids:
                    raise GraphOrderError(f"node {_what(t)} uses the scratch leaf {_what(s)}, "
                                          f"which is not among the graph's leafs", tensor=t)
                continue
            j = pos.get(id(s))
            if j is None:
                raise GraphOrderError(f"node {_what(t)} uses {_what(s)}, which is not a node "
                                      f"of the graph", tensor=t)
            if j >= i:
                raise GraphOrderError(_order_message(t, s, i, j), tensor=t)
        if _planned(t):
            sizes[id(t)] = tensor_size(t)
    return sizes


def _order_message(t: Tensor, s: Tensor, i: int, j: int) -> str:
    # follow src edges from s: reaching t again means the graph has a cycle
    prev: dict[int, Tensor | None] = {id(s): None}
    stack, found = [s], False
    while stack and not found:
        x = stack.pop()
        for y in x.src:
            if y is not None and id(y) not in prev:
                prev[id(y)] = x
                if y is t:
                    found = True
                    break
                stack.append(y)
    if not found:
        return (f"node {_what(t)} (position {i}) uses {_what(s)}, which comes later "
                f"(position {j}): the node list is not in dependency order")
    chain, x = [], prev[id(t)]
    while x is not None:
        chain.append(x)
        x = prev[id(x)]
    cycle = [t] + chain[::-1] + [t]
    return ("graph has a cycle: " + " uses ".join(c.label for c in cycle) +
            " (the nodes were changed after the graph was built)")


# -- liveness: replay ggml-alloc's bookkeeping, record alloc/free events ---------------------

class _Trace:
    """The alloc/free events of one node order under one in-place rule, before placement."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int]] = []   # (kind 0 alloc/1 free/2 shrink, block, keep)
        self.ev_step: list[int] = []
        self.bsize: list[int] = []                     # aligned block sizes
        self.bowner: list[Tensor] = []                 # tensor that first took each block
        # id -> [tensor, block, first, last, reused, seq]; seq orders the record among the
        # events: an allocation's own event index, or (index of the next event) - 0.5
        self.recs: dict[int, list] = {}
        self.n_view_inplace = 0


def _trace(nodes: Sequence[Tensor], leafs: Sequence[Tensor], sizes: dict[int, int],
           align: int, views_inplace: bool) -> _Trace:
    """Replay ggml_gallocr_alloc_graph_impl over `nodes` (in this order); `views_inplace`
    lets an in-place op take over a planner-owned root through a view at offset 0."""
    tr = _Trace()
    # flags and in-place capability looked up once (enum flag arithmetic is slow in Python)
    every = list(leafs) + list(nodes) + [s for t in nodes for s in t.src if s is not None]
    inputs = {id(t) for t in every if t.flags & Flag.INPUT}
    outputs = {id(t) for t in every if t.flags & Flag.OUTPUT}
    inplace = {k for k in {t.op for t in nodes} if k is not None and get_op(k).inplace}
    st: dict[int, list] = {}          # id -> [n_children, n_views, allocated, block]
    step = -1
    ev, evs, recs = tr.events, tr.ev_step, tr.recs

    def S(t: Tensor) -> list:
        s = st.get(id(t))
        if s is None:
            s = st[id(t)] = [0, 0, False, -1]
        return s

    def pad(n: int) -> int:
        return (n + align - 1) // align * align

    def take(t: Tensor, s: list, p: Tensor, owner: Tensor, os: list) -> None:
        s[3] = b = os[3]
        recs[id(t)] = [t, b, step, None, p, len(ev) - 0.5]
        recs[id(p if p.view_src is None else owner)][3] = step
        keep, have = pad(sizes[id(t)]), pad(sizes[id(owner)])
        if have > keep:               # ggml_gallocr_free_extra_space
            ev.append((2, b, keep))
            evs.append(step)

    def alloc(t: Tensor) -> None:
        if id(t) not in sizes:         # views and pre-allocated tensors are never placed
            return
        s = S(t)
        if s[2]:
            return
        s[2] = True
        if t.op in inplace:
            for p in t.src:
                if p is None:
                    continue
                ps = S(p)
                vs = p.view_src
                if vs is None:
                    if not ps[2]:
                        continue      # not owned by the planner (or already handed on)
                elif not views_inplace or not S(vs)[2]:
                    continue          # ggml: a view is never "own", so never reused
                if id(p) in outputs or (vs is not None and id(vs) in outputs):
                    continue
                if not _same_layout(t, p) or ps[0] != 1 or ps[1] != 0:
                    continue
                if vs is None:
                    ps[2] = False
                    take(t, s, p, p, ps)
                    return
                vss = S(vs)
                if vss[1] == 1 and vss[0] == 0 and p.view_offs == 0:
                    vss[2] = False
                    tr.n_view_inplace += 1
                    take(t, s, p, vs, vss)
                    return
        b = len(tr.bsize)
        tr.bsize.append(pad(sizes[id(t)]))
        tr.bowner.append(t)
        s[3] = b
        ev.append((0, b, 0))
        evs.append(step)
        recs[id(t)] = [t, b, step, None, None, len(ev) - 1]

    def free(t: Tensor) -> None:
        if id(t) in outputs:
            return
        s = S(t)
        ev.append((1, s[3], 0))
        evs.append(step)
        s[2] = False
        recs[id(t)][3] = step

    for leaf in leafs:
        alloc(leaf)
    for node in nodes:
        if node.view_src is not None:
            S(node.view_src)[1] += 1
        if id(node) in inputs:
            alloc(node)
        for src in node.src:
            if src is not None:
                S(src)[0] += 1
                if id(src) in inputs:
                    alloc(src)
    for step, node in enumerate(nodes):
        for p in node.src:
            if p is not None:
                alloc(p)
        alloc(node)
        for p in node.src:
            if p is None:
                continue
            ps = S(p)
            ps[0] -= 1
            if ps[0] == 0 and ps[1] == 0:
                vs = p.view_src
                if vs is not None:
                    vss = S(vs)
                    vss[1] -= 1
                    if vss[1] == 0 and vss[0] == 0 and vss[2]:
                        free(vs)
                elif ps[2]:
                    free(p)
    return tr


# -- planning ------------------------------------------------------------------------------------

@dataclass
class _Candidate:
    label: str
    perm: list[int]
    tr: _Trace
    fit: _Fit


def _live_peak(tr: _Trace) -> int:
    """Most bytes live at once: no placement of this trace can use a smaller buffer."""
    live = peak = 0
    bsz = list(tr.bsize)
    for kind, b, keep in tr.events:
        if kind == 0:
            live += bsz[b]
            peak = max(peak, live)
        elif kind == 1:
            live -= bsz[b]
        else:
            live -= bsz[b] - keep
            bsz[b] = keep
    return peak


def _candidates(graph: Graph, sizes: dict[int, int], alignment: int,
                strategy: str, keep_order: bool = False) -> list[_Candidate]:
    ident = list(range(len(graph.nodes)))
    out: list[_Candidate] = []

    def run(perm: list[int], views: bool, tag: str) -> None:
        nodes = graph.nodes if perm is ident else [graph.nodes[i] for i in perm]
        tr = _trace(nodes, graph.leafs, sizes, alignment, views)
        if views and not tr.n_view_inplace:
            return            # nothing new compared with the ggml in-place rule
        bound = _live_peak(tr)
        if out and bound >= min(c.fit.size for c in out):
            return            # this trace cannot beat the best plan so far
        fit = _fit_online(tr)
        out.append(_Candidate("ggml" + tag, perm, tr, fit))
        if strategy == "default" and fit.size > bound:  # offline placement may close gaps
            out.append(_Candidate("offline" + tag, perm, tr, _fit_offline(tr)))

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


def _build_plan(graph: Graph, c: _Candidate, sizes: dict[int, int], name: str,
                alignment: int, strategy: str, upto_event: int | None = None) -> Plan:
    """Placements of candidate `c`; with `upto_event`, only blocks allocated before it."""
    tr, fit = c.tr, c.fit
    keys: dict[int, tuple[str, int]] = {id(t): ("l", j) for j, t in enumerate(graph.leafs)}
    keys.update((id(t), ("n", i)) for i, t in enumerate(graph.nodes))
    order = [graph.nodes[i] for i in c.perm]
    last_step = len(order) - 1
    alloc_ev = [0] * len(tr.bsize)
    for e, (kind, b, _) in enumerate(tr.events):
        if kind == 0:
            alloc_ev[b] = e
    upto = len(tr.events) if upto_event is None else upto_event
    stop = last_step if upto_event is None else tr.ev_step[upto_event]   # the failing step
    placements: dict[int, Placement] = {}
    for t, b, first, last, reused, seq in tr.recs.values():
        if seq >= upto:
            continue
        size = sizes[id(t)]
        role = "leaf" if t.op is None else "input" if t.flags & Flag.INPUT else "node"
        freed = last is not None and (upto_event is None or last < stop)
        placements[id(t)] = Placement(t, keys[id(t)], role, fit.offsets[b], size,
                                      (size + alignment - 1) // alignment * alignment, first,
                                      last if freed else stop, freed, reused)
    top = max((p.end for p in placements.values()), default=0)
    top_b = fit.peak_block if upto_event is None else max(
        (b for b in range(len(tr.bsize)) if alloc_ev[b] < upto),
        key=lambda b: (fit.offsets[b] + tr.bsize[b], -alloc_ev[b]), default=-1)
    return Plan(name=name, alignment=alignment, strategy=strategy, method=c.label,
                size=fit.size if upto_event is None else top, graph=graph, order=order,
                placements=placements, peak_step=_peak_step(placements, len(order)),
                peak_tensor=tr.bowner[top_b] if top_b >= 0 else None,
                complete=upto_event is None, _perm=c.perm)


def _peak_step(placements: dict[int, Placement], n: int) -> int:
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


def _limit_error(graph: Graph, c: _Candidate, plan: Plan, sizes: dict[int, int],
                 limit: int) -> BufferLimitError:
    tr, fit = c.tr, c.fit
    e, b = next((e, b) for e, (kind, b, _) in enumerate(tr.events)
                if kind == 0 and fit.offsets[b] + tr.bsize[b] > limit)
    t = tr.bowner[b]
    partial = _build_plan(graph, c, sizes, plan.name, plan.alignment, plan.strategy, e)
    partial.baseline, partial.candidates, partial.max_bytes = plan.baseline, plan.candidates, limit
    partial.failed = (t, fit.offsets[b], tr.bsize[b], tr.ev_step[e])
    ggml = f"; ggml's rules need {plan.ggml_size / MIB:.2f} MiB" if plan.baseline else ""
    msg = (f"{plan.name} compute buffer limit max_bytes={limit} ({limit / MIB:.2f} MiB) is too "
           f"small: tensor {_what(t)} needs {tr.bsize[b]} bytes at offset {fit.offsets[b]}, "
           f"ending at byte {fit.offsets[b] + tr.bsize[b]}; the whole graph needs "
           f"{plan.size} bytes ({plan.size / MIB:.2f} MiB, {plan.method}){ggml}")
    partial.error = msg
    return BufferLimitError(msg, plan=partial, tensor=t)


# -- reserve / alloc -----------------------------------------------------------------------------

def _signature(graph: Graph) -> list[tuple]:
    ref: dict[int, tuple[str, int]] = {id(t): ("l", j) for j, t in enumerate(graph.leafs)}
    ref.update((id(t), ("n", i)) for i, t in enumerate(graph.nodes))
    sig: list[tuple] = [("leaf", _planned(t), t.view_src is not None, int(t.flags))
                        for t in graph.leafs]
    for t in graph.nodes:
        srcs = tuple(None if s is None else ref.get(id(s), "outside") for s in t.src)
        view = None if t.view_src is None else ref.get(id(t.view_src), "outside")
        sig.append((t.op, srcs, view, _planned(t), int(t.flags)))
    return sig


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

    @classmethod
    def for_backend(cls, backend: str, **kw) -> GraphAllocator:
        """CPU (alignment 32) or CUDA (alignment 128)."""
        key = backend.lower()
        if key not in ALIGNMENTS:
            raise ValueError(f"unknown backend {backend!r}; expected one of "
                             f"{', '.join(ALIGNMENTS)}")
        return cls(alignment=ALIGNMENTS[key], name=kw.pop("name", key.upper()), **kw)

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
        placements: dict[int, Placement] = {}
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
                if not _same_layout(t, reused):
                    raise TopologyError(
                        f"tensor {_what(t)} runs in place on {_what(reused)} in the reserved "
                        f"plan, but their layouts now differ", tensor=t)
            placements[id(t)] = Placement(t, p.key, p.role, p.offset, size, p.alloc_size,
                                          p.first, p.last, p.freed, reused)
        peak = None
        if res.peak_tensor is not None:
            kind, i = res.placements[id(res.peak_tensor)].key
            peak = get[kind][i]
        perm = res._perm or list(range(len(graph.nodes)))
        return Plan(name=res.name, alignment=res.alignment, strategy=res.strategy,
                    method=res.method, size=res.size, graph=graph,
                    order=[graph.nodes[i] for i in perm], placements=placements,
                    peak_step=res.peak_step, peak_tensor=peak, candidates=dict(res.candidates),
                    baseline=res.baseline, max_bytes=res.max_bytes, _sig=sig, _perm=res._perm)


__all__ = ["ALIGNMENTS", "STRATEGIES", "AllocError", "BufferLimitError", "GraphAllocator",
           "GraphOrderError", "GraphOverCapacityError", "Placement", "Plan", "TensorGrewError",
           "TensorSizeError", "TopologyError", "check_graph", "greedy_order", "plan_graph",
           "subtree_order", "tensor_size"]
