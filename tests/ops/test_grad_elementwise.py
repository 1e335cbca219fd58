"""The element-wise, reduction and view gradient rules (ops/elementwise.py, ops/reduce.py,
ops/views.py) against torch autograd, and the forward values of the ops they added (sub, sqr,
sqrt, log, silu_back, geglu, sum, mean, repeat_back, acc) against torch or hand loops, on the
reference and the CPU backend. tests/backends/cuda/test_cuda_grad_elementwise.py runs one rule
of each group on the CUDA simulator."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ggraph import Context, GGMLType as T, ops
from ggraph.ir.opkind import OpKind
from grad_rules import leaf, rule_grads, run

BACKENDS = ("reference", "cpu")
TOL = dict(rtol=1e-4, atol=1e-5)


def close(got: np.ndarray, want: np.ndarray) -> None:
    """got (numpy order, 4-D as backends read) equals want (any rank, the same elements)."""
    np.testing.assert_allclose(np.asarray(got).reshape(np.shape(want)), want, **TOL)


def tile(b, like):
    """b repeated by modulo to like's shape (ggml's broadcast), in torch."""
    return b.repeat(*[x // y for x, y in zip(like.shape, b.shape)])


def gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


# name: (graph of the leaves, the same in torch, the leaves' numpy shapes, their value range)
RULES = {
    "add": (ops.add, lambda a, b: a + tile(b, a), [(2, 3, 4, 8), (1, 3, 1, 8)], (-1, 1)),
    "add_same": (ops.add, lambda a, b: a + b, [(3, 8), (3, 8)], (-1, 1)),
    "sub": (ops.sub, lambda a, b: a - tile(b, a), [(2, 3, 8), (1, 3, 4)], (-1, 1)),
    "mul": (ops.mul, lambda a, b: a * tile(b, a), [(2, 3, 8), (2, 1, 8)], (-1, 1)),
    "div": (ops.div, lambda a, b: a / tile(b, a), [(2, 3, 8), (1, 3, 1)], (0.5, 2)),
    "scale": (lambda a: ops.scale(a, 0.7, 0.3), lambda a: a * 0.7 + 0.3, [(3, 9)], (-1, 1)),
    "sqr": (ops.sqr, lambda a: a * a, [(3, 9)], (-1, 1)),
    "sqrt": (ops.sqrt, torch.sqrt, [(3, 9)], (0.2, 2)),
    "log": (ops.log, torch.log, [(3, 9)], (0.2, 2)),
    "silu": (ops.silu, torch.nn.functional.silu, [(3, 9)], (-3, 3)),
    "sigmoid": (ops.sigmoid, torch.sigmoid, [(3, 9)], (-3, 3)),
    "tanh": (ops.tanh, torch.tanh, [(3, 9)], (-2, 2)),
    "gelu": (ops.gelu, gelu_tanh, [(3, 9)], (-3, 3)),
    "swiglu": (ops.swiglu, lambda g, u: torch.nn.functional.silu(g) * u, [(3, 9), (3, 9)],
               (-2, 2)),
    "geglu": (ops.geglu, lambda g, u: gelu_tanh(g) * u, [(3, 9), (3, 9)], (-2, 2)),
    "sum_rows": (ops.sum_rows, lambda a: a.sum(-1, keepdim=True), [(2, 3, 7)], (-1, 1)),
    "sum": (ops.sum, lambda a: a.sum().reshape(1), [(2, 3, 7)], (-1, 1)),
    "mean": (ops.mean, lambda a: a.mean(-1, keepdim=True), [(2, 3, 7)], (-1, 1)),
    "repeat": (lambda a: ops.repeat(a, a.ctx.new_tensor(T.F32, (8, 6, 2))),
               lambda a: a.repeat(2, 3, 2), [(1, 2, 4)], (-1, 1)),
    "repeat_back": (lambda a: ops.repeat_back(a, a.ctx.new_tensor(T.F32, (4, 1, 2))),
                    lambda a: a.reshape(1, 2, 3, 1, 2, 4).sum(dim=(0, 2, 4)), [(2, 3, 8)],
                    (-1, 1)),
    "concat0": (lambda a, b: ops.concat(a, b, 0), lambda a, b: torch.cat([a, b], -1),
                [(2, 3, 4), (2, 3, 5)], (-1, 1)),
    "concat1": (lambda a, b: ops.concat(a, b, 1), lambda a, b: torch.cat([a, b], -2),
                [(2, 3, 4), (2, 2, 4)], (-1, 1)),
    "concat2": (lambda a, b: ops.concat(a, b, 2), lambda a, b: torch.cat([a, b], -3),
                [(2, 3, 4), (1, 3, 4)], (-1, 1)),
    "reshape": (lambda a: ops.reshape(a, 6, 4), lambda a: a.reshape(4, 6), [(2, 3, 4)], (-1, 1)),
    "permute": (lambda a: ops.permute(a, 2, 0, 1, 3), lambda a: a.permute(0, 3, 1, 2),
                [(5, 2, 3, 4)], (-1, 1)),
    "transpose": (ops.transpose, lambda a: a.transpose(-1, -2), [(2, 3, 4)], (-1, 1)),
    "cont": (ops.cont, lambda a: a, [(2, 3, 4)], (-1, 1)),
    "cont_reshaped": (lambda a: ops.cont(a, 6, 4), lambda a: a.reshape(4, 6), [(2, 3, 4)],
                      (-1, 1)),
    # b's window: ne [3, 2, 2] at element 1 of row 1 of plane 0 of a (ne [5, 4, 2])
    "acc": (lambda a, b: ops.acc(a, b, a.nb[1], a.nb[2], a.nb[3], a.nb[0] + a.nb[1]),
            lambda a, b: torch.nn.functional.pad(b, (1, 1, 1, 1)) + a, [(2, 4, 5), (2, 2, 3)],
            (-1, 1)),
}


def check_rule(name: str, backend: str) -> None:
    build, f, shapes, (lo, hi) = RULES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    ctx = Context()
    xs = [rng.uniform(lo, hi, s) for s in shapes]
    node = build(*[leaf(ctx, x) for x in xs])
    up = rng.uniform(-1, 1, tuple(reversed(node.ne)))
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in xs]
    out = f(*ts)
    assert np.allclose(run(node, "reference"), out.detach().numpy().reshape(up.shape), **TOL)
    (out.reshape(up.shape) * torch.tensor(up)).sum().backward()
    got = rule_grads(node, up, backend=backend)
    for g, t in zip(got, ts):
        close(g, t.grad.numpy())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_matches_torch(name, backend):
    check_rule(name, backend)


# -- rules whose sources play no part, or are views of views --------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_view_of_a_view_gets_its_window_back(backend):
    """A 2-D window of a contiguous view (plane 1 of X): the view's offset counts from X (the
    root), the gradient's window from the viewed source."""
    rng = np.random.default_rng(3)
    ctx = Context()
    X = leaf(ctx, rng.uniform(-1, 1, (3, 6, 8)))
    src = ops.view_3d(X, 8, 6, 1, X.nb[1], X.nb[2], X.nb[2])        # plane 1
    node = ops.view_2d(src, 4, 3, src.nb[1], 2 * src.nb[0] + 2 * src.nb[1])
    up = rng.uniform(-1, 1, (3, 4))
    (g,) = rule_grads(node, up, backend=backend)
    want = np.zeros((1, 6, 8))
    want[0, 2:5, 2:6] = up
    close(g, want)


def test_view_of_a_strided_source_is_refused():
    ctx = Context()
    a = ops.transpose(leaf(ctx, np.zeros((4, 6))))
    v = ops.view_2d(a, 2, 2, a.nb[1], 0)
    with pytest.raises(ValueError, match="view: the gradient of a view needs a contiguous"):
        rule_grads(v, np.zeros((2, 2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpy_gives_the_source_its_gradient_and_the_destination_none(backend):
    rng = np.random.default_rng(4)
    ctx = Context()
    a = leaf(ctx, rng.uniform(-1, 1, (3, 8)))
    dst = leaf(ctx, np.zeros((2, 12)), T.F16)
    up = rng.uniform(-1, 1, (2, 12))
    ga, gd = rule_grads(ops.cpy(a, dst), up, wants=(True, True), backend=backend)
    assert gd is None
    close(ga, up.reshape(3, 8))


def test_fill_gives_no_gradient_and_clamp_has_no_rule():
    from ggraph.ops import get_op
    ctx = Context()
    a = leaf(ctx, np.ones((2, 3)))
    assert rule_grads(ops.fill(a, 2.0), np.ones((2, 3))) == [None]
    assert get_op(ops.clamp(a, 0, 1).op).backward is None


def test_wants_false_gets_none():
    ctx = Context()
    a, b = leaf(ctx, np.ones((2, 3))), leaf(ctx, np.full((1, 3), 2.0))
    ga, gb = rule_grads(ops.mul(a, b), np.ones((2, 3)), wants=(False, True))
    assert ga is None and np.allclose(gb, 2.0)


def test_reduce_to_and_zeros():
    ctx = Context()
    a = leaf(ctx, np.ones((2, 3)))
    assert ops.reduce_to(a, a) is a
    assert ops.reduce_to(a, leaf(ctx, np.ones((1, 3)))).op == OpKind.REPEAT_BACK
    h = leaf(ctx, np.ones((2, 5)), T.F16)
    for z in (ops.zeros(a), ops.zeros(h, a)):
        assert z.type == T.F32
        assert not run(z, "reference").any()
    with pytest.raises(ValueError, match="zeros"):
        ops.zeros(h)


# -- forward values of the new ops ----------------------------------------------------------

def _rand(rng, shape, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, shape)


FORWARD = {
    "sub": (ops.sub, lambda a, b: a - np.tile(b, (2, 1, 2)), [(2, 3, 8), (1, 3, 4)], (-1, 1)),
    "sqr": (ops.sqr, lambda a: a ** 2, [(3, 9)], (-2, 2)),
    "sqrt": (ops.sqrt, lambda a: np.array([[math.sqrt(v) for v in r] for r in a]), [(3, 9)],
             (0.0, 2)),
    "log": (ops.log, lambda a: np.array([[math.log(v) for v in r] for r in a]), [(3, 9)],
            (0.1, 2)),
    "silu_back": (ops.silu_back, None, [(3, 9), (3, 9)], (-3, 3)),  # torch: below
    "geglu": (ops.geglu, lambda g, u: gelu_tanh(torch.tensor(g)).numpy() * u,
              [(3, 9), (3, 9)], (-3, 3)),
    "sum": (ops.sum, lambda a: np.array([math.fsum(a.ravel())]), [(2, 3, 7)], (-1, 1)),
    "mean": (ops.mean, lambda a: np.array([[[math.fsum(r) / len(r)] for r in p] for p in a]),
             [(2, 3, 7)], (-1, 1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(FORWARD))
def test_forward_values(name, backend):
    build, f, shapes, (lo, hi) = FORWARD[name]
    rng = np.random.default_rng(len(name))
    ctx = Context()
    xs = [_rand(rng, s, lo, hi) for s in shapes]
    node = build(*[leaf(ctx, x) for x in xs])
    if name == "silu_back":  # silu's vector-Jacobian product, by torch autograd
        x = torch.tensor(xs[1], requires_grad=True)
        torch.nn.functional.silu(x).backward(torch.tensor(xs[0]))
        want = x.grad.numpy()
    else:
        want = f(*xs)
    close(run(node, backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeat_back_sums_the_tiles(backend):
    rng = np.random.default_rng(5)
    ctx = Context()
    A = rng.uniform(-1, 1, (2, 6, 9))                    # ne [9, 6, 2] into ne [3, 2, 1]
    node = ops.repeat_back(leaf(ctx, A), ctx.new_tensor(T.F32, (3, 2, 1)))
    want = np.zeros((1, 2, 3))
    for i2, i1, i0 in np.ndindex(A.shape):
        want[0, i1 % 2, i0 % 3] += A[i2, i1, i0]
    close(run(node, backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_acc_adds_into_the_window_of_a_copy(backend):
    rng = np.random.default_rng(6)
    ctx = Context()
    A, B = rng.uniform(-1, 1, (3, 5, 8)), rng.uniform(-1, 1, (2, 2, 3))
    a = leaf(ctx, A)
    # rows 2 elements apart (overlapping), planes one plane of a apart, from element 9
    node = ops.acc(a, leaf(ctx, B), 2 * a.nb[0], a.nb[2], a.nb[3], 9 * a.nb[0])
    want = A.reshape(-1).copy()
    for i2, i1, i0 in np.ndindex(B.shape):
        want[9 + i2 * 40 + i1 * 2 + i0] += B[i2, i1, i0]
    close(run(node, backend), want.reshape(A.shape))


def test_shape_rules_name_the_op():
    ctx = Context()
    a, b = leaf(ctx, np.zeros((3, 8))), leaf(ctx, np.zeros((2, 8)))
    with pytest.raises(ValueError, match="silu_back: grad and x must have the same shape"):
        ops.silu_back(a, b)
    with pytest.raises(ValueError, match="repeat_back: b.ne=.* must divide"):
        ops.repeat_back(a, b)
    with pytest.raises(ValueError, match="acc: the window of ne=.* past a's 96 bytes"):
        ops.acc(a, b, a.nb[1], a.nb[2], a.nb[3], 4 * a.nb[1])
    with pytest.raises(ValueError, match="sum: a must be of type f32"):
        ops.sum(leaf(ctx, np.zeros(4), T.F16))
