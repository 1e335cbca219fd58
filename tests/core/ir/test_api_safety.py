"""API misuse gives a one-line error naming the tensor, never a crash or wrong numbers (#13):
inputs of the wrong shape, type or name; reads of memory the plan freed; views reaching
outside their root. The CPU backend and the reference executor run small graphs."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends import get_backend
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.multi import MultiSession
from ggraph.ir.opkind import OpKind
from ggraph.ops.registry import new_view
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Tensor


def _cpu(g, inputs):
    return get_backend("cpu").session().run(g, inputs)


EXECUTORS = {"reference": run_reference, "cpu": _cpu}


def _graph(itype: str = "f32"):
    """y = w @ x (+ idx rows when itype is an integer type): x is [4, 3], idx is [3]."""
    ctx = Context()
    x = ctx.new_tensor("f32", (4, 3), name="x").set_input()
    w = ctx.from_numpy(np.eye(4, dtype=np.float32), name="w")
    y = ops.mul_mat(w, x, name="y")
    idx = ctx.new_tensor(itype, (3,), name="idx").set_input()
    out = ops.get_rows(y, idx, name="out").set_output() if itype != "f32" else y.set_output()
    return ctx, x, w, idx, out, build_graph(out)


X = np.arange(12, dtype=np.float32).reshape(3, 4)


# -- inputs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_shape_must_match_up_to_leading_ones(run):
    _, x, _, _, y, g = _graph()
    for ok in (X, X[None], X[None, None]):                  # leading 1-dims may be left out
        np.testing.assert_array_equal(run(g, {x: ok}).read(y)[0, 0], X)
    for bad in (X.T, X.ravel(), X.reshape(2, 6), X[:, None], X[None, None, None, None]):
        with pytest.raises(ValueError, match=r"input for 'x' f32 ne=\[4, 3, 1, 1\] has shape "
                                             r".*expected 12 elements in shape \(3, 4\)"):
            run(g, {x: bad})


@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_scalars_only_for_one_element(run):
    ctx = Context()
    s = ctx.new_tensor("f32", (1,), name="s").set_input()
    v = ctx.new_tensor("f32", (2,), name="v").set_input()
    out = ops.mul(v, s, name="out").set_output()
    g = build_graph(out)
    got = run(g, {s: np.float32(3), v: np.array([1, 2], np.float32)}).read(out)
    np.testing.assert_array_equal(got.ravel(), [3, 6])
    with pytest.raises(ValueError, match=r"input for 'v' f32 ne=\[2, 1, 1, 1\] has shape \(\)"):
        run(g, {s: 3.0, v: 1.0})


def _int_graph(itype: str):
    """out = x's rows picked by idx: get_rows for i32 indices, set_rows into a cache for i64."""
    if itype == "i32":
        _, x, _, idx, out, g = _graph("i32")
        return x, idx, out, g, X[[2, 0, 1]]
    ctx = Context()
    x = ctx.new_tensor("f32", (4, 3), name="x").set_input()
    cache = ctx.new_tensor("f32", (4, 3), name="cache")
    cache.buffer = "kv_cache"
    idx = ctx.new_tensor("i64", (3,), name="idx").set_input()
    out = ops.scale(ops.set_rows(cache, x, idx), 1.0, name="out").set_output()
    want = np.zeros_like(X)
    want[[2, 0, 1]] = X
    return x, idx, out, build_graph(out), want


@pytest.mark.parametrize("itype", ["i32", "i64"])
@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_integer_inputs_refuse_lossy_values(run, itype):
    x, idx, out, g, want = _int_graph(itype)
    good = run(g, {x: X, idx: np.array([2, 0, 1], np.int64)}).read(out)
    np.testing.assert_array_equal(good[0, 0], want)
    np.testing.assert_array_equal(run(g, {x: X, idx: [2, 0, 1]}).read(out)[0, 0], want)
    bad = {"float": np.array([2.0, 0.0, 1.0]), "fraction": np.array([0.5, 0, 1]),
           "nan": np.array([np.nan, 0, 1]), "complex": np.array([1j, 0, 1])}
    for what, v in bad.items():
        with pytest.raises(ValueError, match=rf"input for 'idx' {itype} ne=\[3, 1, 1, 1\] has "
                                             rf"\w+ values; an {itype} tensor takes integers"):
            run(g, {x: X, idx: v})
    too_big = ([np.array([2 ** 32 + 1, 0, 1]), np.array([-2 ** 40, 0, 1])] if itype == "i32"
               else [np.array([2 ** 63, 0, 1], np.uint64)])
    for v in too_big:
        with pytest.raises(ValueError, match=rf"input for 'idx' {itype} .* holds -?\d+, outside "
                                             rf"the range"):
            run(g, {x: X, idx: v})


@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_float_inputs_refuse_complex_and_objects(run):
    _, x, _, _, _, g = _graph()
    with pytest.raises(ValueError, match=r"input for 'x' f32 .* complex128 values"):
        run(g, {x: X.astype(np.complex128) + 1j})
    with pytest.raises(ValueError, match=r"input for 'x' f32 .* object values"):
        run(g, {x: np.array([[None] * 4] * 3)})
    with pytest.raises(ValueError, match=r"input for 'x' f32 ne=\[4, 3, 1, 1\] is None"):
        run(g, {x: None})


@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_unknown_names_and_foreign_tensors_are_refused(run):
    ctx, x, w, _, y, g = _graph()
    with pytest.raises(ValueError, match=r"input name 'xx' is not the name of a leaf of the "
                                         r"graph; its inputs are 'x'"):
        run(g, {x: X, "xx": X})
    other = Context().new_tensor("f32", (4, 3), name="x2")
    with pytest.raises(ValueError, match=r"input 'x2' f32 ne=\[4, 3, 1, 1\] is not a leaf of "
                                         r"the graph; its inputs are 'x'"):
        run(g, {x: X, other: X})
    with pytest.raises(ValueError, match=r"input 'y' .* not a leaf of the graph \(it is "
                                         r"computed by op mul_mat"):
        run(g, {x: X, y: X})
    with pytest.raises(ValueError, match=r"input keys must be tensors or names, got int"):
        run(g, {x: X, 3: X})


def test_many_input_names_are_listed_briefly():
    ctx = Context()
    xs = [ctx.new_tensor("f32", (2,), name=f"in{i}").set_input() for i in range(12)]
    out = xs[0]
    for t in xs[1:]:
        out = ops.add(out, t)
    g = build_graph(out.set_output())
    vals = {t: np.ones(2, np.float32) for t in xs}
    with pytest.raises(ValueError, match=r"its inputs are 'in0', .*'in7', \.\.\. \(12 in all\)"):
        run_reference(g, {**vals, "nope": 1})


@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_a_fed_leaf_with_host_data_never_writes_the_callers_array(run):
    _, x, w, _, y, g = _graph()
    before = w.data.copy()
    w2 = 2 * np.eye(4, dtype=np.float32)
    got = run(g, {x: X, w: w2}).read(y)[0, 0]
    np.testing.assert_array_equal(got, 2 * X)
    np.testing.assert_array_equal(w.data, before)


def test_a_session_keeps_its_own_copy_of_a_fed_leaf():
    """Copy-on-write: the Session computes with its copy from then on; bound kernels are
    re-bound to it, and another Session still sees the caller's data."""
    _, x, w, _, y, g = _graph()
    before = w.data.copy()
    s = get_backend("cpu").session()
    np.testing.assert_array_equal(s.run(g, {x: X}).read(y)[0, 0], X)  # binds w's own array
    np.testing.assert_array_equal(s.run(g, {x: X, w: 3 * np.eye(4)}).read(y)[0, 0], 3 * X)
    np.testing.assert_array_equal(s.run(g, {x: X}).read(y)[0, 0], 3 * X)   # its copy stays
    np.testing.assert_array_equal(w.data, before)
    np.testing.assert_array_equal(_cpu(g, {x: X}).read(y)[0, 0], X)
    ms = MultiSession([CPUBackend(), CPUBackend()])
    np.testing.assert_array_equal(ms.run(g, {x: X, w: 5 * np.eye(4)}).read(y)[0, 0], 5 * X)
    np.testing.assert_array_equal(w.data, before)


@pytest.mark.parametrize("run", EXECUTORS.values(), ids=EXECUTORS.keys())
def test_an_input_left_out_is_named_as_the_graph_grows(run):
    """Fed by tensor keys, a graph asks only its leafs without host data whether one went
    unfed (Graph.leafs_without_data, worked out again when a leaf is added): the input left
    out is named, a weight fed alongside is still written, and an input added to the graph
    after a run is asked too."""
    ctx, x, w, _, y, g = _graph()
    with pytest.raises(ValueError, match=r"graph input 'x' .* was given no value"):
        run(g, {w: np.eye(4, dtype=np.float32)})
    np.testing.assert_array_equal(run(g, {x: X, w: 2 * np.eye(4)}).read(y)[0, 0], 2 * X)
    z = ctx.new_tensor("f32", (4, 3), name="z").set_input()
    yz = ops.add(y, z, name="yz").set_output()
    g.build_forward_expand(yz)
    with pytest.raises(ValueError, match=r"graph input 'z' .* was given no value"):
        run(g, {x: X})
    np.testing.assert_array_equal(run(g, {x: X, z: X}).read(yz)[0, 0], 2 * X)


def test_nothing_is_written_when_one_input_is_bad():
    _, x, _, idx, out, g = _graph("i32")
    s = get_backend("cpu").session()
    s.run(g, {x: X, idx: [0, 1, 2]})
    with pytest.raises(ValueError, match="'idx'"):
        s.run(g, {x: 2 * X, idx: [0.0, 1.0, 2.0]})
    np.testing.assert_array_equal(s.read(out)[0, 0], X)      # the last good run's values


# -- memory the plan freed ----------------------------------------------------------------------

def _chain():
    """x -> a = w @ x -> b = silu(a) (in place on a) -> c = b + b -> out = 2c."""
    ctx = Context()
    x = ctx.new_tensor("f32", (8, 4), name="x").set_input()
    w = ctx.from_numpy(np.eye(8, dtype=np.float32), name="w")
    a = ops.mul_mat(w, x, name="a")
    a_view = ops.view_2d(a, 4, 4, a.nb[1], 0, name="a_view")
    b = ops.silu(a, name="b")
    c = ops.add(b, ops.scale(a_view, 1.0, name="sv"), name="c")
    out = ops.scale(c, 2.0, name="out").set_output()
    return x, w, a, a_view, c, out


XV = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)


def test_reading_freed_memory_is_an_error():
    x, w, a, a_view, c, out = _chain()
    g = build_graph(out)
    s = get_backend("cpu").session().run(g, {x: XV})
    with pytest.raises(ValueError, match=r"tensor 'a' f32 ne=\[8, 4, 1, 1\] was freed by the "
                                         r"plan at step \d+ \(last used by 'b'\), so later nodes "
                                         r"may have overwritten it; mark it with set_output\(\)"):
        s.read(a)
    with pytest.raises(ValueError, match=r"tensor 'a_view' .* is a view of 'a', which was freed"):
        s.read(a_view)
    with pytest.raises(ValueError, match=r"tensor 'c' .* was freed by the plan"):
        s.read(c)
    # an input is planned memory too: once its last reader ran, its bytes may be reused
    with pytest.raises(ValueError, match=r"tensor 'x' .* was freed by the plan at step 0"):
        s.read(x)
    ref = run_reference(g, {x: XV})
    np.testing.assert_allclose(s.read(out), ref.read(out), rtol=1e-6)
    np.testing.assert_array_equal(s.read(w)[0, 0], np.eye(8))    # host data: always readable


def test_marked_outputs_stay_readable():
    x, w, a, a_view, c, out = _chain()
    a_view.set_output()                                       # keeps its owner 'a' too
    c.set_output()
    g = build_graph(out)
    ref = run_reference(g, {x: XV})
    for s in (get_backend("cpu").session(), MultiSession([CPUBackend(), CPUBackend()])):
        s.run(g, {x: XV})
        for t in (a, a_view, c, out):
            np.testing.assert_allclose(s.read(t), ref.read(t), rtol=1e-6, err_msg=t.name)


def test_kernels_may_read_their_sources_while_running():
    """A kernel written in Python reads its source through the session during the run, when
    the source is live, even though the plan frees it right after."""
    from ggraph.backends.base import Kernel

    def silu_by_hand(node, session):
        x = session.read(node.src[0])
        session.write(node, x / (1 + np.exp(-x)))

    x, w, a, a_view, c, out = _chain()
    g = build_graph(out)
    ref = run_reference(g, {x: XV}).read(out)
    backends = [CPUBackend(), CPUBackend()]
    for b in backends:
        b.kernels = {**b.kernels, OpKind.SILU: Kernel(silu_by_hand)}
    for s in (backends[0].session(), MultiSession(backends)):
        np.testing.assert_allclose(s.run(g, {x: XV}).read(out), ref, rtol=1e-6)
        with pytest.raises(ValueError, match="'a' .* was freed by the plan"):
            s.read(a)                                        # after the run: refused


def test_multisession_refuses_freed_memory_too():
    x, w, a, a_view, c, out = _chain()
    g = build_graph(out)
    ms = MultiSession([CPUBackend(), CPUBackend()]).run(g, {x: XV})
    with pytest.raises(ValueError, match=r"tensor 'a' f32 .* was freed by the plan"):
        ms.read(a)


def test_caches_stay_readable():
    ctx = Context()
    cache = ctx.new_tensor("f32", (4, 2), name="cache")
    cache.buffer = "kv_cache"
    row = ctx.new_tensor("f32", (4, 1), name="row").set_input()
    i = ctx.new_tensor("i64", (1,), name="i").set_input()
    stored = ops.set_rows(cache, row, i)
    out = ops.scale(stored, 1.0, name="out").set_output()
    s = get_backend("cpu").session().run(build_graph(out), {row: [[1, 2, 3, 4]], i: [1]})
    np.testing.assert_array_equal(s.read(cache), [[[[0, 0, 0, 0], [1, 2, 3, 4]]]])


# -- views ------------------------------------------------------------------------------------

def test_views_with_negative_strides_are_refused():
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 4), name="a")
    with pytest.raises(ValueError, match=r"view: view 'back' has a negative stride "
                                         r"nb=\[4, -16, -64, -64\].*a='a' f32"):
        ops.view_2d(a, 4, 4, -16, 48, name="back")
    with pytest.raises(ValueError, match="negative stride"):
        ops.view_4d(a, 2, 2, 1, 1, 16, -8, 32, 32)


def test_views_must_stay_inside_their_root():
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 4), name="a")          # 64 bytes
    with pytest.raises(ValueError, match=r"view: a view at offset 80 starts at byte 80, past "
                                         r"the end of its root tensor 'a'"):
        ops.view_1d(a, 0, 80)
    with pytest.raises(ValueError, match=r"view: a view .* ends at byte 68, past the end"):
        ops.view_1d(a, 4, 52)
    with pytest.raises(ValueError, match=r"view: a view .* past the end"):
        ops.view_2d(a, 4, 2, 52, 0)                      # rows 52 bytes apart: 68 bytes
    with pytest.raises(ValueError, match=r"starts 4 bytes before its root tensor 'a'"):
        ops.view_1d(ops.view_1d(a, 4, 16), 2, -20)
    assert ops.view_1d(a, 0, 64).nelements == 0          # zero elements at the end: fine
    assert ops.view_1d(a, 16, 0).nbytes == 64
    with pytest.raises(ValueError, match=r"view: view 'v' has nb0=8; a view inherits its "
                                         r"source's nb0=4"):
        new_view(OpKind.VIEW, a, (2, 1, 1, 1), (8, 16, 16, 16), 0, name="v")


def test_views_are_aligned_to_their_elements_and_blocks():
    """A GPU cannot load a misaligned element (a sticky fault; numpy on the host reads it
    anyway): a view starts and steps by whole elements, or whole blocks of a quantized type."""
    ctx = Context()
    a = ctx.new_tensor("f32", (8, 4), name="a")
    with pytest.raises(ValueError, match=r"view: a view at offset 6 \(byte 6 of its root\) "
                                         r"with nb=\[4, 32, 128, 128\] is not aligned to "
                                         r"F32's 4-byte element"):
        ops.view_2d(a, 4, 4, 32, 6)
    with pytest.raises(ValueError, match="not aligned"):
        ops.view_2d(a, 2, 4, 30, 0)                      # rows 30 bytes apart
    q = ctx.new_tensor("q4_0", (64, 4), name="q")        # rows of 2 blocks of 18 bytes
    assert ops.view_2d(q, 32, 4, q.nb[1], 18).nbytes > 0  # the second block of each row
    with pytest.raises(ValueError, match="Q4_0's 18-byte block"):
        ops.view_2d(q, 32, 4, q.nb[1], 9)


def test_permutes_of_legal_views_stay_legal():
    ctx = Context()
    a = ctx.new_tensor("f32", (8, 6), name="a").set_input()
    v = ops.view_3d(a, 4, 3, 2, a.nb[1] * 2, a.nb[1], 16, name="v")   # a strided window
    p = ops.permute(v, 2, 0, 1, name="p")
    t = ops.transpose(p, name="t")
    out = ops.cont(t, name="out").set_output()
    g = build_graph(out)
    av = np.arange(48, dtype=np.float32).reshape(6, 8)
    ref = run_reference(g, {a: av}).read(out)
    np.testing.assert_array_equal(_cpu(g, {a: av}).read(out), ref)
    for x in (v, p, t):
        assert min(x.nb) >= 0 and x.view_offs + x.nbytes <= a.nbytes


def test_a_hand_made_bad_view_never_reaches_a_kernel():
    """Tensor() itself takes any strides; the executors refuse a negative one before running."""
    ctx = Context()
    a = ctx.new_tensor("f32", (4, 4), name="a").set_input()
    bad = Tensor(ctx, a.type, (4, 4), nb=(4, -16, 64, 64), op=OpKind.VIEW, src=(a,),
                 view_src=a, view_offs=48, name="bad")
    out = ops.cont(bad, name="out").set_output()
    g = build_graph(out)
    av = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"tensor 'bad' f32 ne=\[4, 4, 1, 1\] has a negative "
                                         r"stride nb=\[4, -16, 64, 64\]"):
        _cpu(g, {a: av})
    with pytest.raises(ValueError, match=r"'bad' .* negative stride"):
        run_reference(g, {a: av})
    past = Tensor(ctx, a.type, (4, 4), op=OpKind.VIEW, src=(a,), view_src=a, view_offs=16,
                  name="past")
    with pytest.raises(ValueError, match=r"view 'past' .* spans bytes \[16, 80\) outside its "
                                         r"root 'a'"):
        _cpu(build_graph(ops.cont(past).set_output()), {a: av})
