"""ggraph.autodiff.grad: gradients of whole graphs (shares added where a tensor is read more
than once, broadcasts and views on the way), checkpointing's recomputation (the same
gradients, fewer activations kept, a lower planned peak), and the errors a user meets."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ggraph import Context, ops
from ggraph.autodiff import grad
from ggraph.backends import get_backend
from ggraph.check.reference import run_reference
from ggraph.ir.types import GGMLType as T
from ggraph.plan.alloc import GraphAllocator


def _leaf(ctx, values, name):
    return ctx.from_numpy(np.asarray(values, np.float32), name=name).set_param()


def test_shared_uses_broadcast_and_views_match_torch():
    rng = np.random.default_rng(0)
    xv, wv, bv = (rng.uniform(-1, 1, s) for s in ((6, 8), (5, 8), (5,)))
    ctx = Context()
    x, w, b = _leaf(ctx, xv, "x"), _leaf(ctx, wv, "w"), _leaf(ctx, bv.reshape(1, 5), "b")
    h = ops.add(ops.mul_mat(w, x), b)                       # [5, 6]; b broadcast over rows
    h = ops.mul(h, ops.silu(h))                             # h read twice
    t = ops.cont(ops.transpose(h))                          # a view on the way
    loss = ops.sum(ops.mul(t, t))
    G = grad(loss)
    ex = run_reference(G.graph())
    tx, tw, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True)
                  for v in (xv, wv, bv))
    th = tx @ tw.T + tb
    th = th * torch.nn.functional.silu(th)
    (th.T ** 2).sum().backward()
    for p, tp in ((x, tx), (w, tw), (b, tb)):
        got = ex.read(G[p]).reshape(tp.shape)
        np.testing.assert_allclose(got, tp.grad.numpy(), rtol=1e-5, atol=1e-6)
    cpu = get_backend("cpu").session().run(G.graph())
    np.testing.assert_allclose(cpu.read(G[w]).reshape(tw.shape), tw.grad.numpy(), rtol=1e-4,
                               atol=1e-5)


def _deep(n_layers: int, width: int, batch: int):
    rng = np.random.default_rng(1)
    ctx = Context()
    x = ctx.from_numpy(rng.uniform(-1, 1, (batch, width)).astype(np.float32), name="x")
    ws, cur, outs = [], x, []
    for i in range(n_layers):
        w = _leaf(ctx, rng.uniform(-0.3, 0.3, (width, width)), f"w{i}")
        ws.append(w)
        cur = ops.silu(ops.mul_mat(w, cur, name=f"mm{i}"), name=f"act{i}")
        outs.append(cur)
    return ops.sum(ops.sqr(cur)), ws, outs


def test_checkpointing_recomputes_and_lowers_the_peak():
    loss, ws, acts = _deep(8, 64, 256)
    plain = grad(loss)
    kept = set(acts[1::3])
    ck = grad(loss, checkpoint=kept)
    assert ck.recomputed and not plain.recomputed
    assert all(t.op is not None for t in ck.recomputed)
    a = run_reference(plain.graph())
    b = run_reference(ck.graph())
    for w in ws:
        np.testing.assert_allclose(b.read(ck[w]), a.read(plain[w]), rtol=1e-6, atol=1e-9)
    peaks = [GraphAllocator().alloc(G.graph()).size for G in (plain, ck)]
    assert peaks[1] < peaks[0], peaks


def test_errors_name_the_problem():
    ctx = Context()
    x = _leaf(ctx, np.ones((4, 8)), "x")
    with pytest.raises(ValueError, match="not a scalar"):
        grad(ops.scale(x, 2.0))
    with pytest.raises(ValueError, match="only F32 tensors train"):
        grad(ops.sum(ops.scale(x, 2.0)), [ctx.new_tensor(T.F16, (8,), name="h")])
    y = _leaf(ctx, np.ones(8), "y")
    with pytest.raises(ValueError, match="'y'.*does not reach the loss"):
        grad(ops.sum(x), [x, y])
    with pytest.raises(ValueError, match="no parameters"):
        grad(ops.sum(ctx.from_numpy(np.ones(3, np.float32))))
    q = _leaf(ctx, np.ones((1, 2, 1, 64)), "q")
    k = ctx.new_tensor(T.F16, (64, 32, 1), name="k")
    v = ctx.new_tensor(T.F16, (64, 32, 1), name="v")
    fa = ops.flash_attn_ext(q, k, v, None, scale=0.125)
    with pytest.raises(ValueError, match="flash_attn_ext.*'q'.*unfused path"):
        grad(ops.sum(fa), [q])
    with pytest.raises(ValueError, match="only leafs can be parameters"):
        ops.scale(x, 1.0).set_param()
