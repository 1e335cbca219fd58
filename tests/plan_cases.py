"""Random graphs for the allocator's tests and the checks a plan must pass: every tensor's
bytes live from the step that makes it to the last that reads it, in-place and view rules,
orders (tests/core/plan/test_alloc_properties.py, test_alloc.py, tests/core/check/
test_ggml_ref.py)."""
from __future__ import annotations

import random
from collections import Counter

from ggraph import Context, GGMLType, OpKind, Tensor, build_graph
from ggraph.plan.alloc import Plan
from ggraph.ops.registry import get_op


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
