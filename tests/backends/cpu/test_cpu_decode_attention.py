"""The CPU backend's F16 mat-vec path (k_mul_mat_half): K*Q and V*softmax at decode read the
F16 KV cache through strided views (K heads strided by a cache row, V stored transposed) with
GQA broadcast. Checked against an exact emulation of what ggml computes (activations rounded
to F16, products summed in float32 or better), against the reference executor, and that the
fast path is the one bound for those views."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from ggraph.backends.cpu import CPUBackend, fastmath
from ggraph.backends.cpu import kernels as CK
from ggraph.backends.cpu.attn_bind import flat_rows
from ggraph.backends.cpu.compile import EXPF

from ggraph import Context, build_graph
from ggraph import ops as O
from ggraph.check.conformance import nmse
from ggraph.ir.opkind import OpKind
from ggraph.check.reference import run_reference

SHAPES = [  # head_dim, n_head, n_head_kv, n_tokens, n_kv, cache size
    (64, 9, 3, 1, 768, 1024),   # SmolLM2 decode
    (64, 4, 4, 3, 300, 512),    # no GQA, a few tokens, n_kv not a multiple of the row block
    (40, 6, 2, 2, 5, 8),        # odd head size, tiny (serial kernel)
    (64, 8, 1, 4, 129, 256),    # MQA
    (128, 2, 2, 1, 2048, 2048),  # rows spanning the whole cache
]


def _attention_matvecs(hd, nh, nkvh, nt, nkv, size):
    """K*Q and V*P on views of F16 caches laid out as graphs/models/attention.py lays them out."""
    ctx = Context()
    kc = ctx.new_tensor("f16", (hd * nkvh, size), name="k_cache").set_input()
    vc = ctx.new_tensor("f16", (size, hd * nkvh), name="v_cache").set_input()
    q = ctx.new_tensor("f32", (hd, nh, nt), name="q").set_input()
    p = ctx.new_tensor("f32", (nkv, nt, nh), name="p").set_input()
    k = O.permute(O.view_3d(kc, hd, nkvh, nkv, 2 * hd, kc.nb[1], 0), 0, 2, 1, 3)
    v = O.view_3d(vc, nkv, hd, nkvh, vc.nb[1], vc.nb[1] * hd, 0)
    kq = O.mul_mat(k, O.permute(q, 0, 2, 1, 3), name="kq").set_output()
    kqv = O.mul_mat(v, p, name="kqv").set_output()
    rng = np.random.default_rng(hd * nkv + nh)
    probs = rng.dirichlet(np.ones(nkv), size=(nh, nt))  # (nh, nt, nkv)
    probs[..., ::7] *= 1e-4  # values below F16's normal range: rounding must still match
    inputs = {kc: rng.standard_normal(kc.shape), vc: rng.standard_normal(vc.shape),
              q: rng.standard_normal(q.shape), p: probs}
    return build_graph(kq, kqv), (kq, kqv), (k, v), inputs


def _expected(a_vals: np.ndarray, b_vals: np.ndarray, round_b: bool) -> np.ndarray:
    """a_vals (A3, A2, M, K) f16-exact values, b_vals (B3, B2, N, K) -> (B3, B2, N, M)."""
    B = b_vals.astype(np.float32)
    if round_b:
        B = B.astype(np.float16)
    B = B.astype(np.float64)
    A = a_vals.astype(np.float64)
    A = np.repeat(np.repeat(A, B.shape[0] // A.shape[0], 0), B.shape[1] // A.shape[1], 1)
    return B @ np.swapaxes(A, -1, -2)


def _run(shape):
    graph, (kq, kqv), (k, v), inputs = _attention_matvecs(*shape)
    ref = run_reference(graph, inputs)
    s = CPUBackend().session()
    s.run(graph, inputs)
    return graph, (kq, kqv), (k, v), ref, s


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hd{}_h{}_kv{}_t{}_n{}".format(*s))
@pytest.mark.parametrize("round_b", [True, False], ids=["f16-activations", "exact"])
def test_kq_and_kqv_match_ggml_emulation(shape, round_b, monkeypatch):
    monkeypatch.setattr(CK, "ROUND_ACTIVATIONS", round_b)
    _, nodes, _, ref, s = _run(shape)
    for node in nodes:
        a, b = node.src
        want = _expected(ref.read(a), ref.read(b), round_b)
        got = s.read(node)
        # float32 accumulation of <= 2048 products of exact f16 x f16 values
        scale = np.sqrt(np.sum(np.abs(ref.read(a).astype(np.float64)) ** 2, axis=-1)).max()
        assert np.abs(got - want).max() <= 1e-5 * scale * np.abs(ref.read(b)).max() + 1e-30, \
            node.name
        assert nmse(ref.read(node), got) < 5e-4
        if not round_b:
            assert nmse(ref.read(node), got) < 1e-10


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["smollm2", "mha"])
def test_fast_path_bound_for_cache_views(shape):
    _, nodes, _, _, s = _run(shape)
    for node in nodes:
        call = CK.KERNELS[OpKind.MUL_MAT].fn(node, s)
        assert "k_mul_mat_half" in call.func.py_func.__qualname__, node.name


def test_non_unit_row_stride_falls_back():
    """A view whose rows are not contiguous (nb0 > element size) takes the generic kernel."""
    ctx = Context()
    x = ctx.new_tensor("f16", (2, 4, 8), name="x").set_input()
    a = O.permute(x, 2, 0, 1, 3)                       # ne [4, 8, 2], nb [4, 16, 2]
    b = ctx.new_tensor("f32", (4, 1, 2), name="b").set_input()
    out = O.mul_mat(a, b, name="out").set_output()
    g = build_graph(out)
    rng = np.random.default_rng(0)
    inputs = {x: rng.standard_normal(x.shape), b: rng.standard_normal(b.shape)}
    s = CPUBackend().session()
    got = s.run(g, inputs).read(out)
    assert flat_rows(s.arr(a)) is None
    assert "k_mul_mat_half" not in CK.KERNELS[OpKind.MUL_MAT].fn(out, s).func.__qualname__
    assert nmse(run_reference(g, inputs).read(out), got) < 5e-4


def test_flat_rows_spans_the_view():
    base = np.arange(4 * 6 * 10, dtype=np.uint16).reshape(4, 6, 10)
    view = base[1:3, ::2, 2:7].transpose(1, 0, 2)[None]     # (1, 3, 2, 5), rows contiguous
    flat, (_, o2, o1) = flat_rows(view)
    assert flat.flags.c_contiguous and flat.ndim == 1
    for j2 in range(3):
        for m in range(2):
            o = j2 * o2 + m * o1
            assert np.array_equal(flat[o:o + 5], view[0, j2, m])


def _map(fn):
    @numba.njit
    def run(xs, out):
        for i in range(xs.size):
            out[i] = fn(xs[i])
    return run


def _floats():
    rng = np.random.default_rng(1)
    f16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    return np.concatenate([f16[~np.isnan(f16)], rng.normal(0, 1e3, 20000), rng.uniform(-1e-4, 1e-4, 20000),
                           rng.uniform(-1e-7, 1e-7, 20000),
                           [0.0, -0.0, 65519.0, 65520.0, 1e9, -np.inf, np.inf, np.nan]]
                          ).astype(np.float32)


@pytest.mark.parametrize("which", ["f16c", "soft"])
def test_round_half_like_numpy(which):
    if which == "f16c" and not fastmath.F16C:
        pytest.skip("no F16C on this host")
    fn = (CK.TARGET.device(fastmath.round_half_f16c) if which == "f16c" else
          CK.TARGET.bind(fastmath.round_half_soft, CK.TARGET.device, ""))
    x = _floats()
    got = np.empty_like(x)
    _map(fn)(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(got[nan]).all()


def test_half_to_f32_table_and_f16c_agree():
    h = np.arange(65536, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    fns = [numba.njit(fastmath.half_to_f32_table)]
    if fastmath.F16C:
        fns.append(numba.njit(fastmath.half_to_f32_f16c))
    for f in fns:
        got = np.empty(65536, np.float32)
        _map(f)(h, got)
        assert np.array_equal(got[~nan], want[~nan]) and np.isnan(got[nan]).all()


def test_f32_to_half_f16c_equals_the_shared_conversion():
    """The CPU's one-instruction f32 -> f16 (fastmath.OVERRIDES) gives the shared software
    conversion's bits for every input, ties, overflow, subnormals and NaN (0x7E00) included."""
    if not fastmath.F16C:
        pytest.skip("no F16C on this host: the CPU keeps the shared conversion")
    from ggraph.backends.shared import numeric

    with np.errstate(invalid="ignore"):  # the f16 NaNs plus a little stay NaN
        x = np.concatenate([_floats(), np.array([-np.float32(np.nan)], np.float32),
                            (np.arange(65536, dtype=np.uint16).view(np.float16)
                             .astype(np.float32) + np.float32(2.0 ** -25))])
    x = np.concatenate([x, np.array([0x7FC00001, 0xFFC12345], np.uint32).view(np.float32)])
    hw = np.empty(x.size, np.uint16)
    sw = np.empty(x.size, np.uint16)
    _map(CK.TARGET.fn("f32_to_half"))(x, hw)
    _map(CK.TARGET.bind(numeric.f32_to_half, CK.TARGET.device, "soft"))(x, sw)
    assert np.array_equal(hw, sw)


def test_expf_within_two_ulp_of_exp():
    """The CPU's float32 exp (softmax, flash attention) as the kernels compile it: within 2
    ulp of the correctly rounded exp wherever that is a normal float, 0 below e^-87.3 and for
    -inf, inf above e^88.72 and for inf, NaN for NaN."""
    with np.errstate(over="ignore"):
        x = np.concatenate([np.linspace(-90, 90, 400_001, dtype=np.float32),
                            np.array([88.72, 88.7228, -87.336, 0.0, -0.0, 1e-30], np.float32)])
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    got = np.empty_like(x)
    _map(EXPF)(x, got)
    normal = np.isfinite(want) & (want >= np.finfo(np.float32).tiny)
    ulp = np.abs(got[normal].view(np.int32).astype(np.int64) - want[normal].view(np.int32))
    assert ulp.max() <= 2
    assert (got[~normal & (x < 0)] == 0).all() and np.isinf(got[~normal & (x > 0)]).all()
    special = np.array([-np.inf, np.inf, np.nan], np.float32)
    out = np.empty_like(special)
    _map(EXPF)(special, out)
    assert out[0] == 0 and out[1] == np.inf and np.isnan(out[2])
