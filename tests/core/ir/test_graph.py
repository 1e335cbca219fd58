"""Graphs: ggml's post-order, repeated expands, leafs and nodes, capacity, names, cycles; and
the reference executor's input errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggraph import (Context, GGMLType, Graph, GraphCapacityError, GraphCycleError, build_graph,
                    ops)
from ggraph.check.reference import run_reference


def small_example():
    ctx = Context()
    x = ctx.new_tensor("f32", (4, 3), name="x")
    w = ctx.new_tensor("f32", (4, 5), name="w")
    b = ctx.new_tensor("f32", (5,), name="b")
    h = ops.mul_mat(w, x, name="h")            # src w, x
    h2 = ops.add(h, b, name="h2")              # src h, b
    s = ops.silu(h2, name="s")
    out = ops.mul(s, h, name="out")            # h already visited
    v = ops.view_1d(s, 5, 0, name="v")         # a view: a node
    out2 = ops.add(out, v, name="out2")
    return ctx, dict(x=x, w=w, b=b, h=h, h2=h2, s=s, out=out, v=v, out2=out2)


def ggml_visit(node, visited, nodes, leafs):
    """ggml_visit_parents_graph, written out recursively: src[0..] first, then the node."""
    if node in visited:
        return
    visited.add(node)
    for s in node.src:
        if s is not None:
            ggml_visit(s, visited, nodes, leafs)
    (leafs if node.op is None else nodes).append(node)


def test_post_order_matches_ggml_by_hand():
    _, t = small_example()
    g = Graph().build_forward_expand(t["out2"])
    # worked out by hand from ggml_visit_parents_graph
    assert [n.name for n in g.nodes] == ["h", "h2", "s", "out", "v", "out2"]
    assert [n.name for n in g.leafs] == ["w", "x", "b"]
    assert g.n_nodes == 6 and g.n_leafs == 3 and len(g) == 6
    assert list(g) == g.nodes
    assert t["v"] in g.nodes and t["v"].is_view     # views are nodes
    assert all(x.op is None for x in g.leafs)


def test_repeated_expands_append():
    ctx, t = small_example()
    g = Graph()
    g.build_forward_expand(t["s"])
    assert [n.name for n in g.nodes] == ["h", "h2", "s"]
    g.build_forward_expand(t["out2"])
    assert [n.name for n in g.nodes] == ["h", "h2", "s", "out", "v", "out2"]
    before = (list(g.nodes), list(g.leafs))
    g.build_forward_expand(t["out2"])               # nothing new
    g.build_forward_expand(t["h"])
    assert (g.nodes, g.leafs) == before
    c = ctx.new_tensor("f32", (5, 3), name="c")
    extra = ops.scale(ops.add(t["h"], c, name="hc"), 2.0, name="sc")
    g.build_forward_expand(extra)
    assert [n.name for n in g.nodes][-2:] == ["hc", "sc"]
    assert g.leafs[-1] is c
    assert extra in g and c in g and ctx.new_tensor("f32", (1,)) not in g


def test_none_sources_are_skipped_in_order():
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 2, 3), name="a")
    sinks = ctx.new_tensor("f32", (3,), name="sinks")
    sm = ops.soft_max_ext(a, None, sinks=sinks, name="sm")   # src (a, None, sinks)
    g = build_graph(sm)
    assert [x.name for x in g.leafs] == ["a", "sinks"] and g.nodes == [sm]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_dags_match_ggml_visit(data):
    ctx = Context()
    pool = [ctx.new_tensor("f32", (4, 4), name=f"l{i}") for i in range(3)]
    n = data.draw(st.integers(1, 25))
    for i in range(n):
        kind = data.draw(st.sampled_from(["add", "mul", "silu", "view", "cpy", "concat"]))
        a = data.draw(st.sampled_from(pool))
        b = data.draw(st.sampled_from(pool))
        if kind in ("add", "mul"):
            t = getattr(ops, kind)(a, b)
        elif kind == "silu":
            t = ops.silu(a)
        elif kind == "view":
            t = ops.view_2d(a, 4, 4, a.nb[1], 0)
        elif kind == "cpy":
            t = ops.cpy(a, b)
        else:
            t = ops.view_2d(ops.concat(a, b, 0), 4, 4, 32, 0)
        pool.append(t)
    outs = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
    g = build_graph(*outs, capacity=4096)
    visited, nodes, leafs = set(), [], []
    for o in outs:
        ggml_visit(o, visited, nodes, leafs)
    assert g.nodes == nodes and g.leafs == leafs


def test_capacity_error():
    ctx = Context()
    x = ctx.new_tensor("f32", (4,), name="x")
    y = x
    for i in range(4):
        y = ops.silu(y, name=f"y{i}")
    g = Graph(capacity=3)
    with pytest.raises(GraphCapacityError) as ei:
        g.build_forward_expand(y)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "capacity of 3 nodes" in msg and "'y3'" in msg and "ne=[4, 1, 1, 1]" in msg
    assert "Graph(capacity=6)" in msg
    assert Graph().capacity == 2048           # GGML_DEFAULT_GRAPH_SIZE
    # leafs are capped too
    leafs = [ctx.new_tensor("f32", (4,), name=f"l{i}") for i in range(3)]
    with pytest.raises(GraphCapacityError, match="capacity of 2 leafs"):
        build_graph(ops.add(ops.add(leafs[0], leafs[1]), leafs[2]), capacity=2)
    with pytest.raises(ValueError, match="capacity must be positive"):
        Graph(0)


def test_deep_chain_has_no_recursion_limit():
    ctx = Context()
    y = ctx.new_tensor("f32", (2,), name="x")
    for _ in range(5000):
        y = ops.scale(y, 1.0)
    g = build_graph(y, capacity=6000)
    assert g.n_nodes == 5000 and g.nodes[-1] is y


def test_get_tensor_by_name():
    ctx, t = small_example()
    g = build_graph(t["out2"])
    assert g.get_tensor("h2") is t["h2"]
    assert g.get_tensor("w") is t["w"]                # leafs too
    assert g.get_tensor("v") is t["v"]
    t["s"].set_name("renamed")                         # names set after expanding
    assert g.get_tensor("renamed") is t["s"]
    with pytest.raises(KeyError, match="'s'"):
        g.get_tensor("s")
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        g.get_tensor("nope")


def test_graph_from_lists():
    ctx, t = small_example()
    g = build_graph(t["out2"])
    h = Graph.from_lists(g.nodes, g.leafs)
    assert h.nodes == g.nodes and h.leafs == g.leafs and h.nodes is not g.nodes
    assert h.capacity == max(g.n_nodes, g.n_leafs) and all(x in h for x in g.nodes + g.leafs)
    assert t["out2"] in h and ctx.new_tensor("f32", (1,)) not in h
    assert h.get_tensor("h2") is t["h2"] and Graph.from_lists([], []).capacity == 1


def test_cycle_is_reported():
    ctx = Context()
    a = ctx.new_tensor("f32", (4,), name="a")
    b = ops.add(a, a, name="b")
    c = ops.mul(b, b, name="c")
    d = ops.silu(c, name="d")
    b.src = (d, a)                                     # someone mutates src into a cycle
    with pytest.raises(GraphCycleError) as ei:
        build_graph(d)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "cycle" in msg and "'b'" in msg and "'c'" in msg and "'d'" in msg
    e = ops.silu(a, name="e")
    e.src = (e,)
    with pytest.raises(GraphCycleError, match="'e' -> 'e'"):
        build_graph(e)


# -- the reference executor's input errors ------------------------------------------------

def _io_graph():
    ctx = Context()
    x = ctx.new_tensor("f32", (4, 3), name="x").set_input()
    w = ctx.from_numpy(np.eye(4, dtype=np.float32), name="w")
    y = ops.mul_mat(w, x, name="y").set_output()
    return x, w, y, build_graph(y)


def test_reference_missing_input():
    x, w, y, g = _io_graph()
    with pytest.raises(ValueError, match=r"graph input 'x' f32 ne=\[4, 3, 1, 1\] was given no "
                                         r"value"):
        run_reference(g)


def test_reference_wrong_input_size():
    x, w, y, g = _io_graph()
    with pytest.raises(ValueError, match=r"input for 'x' f32 ne=\[4, 3, 1, 1\] has shape "
                                         r"\(5,\) \(5 elements\), expected 12"):
        run_reference(g, {x: np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="expected 12"):
        run_reference(g, {"x": np.zeros((4, 4), np.float32)})


def test_reference_inputs_by_tensor_and_by_name():
    x, w, y, g = _io_graph()
    vals = np.arange(12, dtype=np.float32).reshape(3, 4)
    for key in (x, "x"):
        ex = run_reference(g, {key: vals})
        np.testing.assert_array_equal(ex.read(y)[0, 0], vals)


def test_reference_rejects_leaf_data_of_wrong_size():
    ctx = Context()
    a = ctx.new_tensor("f32", (4,), name="a")
    a.data = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"'a' f32 ne=\[4, 1, 1, 1\] carries 8 bytes"):
        run_reference(build_graph(ops.silu(a)))


def test_reference_quantized_input_is_stored_in_its_type():
    ctx = Context()
    x = ctx.new_tensor(GGMLType.Q8_0, (32, 2), name="xq").set_input()
    y = ops.get_rows(x, ctx.from_numpy(np.array([1, 0], np.int32), "i32"))
    vals = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    got = run_reference(build_graph(y), {"xq": vals}).read(y)[0, 0]
    assert np.abs(got[::-1] - vals).max() <= 1 / 127 / 2 + 1e-7
    assert not np.array_equal(got[::-1], vals)
