"""The conformance harness itself, and every op case on the CPU backend.

The harness must catch wrong values (NMSE), NaN, mismatched infinities and out-of-bounds
writes (canaries), which is checked by swapping deliberately broken kernels into a copy of the
CPU kernel table.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggraph.backends.base import Kernel
from ggraph.backends.cpu import CPUBackend
from ggraph.check.conformance import compare, cases_for, nmse, run_case
from ggraph.ir.opkind import OpKind
from ggraph.ops.registry import REGISTRY

ALL_CASES = list(cases_for())


def test_nmse_formula():
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, 2.0, 4.0])
    assert nmse(a, b) == pytest.approx(1.0 / 14.0)
    assert nmse(a, a) == 0.0
    assert nmse(np.zeros(3), np.zeros(3)) == 0.0
    assert math.isinf(nmse(np.zeros(3), np.ones(3)))


def test_compare_nan_and_inf_rules():
    ok, _, why = compare(np.array([1.0, 2.0]), np.array([1.0, np.nan]), 1e-3)
    assert not ok and "NaN" in why
    ok, _, why = compare(np.array([np.inf, 1.0]), np.array([-np.inf, 1.0]), 1e-3)
    assert not ok and "infinities" in why
    ok, err, _ = compare(np.array([-np.inf, 1.0]), np.array([-np.inf, 1.0]), 0.0)
    assert ok and err == 0.0
    ok, _, _ = compare(np.array([1.0, 2.0]), np.array([1.0, 2.01]), 1e-7)
    assert not ok


def test_every_op_has_cases():
    ops_with_cases = {c.op for c in ALL_CASES}
    assert ops_with_cases == set(REGISTRY), set(REGISTRY) - ops_with_cases


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.label)
def test_cpu_case(case):
    r = run_case(case, CPUBackend())
    assert r.status == "OK", r.line()


class _Patched(CPUBackend):
    """A CPU backend whose table has one kernel replaced."""

    def __init__(self, op: OpKind, fn) -> None:
        super().__init__()
        self.kernels = dict(CPUBackend.kernels)
        self.kernels[op] = Kernel(fn)


def _off_by_one_scale(node, s):
    # reads one element too far along each row: the wrong value lands in every row's tail
    a = s.arr(node.src[0])
    d = s.arr(node)
    d[..., :-1] = a[..., 1:] * node.params.s + node.params.b
    d[..., -1] = a[..., -1] * node.params.s + node.params.b


def _overrunning_scale(node, s):
    # the right values, plus a write of 16 bytes past the end of the output
    d = s.arr(node)
    d[...] = s.arr(node.src[0]) * node.params.s + node.params.b
    buf, off = s._storage(node)
    buf[off + node.nbytes: off + node.nbytes + 16] = 0


def _scale_case():
    return next(c for c in ALL_CASES if c.op == OpKind.SCALE
                and str(dict(c.vars).get("type")) == "f32" and "src" not in dict(c.vars))


def test_broken_kernel_values_fail():
    r = run_case(_scale_case(), _Patched(OpKind.SCALE, _off_by_one_scale))
    assert r.status == "FAIL" and r.nmse > 1e-3, r.line()


def test_out_of_bounds_write_hits_canary():
    r = run_case(_scale_case(), _Patched(OpKind.SCALE, _overrunning_scale))
    assert r.status == "FAIL" and "canary" in r.detail, r.line()


def test_unsupported_is_reported_not_failed():
    class NoSoftmax(CPUBackend):
        kernels = {k: v for k, v in CPUBackend.kernels.items() if k != OpKind.SOFT_MAX}

    case = next(c for c in ALL_CASES if c.op == OpKind.SOFT_MAX)
    assert run_case(case, NoSoftmax()).status == "not supported"


def test_out_of_range_index_is_an_error_not_a_crash():
    import ggraph
    from ggraph import ops as O

    ctx = ggraph.Context()
    a = ctx.new_tensor("f32", (8, 4), "a").set_data(np.ones((4, 8)))
    idx = ctx.new_tensor("i32", (2,), "idx").set_input()
    out = O.get_rows(a, idx)
    s = CPUBackend().session()
    with pytest.raises(IndexError, match="row 7 is outside"):
        s.run(ggraph.build_graph(out), {idx: np.array([1, 7])})
