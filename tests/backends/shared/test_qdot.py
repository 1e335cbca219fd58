"""The integer dot products (backends/shared/qdot.py) and their CPU vector block sums
(backends/cpu/qsimd.py): each CPU helper equals the shared loop on random bytes, and the CPU
backend's quantized mul_mat / mul_mat_id at decode shapes equal float64 products of the
dequantized weights with the dequantized vec_dot_type activations (what ggml multiplies)."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ggraph import Context, GGMLType, build_graph, ops
from ggraph.backends import get_backend
from ggraph.backends.cpu import qrows, qsimd, qvec
from ggraph.backends.shared import qdot as shared
from ggraph.ops.case import random_blocks
from ggraph.codecs.quants import dequantize, quantize
from ggraph.ir.types import TYPE_RECORDS

QDOT_TYPES = [t for t, r in TYPE_RECORDS.items() if r.qdot]
# Q4_1/Q5_1 dot Q8_1, whose sum term d*sum(q) is stored as f16 (rounded): ~2^-11 relative
MIN_TYPES = (GGMLType.Q4_1, GGMLType.Q5_1)

_j = numba.njit


def _pair(k):
    """(CPU intrinsic caller, shared loop caller) for each helper, with literal k inside."""
    sh = {n: _j(getattr(shared, n)) for n in ("_isum_i8", "_sum_i8", "_isum_nib", "_isum_nib_h",
                                               "_isum_q4", "_isum_q5", "_isum_q4k")}

    def both(fn_cpu, fn_shared):
        return _j(fn_cpu), _j(fn_shared)

    i8, si8, nib, nibh = (sh["_isum_i8"], sh["_sum_i8"], sh["_isum_nib"], sh["_isum_nib_h"])
    q4, q5, q4k = sh["_isum_q4"], sh["_isum_q5"], sh["_isum_q4k"]
    c_i8, c_s, c_nib, c_nibh = qsimd.isum_i8, qsimd.sum_i8, qsimd.isum_nib, qsimd.isum_nib_h
    c_q4, c_q5, c_q4k = qsimd.isum_q4, qsimd.isum_q5, qsimd.isum_q4k
    if k == 16:
        return [
            both(lambda a, b, p: c_i8(a, p[0], b, p[1], 16),
                 lambda a, b, p: i8(a, p[0], b, p[1], 16)),
            both(lambda a, b, p: c_s(b, p[1], 16), lambda a, b, p: si8(b, p[1], 16)),
            both(lambda a, b, p: c_nib(a, p[0], p[2], p[3], p[4], b, p[1], 16),
                 lambda a, b, p: nib(a, p[0], p[2], p[3], p[4], b, p[1], 16)),
            both(lambda a, b, p: c_nibh(a, p[0], p[2], p[3], a, p[5], p[6], p[7], p[8], p[4], b,
                                        p[1], 16),
                 lambda a, b, p: nibh(a, p[0], p[2], p[3], a, p[5], p[6], p[7], p[8], p[4], b,
                                      p[1], 16)),
        ]
    return [
        both(lambda a, b, p: c_i8(a, p[0], b, p[1], 32), lambda a, b, p: i8(a, p[0], b, p[1], 32)),
        both(lambda a, b, p: c_s(b, p[1], 32), lambda a, b, p: si8(b, p[1], 32)),
        both(lambda a, b, p: c_nib(a, p[0], p[2], p[3], p[4], b, p[1], 32),
             lambda a, b, p: nib(a, p[0], p[2], p[3], p[4], b, p[1], 32)),
        both(lambda a, b, p: c_nibh(a, p[0], p[2], p[3], a, p[5], p[6], p[7], p[8], p[4], b,
                                    p[1], 32),
             lambda a, b, p: nibh(a, p[0], p[2], p[3], a, p[5], p[6], p[7], p[8], p[4], b,
                                  p[1], 32)),
        both(lambda a, b, p: c_q4(a, p[0], p[4], b, p[1]),
             lambda a, b, p: q4(a, p[0], p[4], b, p[1])),
        both(lambda a, b, p: c_q5(a, p[0], p[9], p[4], b, p[1]),
             lambda a, b, p: q5(a, p[0], p[9], p[4], b, p[1])),
        both(lambda a, b, p: c_q4k(a, p[0], p[2] + 40, p[3] + 20, b, p[1]),
             lambda a, b, p: q4k(a, p[0], p[2] + 40, p[3] + 20, b, p[1])),
    ]


@pytest.mark.parametrize("k", [16, 32])
def test_cpu_block_sums_equal_shared_loops(k):
    rng = np.random.default_rng(k)
    funcs = _pair(k)
    for trial in range(40):
        a = rng.integers(0, 256, 160, dtype=np.uint8)
        b = rng.integers(0, 256, 160, dtype=np.uint8)
        if trial == 0:  # the extremes: every weight byte 255, every quant -128
            a[:] = 255
            b[:] = 128
        # ao, bo, shift, mask, offset, h offset, h shift, h mask, h up, 32-bit word
        p = np.array([rng.integers(0, 64), rng.integers(0, 64), rng.integers(0, 5),
                      rng.choice([3, 15]), rng.integers(0, 33), rng.integers(0, 64),
                      rng.integers(0, 7), rng.choice([1, 3]), rng.choice([2, 4]),
                      rng.integers(0, 2**32)], dtype=np.int64)
        for i, (cpu, ref) in enumerate(funcs):
            assert cpu(a, b, p) == ref(a, b, p), f"helper {i}, k={k}, params {p}"


def test_cpu_f32_row_reads_little_endian_floats():
    vals = np.array([1.5, -0.0, 3.4e38, 1e-45, -2.75e-3], np.float32)
    raw = np.concatenate([np.zeros(3, np.uint8), vals.view(np.uint8)])
    read = _j(lambda r, o: qsimd.f32_row(r, o))
    got = np.array([read(raw, 3 + 4 * i) for i in range(len(vals))], np.float32)
    assert got.view(np.uint32).tolist() == vals.view(np.uint32).tolist()


def _ref(t, wq, xv):
    """float64 product of the dequantized weights with the dequantized vec-dot activations."""
    vt = TYPE_RECORDS[t].vec_dot_type
    W = dequantize(t, wq).astype(np.float64)
    X = dequantize(vt, quantize(vt, xv)).astype(np.float64)
    return X @ W.T


def _tol(t, ref):
    return (2e-3 if t in MIN_TYPES else 1e-5) * np.abs(ref).max()


@pytest.mark.parametrize("t", QDOT_TYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [3, 21], ids=["decode", "gemm"])
def test_mul_mat_integer_path_matches_dequantized_product(t, threads, N):
    """3 columns take the row dots (qrows.py), 21 the integer GEMM (qgemm.py) where the type
    has one: 81 rows and 21 columns leave partial tiles, and the row lengths end in a whole
    group of 8 sub-blocks, a half one, or a zero-padded one."""
    rng = np.random.default_rng(int(t))
    M = 81
    for K in ((512, 768) if t.block_size == 256 else (512, 544, 448)):
        _check_product(t, threads, rng, K, M, N)


def _check_product(t, threads, rng, K, M, N):
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (K, N), "x").set_input()
    w = ctx.new_tensor(t, (K, M), "w")
    w.set_data(rng.standard_normal((M, K)).astype(np.float32))
    out = ops.mul_mat(w, x)
    sess = get_backend("cpu", n_threads=threads).session()
    xv = rng.standard_normal((N, K)).astype(np.float32)
    sess.run(build_graph(out), {x: xv})
    got = sess.read(out).reshape(N, M)
    ref = _ref(t, w.data.reshape(M, -1), xv)
    assert np.abs(got - ref).max() <= _tol(t, ref), f"{t} K={K} N={N}: max error {np.abs(got - ref).max()}"


def test_gemm_products_of_one_input_share_its_activations():
    """Q, K and V read one normed input: the first GEMM (in run order) unpacks it, the others
    (Q5_0 and Q8_0 weights: the same Q8_0 layout; Q6_K: its own) reuse or redo it; each
    product equals its own reference, run after run with new inputs."""
    from ggraph.backends.cpu import qgemm

    rng = np.random.default_rng(5)
    K, N = 512, 24
    ctx = Context()
    x = ctx.new_tensor(GGMLType.F32, (K, N), "x").set_input()
    types = [GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q4_0] + (
        [GGMLType.Q8_0] if GGMLType.Q8_0 in qgemm.GEMMS else [])
    ws = []
    for i, t in enumerate(types):
        w = ctx.new_tensor(t, (K, 40 + 8 * i), f"w{i}")
        w.set_data(rng.standard_normal((40 + 8 * i, K)).astype(np.float32))
        ws.append(w)
    outs = [ops.mul_mat(w, x) for w in ws]
    sess = get_backend("cpu", n_threads=2).session()
    g = build_graph(*outs)
    for _ in range(2):
        xv = rng.standard_normal((N, K)).astype(np.float32)
        sess.run(g, {x: xv})
        for t, w, out in zip(types, ws, outs):
            got = sess.read(out).reshape(N, -1)
            ref = _ref(t, w.data.reshape(w.ne[1], -1), xv)
            assert np.abs(got - ref).max() <= _tol(t, ref), t


@pytest.mark.parametrize("t", [GGMLType.Q4_0, GGMLType.Q4_K], ids=str)
def test_mul_mat_id_integer_path(t):
    rng = np.random.default_rng(7)
    K, M, n_exp, n_used, T = 256, 8, 4, 2, 3
    w = rng.standard_normal((n_exp, M, K)).astype(np.float32)
    xv = rng.standard_normal((T, n_used, K)).astype(np.float32)
    ids = rng.integers(0, n_exp, (T, n_used)).astype(np.int32)
    ctx = Context()
    wt = ctx.from_numpy(w, t, name="as")
    out = ops.mul_mat_id(wt, ctx.from_numpy(xv, name="b"), ctx.from_numpy(ids, "i32", name="ids"))
    sess = get_backend("cpu", n_threads=2).session()
    sess.run(build_graph(out), {})
    got = sess.read(out).reshape(T, n_used, M)
    wq = wt.data.reshape(n_exp, M, -1)
    for ti in range(T):
        for e in range(n_used):
            ref = _ref(t, wq[ids[ti, e]], xv[ti, e][None])[0]
            assert np.abs(got[ti, e] - ref).max() <= _tol(t, ref), (ti, e)



def _row_dot(t, tag):
    """(the CPU's row dot of t, its Q8_1 sums, the shared qdot), compiled as the CPU backend
    compiles them."""
    from ggraph.backends.cpu import kernels

    bind, dec = kernels.TARGET.bind, numba.njit(fastmath=True)
    blk = bind(qrows.ROW_DOTS[t].blk, dec, tag)
    return (bind(qrows.rowdot, dec, f"{t}{tag}", blk=blk),
            bind(qrows.act_sums, kernels.TARGET.device, "test"), kernels.TARGET.codec(t).qdot)


@pytest.mark.parametrize("t", sorted(qrows.ROW_DOTS, key=int), ids=str)
@pytest.mark.parametrize("x86", [True, False], ids=["x86", "portable"])
def test_cpu_row_dots_equal_shared_qdot_on_any_bytes(t, x86, monkeypatch):
    """Random blocks (any bit pattern, finite f16 scales as a file's; trial 0 the extremes:
    every other byte 255 against quants of +-127) give the shared integer dot's value: the
    same integer sums, the float sums within rounding of their order. Both with the x86 instructions (where the host
    has AVX2, and VNNI where it has that) and with the portable vector IR other hosts get."""
    if x86 and not qvec.AVX2:
        pytest.skip("this host has no AVX2: the x86 path is not compiled here")
    monkeypatch.setattr(qvec, "AVX2", x86)
    monkeypatch.setattr(qvec, "VNNI", qvec.VNNI and x86)
    rd, sums, qd = _row_dot(t, "x86" if x86 else "portable")
    vt = t.traits.vec_dot_type
    nb = 3 if t.block_size == 256 else 11
    n = nb * t.block_size
    rng = np.random.default_rng(int(t))
    for trial in range(30):
        w = random_blocks(rng, t, nb * t.type_size).reshape(nb, t.type_size)
        x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))
        if trial == 0:
            keep = w[:, sorted(i + k for i in t.traits.scale_fields for k in (0, 1))].copy()
            w[:] = 255
            w[:, sorted(i + k for i in t.traits.scale_fields for k in (0, 1))] = keep
            x = np.where(np.arange(n) % 2, 1.0, -1.0).astype(np.float32)
        qrow = quantize(vt, x[None]).reshape(-1).view(np.uint8)
        ys = np.zeros(n // 32, np.float32)
        if qrows.ROW_DOTS[t].sums:
            sums(qrow, ys, n // 32)
        got = rd(w.reshape(-1), qrow, ys, nb)
        want = qd(w.reshape(1, 1, 1, -1), 0, 0, 0, qrow, n)
        W = dequantize(t, w.reshape(1, -1)).astype(np.float64)
        scale = float(np.abs(W).max()) * float(np.abs(dequantize(vt, qrow[None])).sum())
        assert abs(got - want) <= 1e-5 * scale, (t, trial, got, want)


@pytest.mark.parametrize("t", [GGMLType.F32, GGMLType.Q4_K, GGMLType.Q8_0], ids=str)
def test_blas_batches_split_over_threads_equal_one_thread(t):
    """From BLAS_MIN_N columns the product goes through BLAS, runs of weight rows spread over
    the run's threads (backends/cpu/blas.py): the runs are the same whatever the thread
    count, so 1 and 2 threads give the same bits, odd row counts too."""
    from ggraph.backends.cpu import blas, kernels

    rng = np.random.default_rng(3)
    K, M, N = 512, 333 + blas.RUN_ROWS, kernels.BLAS_MIN_N + 4
    wv = rng.standard_normal((M, K)).astype(np.float32)
    xv = rng.standard_normal((N, K)).astype(np.float32)
    got = {}
    for threads in (1, 2):
        ctx = Context()
        x = ctx.new_tensor(GGMLType.F32, (K, N), "x").set_input()
        w = ctx.new_tensor(t, (K, M), "w")
        w.set_data(wv)
        out = ops.mul_mat(w, x)
        sess = get_backend("cpu", n_threads=threads, adaptive=False).session()
        sess.run(build_graph(out), {x: xv})
        got[threads] = sess.read(out).reshape(N, M)
    ref = _ref(t, w.data.reshape(M, -1), xv) if t != GGMLType.F32 else xv @ wv.T
    assert np.array_equal(got[1], got[2])
    assert np.abs(got[2] - ref).max() <= _tol(t, ref) * 10
