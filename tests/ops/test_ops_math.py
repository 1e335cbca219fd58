"""Math ops against independent computations: explicit loops and hand formulas.

mul_mat (block-repeat broadcast, quantized and strided operands) and mul_mat_id at loop
level; rope (NORMAL, NEOX, linear scaling, YaRN, freq_factors, partial rotation) from the
facts page's formulas; norms; element-wise ops with modulo broadcast; sum_rows, argsort,
top_k. Stored weights are decoded with gguf, not ggraph.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggraph import Context, GGMLType, build_graph, ops
from ggraph.ops import RopeMode, SortOrder
from ggraph.check.reference import run_reference
from stored_values import stored

FEW = settings(max_examples=30, deadline=None)


def compute(*outs, inputs=None):
    ex = run_reference(build_graph(*outs), inputs)
    return [ex.read(o) for o in outs]


# -- mul_mat ------------------------------------------------------------------------------

def loop_mul_mat(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """A (A3, A2, M, K), B (B3, B2, N, K) -> (B3, B2, N, M) with block-repeat broadcast."""
    A3, A2, M, K = A.shape
    B3, B2, N, _ = B.shape
    r2, r3 = B2 // A2, B3 // A3
    out = np.zeros((B3, B2, N, M))
    for i3, i2, n, m in itertools.product(range(B3), range(B2), range(N), range(M)):
        out[i3, i2, n, m] = math.fsum(A[i3 // r3, i2 // r2, m, k] * B[i3, i2, n, k]
                                      for k in range(K))
    return out


@FEW
@given(wtype=st.sampled_from([GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0,
                              GGMLType.Q4_0, GGMLType.Q4_1]),
       btype=st.sampled_from([GGMLType.F32, GGMLType.F16]),
       K=st.sampled_from([32, 64]), M=st.integers(1, 4), N=st.integers(1, 3),
       A2=st.integers(1, 2), A3=st.integers(1, 2), r2=st.integers(1, 3), r3=st.integers(1, 2),
       seed=st.integers(0, 2**31 - 1))
def test_mul_mat_broadcast_loops(wtype, btype, K, M, N, A2, A3, r2, r3, seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (A3, A2, M, K)).astype(np.float32)
    b = rng.uniform(-1, 1, (A3 * r3, A2 * r2, N, K)).astype(np.float32)
    ctx = Context()
    at = ctx.from_numpy(a, wtype, name="a")
    bt = ctx.from_numpy(b, btype, name="b")
    out = ops.mul_mat(at, bt)
    assert out.type == GGMLType.F32 and out.ne == (M, N, A2 * r2, A3 * r3)
    (got,) = compute(out)
    want = loop_mul_mat(stored(a, wtype), stored(b, btype))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mul_mat_strided_operands():
    """a is a row window of a bigger weight, b a permuted (non-contiguous) activation."""
    rng = np.random.default_rng(4)
    K, M, N, H = 32, 3, 4, 2
    w = rng.uniform(-1, 1, (1, 1, 7, K)).astype(np.float32)
    x = rng.uniform(-1, 1, (1, N, H, K)).astype(np.float32)     # ne [K, H, N]
    ctx = Context()
    wt = ctx.from_numpy(w, "q8_0", name="w")
    xt = ctx.from_numpy(x, name="x")
    a = ops.view_2d(wt, K, M, wt.nb[1], 2 * wt.nb[1])           # rows 2..4
    b = ops.permute(xt, 0, 2, 1, 3)                             # [K, N, H]
    (got,) = compute(ops.mul_mat(a, b))
    A = stored(w, GGMLType.Q8_0)[:, :, 2:5]
    B = np.swapaxes(x, 1, 2).astype(np.float64)                 # (1, H, N, K)
    np.testing.assert_allclose(got, loop_mul_mat(A, B), rtol=1e-6, atol=1e-6)


@FEW
@given(wtype=st.sampled_from([GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0]),
       n_expert=st.integers(1, 5), n_used=st.integers(1, 3), n_b_is_one=st.booleans(),
       T=st.integers(1, 4), M=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_mul_mat_id_loops(wtype, n_expert, n_used, n_b_is_one, T, M, seed):
    rng = np.random.default_rng(seed)
    K = 32
    n_b = 1 if n_b_is_one else n_used
    w = rng.uniform(-1, 1, (n_expert, M, K)).astype(np.float32)      # ne [K, M, n_expert]
    x = rng.uniform(-1, 1, (T, n_b, K)).astype(np.float32)           # ne [K, n_b, T]
    ids = rng.integers(0, n_expert, (T, n_used)).astype(np.int32)    # ne [n_used, T]
    ctx = Context()
    out = ops.mul_mat_id(ctx.from_numpy(w, wtype, name="as"), ctx.from_numpy(x, name="b"),
                         ctx.from_numpy(ids, "i32", name="ids"))
    assert out.ne == (M, n_used, T, 1)
    (got,) = compute(out)
    W = stored(w, wtype)
    want = np.zeros((1, T, n_used, M))
    for t, e, m in itertools.product(range(T), range(n_used), range(M)):
        want[0, t, e, m] = math.fsum(W[ids[t, e], m, k] * float(x[t, e % n_b, k])
                                     for k in range(K))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mul_mat_id_rejects_bad_expert_at_run_time():
    ctx = Context()
    w = ctx.from_numpy(np.zeros((2, 1, 32), np.float32), name="as")
    x = ctx.from_numpy(np.zeros((1, 1, 32), np.float32), name="b")
    ids = ctx.from_numpy(np.array([[2]], np.int32), "i32", name="ids")
    with pytest.raises(ValueError, match=r"mul_mat_id: expert id 2 .*'ids'.*outside \[0, 2\)"):
        compute(ops.mul_mat_id(w, x, ids))


# -- rope ---------------------------------------------------------------------------------

def hand_rope(x, pos, n_dims, mode, freq_base=10000.0, freq_scale=1.0, ext_factor=0.0,
              attn_factor=1.0, n_ctx_orig=0, beta_fast=32.0, beta_slow=1.0, ff=None):
    """x numpy (T, H, head_dim); the facts page's formulas, one rotated pair at a time."""
    T, H, hd = x.shape
    out = x.astype(np.float64).copy()
    half = n_dims // 2

    def cd(r):
        return n_dims * math.log(n_ctx_orig / (2 * math.pi * r)) / (2 * math.log(freq_base))

    for t in range(T):
        for i in range(half):
            theta = pos[t] * freq_base ** (-2.0 * i / n_dims)
            if ff is not None:
                theta /= ff[i]
            mscale = attn_factor
            if ext_factor != 0.0:
                low = max(0.0, math.floor(cd(beta_fast)))
                high = min(n_dims - 1.0, math.ceil(cd(beta_slow)))
                ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
                theta = (freq_scale * theta * (1 - ramp * ext_factor)
                         + theta * ramp * ext_factor)
                mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
            else:
                theta = freq_scale * theta
            c, s = math.cos(theta) * mscale, math.sin(theta) * mscale
            j0, j1 = (2 * i, 2 * i + 1) if mode == RopeMode.NORMAL else (i, i + half)
            for h in range(H):
                x0, x1 = float(x[t, h, j0]), float(x[t, h, j1])
                out[t, h, j0] = x0 * c - x1 * s
                out[t, h, j1] = x0 * s + x1 * c
    return out


ROPE_CASES = {
    "normal": dict(mode=RopeMode.NORMAL),
    "neox": dict(mode=RopeMode.NEOX),
    "normal_partial": dict(mode=RopeMode.NORMAL, n_dims=8),
    "neox_partial": dict(mode=RopeMode.NEOX, n_dims=6),
    "linear": dict(mode=RopeMode.NEOX, freq_scale=0.25),                  # --rope-scale 4
    "base": dict(mode=RopeMode.NORMAL, freq_base=500000.0),
    "yarn_deepseek": dict(mode=RopeMode.NORMAL, freq_scale=1 / 40, ext_factor=1.0,
                          attn_factor=1.0 / (1 + 0.1 * math.log(40)), n_ctx_orig=4096),
    "yarn_neox_partial": dict(mode=RopeMode.NEOX, n_dims=12, freq_scale=0.125,
                              ext_factor=0.5, attn_factor=0.9, n_ctx_orig=256,
                              beta_fast=16.0, beta_slow=2.0),
    "freq_factors": dict(mode=RopeMode.NEOX, ff=True),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("atype", [GGMLType.F32, GGMLType.F16])
def test_rope_hand_formulas(case, atype):
    kw = dict(ROPE_CASES[case])
    rng = np.random.default_rng(5)
    hd, H, T = 16, 2, 5
    n_dims = kw.pop("n_dims", hd)
    use_ff = kw.pop("ff", False)
    x = rng.uniform(-1, 1, (T, H, hd)).astype(np.float32)
    if atype == GGMLType.F16:
        x = x.astype(np.float16).astype(np.float32)
    pos = np.array([0, 1, 7, 4096, 163839], dtype=np.int32)
    ff = rng.uniform(0.5, 4.0, n_dims // 2).astype(np.float32) if use_ff else None
    ctx = Context()
    at = ctx.from_numpy(x, atype, name="a")
    pt = ctx.from_numpy(pos, "i32", name="pos")
    ft = ctx.from_numpy(ff, name="ff") if use_ff else None
    out = ops.rope_ext(at, pt, ft, n_dims=n_dims, **kw)
    assert out.type == atype and out.ne == at.ne
    got = compute(out)[0][0]
    want = hand_rope(x, pos, n_dims, ff=ff, **kw)
    tol = 1e-6 if atype == GGMLType.F32 else 2e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[..., n_dims:], x[..., n_dims:])   # copied unchanged
    if not kw.get("ext_factor") and kw.get("attn_factor", 1.0) == 1.0:
        # a rotation keeps the norm of each pair
        np.testing.assert_allclose(np.linalg.norm(got[..., :n_dims], axis=-1),
                                   np.linalg.norm(x[..., :n_dims], axis=-1), rtol=tol)


def test_rope_on_strided_view_and_position_zero_is_identity():
    rng = np.random.default_rng(6)
    q = rng.uniform(-1, 1, (3, 4, 24)).astype(np.float32)   # ne [24, 4, 3]: nope 16 + rope 8
    ctx = Context()
    qt = ctx.from_numpy(q, name="q")
    pe = ops.view_3d(qt, 8, 4, 3, qt.nb[1], qt.nb[2], 16 * 4)   # the rope part of each head
    pos = ctx.from_numpy(np.array([0, 3, 9], np.int32), "i32")
    got = compute(ops.rope_ext(pe, pos, n_dims=8, mode=RopeMode.NORMAL))[0][0]
    want = hand_rope(q[..., 16:], [0, 3, 9], 8, RopeMode.NORMAL)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[0], q[0, :, 16:], rtol=0, atol=0)


# -- norms --------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-2])
def test_rms_norm_and_norm_loops(eps):
    rng = np.random.default_rng(7)
    x = rng.uniform(-2, 2, (2, 3, 33)).astype(np.float32)
    x[0, 0] = 1e3 + x[0, 0]                                    # large mean for norm
    ctx = Context()
    xt = ctx.from_numpy(x)
    rms, nrm = compute(ops.rms_norm(xt, eps), ops.norm(xt, eps))
    for idx in np.ndindex(*x.shape[:-1]):
        row = [float(v) for v in x[idx]]
        n = len(row)
        r = math.sqrt(math.fsum(v * v for v in row) / n + eps)
        np.testing.assert_allclose(rms[(0,) + idx], [v / r for v in row], rtol=1e-6)
        mean = math.fsum(row) / n
        var = math.fsum((v - mean) ** 2 for v in row) / n
        np.testing.assert_allclose(nrm[(0,) + idx], [(v - mean) / math.sqrt(var + eps)
                                                     for v in row], rtol=2e-6, atol=2e-6)


# -- element-wise -------------------------------------------------------------------------

def loop_binary(A, B, f):
    out = np.zeros(A.shape)
    for i in np.ndindex(*A.shape):
        j = tuple(ii % n for ii, n in zip(i, B.shape))
        out[i] = f(float(A[i]), float(B[j]))
    return out


@FEW
@given(ne=st.lists(st.integers(1, 4), min_size=4, max_size=4),
       div=st.lists(st.booleans(), min_size=4, max_size=4),
       op=st.sampled_from(["add", "mul", "div"]),
       atype=st.sampled_from([GGMLType.F32, GGMLType.F16]),
       btype=st.sampled_from([GGMLType.F32, GGMLType.F16]), seed=st.integers(0, 2**31 - 1))
def test_binary_broadcast_loops(ne, div, op, atype, btype, seed):
    rng = np.random.default_rng(seed)
    a_ne = [n * (2 if d else 1) for n, d in zip(ne, div)]       # b.ne divides a.ne
    b_ne = [n if d else (1 if n % 2 else n) for n, d in zip(ne, div)]
    A = rng.uniform(-2, 2, a_ne[::-1]).astype(np.float32)
    B = rng.uniform(0.5, 2, b_ne[::-1]).astype(np.float32) * rng.choice([-1, 1], b_ne[::-1])
    if atype == GGMLType.F16:
        A = A.astype(np.float16).astype(np.float32)
    if btype == GGMLType.F16:
        B = B.astype(np.float16).astype(np.float32)
    ctx = Context()
    at, bt = ctx.from_numpy(A, atype, name="a"), ctx.from_numpy(B, btype, name="b")
    out = getattr(ops, op)(at, bt)
    assert out.type == atype and out.ne == at.ne
    (got,) = compute(out)
    f = {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    want = loop_binary(A, B, f)
    if atype == GGMLType.F16:
        want = want.astype(np.float32).astype(np.float16)
        np.testing.assert_array_equal(got, want.astype(np.float32))
    else:
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


UNARY = {
    "silu": (lambda a: ops.silu(a), lambda x: x / (1.0 + math.exp(-x))),
    "gelu": (lambda a: ops.gelu(a), _gelu_tanh),
    "sigmoid": (lambda a: ops.sigmoid(a), lambda x: 1.0 / (1.0 + math.exp(-x))),
    "gelu_quick": (lambda a: ops.gelu_quick(a), lambda x: x / (1.0 + math.exp(-1.702 * x))),
    "tanh": (lambda a: ops.tanh(a), math.tanh),
    "scale": (lambda a: ops.scale(a, -0.75), lambda x: -0.75 * x),
    "scale_bias": (lambda a: ops.scale(a, 2.5, 0.125), lambda x: 2.5 * x + 0.125),
    "clamp": (lambda a: ops.clamp(a, -0.5, 1.25), lambda x: min(1.25, max(-0.5, x))),
    "fill": (lambda a: ops.fill(a, -3.5), lambda x: -3.5),
}


@pytest.mark.parametrize("atype", [GGMLType.F32, GGMLType.F16])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_hand_formulas(name, atype):
    build, f = UNARY[name]
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.uniform(-6, 6, 29), [0.0, -20.0, 20.0]]).astype(np.float32)
    x = x.reshape(2, 16)
    if atype == GGMLType.F16:
        x = x.astype(np.float16).astype(np.float32)
    ctx = Context()
    out = build(ctx.from_numpy(x, atype, name="x"))
    assert out.type == atype and out.ne == (16, 2, 1, 1)
    got = compute(out)[0].reshape(x.shape)
    want = np.vectorize(f)(x.astype(np.float64))
    if atype == GGMLType.F32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_gelu_is_the_tanh_approximation():
    """gelu(1) = 0.8411920 with tanh, 0.8413447 with erf: ggml uses tanh."""
    ctx = Context()
    (got,) = compute(ops.gelu(ctx.from_numpy(np.array([1.0, -1.0, 3.0], np.float32))))
    np.testing.assert_allclose(got.ravel(), [0.8411920, -0.1588080, 2.9963627], atol=2e-7)


def test_swiglu_hand_formula():
    rng = np.random.default_rng(9)
    g = rng.uniform(-5, 5, (3, 8)).astype(np.float32)
    u = rng.uniform(-2, 2, (3, 8)).astype(np.float32)
    ctx = Context()
    got = compute(ops.swiglu(ctx.from_numpy(g), ctx.from_numpy(u)))[0].reshape(g.shape)
    want = np.vectorize(lambda a, b: a / (1 + math.exp(-a)) * b)(g.astype(float), u.astype(float))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# -- reductions and selection -------------------------------------------------------------

def test_sum_rows_fsum():
    rng = np.random.default_rng(10)
    x = (rng.uniform(-1, 1, (2, 3, 4, 50)) * 10.0 ** rng.integers(-3, 4, (2, 3, 4, 50)))
    x = x.astype(np.float32)
    ctx = Context()
    out = ops.sum_rows(ctx.from_numpy(x))
    assert out.ne == (1, 4, 3, 2)
    (got,) = compute(out)
    for idx in np.ndindex(*x.shape[:-1]):
        assert got[idx + (0,)] == np.float32(math.fsum(float(v) for v in x[idx]))


@FEW
@given(n=st.integers(1, 12), rows=st.integers(1, 3), k_frac=st.floats(0, 1),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_argsort_and_top_k_sorted(n, rows, k_frac, ties, seed):
    rng = np.random.default_rng(seed)
    x = (rng.integers(-3, 4, (rows, n)) if ties else rng.permutation(rows * n).reshape(rows, n)
         - rows * n / 2).astype(np.float32)
    k = max(1, round(k_frac * n))
    ctx = Context()
    xt = ctx.from_numpy(x)
    asc, desc, top = compute(ops.argsort(xt, SortOrder.ASC), ops.argsort(xt, SortOrder.DESC),
                             ops.top_k(xt, k))
    for r in range(rows):
        row = [float(v) for v in x[r]]
        # ggraph's contract: stable, ties keep index order (ggml's CPU sort only promises order)
        assert list(asc[0, 0, r]) == sorted(range(n), key=lambda i: (row[i], i))
        assert list(desc[0, 0, r]) == sorted(range(n), key=lambda i: (-row[i], i))
        assert list(top[0, 0, r]) == sorted(range(n), key=lambda i: (-row[i], i))[:k]
        # ggml's contract for top_k (order not specified): the k largest values
        assert sorted(row[i] for i in top[0, 0, r]) == sorted(row)[n - k:]


def test_every_op_has_an_independent_reference_test():
    """A guard for new ops: each OpKind is checked against torch, loops or hand formulas in
    tests/ops/test_ops_{attention,math,layout}.py and the gradient ops' test_grad_*.py /
    test_optim.py. Add a test there before extending this set."""
    from ggraph import OpKind
    covered = {
        # test_ops_layout.py
        "view", "reshape", "permute", "transpose", "cpy", "cont", "get_rows", "set_rows",
        "concat", "repeat",
        # test_ops_attention.py
        "soft_max", "flash_attn_ext",
        # this file
        "mul_mat", "mul_mat_id", "rope", "rms_norm", "norm", "add", "mul", "div", "scale",
        "clamp", "fill", "silu", "gelu", "sigmoid", "swiglu", "sum_rows", "argsort", "top_k",
        "gelu_quick", "tanh",
        # tests/ops/test_grad_elementwise.py (torch and hand loops)
        "sub", "sqr", "sqrt", "log", "silu_back", "geglu", "sum", "mean", "repeat_back", "acc",
        # tests/ops/test_grad_rows.py
        "soft_max_back", "rope_back", "rms_norm_back", "get_rows_back", "cross_entropy_loss",
        "cross_entropy_loss_back",
        # tests/ops/test_grad_matmul.py, tests/ops/test_optim.py
        "out_prod", "opt_step_adamw", "opt_step_sgd",
    }
    assert {k.value for k in OpKind} == covered
