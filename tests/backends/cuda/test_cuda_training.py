"""The CUDA kernels of training's matrix ops and optimizer steps under numba's CUDA simulator:
mul_mat's gradient rule (broadcast a, quantized a) computed by out_prod on the device against
torch autograd, and AdamW / SGD steps run three times in one session against torch.optim.
(Every conformance case of out_prod and the steps runs in test_cuda_sim.py's sweep.)"""
from __future__ import annotations

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

import torch  # noqa: E402

from ggraph import Context, GGMLType as T, build_graph, ops  # noqa: E402
from ggraph.backends import get_backend  # noqa: E402
from ggraph.ops.optim import adamw_param_values, sgd_param_values  # noqa: E402
from grad_rules import rule_grads  # noqa: E402

pytestmark = pytest.mark.cudasim


def _values(t) -> np.ndarray:
    """A leaf's values as ggraph stores them (quantized: decoded by the reference)."""
    from ggraph.check.reference import run_reference
    return run_reference(build_graph(ops.cont(t).set_output())).read(t).astype(np.float64)


@pytest.mark.parametrize("type", [T.F32, T.Q8_0])
def test_mul_mat_rule_on_cuda_matches_torch(type):
    rng = np.random.default_rng(2)
    ctx = Context()
    a = ctx.new_tensor(type, (32, 3, 2, 1), name="a").set_data(rng.uniform(-1, 1, (1, 2, 3, 32)))
    b = ctx.new_tensor(T.F32, (32, 4, 4, 2), name="b").set_data(rng.uniform(-1, 1, (2, 4, 4, 32)))
    node = ops.mul_mat(a, b)
    up = rng.uniform(-1, 1, node.shape)
    ga, gb = rule_grads(node, up, wants=(True, True), backend="cuda")
    ta = torch.tensor(_values(a), requires_grad=True)
    tb = torch.tensor(_values(b), requires_grad=True)
    out = tb @ ta.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1).transpose(-1, -2)
    (out * torch.tensor(up)).sum().backward()
    np.testing.assert_allclose(gb, tb.grad.numpy(), rtol=1e-4, atol=1e-4)
    if type.is_quantized:
        assert ga is None
    else:
        np.testing.assert_allclose(ga, ta.grad.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("adamw", [True, False])
def test_optimizer_steps_on_cuda_match_torch(adamw):
    ne, lrs, wd = (33, 2), (0.05, 0.03, 0.02), 0.1
    rng = np.random.default_rng(4)
    w0 = rng.uniform(-1, 1, (2, 33))
    grads = [rng.uniform(-1, 1, (2, 33)) for _ in lrs]
    tw = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.AdamW([tw], eps=1e-8, weight_decay=wd) if adamw else \
        torch.optim.SGD([tw], lr=lrs[0], weight_decay=wd)
    ctx = Context()
    w, m, v = (ctx.new_tensor(T.F32, ne, name=n) for n in "wmv")
    for t in (w, m, v):
        t.buffer = "cache"   # pre-allocated: kept on the device across runs
    g = ctx.new_tensor(T.F32, ne).set_data(np.zeros((2, 33)))
    p = ctx.new_tensor(T.F32, (7 if adamw else 2,)).set_data(np.zeros(7 if adamw else 2))
    step = ops.opt_step_adamw(w, g, m, v, p) if adamw else ops.opt_step_sgd(w, g, p)
    graph = build_graph(step.set_output())
    sess = get_backend("cuda").session()
    sess.prepare(graph)
    sess.write(w, w0)
    for k, (lr, gv) in enumerate(zip(lrs, grads), start=1):
        sess.write(g, gv)
        sess.write(p, adamw_param_values(lr, wd=wd, step=k) if adamw else sgd_param_values(lr, wd))
        sess.run(graph)
        opt.param_groups[0]["lr"] = lr
        tw.grad = torch.tensor(gv)
        opt.step()
        np.testing.assert_allclose(sess.read(step).reshape(2, 33), tw.detach().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"step {k}")
