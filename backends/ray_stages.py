"""Pipeline stages on Ray: a model's layers split over actors on one or several machines, driven
by the same schedule as devices in one process (backends/multi.py).

`--devices ray:cpu,ray:cpu` (docs/distributed.md) gives each remote device a Ray actor running a
`StageServer` (backends/stage.py): a backend, its device graphs, its layers' weights (mapped
from the GGUF on its own disk when it has the file, otherwise sent once through Ray's object
store), its slice of the KV cache. `ray:cpu@10.0.0.2` pins a stage to a node by address. The
host keeps the graph inputs, the input and output layers and sampling, as the scheduler
decides. Activations at a cut travel as arrays through the object store: a stage's outputs go
to the next stage as object references, without passing through the host.

Pipelining: a run submits its remote splits and returns; the host's own splits after them
(the output layer) are deferred until a value is read, and dropped when the next run starts
first (they write nothing that outlives the run). An Engine evaluating a prompt in ubatches
reads only the last one's logits, so ubatch u+1 enters stage 1 while ubatch u is in stage 2.
Decode reads every token's logits and stays exact token by token.

Faults: every wait on a stage has a timeout; an actor that dies or a node that disappears
raises StageError naming the stage, and the session refuses further runs (build a new Engine).
Ray is imported here only: `pip install ggraph[distributed]`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ggraph.ir.graph import Graph
from ggraph.plan.sched import Schedule
from ggraph.ir.tensor import Tensor
from .base import Backend
from .buffer_type import BufferType
from . import registry
from .multi import BoundSchedule, MultiSession
from .runner import ComputeBuffer
from .tensor_wire import WireRegistry, tensor_table


class StageError(RuntimeError):
    """A remote stage failed (its actor died, its node went away, or it timed out)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("remote stages (--devices ray:...) need Ray: pip install "
                         "'ggraph[distributed]'") from None
    return ray


@dataclass
class StagePlan:
    """A remote stage's compute buffer as its actor sized it (ComputeBuffer's plan)."""
    size: int
    baseline: Any = None


class RemoteBackend(Backend):
    """What the host knows of a remote stage's backend: its name and kernel table (which nodes
    it may run: the scheduler asks), never its memory."""

    def __init__(self, kind: str, node: str | None = None) -> None:
        if kind not in registry.KINDS:
            raise ValueError(f"unknown stage backend {kind!r}: "
                             f"{', '.join(f'ray:{k}' for k in registry.NAMES)}")
        k = registry.KINDS[kind]
        self.gpus = k.gpus
        self.kind, self.node, self.kernels = kind, node, registry.kernel_table(kind)
        self.name = f"{registry.REMOTE}:{kind}"
        # its memory described (the planner asks the alignment), never held here
        self.buffers = BufferType(self.name.upper(), k.alignment)

    def session(self, **kw: Any) -> "RemoteStage":
        raise RuntimeError("a remote stage's session is made by RayMultiSession")


@dataclass
class _Shipped:
    key: int
    table: list[Tensor]
    index: dict[Tensor, int]
    splits: set[int] = field(default_factory=set)


class RemoteStage:
    """The host's handle on one stage actor: ships graphs and tensors, submits splits."""

    def __init__(self, actor: Any, name: str, backend: RemoteBackend, weights: set[Tensor],
                 timeout: float, ship_weights: bool) -> None:
        self.actor, self.name, self.backend = actor, name, backend
        self.timeout = timeout
        self.wire = WireRegistry()
        self.weights = weights
        self.graphs: dict[Graph, _Shipped] = {}
        self.ship_weights = ship_weights
        self.mapped = False
        self.busy = 0.0  # seconds of kernels the stage reported (pipelining figures)

    def take_new_copies(self) -> bool:
        """Session's question (MultiSession.run asks every session): a stage binds its own
        calls, so a host-side copy never leaves its bound calls stale."""
        return False

    def get(self, ref: Any, what: str) -> Any:
        ray = _ray()
        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise StageError(f"stage {self.name} did not answer within {self.timeout:g} s "
                             f"({what}); the engine must be rebuilt") from None
        except ray.exceptions.RayActorError as e:
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else "actor died"
            raise StageError(f"stage {self.name} died ({what}): {why}; the engine must be "
                             f"rebuilt") from None
        except ray.exceptions.RayTaskError as e:
            raise StageError(f"stage {self.name} failed ({what}): "
                             f"{str(e.cause if hasattr(e, 'cause') else e)[:300]}") from None

    def attach_file(self, path: str, load: Callable[[str], Any]) -> None:
        """Map weights from the stage's own copy of the GGUF, read by `load`, when it has
        this file."""
        if not self.ship_weights:
            self.mapped = bool(self.get(self.actor.has_file.remote(
                path, os.path.getsize(path), load), "opening the model file"))

    def ship(self, g: Graph) -> _Shipped:
        """Send device graph g (and the tensors it reaches for the first time) once."""
        s = self.graphs.get(g)
        if s is not None:
            return s
        table = tensor_table(g.nodes, g.leafs)
        blob, new = self.wire.dumps((g, table), self.weights)
        if new:
            specs = [spec for spec, _ in new]
            wants = self.get(self.actor.wants_values.remote(specs), "describing tensors")
            data = [np.asarray(t.data) for (spec, t), w in zip(new, wants) if w]
            self.get(self.actor.add_tensors.remote(specs, *data), "receiving tensors")
        s = _Shipped(len(self.graphs), table, {t: i for i, t in enumerate(table)})
        self.get(self.actor.load_graph.remote(s.key, blob), "receiving a graph")
        self.graphs[g] = s
        while len(self.graphs) > 8:
            self.graphs.pop(next(iter(self.graphs)))
        return s

    # -- the Session methods MultiSession calls ---------------------------------------------
    def prepare(self, g: Graph) -> None:
        self.ship(g)

    def reserve(self, g: Graph) -> list[ComputeBuffer]:
        s = self.ship(g)
        size = self.get(self.actor.reserve.remote(s.key), "sizing its compute buffer")
        return [ComputeBuffer(self.name, StagePlan(size))]  # type: ignore[arg-type]

    def running(self) -> Any:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def check_not_freed(self, t: Tensor, shown: Tensor | None = None) -> None:
        pass


@dataclass
class _RemoteStep:
    """A split on a remote stage: where its inputs come from, what it must return."""
    stage: RemoteStage
    key: int
    k: int
    copies: list[tuple[Tensor, Tensor, int]]
    outputs: list[Tensor]


class RayMultiSession(MultiSession):
    """MultiSession whose remote devices are stage actors (their `sessions` entries are
    RemoteStage handles)."""

    def __init__(self, backends: Sequence[Backend], names: Sequence[str], path: str,
                 weights: set[Tensor], load: Callable[[str], Any], strategy: str = "default",
                 timeout: float = 60.0, pipeline: bool = True, ship_weights: bool = False,
                 threads: int | None = None) -> None:
        ray = _ray()
        self.timeout, self.pipeline = timeout, pipeline
        self.broken: str | None = None
        # the stages' kernel seconds, collected once stage_busy() is first called (benchmarks);
        # None otherwise: a long generation must not pile up references to them
        self._busy_refs: list[tuple[RemoteStage, Any]] | None = None
        self._effects: list[bool] = []
        self._pending: Callable[[], None] | None = None
        self._pending_effects = False
        local = [b if not isinstance(b, RemoteBackend) else _placeholder(b) for b in backends]
        super().__init__(local, names=names, strategy=strategy)
        self.backends = list(backends)
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)
        from .stage import StageServer

        actor_cls = ray.remote(StageServer)
        self.actors = []
        for d, b in enumerate(backends):
            if not isinstance(b, RemoteBackend):
                continue
            opts: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0}
            if b.gpus:
                opts["num_gpus"] = b.gpus
            if b.node:
                opts["resources"] = {f"node:{b.node}": 0.001}
            actor = actor_cls.options(**opts).remote(b.kind, self._names[d], threads, strategy)
            self.actors.append(actor)
            stage = RemoteStage(actor, self._names[d], b, weights, timeout, ship_weights)
            stage.get(actor.ping.remote(), "starting; a cluster short of CPUs (or GPUs) for "
                      "another stage leaves it waiting")
            stage.attach_file(path, load)
            self.sessions[d] = stage  # type: ignore[call-overload]

    def remote(self, d: int) -> bool:
        return isinstance(self.sessions[d], RemoteStage)

    # -- binding ------------------------------------------------------------------------------
    def _bind(self, sch: Schedule) -> BoundSchedule:
        steps: list[Any] = []
        self._effects = []
        for k, split in enumerate(sch.splits):
            d = split.device
            copies = [(sch.local(t, sch.device_of(t)), sch.copies[(t, d)], sch.device_of(t))
                      for t in split.inputs]
            self._effects.append(not self.remote(d) and any(_writes_cache(n)
                                                             for n in split.nodes))
            if self.remote(d):
                stage: RemoteStage = self.sessions[d]  # type: ignore[assignment]
                shipped = stage.ship(sch.device_graphs[d])
                nodes = [shipped.index[sch.clones[n]] for n in split.nodes]
                stage.get(stage.actor.set_split.remote(shipped.key, k, nodes), "binding")
                steps.append(_RemoteStep(stage, shipped.key, k, copies, []))
            else:
                steps.append((copies, d, self.sessions[d].bind([sch.clones[n]
                                                                  for n in split.nodes])))
        # what each remote split must return: what later splits on other devices copy from it
        last_on: dict[int, _RemoteStep] = {}
        for k, split in enumerate(sch.splits):
            st = steps[k]
            for src_t, _, sd in (st.copies if isinstance(st, _RemoteStep) else st[0]):
                if self.remote(sd) and src_t not in last_on[sd].outputs:
                    last_on[sd].outputs.append(src_t)
            if isinstance(st, _RemoteStep):
                last_on[split.device] = st
        return BoundSchedule(sch, steps)

    # -- running --------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken:
            raise StageError(f"this session lost a stage ({self.broken}); build a new Engine")

    def run(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None,
            observe: Any = None) -> "RayMultiSession":
        if observe is not None:
            raise ValueError("observe: a runner with remote stages cannot hand node values "
                             "over yet; run the model on local devices to observe it")
        with self._lock:
            self._check()
            self._finish_pending(drop=True)
            try:
                self._ready(graph, inputs)
                self._run_steps(self._bound.steps)
            except StageError as e:
                self.broken = str(e)
                raise
            return self

    def _run_steps(self, steps: list[Any]) -> None:
        produced: dict[tuple[int, Tensor], tuple[Any, int, RemoteStage]] = {}
        remote_seen = False
        for k, st in enumerate(steps):
            if isinstance(st, _RemoteStep):
                remote_seen = True
                spec, args = [], []
                d = self._index_of(st.stage)
                shipped = st.stage.graphs[self._bound.sch.device_graphs[d]]
                for src_t, copy_t, sd in st.copies:
                    if self.remote(sd):
                        ref, item, _ = produced[(sd, src_t)]
                        spec.append((shipped.index[copy_t], len(args), item))
                        args.append(ref)
                    else:
                        spec.append((shipped.index[copy_t], len(args), -1))
                        args.append(self._bytes_of(self.sessions[sd], src_t))
                outs = [shipped.index[t] for t in st.outputs]
                ref = st.stage.actor.run_split.options(num_returns=2).remote(
                    st.key, st.k, spec, outs, *args)
                for j, t in enumerate(st.outputs):
                    produced[(d, t)] = (ref[0], j, st.stage)
                if self._busy_refs is not None:
                    self._busy_refs.append((st.stage, ref[1]))
                if not self.pipeline:
                    st.stage.get(ref[1], f"split {k}")
                continue
            rest = steps[k:]
            if remote_seen and self.pipeline and all(not isinstance(s, _RemoteStep)
                                                    for s in rest):
                # the host's tail (output layer): run when a value is read, or dropped when
                # the next run starts first; one that writes a cache runs before that run
                self._pending = lambda rest=rest, produced=produced: self._run_local(
                    rest, produced)
                self._pending_effects = any(self._effects[k:])
                return
            self._run_local([st], produced)

    def _run_local(self, steps: list[Any], produced: dict) -> None:
        cache: dict[Any, list[np.ndarray]] = {}
        for copies, d, calls in steps:
            dst = self.sessions[d]
            for src_t, copy_t, sd in copies:
                if self.remote(sd):
                    ref, item, stage = produced[(sd, src_t)]
                    vals = cache.get(ref)
                    if vals is None:
                        vals = cache[ref] = stage.get(ref, "sending activations")
                    self._put(dst, copy_t, np.asarray(vals[item]))
                else:
                    self._copy(self.sessions[sd], src_t, dst, copy_t)
            with dst.running(), dst.backend.executor.run_context():
                for call in calls:
                    call()

    def _finish_pending(self, drop: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and (not drop or self._pending_effects):
            try:
                pending()
            except StageError as e:
                self.broken = str(e)
                raise

    def _index_of(self, stage: RemoteStage) -> int:
        return self.sessions.index(stage)  # type: ignore[arg-type]

    # -- values -----------------------------------------------------------------------------------
    def read(self, t: Tensor) -> np.ndarray:
        with self._lock:
            self._check()
            self._finish_pending(drop=False)
            s, local = self._where(t)
            if isinstance(s, RemoteStage):
                shipped = s.graphs[self._bound.sch.device_graphs[self._index_of(s)]]
                return s.get(s.actor.read.remote(shipped.key, shipped.index[local]), "reading")
            return super().read(t)

    def synchronize(self) -> None:
        for s in self.sessions:
            s.synchronize()

    def stage_busy(self) -> float:
        """Seconds of kernels the stages reported since the last call (waits for them); the
        first call starts the collection and returns 0."""
        refs, self._busy_refs = self._busy_refs or [], []
        return sum(stage.get(r, "reporting its time") for stage, r in refs)

    def shutdown(self) -> None:
        ray = _ray()
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []


def _placeholder(b: RemoteBackend) -> Backend:
    """A host-side stand-in while MultiSession builds its sessions (replaced by the stage)."""
    from .cpu import CPUBackend

    return CPUBackend(n_threads=1)


def _writes_cache(n: Tensor) -> bool:
    """A node that stores into a preallocated tensor other than a weight (a KV cache)."""
    from ggraph.ir.opkind import OpKind

    if n.op not in (OpKind.SET_ROWS, OpKind.CPY) or not n.src or n.src[0] is None:
        return False
    owner = n.src[0].owner
    return owner.buffer is not None and owner.buffer != "model"
