"""Running one graph across several backends: a Session per device, driven split by split.

`MultiSession` is what `Backend.session()` is for one device: `run(graph, inputs)`,
`read(t)`, `write(t, values)`. It schedules the graph with ggraph.plan.sched (cached per graph),
plans each device's graph with that device's allocator (reserve() sizes each compute buffer
on a worst-case graph, as ggml_backend_sched_reserve does), binds each split's kernel calls,
and runs: copy the split's inputs in from the devices holding them, then the split's calls.
With `observe` (backends/observe.py) each split's calls are bound again, the observer's nodes
handed over as they are computed, device by device, under the caller's original nodes.

Like a Session it may be shared between threads: run/read/write serialise on its lock, a read
from a thread other than the last run's is refused, and `with multi:` holds the lock across
a run and its reads. Both implement the Runner interface of backends/runner.py, so a caller
(the Engine) holds either without asking which.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ggraph.codecs import buffers
from ggraph.plan.alloc import GraphAllocator
from ggraph.ir.graph import Graph
from ggraph.plan.sched import Schedule, schedule_graph
from ggraph.ir.tensor import Tensor

from .base import Backend, Session
from .observe import ObservedStep, Observer, run_steps
from . import registry
from .runner import ComputeBuffer, MemoryFigures, ModelMemory, Offload, ThreadGuard, check_device


@dataclass
class BoundSchedule:
    """A scheduled graph with every device planned and every split's calls bound."""
    sch: Schedule
    steps: list[tuple[list[tuple[Tensor, Tensor, int]], int, list[Callable[[], None]]]]


class MultiSession(ThreadGuard):
    """Sessions over `backends` (priority order, the host last: graph inputs are written
    there) with weights and caches placed by `placement` (tensor -> device index)."""

    def __init__(self, backends: Sequence[Backend], placement: Mapping[Tensor, int] | None = None,
                 names: Sequence[str] | None = None, strategy: str = "default") -> None:
        if not backends:
            raise ValueError("MultiSession needs at least one backend")
        self.backends = list(backends)
        self._names = list(names) if names is not None else _default_names(self.backends)
        if len(self._names) != len(self.backends):
            raise ValueError(f"{len(self._names)} names for {len(self.backends)} backends")
        self.host = len(self.backends) - 1
        self.placement: dict[Tensor, int] = {}
        for t, d in (placement or {}).items():
            self.place(t, d)
        self.sessions = [b.session(allocator=GraphAllocator(
            alignment=b.buffers.alignment, strategy=strategy, name=n, keep_order=True))
            for b, n in zip(self.backends, self._names)]
        self._schedules: dict[Graph, tuple[Graph, Schedule]] = {}
        self._bound: BoundSchedule | None = None
        self._bound_graph: Graph | None = None
        ThreadGuard.__init__(self)                # run/read/write take turns
        self._reserved: list[ComputeBuffer] = []  # what the last reserve() returned

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def place(self, t: Tensor, device: int) -> None:
        check_device(t, device, self._names)
        self.placement[t] = device

    # -- planning -----------------------------------------------------------------------------
    def schedule(self, graph: Graph) -> Schedule:
        hit = self._schedules.get(graph)
        if hit is not None and hit[0] is graph:
            return hit[1]
        sch = schedule_graph(graph, self._names, [b.supports for b in self.backends],
                             self.placement, self.host)
        self._schedules[graph] = (graph, sch)
        while len(self._schedules) > 4:
            self._schedules.pop(next(iter(self._schedules)))
        return sch

    def reserve(self, graph: Graph) -> list[ComputeBuffer]:
        """Size every device's compute buffer on this (worst-case) graph, each through its
        device's Session (as ggml_backend_sched_reserve does per backend); host last."""
        with self._lock:
            sch = self.schedule(graph)
            # bound split calls hold the old plans' offsets: the next run plans again
            self._bound = self._bound_graph = None
            self._reserved = [s.reserve(g)[0] for s, g in zip(self.sessions, sch.device_graphs)]
            return list(self._reserved)

    @property
    def plans(self) -> list[ComputeBuffer]:
        return list(self._reserved)

    @property
    def buffer_sizes(self) -> list[int]:
        return [s.allocator.buffer_size for s in self.sessions]

    def _prepare(self, graph: Graph) -> Schedule:
        sch = self.schedule(graph)
        for s, g in zip(self.sessions, sch.device_graphs):
            s.prepare(g)
        return sch

    def _bind(self, sch: Schedule) -> BoundSchedule:
        steps = []
        for split in sch.splits:
            d = split.device
            copies = [(sch.local(t, sch.device_of(t)), sch.copies[(t, d)], sch.device_of(t))
                      for t in split.inputs]
            calls = self.sessions[d].bind([sch.clones[n] for n in split.nodes])
            steps.append((copies, d, calls))
        return BoundSchedule(sch, steps)

    # -- running ------------------------------------------------------------------------------
    def run(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None,
            observe: Observer | None = None) -> "MultiSession":
        """Run `graph` split by split; with `observe`, hand the nodes its observer asks for
        (the caller's nodes, not the devices' clones) to its receive as they are computed."""
        with self._lock:
            self._ready(graph, inputs)
            if observe is not None:
                self._run_observed(observe)
                return self
            with contextlib.ExitStack() as running:
                for s in self.sessions:      # kernels may read their sources (Session.running)
                    running.enter_context(s.running())
                for copies, d, calls in self._bound.steps:
                    dst = self.sessions[d]
                    for src_t, copy_t, sd in copies:
                        self._copy(self.sessions[sd], src_t, dst, copy_t)
                    with dst.backend.executor.run_context():
                        for call in calls:
                            call()
            for s in self.sessions:
                s.synchronize()
            return self

    def _run_observed(self, observer: Observer) -> None:
        """Every split bound again for the observer (ask consulted for each node, in
        execution order, before anything runs), then run as `run` does, step by step; a
        receive returning False ends the run there."""
        sch = self._bound.sch
        legs: list[tuple[list[tuple[Tensor, Tensor, int]], Session, list[ObservedStep]]] = []
        # asked over the whole graph first: a node may stand for one another split computes
        wanted = set(observer.wanted([n for split in sch.splits for n in split.nodes]))
        for (copies, d, _), split in zip(self._bound.steps, sch.splits):
            shown = {sch.clones[n]: n for n in split.nodes}
            asked = [c for c, n in shown.items() if n in wanted]
            s = self.sessions[d]
            legs.append((copies, s, s.observed_steps(list(shown), asked, shown=shown)))
        with contextlib.ExitStack() as running:
            for s in self.sessions:
                running.enter_context(s.running())
            for copies, dst, steps in legs:
                for src_t, copy_t, sd in copies:
                    self._copy(self.sessions[sd], src_t, dst, copy_t)
                with dst.backend.executor.run_context():
                    if not run_steps(steps, dst.value_of, observer.receive):
                        break
        for s in self.sessions:
            s.synchronize()

    def _ready(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None) -> None:
        """Schedule, plan and bind `graph` (unless it is the one bound), feed its inputs."""
        if graph is not self._bound_graph or self._bound is None:
            self._bound = self._bound_graph = None
            sch = self._prepare(graph)
        else:
            sch = self._bound.sch
        buffers.feed_inputs(graph, inputs or {}, self.write)
        copied = [s.take_new_copies() for s in self.sessions]
        if self._bound is None or any(copied):
            # the feed may have copied leaf data on write (Session.write): bind that copy
            self._bound = self._bind(sch)
            self._bound_graph = graph
        self.mark_run()

    def _copy(self, src: Session, t: Tensor, dst: Session, c: Tensor) -> None:
        self._put(dst, c, self._bytes_of(src, t))

    @staticmethod
    def _bytes_of(src: Session, t: Tensor) -> np.ndarray:
        """t's bytes on the host, once src's queued work is done."""
        sbuf, soff = src.storage(t)
        src.synchronize()
        return src.backend.buffers.read_bytes(sbuf, soff, t.nbytes)

    @staticmethod
    def _put(dst: Session, c: Tensor, data: np.ndarray) -> None:
        dbuf, doff = dst.storage(c)
        dst.backend.buffers.write_bytes(dbuf, doff, data)

    # -- values -------------------------------------------------------------------------------
    def _where(self, t: Tensor) -> tuple[Session, Tensor]:
        sch = self._bound.sch if self._bound is not None else None
        if sch is None or (t.op is not None and t not in sch.clones):
            if t.op is not None:
                raise ValueError(f"tensor {t.describe()} is not a node of the graph last run")
            return self.sessions[self.placement.get(t.owner, self.host)], t
        d = sch.device_of(t)
        return self.sessions[d], sch.local(t, d)

    def read(self, t: Tensor) -> np.ndarray:
        """Values of t; refused from a thread other than the last run's, and for a tensor
        whose memory its device's plan freed (mark it with set_output() to keep it)."""
        with self._lock:
            self.check_reader(t)
            s, local = self._where(t)
            s.check_not_freed(local, shown=t)
            s.synchronize()
            return s.read(local)

    def write(self, t: Tensor, values: np.ndarray) -> None:
        with self._lock:
            s, local = self._where(t)
            s.write(local, values)

    def synchronize(self) -> None:
        for s in self.sessions:
            s.synchronize()

    # -- memory figures -------------------------------------------------------------------------
    def memory_figures(self, model: ModelMemory) -> MemoryFigures:
        """Where the layers went, each device's weights and KV cache (from where its tensors
        were placed), the compute buffers as reserved, and the graph's nodes and splits."""
        names = self._names
        weights = [0] * len(names)
        kv = [0] * len(names)
        seen: set[Tensor] = set()
        for t in model.graph.leafs:
            d = self.placement.get(t)
            if d is None or t in seen:
                continue
            seen.add(t)
            (kv if t in model.kv else weights)[d] += t.nbytes
        lm = model.layers
        offload = Offload(sum(lm.count(i) for i in range(self.host)), len(lm.layers),
                          tuple((n, lm.count(i)) for i, n in enumerate(names)), names[lm.output])
        return MemoryFigures(mapped=(), model=tuple((n, w) for n, w in zip(names, weights) if w),
                             kv=tuple((n, b) for n, b in zip(names, kv) if b),
                             compute=tuple(self._reserved), nodes=model.graph.n_nodes,
                             splits=self.schedule(model.graph).n_splits, offload=offload)


def _default_names(backends: Sequence[Backend]) -> list[str]:
    """CUDA0, CUDA1, ... for devices and CPU for the host (llama.cpp's names); CPU backends
    standing in for devices are CPU1, CPU2, ..."""
    counts: dict[str, int] = {}
    out = []
    for b in backends[:-1]:
        kind = registry.KINDS.get(b.name)
        k = kind.label if kind is not None else b.name.upper()
        # the host is the bare label (CPU): a device of the host's kind counts from 1
        i = counts.get(k, 1 if kind is not None and kind.threads else 0)
        counts[k] = i + 1
        out.append(f"{k}{i}")
    return out + [backends[-1].name.upper()]
