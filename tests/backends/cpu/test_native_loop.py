"""A bound graph's calls made from machine code (backends/cpu/native_loop.py): the same bytes
as the Python loop, every argument kind laid out as numba's wrapper would pass it, and errors
(a kernel's exception, an index check's bad index) raised as the Python call raises them."""
from __future__ import annotations

from functools import partial

import numba
import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends.cpu import CPUBackend, compile as C, native_loop as NL


@numba.njit(cache=False)
def _mix(out, a, b, x, y, on, pair, dims):
    """Every argument kind lay_out takes: arrays of any layout and dtype, a float32 and a
    float64, an int, a bool, a tuple of arrays, a tuple of int64s."""
    p, q = pair
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            v = a[i, j] * x + b[i] * y + p[j] - q[i] + dims[0] * i - dims[1]
            out[i, j] = v if on else -v


@numba.njit(cache=False)
def _refuse(out, k):
    if k < 0:
        raise ValueError("k must not be negative")
    out[0] = k


def _args(seed):
    rng = np.random.default_rng(seed)
    big = rng.standard_normal((6, 10)).astype(np.float32)
    a = big[:, ::2]                                   # strided: an 'A' layout view
    b = rng.standard_normal(6)                        # float64
    pair = (rng.standard_normal(5).astype(np.float32), np.asfortranarray(
        rng.standard_normal((6, 1)).astype(np.float32))[:, 0])
    return a, b, np.float32(0.75), -1.25, pair, (np.int64(3), np.int64(-7))


@pytest.mark.parametrize("on", [True, False])
def test_every_argument_kind_gives_what_the_python_call_gives(on):
    a, b, x, y, pair, dims = _args(1)
    want, got = np.zeros((6, 5), np.float32), np.zeros((6, 5), np.float32)
    C.direct(partial(_mix, want, a, b, x, y, on, pair, dims))()
    items = NL.lay_out([C.direct(partial(_mix, got, a, b, x, y, on, pair, dims))])
    assert len(items) == 1 and isinstance(items[0], NL.Native)
    items[0]()
    np.testing.assert_array_equal(got, want)


@numba.njit(cache=False)
def _fresh(n):
    return np.zeros(n)


def test_calls_it_cannot_lay_out_stay_python_calls_between_native_runs():
    out = np.zeros(1, np.float32)
    seen = []
    native = C.direct(partial(_refuse, out, 5))
    py = partial(seen.append, 1)
    items = NL.lay_out([native, py, C.direct(partial(C.in_turn, native, [py, native]))])
    kinds = [type(i).__name__ if isinstance(i, NL.Native) else "py" for i in items]
    assert kinds == ["Native", "py", "Native", "py", "Native"]
    returns = C.direct(partial(_fresh, 3))           # a result nobody would release
    assert NL.lay_out([returns]) == [returns]
    for i in items:
        i()
    assert seen == [1, 1] and out[0] == 5


def test_a_kernels_exception_is_raised_as_its_python_call_raises_it():
    out = np.zeros(1, np.float32)
    first = np.zeros(1, np.float32)
    items = NL.lay_out([C.direct(partial(_refuse, first, 2)), C.direct(partial(_refuse, out, -1)),
                        C.direct(partial(_refuse, out, 9))])
    assert len(items) == 1
    with pytest.raises(ValueError, match="must not be negative"):
        items[0]()
    assert first[0] == 2 and out[0] == 0             # steps before ran; none after


def test_an_index_check_in_a_native_run_refuses_a_bad_index_naming_the_node():
    ctx = Context()
    idx = np.array([1, 3], np.int32)
    node = ctx.new_tensor("f32", (4, 2), name="rows")
    out = np.zeros(1, np.float32)
    checked = C.direct(C.index_checked(node, idx, 4, "row", partial(_refuse, out, 4)))
    items = NL.lay_out([checked])
    assert len(items) == 1 and isinstance(items[0], NL.Native)
    items[0]()
    assert out[0] == 4
    idx[1], out[0] = 4, 0
    with pytest.raises(IndexError, match="'rows'.*row 4 is outside \\[0, 4\\)"):
        items[0]()
    assert out[0] == 0                               # the kernel after the check did not run


def test_a_landed_copy_runs_as_the_copy_kernel():
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    dst = np.zeros((3, 5), np.float32)[:, :4]       # a strided destination, as a landed result
    items = NL.lay_out([partial(np.copyto, dst, src)])
    assert isinstance(items[0], NL.Native)
    items[0]()
    np.testing.assert_array_equal(dst, src)
    other = partial(np.copyto, dst, np.float64(1.0))  # broadcasting: left to numpy
    assert NL.lay_out([other]) == [other]


def test_the_arrays_a_native_run_addresses_live_as_long_as_it():
    import gc
    out = np.zeros((6, 5), np.float32)
    items = NL.lay_out([C.direct(partial(_mix, out, *_args(2)[:4], True, *_args(2)[4:]))])
    gc.collect()
    np.zeros((64, 64))                               # memory a freed array would go to
    items[0]()
    want = np.zeros((6, 5), np.float32)
    _mix(want, *_args(2)[:4], True, *_args(2)[4:])
    np.testing.assert_array_equal(out, want)


def _graph():
    ctx = Context()
    rng = np.random.default_rng(3)
    x = ctx.new_tensor("f32", (64, 3), name="x").set_input()
    ids = ctx.new_tensor("i32", (3,), name="ids").set_input()
    w = ctx.from_numpy(rng.standard_normal((32, 64)).astype(np.float32), name="w")
    g = ctx.from_numpy(rng.standard_normal(64).astype(np.float32), name="g")
    table = ctx.from_numpy(rng.standard_normal((8, 32)).astype(np.float32), name="table")
    y = ops.mul_mat(w, ops.mul(ops.rms_norm(x, 1e-5), g))
    out = ops.add(ops.soft_max(ops.scale(y, 0.5)), ops.get_rows(table, ids)).set_output()
    return build_graph(out), x, ids, out


def test_a_graph_run_again_and_again_gives_the_python_loops_bytes(monkeypatch):
    """The first run through Python, the later ones natively: every run's bytes equal a
    session's that never goes native, and a bad id in a later run is refused as before."""
    graph, x, ids, out = _graph()
    rng = np.random.default_rng(4)
    feeds = [{x: rng.standard_normal((3, 64)).astype(np.float32),
              ids: rng.integers(0, 8, 3).astype(np.int32)} for _ in range(4)]
    results, native_runs = {}, []
    ran = NL.Native.__call__
    monkeypatch.setattr(NL.Native, "__call__", lambda self: (native_runs.append(1), ran(self)))
    for on in (False, True):
        monkeypatch.setattr(NL, "ENABLED", on)
        s = CPUBackend(n_threads=2).session()
        results[on] = []
        for f in feeds:
            s.run(graph, f)
            results[on].append(s.read(out))
        # every run after the first, through each native run of its calls (a BLAS product
        # between them stays a Python call)
        runs = sum(isinstance(i, NL.Native) for i in NL.lay_out(s.bound_calls))
        assert runs > 0 and len(native_runs) == (3 * runs if on else 0)
        if on:
            with pytest.raises(IndexError, match="outside \\[0, 8\\)"):
                s.run(graph, {x: feeds[0][x], ids: np.array([0, 8, 1], np.int32)})
    for a, b in zip(results[False], results[True]):
        np.testing.assert_array_equal(a, b)


def test_a_list_it_fails_to_lay_out_still_runs_through_python(monkeypatch):
    out = np.zeros(1, np.float32)
    calls = [C.direct(partial(_refuse, out, 3))]
    ran = []
    loop = NL.Loop(calls, lambda cs: (ran.append(1), [c() for c in cs]), enabled=True)

    def broken(cs):
        raise TypeError("an argument it cannot write")
    monkeypatch.setattr(NL, "lay_out", broken)
    loop()                                           # the first run: Python's, as always
    with pytest.warns(RuntimeWarning, match="1 calls left to the Python loop.*TypeError"):
        loop()
    loop()
    assert ran == [1, 1, 1] and out[0] == 3
