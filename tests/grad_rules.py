"""One op's backward rule, run: the gradient each source of a node gets from the rule in its
op record (ops/<module>.py, OpDef.backward) for a given upstream gradient, computed by the
reference executor or a backend. The rule tests (tests/ops/test_grad_*.py) compare these with
torch's autograd on the same values."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ggraph import build_graph
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ggraph.ops.registry import get_op


def leaf(ctx, values: np.ndarray, type: T = T.F32, name: str = "") -> Tensor:
    """A leaf holding `values` (numpy order)."""
    return ctx.new_tensor(type, tuple(reversed(values.shape)), name=name).set_data(values)


def run(node: Tensor, backend: str) -> np.ndarray:
    """node's value computed on `backend` ("reference", "cpu" or "cuda"), float64."""
    node.set_output()
    g = build_graph(node)
    if backend == "reference":
        from ggraph.check.reference import run_reference

        return np.asarray(run_reference(g).read(node), np.float64)
    from ggraph.backends import get_backend

    return np.asarray(get_backend(backend).session().run(g).read(node), np.float64)


def default_wants(node: Tensor) -> tuple[bool, ...]:
    """Every F32 source wants a gradient (indices, F16 masks and quantized weights do not)."""
    return tuple(s is not None and s.type == T.F32 for s in node.src)


def rule_grads(node: Tensor, upstream: np.ndarray, wants: Sequence[bool] | None = None,
               backend: str = "reference") -> list[np.ndarray | None]:
    """The gradient of sum(node * upstream) with respect to each source, as node's op record
    says (None where the rule gives none), on `backend` ("reference", "cpu" or "cuda").
    Sources are the leafs' own values (tests build them with data)."""
    wants = tuple(wants) if wants is not None else default_wants(node)
    seed = node.ctx.new_tensor(T.F32, node.ne, name="upstream")
    seed.set_data(np.asarray(upstream, np.float64).reshape(seed.shape))
    rule = get_op(node.op).backward
    assert rule is not None, f"op {node.op} has no backward rule"
    grads = list(rule(node, seed, wants))
    assert len(grads) == len(node.src), f"{node.op}: one gradient per source"
    for s, g, w in zip(node.src, grads, wants):
        if g is None:
            continue
        assert g.ne == s.ne and g.type == T.F32, \
            f"{node.op}: gradient {g.describe()} for source {s.describe()}"
        g.set_output()
    outs = [g for g in grads if g is not None]
    if not outs:
        return [None] * len(grads)
    graph = build_graph(*outs, capacity=4096)
    if backend == "reference":
        from ggraph.check.reference import run_reference

        ex = run_reference(graph)
        return [None if g is None else np.asarray(ex.read(g), np.float64) for g in grads]
    from ggraph.backends import get_backend

    sess = get_backend(backend).session().run(graph)
    return [None if g is None else np.asarray(sess.read(g), np.float64) for g in grads]
