"""mul_mat's gradient rule against torch autograd, and out_prod's forward against a hand
formula (einsum over the summed dimension, with mul_mat's block-repeat broadcast).

Shapes cover no broadcast, broadcast over dim 2 (grouped-query heads), over dim 3 and over
both, a transposed (strided) b, and quantized a (Q4_0, Q8_0: frozen base weights that get no
gradient but pass one on to b). Stored weights are decoded with gguf, not ggraph.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ggraph import Context, GGMLType as T, ops
from grad_rules import rule_grads, run
from stored_values import stored

BACKENDS = ("reference", "cpu")
# (K, M, N, a.ne[2:4], b.ne[2:4])
SHAPES = [(8, 5, 3, (1, 1), (1, 1)), (16, 4, 6, (2, 1), (6, 1)), (8, 3, 5, (1, 1), (1, 3)),
          (8, 3, 2, (2, 1), (4, 3)), (4, 6, 3, (1, 2), (3, 4))]


def _leaf(ctx: Context, type: T, ne, rng, name: str):
    return ctx.new_tensor(type, ne, name=name).set_data(rng.uniform(-1, 1, tuple(reversed(ne))))


def _f32(t) -> np.ndarray:
    """An F32 leaf's values (numpy order)."""
    return t.data.view(np.float32).reshape(t.shape).astype(np.float64)


def torch_mul_mat_grads(A: np.ndarray, B: np.ndarray, up: np.ndarray):
    """Gradients of sum(mul_mat(a, b) * up): A (A3, A2, M, K), B (B3, B2, N, K) numpy order."""
    ta = torch.tensor(A, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(B, dtype=torch.float64, requires_grad=True)
    r3, r2 = B.shape[0] // A.shape[0], B.shape[1] // A.shape[1]
    rep = ta.repeat_interleave(r3, dim=0).repeat_interleave(r2, dim=1)
    out = tb @ rep.transpose(-1, -2)
    (out * torch.tensor(up, dtype=torch.float64)).sum().backward()
    return ta.grad.numpy(), tb.grad.numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m,n,ab,bb", SHAPES)
def test_mul_mat_rule_matches_torch(backend, k, m, n, ab, bb):
    rng = np.random.default_rng(k * 100 + m * 10 + n + sum(bb))
    ctx = Context()
    a = _leaf(ctx, T.F32, (k, m, *ab), rng, "a")
    b = _leaf(ctx, T.F32, (k, n, *bb), rng, "b")
    node = ops.mul_mat(a, b)
    up = rng.uniform(-1, 1, node.shape)
    ga, gb = rule_grads(node, up, backend=backend)
    want_a, want_b = torch_mul_mat_grads(_f32(a), _f32(b), up)
    np.testing.assert_allclose(ga, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, want_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mul_mat_rule_with_transposed_b(backend):
    """b a transposed view (nb0 > nb1): both gradients still match, b's in b's own ne."""
    rng = np.random.default_rng(7)
    ctx = Context()
    a = _leaf(ctx, T.F32, (6, 4), rng, "a")
    big = _leaf(ctx, T.F32, (5, 6), rng, "big")   # b = big^T: ne [6, 5]
    b = ops.transpose(big)
    node = ops.mul_mat(a, b)
    up = rng.uniform(-1, 1, node.shape)
    ga, gb = rule_grads(node, up, wants=(True, True), backend=backend)
    want_a, want_b = torch_mul_mat_grads(_f32(a), _f32(big).T.reshape(1, 1, 5, 6), up)
    np.testing.assert_allclose(ga, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gb, want_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qt", [T.Q4_0, T.Q8_0])
@pytest.mark.parametrize("ab,bb", [((1, 1), (1, 1)), ((2, 1), (4, 1))])
def test_quantized_a_passes_gradient_to_b(backend, qt, ab, bb):
    rng = np.random.default_rng(11)
    ctx = Context()
    vals = rng.uniform(-1, 1, tuple(reversed((64, 5, *ab))))
    a = ctx.new_tensor(qt, (64, 5, *ab), name="w").set_data(vals)
    b = _leaf(ctx, T.F32, (64, 3, *bb), rng, "x")
    node = ops.mul_mat(a, b)
    up = rng.uniform(-1, 1, node.shape)
    ga, gb = rule_grads(node, up, wants=(True, True), backend=backend)
    assert ga is None  # a frozen quantized weight gets no gradient
    _, want_b = torch_mul_mat_grads(stored(vals, qt), _f32(b), up)
    np.testing.assert_allclose(gb, want_b, rtol=1e-5, atol=1e-5)


def test_rule_gives_only_what_is_wanted():
    rng = np.random.default_rng(3)
    ctx = Context()
    a = _leaf(ctx, T.F32, (8, 4), rng, "a")
    b = _leaf(ctx, T.F32, (8, 3), rng, "b")
    node = ops.mul_mat(a, b)
    ga, gb = rule_grads(node, rng.uniform(-1, 1, node.shape), wants=(False, True))
    assert ga is None and gb is not None
    ga, gb = rule_grads(node, rng.uniform(-1, 1, node.shape), wants=(True, False))
    assert ga is not None and gb is None


# -- out_prod forward -----------------------------------------------------------------------

def out_prod_formula(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """d[i3, i2, q, p] = sum_j A[i3 // r3, i2 // r2, j, p] * B[i3, i2, j, q] (numpy order)."""
    r3, r2 = B.shape[0] // A.shape[0], B.shape[1] // A.shape[1]
    out = np.empty(B.shape[:2] + (B.shape[3], A.shape[3]))
    for i3 in range(B.shape[0]):
        for i2 in range(B.shape[1]):
            out[i3, i2] = np.einsum("jp,jq->qp", A[i3 // r3, i2 // r2], B[i3, i2])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("type", [T.F32, T.F16, T.Q8_0, T.Q4_0])
@pytest.mark.parametrize("ab,bb", [((1, 1), (1, 1)), ((2, 1), (4, 3)), ((1, 2), (3, 2))])
def test_out_prod_matches_formula(backend, type, ab, bb):
    rng = np.random.default_rng(5)
    ctx = Context()
    vals = rng.uniform(-1, 1, tuple(reversed((32, 7, *ab))))
    a = ctx.new_tensor(type, (32, 7, *ab), name="a").set_data(vals)
    b = _leaf(ctx, T.F32, (5, 7, *bb), rng, "b")
    A = vals if type == T.F32 else (vals.astype(np.float16).astype(np.float64) if type == T.F16
                                    else stored(vals, type))
    want = out_prod_formula(A, _f32(b))
    got = run(ops.out_prod(a, b), backend)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_prod_of_a_transposed_gradient(backend):
    """b a transposed view of a gradient [Q, J] stored as [J, Q] (mul_mat's rule for b)."""
    rng = np.random.default_rng(9)
    ctx = Context()
    a = _leaf(ctx, T.F32, (10, 6), rng, "a")
    g = _leaf(ctx, T.F32, (6, 4), rng, "g")           # stored [J=6, Q=4]: b = g^T, ne [4, 6]
    got = run(ops.out_prod(a, ops.transpose(g)), backend)
    G = _f32(g).reshape(4, 6)                           # (Q, J): g[j, q] in ggml order
    np.testing.assert_allclose(got[0, 0], G @ _f32(a).reshape(6, 10), rtol=1e-5, atol=1e-5)


def test_out_prod_shape_errors_name_the_op():
    ctx = Context()
    a = ctx.new_tensor(T.F32, (8, 4))
    with pytest.raises(ValueError, match="out_prod: a.ne\\[1\\]=4 must equal b.ne\\[1\\]=3"):
        ops.out_prod(a, ctx.new_tensor(T.F32, (5, 3)))
    with pytest.raises(ValueError, match="out_prod: b.ne\\[2:4\\]"):
        ops.out_prod(ctx.new_tensor(T.F32, (8, 4, 2)), ctx.new_tensor(T.F32, (5, 4, 3)))
    with pytest.raises(ValueError, match="out_prod: b must be of type f32"):
        ops.out_prod(a, ctx.new_tensor(T.F16, (5, 4)))
