"""The element-wise, reduction and view gradient rules on the CUDA simulator: one rule of each
group of tests/ops/test_grad_elementwise.py (whose checks this module runs with backend
"cuda") against torch autograd, and acc's overlapping window (atomic adds). The new ops'
conformance cases run in test_cuda_sim.py with every other op's.

Runs in its own process with NUMBA_ENABLE_CUDASIM=1 (tests/run_cudasim.sh); skips elsewhere."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sim_guard import require_simulator

require_simulator()

# the CPU module's cases and checks, loaded from its file (tests/ops is no package)
_spec = importlib.util.spec_from_file_location(
    "grad_elementwise_checks", Path(__file__).parents[2] / "ops" / "test_grad_elementwise.py")
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)

pytestmark = pytest.mark.cudasim

# one per group: broadcast binary, unary, gated, reductions, tiling, layout, accumulation
RULES = ("div", "sub", "gelu", "geglu", "swiglu", "mean", "sum", "sum_rows", "repeat",
         "repeat_back", "concat1", "permute", "acc")


@pytest.mark.parametrize("name", RULES)
def test_rule_matches_torch_on_cuda(name):
    G.check_rule(name, "cuda")


def test_view_of_a_view_on_cuda():
    G.test_view_of_a_view_gets_its_window_back("cuda")


def test_acc_overlapping_window_on_cuda():
    G.test_acc_adds_into_the_window_of_a_copy("cuda")


@pytest.mark.parametrize("name", ("silu_back", "sum", "mean"))
def test_forward_values_on_cuda(name):
    G.test_forward_values(name, "cuda")
