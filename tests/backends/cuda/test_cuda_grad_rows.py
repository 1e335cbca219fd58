"""The row-wise gradient rules and the ops they record (soft_max_ext_back, rope_ext_back,
rms_norm_back, get_rows_back, cross_entropy_loss, cross_entropy_loss_back) on the CUDA
backend under numba's simulator, against torch autograd: the checks of
tests/ops/test_grad_rows.py, one case per op group (every conformance case of these ops runs
in test_cuda_sim.py)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

from paths import TESTS  # noqa: E402

pytestmark = pytest.mark.cudasim


def _rows_tests():
    """tests/ops/test_grad_rows.py, loaded by path (tests/ops is no package)."""
    spec = importlib.util.spec_from_file_location("grad_rows_checks",
                                                  TESTS / "ops" / "test_grad_rows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


G = _rows_tests()


@pytest.mark.parametrize("name", ["alibi", "sinks"])
def test_soft_max_rule_on_cuda(name):
    grads, want = G.soft_max_case(name, "cuda")
    G.close(grads[0], want)


def test_soft_max_ext_back_on_cuda():
    G.test_soft_max_ext_back_forward("cuda")


@pytest.mark.parametrize("name", ["neox_partial", "yarn", "freq_factors"])
def test_rope_rule_on_cuda(name):
    got, want = G.rope_case(name, "cuda")
    G.close(got, want)


@pytest.mark.parametrize("kind", ["rms_norm", "norm"])
def test_norm_rules_on_cuda(kind):
    got, want = G.norm_case(kind, "cuda")
    G.close(got, want)


def test_get_rows_rule_on_cuda():
    grads, want, _ = G.get_rows_case("cuda", batched=True)
    G.close(grads[0], want)


def test_get_rows_back_on_cuda():
    G.test_get_rows_back_forward_by_hand("cuda")


def test_cross_entropy_loss_on_cuda():
    grads, want = G.loss_case("cuda")
    G.close(grads[0], want)
    G.test_cross_entropy_loss_forward_matches_torch("cuda")
    G.test_cross_entropy_loss_back_forward("cuda")


def test_get_rows_back_ignores_no_row_twice_on_cuda():
    """Every index repeated: each row's gradient is the sum of all its copies."""
    from ggraph import Context, GGMLType as T, ops

    ctx = Context()
    g = ops.get_rows_back(G.leaf(ctx, np.ones((6, 3))),
                          ctx.new_tensor(T.I32, (6,)).set_data(np.array([1] * 6, np.int32)),
                          ctx.new_tensor(T.F32, (3, 4)))
    out = G.run(g, "cuda").reshape(4, 3)
    np.testing.assert_array_equal(out, np.array([[0] * 3, [6] * 3, [0] * 3, [0] * 3]))
