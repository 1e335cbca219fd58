"""The liveness trace of the graph allocator: ggml-alloc's bookkeeping replayed over one node
order, before any offset is chosen.

This file owns when each planned tensor takes memory and when it gives it back: leafs, then
inputs, then node by node (ggml_gallocr_alloc_graph_impl), with ggml's in-place rule (a node
takes over the memory of a source it may overwrite) and, optionally, the same rule through a
view at offset 0. The result is a Trace: alloc/free/shrink events on blocks of memory, and the
lifetime of every planned tensor. Placement (ggraph.plan.alloc_fit) turns a trace into offsets;
ggraph.plan.alloc turns both into a Plan.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ggraph.ops.registry import get_op
from ggraph.ir.tensor import Flag, Tensor

# event kinds
ALLOC = 0    # a block is taken
FREE = 1     # a block is given back
SHRINK = 2   # a block handed over in place to a smaller tensor gives back its tail


@dataclass(slots=True)
class Event:
    """One change of the memory in use."""
    kind: int          # ALLOC, FREE or SHRINK
    block: int         # index into Trace.block_sizes
    keep: int          # SHRINK: bytes the block keeps (0 for ALLOC and FREE)
    step: int          # step of the node order at which it happens; -1 = before node 0


@dataclass(slots=True)
class Lifetime:
    """When one planned tensor holds which block."""
    tensor: Tensor
    block: int
    first: int                # step at which it takes the block
    last: int | None          # last step it is live; None: never freed (kept to the end)
    reused: Tensor | None     # source whose memory it took over in place
    seq: float                # place among the events: its ALLOC's index, or, for a
    #                           take-over, (index of the next event) - 0.5


@dataclass
class Trace:
    """The events of one node order under one in-place rule."""
    events: list[Event] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)     # aligned sizes, by block
    block_owners: list[Tensor] = field(default_factory=list)  # tensor that took each block
    lifetimes: dict[Tensor, Lifetime] = field(default_factory=dict)   # in allocation order
    n_view_inplace: int = 0   # take-overs through a view (0: the same trace as ggml's rule)


@dataclass(slots=True)
class _Usage:
    """ggml_gallocr's hash-set entry of a tensor while the trace is replayed."""
    n_children: int = 0       # consumers not yet run
    n_views: int = 0          # views of it not yet released
    allocated: bool = False   # holds memory the planner owns
    block: int = -1


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether `a` may take over `b`'s memory in place: the same type, shape and strides."""
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def trace_liveness(nodes: Sequence[Tensor], leafs: Sequence[Tensor],
                   sizes: dict[Tensor, int], alignment: int, views_inplace: bool) -> Trace:
    """Replay ggml_gallocr_alloc_graph_impl over `nodes` (in this order). `sizes` holds every
    tensor the planner places; `views_inplace` lets an in-place op take over a planner-owned
    root through a view at offset 0."""
    tr = Trace()
    # flags and in-place capability looked up once per tensor (enum flag arithmetic is slow
    # in Python, and a tensor is the source of many nodes)
    every = set(leafs).union(nodes, (s for t in nodes for s in t.src if s is not None))
    inputs = {t for t in every if t.flags & Flag.INPUT}
    outputs = {t for t in every if t.flags & Flag.OUTPUT}
    inplace_ops = {k for k in {t.op for t in nodes} if k is not None and get_op(k).inplace}
    usage: dict[Tensor, _Usage] = {}
    events, lifetimes = tr.events, tr.lifetimes
    step = -1

    def usage_of(t: Tensor) -> _Usage:
        u = usage.get(t)
        if u is None:
            u = usage[t] = _Usage()
        return u

    def pad(n: int) -> int:
        return (n + alignment - 1) // alignment * alignment

    def take_over(t: Tensor, t_use: _Usage, parent: Tensor, owner: Tensor,
                  owner_use: _Usage) -> None:
        # t runs in place on `parent`, whose memory belongs to `owner` (itself, or the root
        # of the view `parent`)
        t_use.block = block = owner_use.block
        lifetimes[t] = Lifetime(t, block, step, None, parent, len(events) - 0.5)
        lifetimes[owner].last = step
        keep, have = pad(sizes[t]), pad(sizes[owner])
        if have > keep:               # ggml_gallocr_free_extra_space
            events.append(Event(SHRINK, block, keep, step))

    def alloc(t: Tensor) -> None:
        if t not in sizes:            # views and pre-allocated tensors are never placed
            return
        t_use = usage_of(t)
        if t_use.allocated:
            return
        t_use.allocated = True
        if t.op in inplace_ops:
            for parent in t.src:
                if parent is None:
                    continue
                parent_use = usage_of(parent)
                root = parent.view_src
                if root is None:
                    if not parent_use.allocated:
                        continue      # not owned by the planner (or already handed on)
                elif not views_inplace or not usage_of(root).allocated:
                    continue          # ggml: a view is never "own", so never reused
                if parent in outputs or (root is not None and root in outputs):
                    continue
                if not same_layout(t, parent) or parent_use.n_children != 1 or \
                        parent_use.n_views != 0:
                    continue
                if root is None:
                    parent_use.allocated = False
                    take_over(t, t_use, parent, parent, parent_use)
                    return
                root_use = usage_of(root)
                if root_use.n_views == 1 and root_use.n_children == 0 and parent.view_offs == 0:
                    root_use.allocated = False
                    tr.n_view_inplace += 1
                    take_over(t, t_use, parent, root, root_use)
                    return
        block = len(tr.block_sizes)
        tr.block_sizes.append(pad(sizes[t]))
        tr.block_owners.append(t)
        t_use.block = block
        events.append(Event(ALLOC, block, 0, step))
        lifetimes[t] = Lifetime(t, block, step, None, None, len(events) - 1)

    def free(t: Tensor) -> None:
        if t in outputs:
            return
        t_use = usage_of(t)
        events.append(Event(FREE, t_use.block, 0, step))
        t_use.allocated = False
        lifetimes[t].last = step

    for leaf in leafs:
        alloc(leaf)
    for node in nodes:
        if node.view_src is not None:
            usage_of(node.view_src).n_views += 1
        if node in inputs:
            alloc(node)
        for src in node.src:
            if src is not None:
                usage_of(src).n_children += 1
                if src in inputs:
                    alloc(src)
    for step, node in enumerate(nodes):
        for parent in node.src:
            if parent is not None:
                alloc(parent)
        alloc(node)
        for parent in node.src:
            if parent is None:
                continue
            parent_use = usage_of(parent)
            parent_use.n_children -= 1
            if parent_use.n_children == 0 and parent_use.n_views == 0:
                root = parent.view_src
                if root is not None:
                    root_use = usage_of(root)
                    root_use.n_views -= 1
                    if root_use.n_views == 0 and root_use.n_children == 0 and \
                            root_use.allocated:
                        free(root)
                elif parent_use.allocated:
                    free(parent)
    return tr


def live_peak(tr: Trace) -> int:
    """Most bytes live at once: no placement of this trace can use a smaller buffer."""
    live = peak = 0
    sizes = list(tr.block_sizes)
    for ev in tr.events:
        if ev.kind == ALLOC:
            live += sizes[ev.block]
            peak = max(peak, live)
        elif ev.kind == FREE:
            live -= sizes[ev.block]
        else:
            live -= sizes[ev.block] - ev.keep
            sizes[ev.block] = ev.keep
    return peak


__all__ = ["ALLOC", "FREE", "SHRINK", "Event", "Lifetime", "Trace", "live_peak", "same_layout",
           "trace_liveness"]
