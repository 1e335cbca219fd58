"""Backend conformance (ggraph's test-backend-ops): run every op case on a backend and on the
reference executor, compare by NMSE, and catch out-of-bounds writes with canaries.

Each planned tensor gets its own slot framed by canary bytes (CanaryAllocator), so any byte a
kernel writes outside its output is found; leafs with host data are checked unchanged.

The in-place mode (run_case_inplace, `ggraph conformance --inplace`) runs each case of an op
that ggml-alloc may run in place (OpDef.inplace) with its result in its source's memory: the
source is made a planned intermediate (a `cont` of the case's input), the real allocator plans
the graph, the plan must have handed the source's memory to the result (Placement.reused, same
offset; a plan that did not is a failure), and the backend runs in that plan's arena.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from ggraph.plan.alloc import GraphAllocator
from ggraph.plan.alloc_trace import same_layout
from ggraph.ir.graph import Graph, build_graph
from ggraph.ir.opkind import OpKind
from ggraph.ops.case import Case
from ggraph.ops.registry import REGISTRY, ops_where
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Tensor

CANARY = 64                     # bytes of canary before and after every planned tensor
CANARY_BYTE = 0xA5


def nmse(ref: np.ndarray, got: np.ndarray) -> float:
    """sum((ref - got)^2) / sum(ref^2) in float64 (0 when both are all zero)."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    g = np.asarray(got, dtype=np.float64).ravel()
    num = float(np.sum((r - g) ** 2))
    den = float(np.sum(r * r))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def compare(ref: np.ndarray, got: np.ndarray, tol: float) -> tuple[bool, float, str]:
    """ggml's rules: NaN fails, infinities must match in sign, finite parts by NMSE."""
    r = np.asarray(ref, dtype=np.float64)
    g = np.asarray(got, dtype=np.float64)
    if r.shape != g.shape:
        return False, float("inf"), f"shape {g.shape} != {r.shape}"
    if np.isnan(g).any() and not np.array_equal(np.isnan(g), np.isnan(r)):
        return False, float("nan"), f"NaN at {np.argwhere(np.isnan(g))[0].tolist()}"
    inf_r, inf_g = np.isinf(r), np.isinf(g)
    if not np.array_equal(inf_r, inf_g) or not np.array_equal(r[inf_r], g[inf_g]):
        return False, float("inf"), "infinities differ"
    fin = np.isfinite(r) & np.isfinite(g)
    err = nmse(r[fin], g[fin])
    return err <= tol, err, ""


class CanaryPlan:
    """Every planned tensor in its own slot with canary bytes on both sides."""

    def __init__(self, graph: Graph, alignment: int) -> None:
        self.order = list(graph.nodes)
        self.slots: dict[Tensor, tuple[int, int]] = {}   # root -> (offset, bytes)
        pad = -(-CANARY // alignment) * alignment
        cur = pad
        for t in list(graph.leafs) + list(graph.nodes):
            root = t.owner
            if root.is_preallocated or root in self.slots:
                continue
            self.slots[root] = (cur, root.nbytes)
            cur += -(-max(root.nbytes, 1) // alignment) * alignment + pad
        self.size = cur
        self._graph = graph

    def offset(self, t: Tensor) -> int:
        return self.slots[t][0]

    def __contains__(self, t: Tensor) -> bool:
        return False   # no lifetimes: every tensor keeps its own slot, nothing is freed

    def placement(self, t: Tensor) -> Any:
        raise KeyError(f"the canary plan keeps no lifetimes ({t.label})")

    def canary_damage(self, arena: np.ndarray) -> list[str]:
        """Names of tensors whose surrounding bytes changed."""
        arena = np.asarray(arena)
        clean = np.full(arena.nbytes, CANARY_BYTE, np.uint8)
        for off, n in self.slots.values():
            clean[off:off + n] = arena[off:off + n]
        bad = np.flatnonzero(clean != arena)
        if bad.size == 0:
            return []
        names = []
        for t in self._graph.nodes:
            if t.owner in self.slots:
                off, n = self.slots[t.owner]
                if np.any((bad >= off - CANARY) & (bad < off + n + CANARY)):
                    names.append(t.describe())
        return names or [f"{bad.size} bytes at offsets {bad[:4].tolist()}..."]


class CanaryAllocator:
    """Each tensor in its own slot between canaries (the Allocator of ggraph.plan.alloc)."""

    def __init__(self, alignment: int, name: str = "CPU") -> None:
        self.alignment, self.name = alignment, name
        self.plan: CanaryPlan | None = None

    def alloc(self, graph: Graph, reserve_on_growth: bool = True) -> CanaryPlan:
        self.plan = CanaryPlan(graph, self.alignment)
        return self.plan

    def reserve(self, graph: Graph) -> CanaryPlan:
        return self.alloc(graph)


@dataclass
class Result:
    case: Case
    status: str                  # OK, FAIL, not supported, skipped (in-place mode only)
    nmse: float = 0.0
    detail: str = ""
    seconds: float = 0.0
    perf: str = ""
    variant: str = ""            # the in-place mode: "in place on src0", ...

    @property
    def label(self) -> str:
        return f"{self.case.label} {self.variant}" if self.variant else self.case.label

    def line(self) -> str:
        tail = f" (nmse={self.nmse:.2e}{', ' + self.detail if self.detail else ''})" \
            if self.status == "FAIL" else f" ({self.detail})" if self.status == "skipped" \
            else ""
        perf = f" {self.perf}" if self.perf else ""
        return f"  {self.label}: {self.status}{tail}{perf}"


def run_case(case: Case, backend: Any, reference: Any = None) -> Result:
    """One case on `backend`, judged against the reference executor (or `reference`)."""
    builder, out = case.make()
    out.set_output()
    graph = build_graph(out)
    unsupported = [n for n in graph.nodes if not backend.supports(n)]
    if unsupported:
        return Result(case, "not supported", detail=unsupported[0].describe())
    expected = _expected(graph, out, reference)
    if isinstance(expected, str):
        return Result(case, "not supported", detail=expected)
    leaf_data = {t: t.data.copy() for t in graph.leafs if t.data is not None}
    alloc = CanaryAllocator(backend.buffers.alignment, backend.name.upper())
    session = backend.session(allocator=alloc)
    got, dt = _run_framed(session, graph, out)
    problems = [f"canary overwritten around {n}" for n in
                alloc.plan.canary_damage(session.host_arena())]
    problems += [f"input {t.describe()} modified" for t in graph.leafs
                 if t in leaf_data and not np.array_equal(t.data, leaf_data[t])]
    ok, err, why = compare(expected, got, case.tol)
    if problems:
        return Result(case, "FAIL", err, "; ".join(problems), dt)
    return Result(case, "OK" if ok else "FAIL", err, why, dt)


def _expected(graph: Graph, out: Tensor, reference: Any) -> np.ndarray | str:
    """The reference's values of `out`, or why the reference cannot compute them."""
    if reference is not None and hasattr(reference, "supports"):
        ok, why = reference.supports(graph)
        if not ok:
            return f"by the reference: {why}"
    try:
        return (reference.run(graph, out) if reference is not None
                else run_reference(graph).read(out))
    except NotImplementedError as e:  # a reference that cannot express this case
        return f"by the reference: {e}"


def _run_framed(session: Any, graph: Graph, out: Tensor) -> tuple[np.ndarray, float]:
    """Plan, fill the arena with canaries, run once (timed) and read `out`."""
    session.prepare(graph)
    _fill_canaries(session)
    t0 = time.perf_counter()
    session.run(graph)
    dt = time.perf_counter() - t0
    return session.read(out), dt


def _fill_canaries(session: Any) -> None:
    session.fill_arena(CANARY_BYTE)


def cases_for(ops: Iterable[OpKind] | None = None, perf: bool = False) -> Iterator[Case]:
    for kind, opdef in REGISTRY.items():
        if ops is not None and kind not in ops:
            continue
        for c in (opdef.cases() if opdef.cases else ()):
            if c.perf == perf:
                yield c


def perf_case(case: Case, backend: Any, min_seconds: float = 0.5) -> Result:
    """Time a case's graph (after one warm-up run that compiles kernels)."""
    _, out = case.make()
    graph = build_graph(out)
    if not all(backend.supports(n) for n in graph.nodes):
        return Result(case, "not supported")
    session = backend.session()
    session.run(graph)
    n, t0 = 0, time.perf_counter()
    while True:
        session.run(graph)
        session.synchronize()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            break
    per = dt / n
    if case.flops is not None:
        perf = f"{case.flops(out) / per / 1e9:.2f} GFLOPS"
    else:
        moved = sum(s.nbytes for s in out.src if s is not None) + out.nbytes
        perf = f"{moved / per / 1e9:.2f} GB/s"
    return Result(case, "OK", seconds=per, perf=f"{per * 1e6:.0f} us/run, {perf}")


@dataclass
class Summary:
    backend: str
    results: list[Result] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(r.status == "OK" for r in self.results)

    @property
    def tested(self) -> int:
        return sum(r.status not in ("not supported", "skipped") for r in self.results)

    @property
    def skipped(self) -> int:
        return sum(r.status == "skipped" for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.status == "FAIL" for r in self.results)

    def to_json(self) -> dict:
        return {"backend": self.backend, "passed": self.passed, "tested": self.tested,
                "skipped": self.skipped,
                "cases": [{"case": r.label, "op": r.case.op.name, "status": r.status,
                           "nmse": r.nmse, "detail": r.detail, "seconds": r.seconds,
                           "perf": r.perf} for r in self.results]}


# -- in place: the result in its source's memory, under the real planner ------------------------

class NoInPlaceSource(ValueError):
    """A case none of whose sources can hold its result (ggml-alloc never runs it in place)."""


def inplace_ops() -> tuple[OpKind, ...]:
    """The ops ggml-alloc may run in place (OpDef.inplace), in registration order."""
    return ops_where(lambda d: d.inplace)


def inplace_sources(node: Tensor) -> list[int]:
    """Positions of `node`'s sources whose memory ggml-alloc may hand to `node`: those with the
    result's type, shape and strides (ggml_gallocr_allocate_node's layout rule). ggml takes the
    first of them that the planner owns and nothing else reads."""
    return [k for k, s in enumerate(node.src) if s is not None and same_layout(node, s)]


def cases_inplace(ops: Iterable[OpKind] | None = None
                  ) -> Iterator[tuple[Case, int | None]]:
    """(case, source position) for each source of each case of the in-place ops that can hold
    the case's result, and (case, None) for a case where none can (a strided source, a
    broadcast operand): run_case_inplace reports those as skipped. Naming an op that never runs
    in place is a ValueError."""
    if ops is None:
        chosen = list(inplace_ops())
    else:
        chosen = list(ops)
        never = [k for k in chosen if not REGISTRY[k].inplace]
        if never:
            raise ValueError(f"{', '.join(k.value for k in never)} never "
                             f"{'runs' if len(never) == 1 else 'run'} in place "
                             f"(OpDef.inplace is False); the in-place ops are "
                             f"{', '.join(k.value for k in inplace_ops())}")
    for case in cases_for(chosen):
        srcs = inplace_sources(case.make()[1])
        if not srcs:
            yield case, None
        for k in srcs:
            yield case, k


def inplace_graph(case: Case, src: int | None = None) -> tuple[Graph, Tensor, Tensor]:
    """The case's graph rebuilt so that the planner can run its op node in place on source
    `src` (default: the first source that can hold the result, the one ggml-alloc takes):
    that source, a leaf with host data in the case, becomes a planned intermediate, a `cont`
    of it that only the op node reads. Returns (graph, op node, that source). Raises
    NoInPlaceSource when `src` is None and no source can hold the result, ValueError when the
    given `src` cannot."""
    from ggraph.ops.views import cont

    _, out = case.make()
    if out.op != case.op:
        raise ValueError(f"{case.label}: the case's result is a {out.op} node, not {case.op}")
    can = inplace_sources(out)
    if src is None:
        if not can:
            srcs = ", ".join(f"src{k} {_layout(s)}" for k, s in enumerate(out.src)
                             if s is not None)
            raise NoInPlaceSource(f"no source has the result's layout {_layout(out)} ({srcs}): "
                                  f"ggml-alloc never runs it in place")
        src = can[0]
    elif src not in can:
        raise ValueError(f"{case.label}: source {src} cannot hold the result (sources with the "
                         f"result's layout: {can})")
    source = out.src[src]
    if source.op is None or source.view_src is not None or source.is_preallocated:
        source = cont(source, name=f"src{src} (planned)")
    srcs = list(out.src)
    srcs[src] = source
    node = Tensor(out.ctx, out.type, out.ne, out.nb, out.op, out.params, srcs,
                  name=out.name or f"{case.op.value} (in place)")
    node.set_output()
    return build_graph(node), node, source


def _layout(t: Tensor) -> str:
    return f"{t.type} ne={list(t.ne)} nb={list(t.nb)}"


class FramedPlan:
    """A real allocator plan moved `pad` bytes into an arena framed by canary bytes: offsets,
    order and lifetimes are the plan's own (`inner`), tensors overlap as it planned them."""

    def __init__(self, plan: Any, pad: int) -> None:
        self.inner, self.pad = plan, pad
        self.size = plan.size + 2 * pad
        self.order = plan.order

    def __contains__(self, t: Tensor) -> bool:
        return t in self.inner

    def placement(self, t: Tensor) -> Any:
        return self.inner.placement(t)

    def offset(self, t: Tensor) -> int:
        return self.inner.offset(t) + self.pad

    def address(self, t: Tensor) -> int:
        return self.inner.address(t) + self.pad

    def canary_damage(self, arena: np.ndarray) -> list[str]:
        """Names of tensors near a changed byte that no planned tensor covers (the frame, the
        gaps between tensors and the alignment padding after each)."""
        arena = np.asarray(arena)
        covered = np.zeros(arena.nbytes, bool)
        spans = [(self.pad + p.offset, p.size, p.tensor)
                 for p in self.inner.placements.values()]
        for off, n, _ in spans:
            covered[off:off + n] = True
        bad = np.flatnonzero(~covered & (arena != CANARY_BYTE))
        if bad.size == 0:
            return []
        names = [t.describe() for off, n, t in spans
                 if np.any((bad >= off - CANARY) & (bad < off + n + CANARY))]
        return names or [f"{bad.size} bytes at offsets {(bad - self.pad)[:4].tolist()}..."]


class FramedAllocator:
    """Plans with the real allocator (`inner`, e.g. GraphAllocator) and frames each plan."""

    def __init__(self, inner: Any, alignment: int) -> None:
        self.inner = inner
        self.alignment = alignment
        self.name = inner.name               # a Session names its device after its allocator
        self.pad = -(-CANARY // alignment) * alignment
        self.plan: FramedPlan | None = None

    def alloc(self, graph: Graph, reserve_on_growth: bool = True) -> FramedPlan:
        self.plan = FramedPlan(self.inner.alloc(graph, reserve_on_growth=reserve_on_growth),
                               self.pad)
        return self.plan

    def reserve(self, graph: Graph) -> FramedPlan:
        self.plan = FramedPlan(self.inner.reserve(graph), self.pad)
        return self.plan


def run_case_inplace(case: Case, backend: Any, reference: Any = None, src: int | None = None,
                     allocator: Any = None) -> Result:
    """One case with its result in the memory of source `src` (default: the source ggml-alloc
    takes), planned by the real allocator (`allocator`, default the one a Session uses).

    FAIL when the plan did not hand the source's memory to the result, when the values are
    off (NMSE, the case's tolerance), when a byte outside every planned tensor changed, or
    when a leaf with host data changed; skipped when no source can hold the result."""
    try:
        graph, node, source = inplace_graph(case, src)
    except NoInPlaceSource as e:
        return Result(case, "skipped", detail=str(e))
    variant = f"in place on src{node.src.index(source)}"
    unsupported = [n for n in graph.nodes if not backend.supports(n)]
    if unsupported:
        return Result(case, "not supported", detail=unsupported[0].describe(), variant=variant)
    expected = _expected(graph, node, reference)
    if isinstance(expected, str):
        return Result(case, "not supported", detail=expected, variant=variant)
    leaf_data = {t: t.data.copy() for t in graph.leafs if t.data is not None}
    if allocator is None:
        allocator = GraphAllocator(alignment=backend.buffers.alignment, name=backend.name.upper())
    alloc = FramedAllocator(allocator, backend.buffers.alignment)
    session = backend.session(allocator=alloc)
    got, dt = _run_framed(session, graph, node)
    plan = alloc.plan.inner                  # the plan the run used
    problems = []
    p = plan.placement(node)
    if p.reused is not source or plan.offset(node) != plan.offset(source):
        took = p.reused.describe() if p.reused is not None else "no source's memory"
        problems.append(f"not in place: the plan ({plan.method}) put the result at offset "
                        f"{plan.offset(node)} and its source {source.describe()} at "
                        f"{plan.offset(source)}; the result took {took}")
    problems += [f"canary overwritten around {n}" for n in
                 alloc.plan.canary_damage(session.host_arena())]
    problems += [f"input {t.describe()} modified" for t in graph.leafs
                 if t in leaf_data and not np.array_equal(t.data, leaf_data[t])]
    ok, err, why = compare(expected, got, case.tol)
    if problems:
        return Result(case, "FAIL", err, "; ".join(problems + ([why] if why else [])), dt,
                      variant=variant)
    return Result(case, "OK" if ok else "FAIL", err, why, dt, variant=variant)


def parse_ops(spec: str) -> list[OpKind] | None:
    """`--op rms_norm,soft_max` -> the op kinds (None: every op); an unknown name is an error
    listing the known ones."""
    if not spec:
        return None
    out = []
    for name in spec.split(","):
        key = name.strip().upper()
        try:
            out.append(OpKind[key])
        except KeyError:
            raise ValueError(f"unknown op {name!r}; known ops: "
                             f"{', '.join(k.value for k in OpKind)}") from None
    return out
