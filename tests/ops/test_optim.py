"""The optimizer steps (opt_step_adamw, opt_step_sgd) against torch.optim.AdamW and SGD over
several steps, with the learning rate and step count changed through the params tensor
between runs of one graph (the weights and moments stay in place in the session), and once
per step on the reference executor; their params helpers and shape rules."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ggraph import Context, GGMLType as T, build_graph, ops
from ggraph.check.reference import run_reference
from ggraph.ops.optim import adamw_param_values, sgd_param_values

NE = (7, 3, 2)
STEPS = 4
LRS = (0.05, 0.04, 0.03, 0.02)   # a schedule: changes without rebuilding the graph


def _grads(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, tuple(reversed(NE))).astype(np.float32) for _ in range(STEPS)]


def _w0() -> np.ndarray:
    return np.random.default_rng(1).uniform(-1, 1, tuple(reversed(NE))).astype(np.float32)


def torch_steps(opt_cls, grads, **kw) -> list[np.ndarray]:
    w = torch.tensor(_w0(), dtype=torch.float64, requires_grad=True)
    opt = opt_cls([w], lr=LRS[0], **kw)
    out = []
    for lr, g in zip(LRS, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(w.detach().numpy().copy())
    return out


def _state(ctx: Context, name: str) -> "ops.Tensor":
    t = ctx.new_tensor(T.F32, NE, name=name)
    t.buffer = "cache"   # pre-allocated: kept by the session across runs
    return t


def session_steps(backend: str, adamw: bool, wd: float) -> list[np.ndarray]:
    """One graph, run STEPS times in one session: grad and params written before each run."""
    from ggraph.backends import get_backend
    ctx = Context()
    w, m, v = _state(ctx, "w"), _state(ctx, "m"), _state(ctx, "v")
    g = ctx.new_tensor(T.F32, NE, name="grad").set_data(np.zeros(tuple(reversed(NE))))
    p = ctx.new_tensor(T.F32, (7 if adamw else 2,), name="params")
    p.set_data(np.zeros(7 if adamw else 2))
    step = ops.opt_step_adamw(w, g, m, v, p) if adamw else ops.opt_step_sgd(w, g, p)
    graph = build_graph(step.set_output())
    sess = get_backend(backend).session()
    sess.prepare(graph)
    sess.write(w, _w0())
    out = []
    for t, (lr, gv) in enumerate(zip(LRS, _grads()), start=1):
        sess.write(g, gv)
        sess.write(p, adamw_param_values(lr, 0.9, 0.999, 1e-8, wd, t) if adamw
                   else sgd_param_values(lr, wd))
        sess.run(graph)
        out.append(np.asarray(sess.read(step), np.float64).reshape(_w0().shape))
    return out


def reference_steps(adamw: bool, wd: float) -> list[np.ndarray]:
    """A graph per step on the reference executor, the state carried in numpy."""
    wv, mv, vv = _w0(), np.zeros(_w0().shape), np.zeros(_w0().shape)
    out = []
    for t, (lr, gv) in enumerate(zip(LRS, _grads()), start=1):
        ctx = Context()
        w, g, m, v = (ctx.new_tensor(T.F32, NE, name=n).set_data(x)
                      for n, x in (("w", wv), ("g", gv), ("m", mv), ("v", vv)))
        vals = (adamw_param_values(lr, 0.9, 0.999, 1e-8, wd, t) if adamw
                else sgd_param_values(lr, wd))
        p = ctx.new_tensor(T.F32, (len(vals),)).set_data(vals)
        step = ops.opt_step_adamw(w, g, m, v, p) if adamw else ops.opt_step_sgd(w, g, p)
        ex = run_reference(build_graph(step.set_output()))
        wv = ex.read(step).reshape(gv.shape)
        if adamw:
            mv, vv = ex.read(m).reshape(gv.shape), ex.read(v).reshape(gv.shape)
        out.append(np.asarray(wv, np.float64))
    return out


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_adamw_matches_torch(backend, wd):
    want = torch_steps(torch.optim.AdamW, _grads(), betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=wd)
    got = reference_steps(True, wd) if backend == "reference" else \
        session_steps(backend, True, wd)
    for t, (g, w) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sgd_matches_torch(backend, wd):
    # torch's SGD adds wd*w to the gradient: w - lr (g + wd w) = w (1 - lr wd) - lr g
    want = torch_steps(torch.optim.SGD, _grads(), weight_decay=wd)
    got = reference_steps(False, wd) if backend == "reference" else \
        session_steps(backend, False, wd)
    for t, (g, w) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")


def test_adamw_moments_update_in_place():
    """m and v hold the moments after a run (the next step reads them)."""
    from ggraph.backends import get_backend
    ctx = Context()
    w, m, v = _state(ctx, "w"), _state(ctx, "m"), _state(ctx, "v")
    gv = _grads()[0]
    g = ctx.new_tensor(T.F32, NE).set_data(gv)
    p = ctx.new_tensor(T.F32, (7,)).set_data(adamw_param_values(0.01))
    graph = build_graph(ops.opt_step_adamw(w, g, m, v, p).set_output())
    sess = get_backend("cpu").session().run(graph)
    np.testing.assert_allclose(sess.read(m).reshape(gv.shape), 0.1 * gv, rtol=1e-6)
    # 1 - beta2 in float32 is 0.00099999 (as in ggml): a relative 1e-5 off 0.001
    np.testing.assert_allclose(sess.read(v).reshape(gv.shape),
                               0.001 * gv.astype(np.float64) ** 2, rtol=1e-4)


def test_param_values():
    vals = adamw_param_values(1e-3, 0.9, 0.99, 1e-7, 0.01, step=2)
    assert vals.dtype == np.float32 and vals.shape == (7,)
    np.testing.assert_allclose(vals, [1e-3, 0.9, 0.99, 1e-7, 0.01, 1 / (1 - 0.81),
                                      1 / (1 - 0.99 ** 2)], rtol=1e-6)
    np.testing.assert_allclose(sgd_param_values(0.5, 0.1), [0.5, 0.1])
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_param_values(1e-3, step=0)


def test_shape_rules_name_the_op():
    ctx = Context()
    a = ctx.new_tensor(T.F32, (4, 3))
    p7, p2 = ctx.new_tensor(T.F32, (7,)), ctx.new_tensor(T.F32, (2,))
    with pytest.raises(ValueError, match="opt_step_adamw: m must have a's ne"):
        ops.opt_step_adamw(a, a, ctx.new_tensor(T.F32, (3, 4)), a, p7)
    with pytest.raises(ValueError, match="opt_step_adamw: params must be a 1-D tensor of 7"):
        ops.opt_step_adamw(a, a, a, a, p2)
    with pytest.raises(ValueError, match="opt_step_sgd: grad must be of type f32"):
        ops.opt_step_sgd(a, ctx.new_tensor(T.F16, (4, 3)), p2)
    with pytest.raises(ValueError, match="opt_step_sgd: a must be contiguous"):
        ops.opt_step_sgd(ops.transpose(ctx.new_tensor(T.F32, (3, 4))), a, p2)
    step = ops.opt_step_sgd(a, a, p2)
    assert step.view_src is a and step.src == (a, a, p2)   # in place: a view of a
