"""Property tests of the graph allocator on random DAGs (hypothesis).

Random graphs mix inputs, outputs, weights, scratch leafs, in-place ops, plain ops, views
(reshape, offset views, permutes) and writes through views (cpy). Each plan is checked against
an independent liveness model, not against the planner's own bookkeeping: a tensor is needed
from the step that produces it to the last step that reads it (directly or through a view),
and two tensors needed at the same step may share bytes only as an in-place pair.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggraph import Context, Tensor, build_graph
from ggraph import ops as O
from ggraph.plan.alloc import GraphAllocator, Plan, plan_graph
from ggraph.check.reference import ReferenceExecutor, run_reference

from plan_cases import check_inplace_rules, check_order, check_plan, random_graph


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.randoms(use_true_random=False), st.sampled_from([32, 128]))
def test_plans_are_sound(rnd, alignment):
    g, _, _ = random_graph(rnd)
    for strategy in ("ggml", "default"):
        plan = plan_graph(g, alignment=alignment, strategy=strategy)
        check_order(plan)
        check_plan(plan, alignment)
        check_inplace_rules(plan, views=strategy == "default")
        if strategy == "ggml":
            assert not plan.reordered
            ggml_size = plan.size
        else:
            assert plan.size <= ggml_size
            assert plan.ggml_size == ggml_size


@SETTINGS
@given(st.randoms(use_true_random=False))
def test_every_planned_tensor_has_an_offset(rnd):
    g, _, _ = random_graph(rnd)
    plan = GraphAllocator(strategy="default").reserve(g)
    for t in g.nodes + g.leafs:
        if t.is_view:
            if t.view_src in plan:
                assert plan.address(t) == plan.offset(t.view_src) + t.view_offs
        elif not t.is_preallocated:
            assert 0 <= plan.offset(t) and plan.offset(t) + t.nbytes <= plan.size


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.randoms(use_true_random=False))
def test_alloc_same_topology_reuses_reserved_slots(rnd):
    seed = rnd.randrange(1 << 30)
    big, _, _ = random_graph(random.Random(seed))
    alloc = GraphAllocator(strategy="default")
    res = alloc.reserve(big)
    again, _, _ = random_graph(random.Random(seed))   # same topology, fresh tensors
    plan = alloc.alloc(again)
    assert plan.size == res.size
    assert [plan.offset(t) for t in again.nodes if t in plan] == \
        [res.offset(t) for t in big.nodes if t in res]
    check_plan(plan, 32)


# -- plans run: the reference executor inside one planned arena gives the same outputs ----------

class ArenaExecutor(ReferenceExecutor):
    """The reference executor with every planned tensor inside one buffer at its offset;
    the buffer starts as NaN bytes so reading memory nobody wrote shows up."""

    def __init__(self, plan: Plan, inputs) -> None:
        super().__init__(inputs)
        self.plan = plan
        self.arena = np.full(plan.size, 0xFF, dtype=np.uint8)

    def _buffer(self, t: Tensor) -> np.ndarray:
        root = t.owner
        if root in self.plan:
            off = self.plan.offset(root)
            return self.arena[off:off + root.nbytes]
        return super()._buffer(t)


def random_valid_graph(rnd: random.Random):
    """A random graph of real ops (shape rules hold) over [d, n] F32 activations."""
    ctx = Context()
    d, n = rnd.choice([8, 16]), rnd.choice([3, 5])
    x = ctx.new_tensor("f32", (d, n), name="x").set_input()
    w = ctx.from_numpy(np.linspace(-1, 1, d * d, dtype=np.float32).reshape(d, d), name="w")
    cache = ctx.from_numpy(np.zeros((n, d), np.float32), name="cache")  # like a KV cache
    pool = [x, cache]
    for k in range(rnd.randint(2, 24)):
        a, b = rnd.choice(pool), rnd.choice(pool)
        r = rnd.randrange(11)
        if r >= 9:     # overwrite existing memory through a view; later readers see it
            t = O.cpy(a, b if b is not a else cache)
            t.name = f"t{k}"
            pool.append(t)
            continue
        t = (O.add(a, b) if r == 0 else O.mul(a, b) if r == 1 else O.scale(a, 0.5, 0.25)
             if r == 2 else O.silu(a) if r == 3 else O.soft_max_ext(a, scale=0.3) if r == 4
             else O.mul_mat(w, a) if r == 5 else O.reshape(O.cont(O.transpose(a)), d, n)
             if r == 6 else O.reshape(O.rms_norm(O.reshape(a, d * n)), d, n) if r == 7
             else O.cpy(a, ctx.new_tensor("f32", (d, n))))
        t.name = f"t{k}"
        pool.append(t)
        if rnd.random() < 0.15:
            t.set_output()
    used = {s for t in pool for s in t.src if s is not None}
    outs = [t.set_output() for t in pool[2:] if t not in used or t.is_output]
    return build_graph(*outs), x, outs


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.randoms(use_true_random=False))
def test_planned_runs_match_the_reference(rnd):
    g, x, outs = random_valid_graph(rnd)
    xv = np.sin(np.arange(x.nelements, dtype=np.float32)).reshape(x.shape)
    inputs = {x: xv} if x in g else {}     # no output may read x: then it is not a leaf
    ref = run_reference(g, inputs)
    for strategy in ("ggml", "default"):
        plan = plan_graph(g, strategy=strategy)
        ex = ArenaExecutor(plan, inputs)
        ex.run(SimpleNamespace(nodes=plan.order, leafs=g.leafs))
        for t in outs:
            np.testing.assert_array_equal(ex.read(t), ref.read(t), err_msg=f"{strategy} {t}")
