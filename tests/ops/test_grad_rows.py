"""The row-wise gradient rules (soft_max, rope, rms_norm, norm, get_rows, cross_entropy_loss)
against torch autograd, and the forward values of the ops they record (soft_max_ext_back,
rope_ext_back, rms_norm_back, get_rows_back, cross_entropy_loss, cross_entropy_loss_back)
against torch's vector-Jacobian products or hand loops, on the reference and the CPU backend.
tests/backends/cuda/test_cuda_grad_rows.py runs the same checks on the CUDA simulator."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ggraph import Context, GGMLType as T, ops
from ggraph.ops.attention import alibi_slopes
from ggraph.ops.rope import RopeMode, RopeParams, rope_cache
from grad_rules import leaf, rule_grads, run

BACKENDS = ("reference", "cpu")
TOL = dict(rtol=1e-4, atol=1e-5)


def vjp(f, up: np.ndarray, *xs: np.ndarray) -> list[np.ndarray]:
    """Gradients of sum(f(*xs) * up) with respect to each of xs, by torch autograd."""
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in xs]
    (f(*ts) * torch.tensor(up, dtype=torch.float64)).sum().backward()
    return [t.grad.numpy() for t in ts]


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.reshape(got, np.shape(want)), want, **TOL)


def probabilities(rng, shape) -> np.ndarray:
    p = rng.uniform(0.0, 1.0, shape)
    return p / p.sum(axis=-1, keepdims=True)


# -- soft_max ------------------------------------------------------------------------------

def torch_soft_max(x, scale, mask=None, slopes=None, sinks=None):
    """x (.., H, T, n); mask (T', n) broadcast; slopes per head; sinks per head."""
    w = x * scale
    if mask is not None:
        m = torch.tensor(mask[: x.shape[-2]], dtype=torch.float64)
        w = w + (torch.tensor(slopes, dtype=torch.float64)[:, None, None] * m
                 if slopes is not None else m)
    if sinks is None:
        return torch.softmax(w, dim=-1)
    s = torch.tensor(sinks, dtype=torch.float64)[:, None, None].expand(*w.shape[:-1], 1)
    return torch.softmax(torch.cat([w, s], dim=-1), dim=-1)[..., :-1]


SOFT_MAX_CASES = {
    "plain": dict(scale=1.0),
    "scaled_mask": dict(scale=0.125, mask=True),
    "alibi": dict(scale=0.5, mask=True, max_bias=8.0),
    "sinks": dict(scale=0.5, mask=True, sinks=True),
}


def soft_max_case(name: str, backend: str):
    kw = SOFT_MAX_CASES[name]
    rng = np.random.default_rng(len(name))
    ctx = Context()
    X = rng.uniform(-2, 2, (3, 4, 9))               # ne [9, 4, 3]: 3 heads
    M = rng.uniform(-1, 1, (5, 9))
    M[rng.uniform(size=M.shape) < 0.2] = -np.inf
    M[:, 0] = 0.0
    S = rng.uniform(-1, 1, 3)
    x = leaf(ctx, X, name="x")
    mask = leaf(ctx, M, name="mask") if kw.get("mask") else None
    sinks = leaf(ctx, S, name="sinks") if kw.get("sinks") else None
    node = ops.soft_max_ext(x, mask, kw["scale"], kw.get("max_bias", 0.0), sinks)
    up = rng.uniform(-1, 1, node.shape)
    grads = rule_grads(node, up, backend=backend)
    slopes = alibi_slopes(3, kw["max_bias"]) if kw.get("max_bias") else None
    want, = vjp(lambda t: torch_soft_max(t, kw["scale"], M if mask is not None else None,
                                         slopes, S if sinks is not None else None), up, X)
    return grads, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SOFT_MAX_CASES))
def test_soft_max_rule_matches_torch(backend, name):
    grads, want = soft_max_case(name, backend)
    close(grads[0], want)
    assert grads[1] is None and grads[2] is None       # mask and sinks: no gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_max_ext_back_forward(backend):
    """dx = scale * y * (dy - sum(dy*y)): torch's vjp of softmax(scale * x)."""
    rng = np.random.default_rng(3)
    ctx = Context()
    X, DY = rng.uniform(-2, 2, (2, 3, 11)), rng.uniform(-1, 1, (2, 3, 11))
    y = ops.soft_max_ext(leaf(ctx, X), scale=0.7)
    got = run(ops.soft_max_ext_back(leaf(ctx, DY), y, 0.7), backend)
    want, = vjp(lambda t: torch.softmax(t * 0.7, dim=-1), DY, X)
    close(got, want)


# -- rope ----------------------------------------------------------------------------------

ROPE_CASES = {
    "normal": dict(mode=RopeMode.NORMAL),
    "neox_partial": dict(mode=RopeMode.NEOX, n_dims=8),
    "yarn": dict(mode=RopeMode.NORMAL, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64,
                 attn_factor=1.2),
    "freq_factors": dict(mode=RopeMode.NEOX, ff=True),
}


def torch_rope(x, pos, ff, n_dims, mode, **kw):
    """x (T, H, hd): the rotation of each pair by the angle table of ops.rope.rope_cache (its
    values are checked by hand formulas in test_ops_math.py)."""
    cos, sin = rope_cache(RopeParams(n_dims, mode, **kw), pos, ff)
    c = torch.tensor(cos, dtype=torch.float64)[:, None, :]
    s = torch.tensor(sin, dtype=torch.float64)[:, None, :]
    half = n_dims // 2
    i0 = torch.arange(half) if mode == RopeMode.NEOX else torch.arange(half) * 2
    i1 = i0 + half if mode == RopeMode.NEOX else i0 + 1
    x0, x1 = x[..., i0], x[..., i1]
    out = x.clone()
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def rope_case(name: str, backend: str, back_forward: bool = False):
    kw = dict(ROPE_CASES[name])
    use_ff = kw.pop("ff", False)
    rng = np.random.default_rng(len(name) + 10)
    ctx = Context()
    X = rng.uniform(-1, 1, (5, 3, 16))               # ne [16, 3, 5]: 5 tokens
    P = rng.integers(0, 300, 5).astype(np.int32)
    F = rng.uniform(1.0, 4.0, 8) if use_ff else None
    x = leaf(ctx, X)
    pos = ctx.new_tensor(T.I32, (5,)).set_data(P)
    ff = leaf(ctx, F) if use_ff else None
    n_dims = kw.pop("n_dims", 16)
    up = rng.uniform(-1, 1, X.shape)
    want, = vjp(lambda t: torch_rope(t, P, F, n_dims, **kw), up, X)
    if back_forward:
        return run(ops.rope_ext_back(leaf(ctx, up), pos, ff, n_dims, **kw), backend), want
    node = ops.rope_ext(x, pos, ff, n_dims, **kw)
    grads = rule_grads(node, up, backend=backend)
    assert grads[1] is None and grads[2] is None
    return grads[0], want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_rule_matches_torch(backend, name):
    got, want = rope_case(name, backend)
    close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["neox_partial", "yarn"])
def test_rope_ext_back_forward(backend, name):
    """rope_ext_back(dy) is the vjp of rope_ext: the rotation by -theta."""
    got, want = rope_case(name, backend, back_forward=True)
    close(got, want)


# -- rms_norm, norm ------------------------------------------------------------------------

def torch_rms_norm(x, eps):
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def norm_case(kind: str, backend: str):
    rng = np.random.default_rng(5 if kind == "rms_norm" else 6)
    ctx = Context()
    X = rng.uniform(-2, 2, (2, 3, 13))
    eps = 1e-5
    node = getattr(ops, kind)(leaf(ctx, X), eps)
    up = rng.uniform(-1, 1, X.shape)
    got, = rule_grads(node, up, backend=backend)
    f = ((lambda t: torch_rms_norm(t, eps)) if kind == "rms_norm" else
         (lambda t: torch.nn.functional.layer_norm(t, (13,), eps=eps)))
    want, = vjp(f, up, X)
    return got, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["rms_norm", "norm"])
def test_norm_rules_match_torch(backend, kind):
    got, want = norm_case(kind, backend)
    close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_back_forward(backend):
    """ggml's argument order: (dy, x)."""
    rng = np.random.default_rng(8)
    ctx = Context()
    X, DY = rng.uniform(-2, 2, (4, 10)), rng.uniform(-1, 1, (4, 10))
    got = run(ops.rms_norm_back(leaf(ctx, DY), leaf(ctx, X), 1e-6), backend)
    want, = vjp(lambda t: torch_rms_norm(t, 1e-6), DY, X)
    close(got, want)


# -- get_rows ------------------------------------------------------------------------------

def get_rows_case(backend: str, batched: bool):
    """Indices with repeats (their rows' gradients add up); batched: a 3-D source."""
    rng = np.random.default_rng(9 + batched)
    ctx = Context()
    A = rng.uniform(-1, 1, (2, 6, 5) if batched else (6, 5))     # ne [5, 6(, 2)]
    I = rng.integers(0, 6, (2, 8) if batched else (8,)).astype(np.int32)
    I.reshape(-1)[:2] = 3                                         # a repeated row
    idx = ctx.new_tensor(T.I32, tuple(reversed(I.shape))).set_data(I)
    node = ops.get_rows(leaf(ctx, A), idx)
    up = rng.uniform(-1, 1, node.shape)
    grads = rule_grads(node, up, backend=backend)
    ii = torch.tensor(I.astype(np.int64))
    f = ((lambda t: torch.stack([t[j][ii[j]] for j in range(2)])) if batched
         else (lambda t: t[ii]))
    want, = vjp(f, up.reshape(I.shape + (5,)), A)
    return grads, want, (A, I, up)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batched", [False, True])
def test_get_rows_rule_matches_torch(backend, batched):
    grads, want, _ = get_rows_case(backend, batched)
    close(grads[0], want)
    assert grads[1] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_rows_back_forward_by_hand(backend):
    rng = np.random.default_rng(11)
    ctx = Context()
    G = rng.uniform(-1, 1, (7, 4))
    I = np.array([0, 2, 2, 5, 0, 2, 1], np.int32)
    out = run(ops.get_rows_back(leaf(ctx, G), ctx.new_tensor(T.I32, (7,)).set_data(I),
                                ctx.new_tensor(T.F32, (4, 6))), backend).reshape(6, 4)
    want = np.zeros((6, 4))
    for i, r in enumerate(I):
        want[r] += G[i]
    close(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_rows_back_refuses_an_index_outside_the_rows(backend):
    ctx = Context()
    node = ops.get_rows_back(leaf(ctx, np.ones((2, 4))),
                             ctx.new_tensor(T.I32, (2,)).set_data(np.array([1, 6], np.int32)),
                             ctx.new_tensor(T.F32, (4, 6)))
    with pytest.raises((ValueError, IndexError), match=r"get_rows_back.*6.*outside \[0, 6\)"):
        run(node, backend)


def test_get_rows_back_shape_errors():
    ctx = Context()
    g = ctx.new_tensor(T.F32, (4, 3))
    idx = ctx.new_tensor(T.I32, (2,))
    with pytest.raises(ValueError, match=r"get_rows_back: a.ne\[1:4\].*idx"):
        ops.get_rows_back(g, idx, ctx.new_tensor(T.F32, (4, 6)))
    with pytest.raises(ValueError, match=r"get_rows_back: like must agree"):
        ops.get_rows_back(g, ctx.new_tensor(T.I32, (3,)), ctx.new_tensor(T.F32, (5, 6)))


# -- cross_entropy_loss --------------------------------------------------------------------

def torch_loss(x, p):
    return -(p * torch.log_softmax(x, dim=-1)).sum(dim=-1).mean()


def loss_case(backend: str):
    rng = np.random.default_rng(12)
    ctx = Context()
    X, P = rng.uniform(-4, 4, (2, 3, 10)), probabilities(rng, (2, 3, 10))
    node = ops.cross_entropy_loss(leaf(ctx, X), leaf(ctx, P))
    up = np.array([1.7])
    grads = rule_grads(node, up, backend=backend)
    want, = vjp(lambda t: torch_loss(t, torch.tensor(P)), up[0], X)
    return grads, want


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_loss_rule_matches_torch(backend):
    grads, want = loss_case(backend)
    close(grads[0], want)
    assert grads[1] is None                                  # labels: no gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_loss_forward_matches_torch(backend):
    rng = np.random.default_rng(13)
    ctx = Context()
    X, P = rng.uniform(-4, 4, (5, 17)), probabilities(rng, (5, 17))
    got = run(ops.cross_entropy_loss(leaf(ctx, X), leaf(ctx, P)), backend)
    want = torch.nn.functional.cross_entropy(torch.tensor(X), torch.tensor(P)).item()
    assert got.size == 1 and math.isclose(got.item(), want, rel_tol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_loss_back_forward(backend):
    """ggml's argument order (grad, logits, labels): the loss's gradient times grad."""
    rng = np.random.default_rng(14)
    ctx = Context()
    X, P = rng.uniform(-4, 4, (3, 6)), probabilities(rng, (3, 6))
    got = run(ops.cross_entropy_loss_back(leaf(ctx, np.array([0.5])), leaf(ctx, X),
                                          leaf(ctx, P)), backend)
    want, = vjp(lambda t: torch_loss(t, torch.tensor(P)), 0.5, X)
    close(got, want)


def test_cross_entropy_loss_errors_name_the_tensors():
    ctx = Context()
    a, b = ctx.new_tensor(T.F32, (5, 3), name="logits"), ctx.new_tensor(T.F32, (5, 2))
    with pytest.raises(ValueError, match=r"cross_entropy_loss: .*same shape.*logits"):
        ops.cross_entropy_loss(a, b)
    with pytest.raises(ValueError, match=r"cross_entropy_loss_back: grad must be a scalar"):
        ops.cross_entropy_loss_back(ctx.new_tensor(T.F32, (2,)), a, a)


def test_flash_attn_ext_has_no_backward_rule():
    from ggraph.ir.opkind import OpKind
    from ggraph.ops import REGISTRY

    assert REGISTRY[OpKind.FLASH_ATTN_EXT].backward is None
    assert "unfused" in ops.flash_attn_ext.__doc__
