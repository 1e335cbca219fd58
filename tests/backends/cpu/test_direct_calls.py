"""Bound CPU calls made without numba's dispatch (backends/cpu/compile.py `direct`): each
runs the machine code compiled for its fixed arguments, and a graph run so gives the bytes a
run through the dispatchers gives."""
from __future__ import annotations

from functools import partial

import numba
import numpy as np
import pytest
from numba.core.dispatcher import Dispatcher

from ggraph import Context, build_graph, ops
from ggraph.backends.cpu import CPUBackend, compile as C


@numba.njit(cache=False)
def _add_into(out, a, k):
    for i in range(out.size):
        out[i] = a[i] + k


def test_a_dispatcher_call_becomes_its_compiled_entry_and_computes_the_same():
    a, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    call = C.direct(partial(_add_into, out, a, 2.5))
    assert not isinstance(call.func, Dispatcher)     # the entry point, not the dispatcher
    call()
    np.testing.assert_array_equal(out, a + np.float32(2.5))


def test_a_group_in_turn_has_each_call_made_direct():
    a, out1, out2 = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
    seen = []
    group = partial(C.in_turn, partial(_add_into, out1, a, 1.0),
                    [partial(_add_into, out2, a, 2.0), lambda: seen.append(1)])
    d = C.direct(group)
    assert d.func is C.in_turn and not isinstance(d.args[0].func, Dispatcher)
    assert not isinstance(d.args[1][0].func, Dispatcher)
    d()
    assert (out1 == 2).all() and (out2 == 3).all() and seen == [1]


def test_calls_it_cannot_type_stay_with_their_dispatcher():
    bad = partial(_add_into, np.zeros(2, np.float32), object(), 1.0)
    assert C.direct(bad) is bad                      # the dispatcher says what is wrong
    with pytest.raises(numba.core.errors.TypingError):
        bad()
    other = partial(print, "x")
    assert C.direct(other) is other


def _graph():
    ctx = Context()
    rng = np.random.default_rng(3)
    x = ctx.new_tensor("f32", (64, 3), name="x").set_input()
    w = ctx.from_numpy(rng.standard_normal((32, 64)).astype(np.float32), name="w")
    g = ctx.from_numpy(rng.standard_normal(64).astype(np.float32), name="g")
    y = ops.mul_mat(w, ops.mul(ops.rms_norm(x, 1e-5), g))
    out = ops.soft_max(ops.scale(y, 0.5)).set_output()
    return build_graph(out), {x: rng.standard_normal((3, 64)).astype(np.float32)}, out


def test_a_graph_run_direct_gives_the_dispatched_runs_bytes(monkeypatch):
    graph, feed, out = _graph()
    results = {}
    for on in (True, False):
        monkeypatch.setattr(C, "DIRECT", on)
        s = CPUBackend(n_threads=2).session()
        s.run(graph, feed)
        results[on] = s.read(out)
        kinds = [isinstance(getattr(c, "func", None), Dispatcher) for c in s.bound_calls]
        assert any(kinds) != on                      # direct: no call left to a dispatcher
    np.testing.assert_array_equal(results[True], results[False])


def test_an_index_check_and_its_kernel_are_made_direct_and_still_refuse_bad_rows():
    """index_checked (get_rows, set_rows, mul_mat_id): the check of the ids and the kernel
    after it both run without dispatch, and an id outside [0, n) is still an error naming
    the node, read from the ids as they are at the call (the check holds a view)."""
    ctx = Context()
    idx = np.array([1, 3], np.int32)
    node = ctx.new_tensor("f32", (4, 2), name="rows")
    a, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    d = C.direct(C.index_checked(node, idx, 4, "row", partial(_add_into, out, a, 1.0)))
    check, run = d.args[4], d.args[5]
    assert not isinstance(check.func, Dispatcher) and not isinstance(run.func, Dispatcher)
    d()
    assert (out == 2).all()
    idx[1] = 4
    with pytest.raises(IndexError, match="'rows'.*row 4 is outside \\[0, 4\\)"):
        d()


def test_argument_types_from_the_cache_are_numbas_own():
    """direct() types ndarrays (and tuples of them) from a cache keyed by what numba's Array
    type is made of; each must equal numba's typeof, views, orders, read-only and
    misaligned arrays included, and the second lookup (from the cache) too."""
    f = numba.njit(cache=False)(lambda x: 0)
    a = np.zeros((3, 4, 5), np.float32)
    ro = np.zeros(4)
    ro.flags.writeable = False
    cases = [a, a[:, 1], a[..., ::2], a.T, np.asfortranarray(a), a[0, 0, 0:1],
             np.zeros(0, np.int8), np.zeros((1, 1, 1, 1)), np.frombuffer(b"abcd", np.uint8),
             np.zeros(9, np.uint8)[1:].view(np.uint16), ro, np.zeros(5, np.float16),
             (a, a), (a, a[0]), (np.zeros(3, np.int64),), 3, 2.5, True, np.int64(4)]
    for c in cases:
        for _ in range(2):
            assert C.arg_type(f, c) == f.typeof_pyval(c), c
