"""Property tests of the graph allocator on random DAGs (hypothesis).

Random graphs mix inputs, outputs, weights, scratch leafs, in-place ops, plain ops, views
(reshape, offset views, permutes) and writes through views (cpy). Each plan is checked against
an independent liveness model, not against the planner's own bookkeeping: a tensor is needed
from the step that produces it to the last step that reads it (directly or through a view),
and two tensors needed at the same step may share bytes only as an in-place pair.
"""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggraph import Context, GGMLType, OpKind, Tensor, build_graph
from ggraph import ops as O
from ggraph.plan.alloc import GraphAllocator, Plan, plan_graph
from ggraph.ops.registry import get_op
from ggraph.check.reference import ReferenceExecutor, run_reference

INPLACE = [OpKind.ADD, OpKind.MUL, OpKind.SCALE, OpKind.SOFT_MAX, OpKind.ROPE,
           OpKind.RMS_NORM, OpKind.SILU]
PLAIN = [OpKind.MUL_MAT, OpKind.CONT, OpKind.GET_ROWS, OpKind.CONCAT, OpKind.SUM_ROWS]
TYPES = [GGMLType.F32, GGMLType.F32, GGMLType.F16, GGMLType.I32]


def _ne(rnd: random.Random) -> tuple[int, ...]:
    n0 = rnd.choice([1, 3, 8, 13, 32, 64, 100, 256, 1000])
    n1 = rnd.choice([1, 1, 2, 5, 16, 64])
    return (n0, n1, rnd.choice([1, 1, 3]))


def random_graph(rnd: random.Random, max_nodes: int = 40):
    """A random graph; returns (graph, tensors in creation order, expanded tensors)."""
    ctx = Context()
    made: list[Tensor] = []
    pool: list[Tensor] = []

    def add(t: Tensor, usable: bool = True) -> Tensor:
        t.name = t.name or f"t{len(made)}"
        made.append(t)
        if usable:
            pool.append(t)
        return t

    for i in range(rnd.randint(1, 4)):
        t = add(ctx.new_tensor(rnd.choice(TYPES), _ne(rnd)))
        kind = rnd.choice(["input", "input", "weight", "scratch"]) if i else "input"
        if kind == "input":
            t.set_input()
        elif kind == "weight":
            t.buffer = "model"
    for _ in range(rnd.randint(1, max_nodes)):
        a = rnd.choice(pool)
        r = rnd.random()
        if r < 0.4:
            srcs = (a,) if rnd.random() < 0.5 else (a, rnd.choice(pool))
            t = Tensor(ctx, a.type, a.ne, op=rnd.choice(INPLACE), src=srcs)
        elif r < 0.62:
            srcs = (a,) if rnd.random() < 0.6 else (a, rnd.choice(pool))
            t = Tensor(ctx, rnd.choice(TYPES), _ne(rnd), op=rnd.choice(PLAIN), src=srcs)
        elif r < 0.74 and a.is_contiguous():
            t = Tensor(ctx, a.type, (a.nelements,), op=OpKind.RESHAPE, src=(a,), view_src=a)
        elif r < 0.84 and a.is_contiguous() and a.nelements > 1:
            m = rnd.randint(1, a.nelements - 1)
            k = rnd.randint(0, a.nelements - m)
            t = Tensor(ctx, a.type, (m,), op=OpKind.VIEW, src=(a,), view_src=a,
                       view_offs=k * a.type.type_size)
        elif r < 0.92:
            ne, nb = a.ne, a.nb
            t = Tensor(ctx, a.type, (ne[1], ne[0], ne[2], ne[3]), nb=(nb[1], nb[0], nb[2], nb[3]),
                       op=OpKind.PERMUTE, src=(a,), view_src=a)
        else:  # write a into a destination through a view (cpy returns a view of dst)
            same = [d for d in pool if d.nelements == a.nelements and d is not a and
                    d.type == a.type and d.is_contiguous()]
            if same and rnd.random() < 0.5:
                dst = rnd.choice(same)
            else:
                dst = add(ctx.new_tensor(a.type, a.ne), usable=False)
            t = Tensor(ctx, dst.type, dst.ne, nb=dst.nb, op=OpKind.CPY, src=(a, dst),
                       view_src=dst, view_offs=0)
        add(t)
        if rnd.random() < 0.08:
            t.set_output()
    used = {s for t in made for s in t.src if s is not None}
    roots = [t for t in made if t.op is not None and (t not in used or t.is_output)]
    rnd.shuffle(roots)
    return build_graph(*roots, capacity=4096), made, roots


# -- independent checks ----------------------------------------------------------------------

def needed_intervals(plan: Plan) -> dict[Tensor, tuple[int, int]]:
    """[first, last] steps each planned tensor's bytes are needed, from the plan's order alone."""
    step = {t: i for i, t in enumerate(plan.order)}
    n = len(plan.order)
    last: dict[Tensor, int] = {}
    for i, t in enumerate(plan.order):
        for s in t.src:
            if s is not None:
                last[s.owner] = max(last.get(s.owner, -1), i)
        if t.view_src is not None:  # a write through a view touches the root
            last[t.view_src] = max(last.get(t.view_src, -1), i)
    out = {}
    for p in plan.placements.values():
        t = p.tensor
        first = step.get(t, -1)
        if p.role != "node" or t.is_input:
            first = -1
        end = n - 1 if t.is_output else max(last.get(t, first), first)
        out[t] = (first, end)
    return out


def check_plan(plan: Plan, alignment: int) -> None:
    need = needed_intervals(plan)
    ps = sorted(plan.placements.values(), key=lambda p: p.offset)
    for p in ps:
        assert p.offset % alignment == 0, f"{p.tensor.label} at {p.offset}"
        assert p.alloc_size % alignment == 0 and p.alloc_size >= p.size
        assert p.end <= plan.size, f"{p.tensor.label} ends at {p.end} > {plan.size}"
        first, last = need[p.tensor]
        assert p.first <= max(first, -1) and p.last >= last, \
            f"{p.tensor.label}: planned live {p.first}..{p.last}, needed {first}..{last}"
    for i, a in enumerate(ps):
        if a.size == 0:
            continue
        for b in ps[i + 1:]:
            if b.offset >= a.offset + a.size:
                break
            if b.size == 0:
                continue
            fa, la = need[a.tensor]
            fb, lb = need[b.tensor]
            if fa > lb or fb > la:
                continue
            # overlapping in space and time: only along an in-place chain, handed over at the
            # step where the later tensor starts
            ok = _chained(plan, a, b, need)
            assert ok, (f"{a.tensor.label} [{a.offset},{a.end}) live {fa}..{la} overlaps "
                        f"{b.tensor.label} [{b.offset},{b.end}) live {fb}..{lb}")


def _chained(plan: Plan, a, b, need) -> bool:
    # in-place chains: x -> y -> z share bytes; each hands over at the step the next starts
    for x, y in ((a, b), (b, a)):
        cur = y
        while cur.reused is not None:
            parent = plan.placements.get(cur.reused.owner)
            if parent is None:
                break
            if parent is x:
                _, lx = need[x.tensor]
                fy, _ = need[y.tensor]
                return lx <= fy
            cur = parent
    return False


def check_inplace_rules(plan: Plan, views: bool) -> None:
    step = {t: i for i, t in enumerate(plan.order)}
    for p in plan.placements.values():
        if p.reused is None:
            continue
        t, r = p.tensor, p.reused
        assert get_op(t.op).inplace, f"{t.label}: op {t.op} is not in-place capable"
        assert any(s is r for s in t.src), f"{t.label} reused a tensor that is not its source"
        assert (t.type, t.ne, t.nb) == (r.type, r.ne, r.nb), f"{t.label}: layout differs"
        root = r.owner
        assert not r.is_output and not root.is_output and not root.is_preallocated
        if r.is_view:
            assert views and r.view_offs == 0, f"{t.label} reused view {r.label}"
        i = step[t]
        for u in plan.order[i + 1:]:  # nobody reads or aliases the memory afterwards
            assert u.view_src is not root, f"{u.label} aliases {root.label} after {t.label}"
            for s in u.src:
                assert s is None or s.owner is not root or s is t, \
                    f"{u.label} reads {root.label} after {t.label} overwrote it"
        assert sum(1 for s in t.src if s is not None and s.owner is root) == 1


def check_order(plan: Plan) -> None:
    g = plan.graph
    assert Counter(plan.order) == Counter(g.nodes)
    step = {t: i for i, t in enumerate(plan.order)}
    for i, t in enumerate(plan.order):
        for s in t.src:
            if s is not None and s in step:
                assert step[s] < i


# -- properties --------------------------------------------------------------------------------

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
