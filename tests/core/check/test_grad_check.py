"""Grad mode (ggraph/check/grad_check.py): the float64 reference keeps its precision through
views, every backward rule passes against finite differences on the reference and on the
CPU, and a backward kernel broken on purpose is caught."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from ggraph import Context, OpKind, build_graph, ops
from ggraph.backends.cpu.backend import CPUBackend
from ggraph.check.grad_check import WideReference, grad_cases, run_grad_case
from ggraph.ops.registry import REGISTRY

# one op of each kind of rule: element-wise, broadcast, row-wise, products, views, loss
SAMPLE = (OpKind.MUL, OpKind.SOFT_MAX, OpKind.RMS_NORM, OpKind.MUL_MAT, OpKind.PERMUTE,
          OpKind.CROSS_ENTROPY_LOSS, OpKind.ROPE, OpKind.GET_ROWS, OpKind.SILU)


def test_wide_reference_keeps_float64_through_views():
    ctx = Context()
    x = ctx.new_tensor("f32", (4, 3), name="x")
    v = ops.view_2d(x, 2, 3, x.nb[1], 2 * 4)
    y = ops.scale(ops.cont(ops.transpose(v)), 1.0 + 1e-12)
    vals = np.arange(12, dtype=np.float64).reshape(3, 4) + 1e-10
    got = WideReference({x: vals}).run(build_graph(y)).read(y)
    want = (vals[:, 2:4].T * (1.0 + 1e-12))
    assert np.array_equal(got.reshape(want.shape), want)  # float32 would lose 1e-10, 1e-12


def test_every_rule_has_cases():
    with_rules = [k for k, d in REGISTRY.items() if d.backward is not None]
    assert len(with_rules) >= 30
    for k in with_rules:
        assert any(True for _ in grad_cases([k])), k


@pytest.mark.parametrize("op", SAMPLE, ids=lambda k: k.value)
def test_rules_pass_grad_mode_on_the_reference_and_the_cpu(op):
    cpu = CPUBackend()
    checked = 0
    for case in grad_cases([op]):
        for backend in (None, cpu):
            r = run_grad_case(case, backend)
            assert r.status != "FAIL", r.line()
            checked += r.status == "OK"
    assert checked, f"no case of {op} could be checked"


def _off_by_a_little(real, node, s):
    call = real.fn(node, s)
    out = s.arr(node)

    def run():
        call()
        out[...] *= np.float32(1.001)
    return run


def test_a_broken_backward_kernel_is_caught():
    cpu = CPUBackend()
    real = cpu.kernels[OpKind.SILU_BACK]
    cpu.kernels = {**cpu.kernels, OpKind.SILU_BACK: type(real)(
        partial(_off_by_a_little, real), real.accepts, real.why_not, bind=True)}
    results = [run_grad_case(c, cpu) for c in grad_cases([OpKind.SILU])]
    assert any(r.status == "FAIL" for r in results), [r.line() for r in results]
    assert not any(r.status == "OK" for r in results), [r.line() for r in results]
