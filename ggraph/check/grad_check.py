"""Grad mode: every backward rule checked against central finite differences, as
test-backend-ops `-m grad` does, on the op records' own conformance cases.

For a case whose output y depends on F32 leafs, the loss is sum(y * r) for a random r. Its
gradient with respect to each leaf that the op's rule differentiates is built by
ggraph.autodiff and run on a backend (or on the reference executor); the same gradient is
estimated by central differences of the loss, computed by the reference in float64 (the
`WideReference` below keeps every F32 tensor in float64, so the differences are not lost to
float32 rounding). Where the two disagree, the rule or the backend's backward kernel is
wrong. Large leafs are sampled (GRAD_SAMPLES elements each), so a case costs a few dozen
reference runs.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ggraph.autodiff import Gradients, grad
from ggraph.ir.graph import Graph, build_graph
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType
from ggraph.ops.case import Case
from ggraph.ops.registry import REGISTRY, get_op
from .conformance import Result, nmse
from .reference import ReferenceExecutor

GRAD_SAMPLES = 24      # elements of each leaf whose gradient is estimated by differences
GRAD_EPS = 1e-5        # the step of the central differences, relative to max(1, |x|)
# NMSE of a backend's float32 gradient against the differences: float32 rounding gives
# ~1e-14 on the CPU and up to ~3e-10 on CUDA (a YaRN rope's float32 angles; measured under the
# simulator); a kernel 0.1% off gives ~1e-6
GRAD_TOL = 1e-8
GRAD_TOL_WIDE = 1e-12  # ... of the reference's float64 gradient (the rule's math; ~1e-14)

F32 = GGMLType.F32


class WideReference(ReferenceExecutor):
    """The reference executor with every F32 tensor held in float64: each F32 root has a
    float64 shadow, addressed through the same strides (in elements), so views, permutes and
    in-place writes see one another as they do in bytes. `values` sets leafs' values (float64)
    before the run."""

    def __init__(self, values: Mapping[Tensor, np.ndarray] | None = None) -> None:
        super().__init__()
        self._wide: dict[int, np.ndarray] = {}
        self._values = dict(values or {})

    def _shadow(self, t: Tensor) -> np.ndarray:
        root = t.owner
        buf = self._wide.get(id(root))
        if buf is None:
            buf = np.zeros(max(root.nbytes // 4, 1), np.float64)
            given = self._values.get(root)
            if given is not None:
                buf[:root.nelements] = np.asarray(given, np.float64).reshape(-1)
            elif root.data is not None:
                buf[:root.nelements] = np.frombuffer(
                    np.asarray(root.data).tobytes(), np.float32)[:root.nelements]
            self._wide[id(root)] = buf
        off = t.view_offs // 4
        strides = tuple(8 * (nb // 4) for nb in reversed(t.nb))
        return np.lib.stride_tricks.as_strided(buf[off:], shape=t.shape, strides=strides)

    def read(self, t: Tensor) -> np.ndarray:
        if t.type != F32:
            return super().read(t)
        return self._shadow(t).copy()

    def write(self, t: Tensor, values: np.ndarray) -> None:
        if t.type != F32:
            return super().write(t, values)
        self._shadow(t)[...] = np.broadcast_to(np.asarray(values, np.float64), t.shape)

    def write_rows(self, t: Tensor, index: tuple[np.ndarray, np.ndarray, np.ndarray],
                   values: np.ndarray) -> None:
        if t.type != F32:
            return super().write_rows(t, index, values)
        self._shadow(t)[index] = values


@dataclass
class GradCase:
    """One conformance case made ready for grad mode: its output, the leafs differentiated
    and the random weights r of the loss sum(y * r)."""
    case: Case
    out: Tensor
    params: tuple[Tensor, ...]
    seed: Tensor
    grads: Gradients | None = None   # the backward graph of the loss for `params`
    why_not: str = ""


def prepare(case: Case) -> GradCase:
    """The case's graph with its F32 leafs as parameters, where the op's rule gives them a
    gradient; `why_not` says why a case cannot be checked."""
    builder, out = case.make()
    rule = get_op(case.op).backward
    seed = out.ctx.new_tensor(F32, out.ne, name="r")
    seed.set_data(builder.rng.uniform(-1.0, 1.0, seed.shape))
    if rule is None:
        return GradCase(case, out, (), seed, why_not="the op has no backward rule")
    g = build_graph(out, capacity=1 << 16)
    if out.type != F32 or any(n.type != F32 for n in g.nodes if n.op is not None):
        return GradCase(case, out, (), seed,
                        why_not="a node is not F32 (finite differences need F32)")
    leafs = [t for t in g.leafs if t.type == F32 and t.data is not None and t.buffer is None]
    # the leafs a gradient reaches: the rules give none to masks, positions and the like
    G = grad(out, leafs, seed=seed, skip_unreached=True) if leafs else None
    if G is None or not G.params:
        return GradCase(case, out, (), seed, why_not="no F32 source the rule differentiates")
    return GradCase(case, out, G.params, seed, G)


def _loss(gc: GradCase, values: Mapping[Tensor, np.ndarray], graph: Graph) -> float:
    ex = WideReference(values).run(graph)
    return float(np.sum(ex.read(gc.out) * ex.read(gc.seed)))


def finite_differences(gc: GradCase, rng: np.random.Generator
                       ) -> dict[Tensor, tuple[np.ndarray, np.ndarray]]:
    """Per parameter: (flat indices sampled, d loss / d x at them by central differences)."""
    graph = build_graph(gc.out, capacity=1 << 16)
    base = {p: WideReference().read(p).reshape(-1) for p in gc.params}
    out: dict[Tensor, tuple[np.ndarray, np.ndarray]] = {}
    for p in gc.params:
        n = p.nelements
        idx = np.arange(n) if n <= GRAD_SAMPLES else np.sort(
            rng.choice(n, GRAD_SAMPLES, replace=False))
        est = np.empty(len(idx))
        for j, i in enumerate(idx):
            x = base[p][i]
            h = GRAD_EPS * max(1.0, abs(x))
            vals = dict(base)
            up, down = base[p].copy(), base[p].copy()
            up[i], down[i] = x + h, x - h
            vals[p] = up
            lo_vals = dict(vals)
            lo_vals[p] = down
            est[j] = (_loss(gc, vals, graph) - _loss(gc, lo_vals, graph)) / (2 * h)
        out[p] = (idx, est)
    return out


def analytic(gc: GradCase, graph: Graph, backend: Any) -> dict[Tensor, np.ndarray]:
    """Each parameter's gradient from the backward graph `graph` (gc.grads'), flat, run on
    `backend` (None: the float64 reference)."""
    G = gc.grads
    if backend is None:
        ex = WideReference().run(graph)
        return {p: ex.read(G[p]).reshape(-1) for p in gc.params}
    sess = backend.session().run(graph)
    return {p: np.asarray(sess.read(G[p]), np.float64).reshape(-1) for p in gc.params}


def run_grad_case(case: Case, backend: Any = None) -> Result:
    """One case in grad mode on `backend` (None: the reference in float64)."""
    try:  # a rule that builds a wrong graph fails its case, naming what it built
        gc = prepare(case)
        if gc.why_not:
            return Result(case, "not supported", detail=gc.why_not)
        graph = gc.grads.graph()
        bad = [n for n in graph.nodes if backend is not None and not backend.supports(n)]
        if bad:
            return Result(case, "not supported", detail=f"backward node "
                          f"{bad[0].describe()} ({bad[0].op})")
        got = analytic(gc, graph, backend)
    except ValueError as e:
        return Result(case, "FAIL", float("inf"), str(e))
    rng = np.random.default_rng(zlib.crc32(case.label.encode()))
    fd = finite_differences(gc, rng)
    tol = GRAD_TOL if backend is not None else GRAD_TOL_WIDE
    worst, where = 0.0, ""
    for p, (idx, est) in fd.items():
        g = got[p][idx]
        if not np.all(np.isfinite(g)):
            return Result(case, "FAIL", float("inf"), f"gradient of {p.describe()} is not "
                          f"finite")
        err = nmse(est, g) if np.any(est) else float(np.max(np.abs(g)))
        if err > worst:
            worst, where = err, p.describe()
    ok = worst <= tol
    return Result(case, "OK" if ok else "FAIL", worst,
                  "" if ok else f"worst: gradient of {where}")


def grad_cases(ops: Iterable[OpKind] | None = None) -> Iterator[Case]:
    """Every non-perf case of the ops whose records have a backward rule."""
    for kind, opdef in REGISTRY.items():
        if (ops is not None and kind not in ops) or opdef.backward is None or not opdef.cases:
            continue
        for c in opdef.cases():
            if not c.perf:
                yield c
