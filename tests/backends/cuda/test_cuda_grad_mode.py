"""Grad mode on the CUDA backend under numba's simulator: a sample of the backward rules
(element-wise, row-wise, views, loss; the other rules' CUDA kernels have their own tests) run as backward graphs on the
device against finite differences of the float64 reference, and a backward kernel broken on
purpose is caught. (`ggraph conformance --mode grad --backend cuda` runs every case.)"""
from __future__ import annotations

from functools import partial

import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

from ggraph import OpKind  # noqa: E402
from ggraph.backends import get_backend  # noqa: E402
from ggraph.check.grad_check import grad_cases, run_grad_case  # noqa: E402

pytestmark = pytest.mark.cudasim

SAMPLE = (OpKind.SILU, OpKind.SOFT_MAX, OpKind.PERMUTE, OpKind.CROSS_ENTROPY_LOSS)


@pytest.mark.parametrize("op", SAMPLE, ids=lambda k: k.value)
def test_rules_pass_grad_mode_on_cuda(op):
    cuda = get_backend("cuda")
    results = [run_grad_case(c, cuda) for c in list(grad_cases([op]))[:2]]
    assert all(r.status != "FAIL" for r in results), [r.line() for r in results]
    assert any(r.status == "OK" for r in results)


def _scaled(real, node, s):
    launch = real.fn(node, s)
    out = s.arr(node)

    def run():
        launch()
        out[...] = out.copy_to_host() * 1.001 if hasattr(out, "copy_to_host") else out * 1.001
    return run


def test_a_broken_cuda_backward_kernel_is_caught():
    cuda = get_backend("cuda")
    real = cuda.kernels[OpKind.RMS_NORM_BACK]
    cuda.kernels = {**cuda.kernels, OpKind.RMS_NORM_BACK: type(real)(
        partial(_scaled, real), real.accepts, real.why_not, bind=True)}
    results = [run_grad_case(c, cuda) for c in grad_cases([OpKind.RMS_NORM])]
    assert results and all(r.status == "FAIL" for r in results if r.status != "not supported")
