"""What every backend is, and running a graph node by node inside an allocator plan.

A backend is a device (`Backend`: its kernel table, `supports(node)`, the weight copies its
kernels read) with a buffer type (its memory: backends/buffer_type.py) and an executor (how
bound calls run: backends/executor.py), the three parts ggml's backend interface separates. It
hands out kernels, its buffer type hands out memory (aligned arenas); where each tensor lives is
the allocator's plan. Pre-allocated tensors live elsewhere: leafs with host data are used in
place (a weight in a read-only mmap stays there), leafs with a `buffer` name but no data (a KV
cache) get zeroed static memory that a Session keeps between runs.

A Session is safe to share between threads: run, read and write take its lock, and a read by
a thread other than the one whose run produced the current values is refused (another run
may come in between); `with session:` holds the lock around a run and its reads.

A Session is the one-device runner of backends/runner.py (reserve, run, read, write, plans,
memory lines); backends/multi.py's MultiSession is the same interface over several. Either
runs a graph observed (`run(..., observe=Observer(ask, receive))`, backends/observe.py: ggml's
eval callback), handing asked nodes' values over as they are computed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping

import numpy as np

from ggraph.codecs import buffers
from ggraph.ir.graph import Graph
from ggraph.plan.alloc import Allocator, BufferPlan
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor

from .buffer_type import BufferType, HostBufferType
from .executor import Executor
from .fusion_rules import Group
from .observe import Handoff, ObservedStep, Observer, Recorder, run_steps, schedule
from .profile import Profile
from .registry import KINDS
from .runner import ComputeBuffer, MemoryFigures, ModelMemory, ThreadGuard, check_device

KernelFn = Callable[[Tensor, "Session"], None]

__all__ = ["Backend", "BoundGraph", "Kernel", "Observer", "Recorder", "Session",
           "UnsupportedOpError"]


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


class Backend:
    """A device, after ggml's (ggml-backend-impl.h: ggml_backend_device): its name, the kernels
    it has (`supports`), its buffer type (`buffers`: what its memory is, backends/
    buffer_type.py), its executor (`executor`: how bound calls run, backends/executor.py), the
    copies of weights its kernels read (`prepare_weights`, `model_buffers`), and sessions."""

    name = "base"
    kernels: dict[OpKind, Kernel] = {}
    buffers: BufferType = HostBufferType(KINDS["cpu"].label, KINDS["cpu"].alignment)
    executor: Executor = Executor()

    def supports(self, node: Tensor) -> bool:
        if node.op is None:
            return True
        k = self.kernels.get(node.op)
        return k is not None and k.accepts(node)

    def session(self, **kw: Any) -> "Session":
        return Session(self, **kw)

    def prepare_weights(self, nodes: list[Tensor], session: "Session") -> None:
        """Make whatever own copies of weights the kernels of `nodes` will read (the CPU's
        packed layout), once, when a worst-case graph is reserved. Nothing by default."""

    def model_buffers(self) -> list[tuple[str, int]]:
        """(name, bytes) of the weight copies this backend holds (llama.cpp's CPU_REPACK)."""
        return []


@dataclass
class BoundGraph:
    """A graph a Session ran: its plan and bound calls, valid while the arena they view is
    the Session's arena."""
    plan: BufferPlan
    calls: list[Callable[[], None]]
    groups: list[tuple[Tensor, ...]]
    arena: Any
    loop: Callable[[], None]   # runs the calls (the executor's loop)


BOUND_GRAPHS = 4   # graphs a Session keeps bound (a prompt's, a decode step's, a draft's ...)


class Session(ThreadGuard):
    """Runs graphs on one backend: holds the compute arena, static (cache) buffers and the
    plan of the last graph. Reuse one Session for graphs of the same topology (decode steps).
    The one-device Runner (backends/runner.py): its device is index 0, named as its
    allocator (the backend's name in capitals by default)."""

    def __init__(self, backend: Backend, allocator: Allocator | None = None) -> None:
        self.backend = backend
        if allocator is None:
            from ggraph.plan.alloc import GraphAllocator

            allocator = GraphAllocator(alignment=backend.buffers.alignment,
                                       name=backend.name.upper())
        self.allocator: Allocator = allocator
        self.arena: Any = None
        self.plan: BufferPlan | None = None
        self.static: dict[Tensor, Any] = {}
        self._graph: Graph | None = None          # the graph whose calls are bound
        self._calls: list[Callable[[], None]] | None = None
        self._loop: Callable[[], None] | None = None   # the executor's loop over _calls
        self._groups: list[tuple[Tensor, ...]] = []  # the nodes each bound call computes
        # the last few graphs run, by identity: alternating between graphs (a batch's ubatch
        # widths, a speculative draft and its check) then costs no planning or binding
        self._bound: dict[int, tuple[Graph, BoundGraph]] = {}
        # a Profile every run records into while set (Profile.attach); run(profile=) for one
        self.profile: Profile | None = None
        # leafs with host data that a write changed: this Session's copy of their bytes, so
        # the caller's array (or a read-only mmap of weights) is never written
        self._own: dict[Tensor, Any] = {}
        self._own_changed = False                 # a new copy: bound calls see the old array
        ThreadGuard.__init__(self)                # run/read/write take turns
        self._in_run = False                      # kernels are running: a source they read is
        #                                           live at that step, freed or not afterwards
        self.name: str = allocator.name
        self.placement: dict[Tensor, int] = {}    # always device 0; kept for the interface
        self._reserved: list[ComputeBuffer] = []  # what the last reserve() returned
        # work kernel binders share between the nodes of one bind_calls list (the CPU's
        # quantized activations of a tensor several products read); reset by each list
        self.bind_memo: dict[Any, Any] = {}

    # -- the runner interface (backends/runner.py) ----------------------------------------
    @property
    def names(self) -> list[str]:
        return [self.name]

    def place(self, t: Tensor, device: int) -> None:
        """One device: every tensor lives on device 0, so placing only checks the index."""
        check_device(t, device, self.names)
        self.placement[t] = device

    def reserve(self, graph: Graph) -> list[ComputeBuffer]:
        """Size the compute buffer on this (worst-case) graph; later graphs of its topology
        are placed at its offsets. The arena itself is allocated by the next run."""
        with self._lock:
            plan = self.allocator.reserve(graph)
            self.backend.prepare_weights(graph.nodes, self)
            # bound calls hold views at the old plan's offsets: the next run plans again
            # (the last run's values stay readable until then: self.plan is kept)
            self._calls = None
            self._bound.clear()
            self._reserved = [ComputeBuffer(self.name, plan)]
            return list(self._reserved)

    @property
    def plans(self) -> list[ComputeBuffer]:
        return list(self._reserved)

    def memory_figures(self, model: ModelMemory) -> MemoryFigures:
        """One device: the weights mapped from the file, the backend's own weight buffers
        (CPU_REPACK), the compute buffer (beside ggml-alloc's size where ours differs) and the
        graph's size; the KV cache is the model's to count."""
        return MemoryFigures(mapped=((self.name, model.mapped_bytes),),
                             model=tuple(self.backend.model_buffers()), kv=(),
                             compute=tuple(self._reserved), nodes=model.graph.n_nodes,
                             baseline=True)

    # -- memory ---------------------------------------------------------------------------
    def storage(self, t: Tensor) -> tuple[Any, int]:
        """(buffer, byte offset) holding t: its host data, static memory, or the arena."""
        return self._storage(t)

    def _storage(self, t: Tensor) -> tuple[Any, int]:
        root = t.owner
        if root.data is not None:
            own = self._own.get(root)
            return (own if own is not None else self.backend.buffers.upload(root)), t.view_offs
        if root.buffer is not None:
            buf = self.static.get(root)
            if buf is None:
                buf = self.static[root] = self._zeros(root.nbytes)
            return buf, t.view_offs
        if self.plan is None:
            raise RuntimeError(f"tensor {t.describe()} has no memory: no plan is active")
        try:
            return self.arena, self.plan.offset(root) + t.view_offs
        except KeyError:
            raise ValueError(f"tensor {t.describe()} is not in the graph this session ran "
                             f"last: another graph ran since, in the same memory (read results "
                             f"before the next run, or use one Session per graph)") from None

    def _zeros(self, nbytes: int) -> Any:
        buf = self.backend.buffers.alloc(nbytes)
        self.backend.buffers.fill(buf, 0)
        return buf

    def arr(self, t: Tensor) -> Any:
        buf, off = self._storage(t)
        return self.backend.buffers.view(buf, off, t)

    def read(self, t: Tensor) -> np.ndarray:
        """Values of t as numpy (float32 / ints), numpy order.

        Refused (RuntimeError) from a thread other than the one that made the last run, and
        (ValueError) for a tensor whose memory the plan freed: later nodes may have reused it.
        """
        with self._lock:
            self.check_reader(t)
            self.check_not_freed(t)
            buf, off = self._storage(t)
            return self.backend.buffers.read(buf, off, t)

    def write(self, t: Tensor, values: np.ndarray) -> None:
        """Store values into t. A leaf with host data (`t.data`) is copied into memory this
        Session owns on its first write (copy-on-write): the caller's array is never written,
        and this Session uses its copy from then on (later runs keep the last value written)."""
        with self._lock:
            root = t.owner
            if root.data is not None and root not in self._own:
                self._own[root] = self._copy_of(root)
                self._own_changed = True
            buf, off = self._storage(t)
            self.backend.buffers.write(buf, off, t, values)

    def _copy_of(self, root: Tensor) -> Any:
        data = np.asarray(root.data)
        if data.nbytes != root.nbytes:
            raise ValueError(f"tensor {root.describe()} carries {data.nbytes} bytes of data, "
                             f"expected {root.nbytes}")
        buf = self.backend.buffers.alloc(root.nbytes)
        self.backend.buffers.write_bytes(buf, 0, data.reshape(-1).view(np.uint8))
        return buf

    def check_not_freed(self, t: Tensor, shown: Tensor | None = None) -> None:
        """ValueError if the active plan freed t's memory (in-place reuse included): its
        bytes may hold a later node's values. Outputs, views of outputs and pre-allocated
        tensors (weights, caches, host data) are never freed. `shown` names t in messages."""
        root, plan = t.owner, self.plan
        # a plan without lifetimes (the conformance canary plan) has no tensor in it
        if (self._in_run or t.is_output or root.is_output or plan is None
                or root not in plan):
            return
        p = plan.placement(root)
        if not p.freed:
            return
        order = plan.order
        user = f" (last used by {order[p.last].label})" if 0 <= p.last < len(order) else ""
        via = f" is a view of {root.label}, which" if root is not t else ""
        raise ValueError(f"tensor {(shown or t).describe()}{via} was freed by the plan at step "
                         f"{p.last}{user}, so later nodes may have overwritten it; mark it with "
                         f"set_output() to read it")

    def fill_arena(self, byte: int) -> None:
        """Fill the compute arena (conformance canaries)."""
        with self._lock:
            self.backend.buffers.fill(self.arena, byte)

    def host_arena(self) -> np.ndarray:
        """The compute arena's bytes on the host."""
        return self.backend.buffers.to_host(self.arena)

    def synchronize(self) -> None:
        """Wait for queued work."""
        self.backend.executor.synchronize()

    # -- running --------------------------------------------------------------------------
    def prepare(self, graph: Graph) -> Any:
        """Plan `graph` (reserving a larger arena when it outgrows the current one)."""
        for t in graph.leafs:
            buffers.check_layout(t)
        for node in graph.nodes:
            buffers.check_layout(node)  # no kernel may be handed a view reaching past its root
            if not self.backend.supports(node):
                raise UnsupportedOpError(
                    f"backend {self.backend.name} cannot run {node.op} on {node.describe()} "
                    f"(sources: {', '.join(s.describe() for s in node.src if s is not None)})")
        with self._lock:
            self._calls = None
            self.plan = self.allocator.alloc(graph, reserve_on_growth=True)
            need = self.plan.size
            if self.arena is None or self.arena.nbytes < need:
                self.arena = self.backend.buffers.alloc(need)
            return self.plan

    def run(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None,
            profile: Profile | None = None, observe: Observer | None = None) -> "Session":
        """Feed `inputs` (see buffers.feed_inputs) and run `graph`; read results afterwards
        from the same thread, or hold `with session:` around run and read. With `profile`
        (or one attached to the session), every kernel call is timed into it. With
        `observe`, the run hands the nodes its observer asks for to its receive as they are
        computed (backends/observe.py); such a run is not timed into a profile."""
        if observe is not None and profile is not None:
            raise ValueError("run: give profile or observe, not both (an observed run's "
                             "callbacks would be timed with its kernels)")
        with self._lock:
            if (graph is not self._graph or self._calls is None) and not self._rebind(graph):
                self._graph = None
                self.prepare(graph)
            self._feed(graph, inputs or {})
            if self._graph is not graph or self._own_changed:
                # bound calls hold views of the arena (valid until the next plan) and of leaf
                # data: a copy-on-write made by this feed must be bound in (and every other
                # graph's calls see the old array: they are dropped)
                if self._own_changed:
                    self._bound.clear()
                self._calls = self._bind(graph)
                self._loop = self.backend.executor.loop(self._calls)
                self._graph = graph
                self._own_changed = False
                self._bound.pop(id(graph), None)
                self._bound[id(graph)] = (graph, BoundGraph(self.plan, self._calls,
                                                            self._groups, self.arena,
                                                            self._loop))
                while len(self._bound) > BOUND_GRAPHS:
                    self._bound.pop(next(iter(self._bound)))
            self.mark_run()
            if observe is not None:
                self._run_observed(graph, observe)
                return self
            profile = profile if profile is not None else self.profile
            with self.running(), self.backend.executor.run_context(graph):
                if profile is None:
                    self._loop()
                else:
                    profile.time_calls(self._calls, self._groups, self.backend.executor.synchronize)
            return self

    def _rebind(self, graph: Graph) -> bool:
        """Make `graph` the bound graph again from the ones kept, if its calls still view
        this arena."""
        kept = self._bound.get(id(graph))
        if kept is None or kept[0] is not graph or kept[1].arena is not self.arena or \
                self.arena is None:
            return False
        b = kept[1]
        self.plan, self._calls, self._groups, self._graph = b.plan, b.calls, b.groups, graph
        self._loop = b.loop
        return True

    @property
    def bound_calls(self) -> list[Callable[[], None]] | None:
        """The calls one run of the bound graph makes, in order (None until a graph is bound):
        what benchmarks replay and tools count as launches. Time them through `profile`."""
        return self._calls

    @property
    def bound_graph(self) -> Graph | None:
        """The graph whose calls are bound (the last one run)."""
        return self._graph

    def take_new_copies(self) -> bool:
        """Whether a write has copied a leaf's data since the last call (copy-on-write: calls
        bound before it still see the old array, so the caller binds again)."""
        with self._lock:
            changed, self._own_changed = self._own_changed, False
            return changed

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Held while kernels run: a kernel written in Python may read its sources through
        `read` (they are live at its step, whatever the plan does with them afterwards)."""
        with self._lock:
            was, self._in_run = self._in_run, True
            try:
                yield
            finally:
                self._in_run = was

    def _bind(self, graph: Graph) -> list[Callable[[], None]]:
        calls, self._groups = self.bind_calls(self.plan_order(graph), fuse=True)
        return calls

    def _run_observed(self, graph: Graph, observer: Observer) -> None:
        """The bound graph's calls bound again with the observer's nodes kept (ask is
        consulted here, in execution order), run step by step; the plain calls stay bound.
        Not keyed to the graph (no thread governor's timing): callbacks run in it."""
        order = self.plan_order(graph)
        steps = self.observed_steps(order, observer.wanted(order), fuse=True)
        with self.running(), self.backend.executor.run_context():
            run_steps(steps, self.value_of, observer.receive)

    def observed_steps(self, nodes: list[Tensor], asked: Collection[Tensor], fuse: bool = False,
                       shown: Mapping[Tensor, Tensor] | None = None) -> list[ObservedStep]:
        """The steps of an observed run of `nodes` (of the prepared graph, as `bind_calls`
        takes them): each call, then the handoffs of the `asked` nodes it computed (views at
        their place). Asked nodes are not fused away (Executor.fuse's `observed`). `shown`:
        the caller's node for each local one (a scheduler's clones)."""
        observed = frozenset(t.owner for t in asked)
        return schedule(nodes, self.bind_groups(nodes, fuse, observed), asked, shown)

    def value_of(self, h: Handoff) -> np.ndarray:
        """A handed node's values (a copy, as `read` gives), from where its call left them;
        during a run, with no check of the plan's lifetimes (the value is current)."""
        if h.held is not None:
            return buffers.read(h.held, h.local.view_offs, h.local)
        buf, off = self._storage(h.local)
        return self.backend.buffers.read(buf, off, h.local)

    def bind(self, nodes: list[Tensor]) -> list[Callable[[], None]]:
        """Zero-argument calls running `nodes` (of the prepared graph) in order; views add
        none. The scheduler binds each split of a device's graph separately."""
        return self.bind_calls(nodes)[0]

    def bind_calls(self, nodes: list[Tensor], fuse: bool = False
                   ) -> tuple[list[Callable[[], None]], list[tuple[Tensor, ...]]]:
        """The calls of `bind` and, for each, the nodes it computes (for profiles). With
        `fuse`, `nodes` is a whole planned graph and the backend's fusion groups run as one
        call each (a split of a scheduled graph is bound unfused: a node's readers in other
        splits are not in `nodes`)."""
        groups = self.bind_groups(nodes, fuse)
        ex = self.backend.executor
        ex.prepare([g.call for g in groups])
        return [ex.direct(g.call) for g in groups], [g.nodes for g in groups]

    def bind_groups(self, nodes: list[Tensor], fuse: bool = False,
                    observed: frozenset[Tensor] = frozenset()) -> list[Group]:
        """`bind_calls` as Groups (backends/fusion_rules.py: a call and the nodes it
        computes; a node nothing computes, a view, has none). `observed`: nodes an observer
        reads after their call, which fusion must not leave unwritten."""
        self.bind_memo = {}  # the calls run in `nodes` order: a binder may leave work to an earlier one
        fused = self.backend.executor.fuse(nodes, self, observed) if fuse else {}
        inside: set[Tensor] = set()
        groups: list[Group] = []
        for node in nodes:
            g = fused.get(node)
            if g is not None:
                groups.append(g)
                inside.update(g.nodes)
                continue
            if node in inside:
                continue
            c = self.bind_node(node)
            if c is not None:
                groups.append(Group((node,), c))
        return groups

    def bind_node(self, node: Tensor) -> Callable[[], None] | None:
        """The call that runs `node` alone (None where it needs none); a fusion group that
        runs other nodes among its own binds them so (backends/cpu/fusion.py)."""
        k = self.backend.kernels[node.op]
        if k.bind:
            return k.fn(node, self)
        return lambda: k.fn(node, self)

    def plan_order(self, graph: Graph) -> list[Tensor]:
        return list(self.plan.order) if self.plan is not None else graph.nodes

    def _feed(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray]) -> None:
        buffers.feed_inputs(graph, inputs, self.write)
