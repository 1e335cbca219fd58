"""Backend conformance (ggraph's test-backend-ops): run every op case on a backend and on the
reference executor, compare by NMSE, and catch out-of-bounds writes with canaries.

Each planned tensor gets its own slot framed by canary bytes (CanaryAllocator), so any byte a
kernel writes outside its output is found; leafs with host data are checked unchanged.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np

from ggraph.graph import Graph, build_graph
from ggraph.opkind import OpKind
from ggraph.ops.case import Case
from ggraph.ops.registry import REGISTRY
from ggraph.reference import run_reference
from ggraph.tensor import Tensor

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
    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.plan: CanaryPlan | None = None

    def alloc(self, graph: Graph, reserve_on_growth: bool = True) -> CanaryPlan:
        self.plan = CanaryPlan(graph, self.alignment)
        return self.plan


@dataclass
class Result:
    case: Case
    status: str                  # OK, FAIL, not supported
    nmse: float = 0.0
    detail: str = ""
    seconds: float = 0.0
    perf: str = ""

    def line(self) -> str:
        tail = f" (nmse={self.nmse:.2e}{', ' + self.detail if self.detail else ''})" \
            if self.status == "FAIL" else ""
        perf = f" {self.perf}" if self.perf else ""
        return f"  {self.case.label}: {self.status}{tail}{perf}"


def run_case(case: Case, backend: Any, reference: Any = None) -> Result:
    """One case on `backend`, judged against the reference executor (or `reference`)."""
    builder, out = case.make()
    out.set_output()
    graph = build_graph(out)
    unsupported = [n for n in graph.nodes if not backend.supports(n)]
    if unsupported:
        return Result(case, "not supported", detail=unsupported[0].describe())
    if reference is not None and hasattr(reference, "supports"):
        ok, why = reference.supports(graph)
        if not ok:
            return Result(case, "not supported", detail=f"by the reference: {why}")
    try:
        expected = (reference.run(graph, out) if reference is not None
                    else run_reference(graph).read(out))
    except NotImplementedError as e:  # a reference that cannot express this case
        return Result(case, "not supported", detail=f"by the reference: {e}")
    leaf_data = {t: t.data.copy() for t in graph.leafs if t.data is not None}
    alloc = CanaryAllocator(backend.alignment)
    session = backend.session(allocator=alloc)
    session.prepare(graph)
    _fill_canaries(session)
    t0 = time.perf_counter()
    session.run(graph)
    dt = time.perf_counter() - t0
    got = session.read(out)
    problems = [f"canary overwritten around {n}" for n in
                alloc.plan.canary_damage(session.host_arena())]
    problems += [f"input {t.describe()} modified" for t in graph.leafs
                 if t in leaf_data and not np.array_equal(t.data, leaf_data[t])]
    ok, err, why = compare(expected, got, case.tol)
    if problems:
        return Result(case, "FAIL", err, "; ".join(problems), dt)
    return Result(case, "OK" if ok else "FAIL", err, why, dt)


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
        return sum(r.status != "not supported" for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.status == "FAIL" for r in self.results)

    def to_json(self) -> dict:
        return {"backend": self.backend, "passed": self.passed, "tested": self.tested,
                "cases": [{"case": r.case.label, "op": r.case.op.name, "status": r.status,
                           "nmse": r.nmse, "detail": r.detail, "seconds": r.seconds,
                           "perf": r.perf} for r in self.results]}
