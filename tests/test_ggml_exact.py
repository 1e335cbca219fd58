"""The CPU backend's ggml_exact mode (backends/cpu/ggml_exact.py) against the real libggml: every
kernel it replaces gives ggml's result bit for bit (np.array_equal, not a tolerance).

Skipped, saying why, without libggml (llama-cpp-python) or on a CPU without AVX512F/DQ (the
mode reproduces ggml's AVX512 build: tinyBLAS's 16-lane F16 products and the AVX512
ggml_v_expf; an AVX2-only ggml rounds differently).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, GGMLType as T, build_graph, ggml_ref, ops as O
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.cpu.ggml_exact import host_matches_ggml_build
from ggraph.conformance import nmse
from ggraph.ops.rope import RopeMode

try:
    ggml_ref.load()
    WHY = "" if host_matches_ggml_build() else "this CPU lacks AVX512F/DQ"
except ggml_ref.GGMLUnavailable as e:
    WHY = f"libggml not available: {e}"

pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "-")


def _both(out):
    g = build_graph(out)
    ref = ggml_ref.run_graph(g, [out], n_threads=1)[0]
    got = CPUBackend(ggml_exact=True).session().run(g, {}).read(out)
    plain = CPUBackend().session().run(g, {}).read(out)
    return ref, got.reshape(ref.shape), plain.reshape(ref.shape)


RNG = np.random.default_rng(7)


@pytest.mark.parametrize("wt", [T.Q4_1, T.Q8_0, T.Q4_0])
@pytest.mark.parametrize("n", [1, 7])
def test_quantized_mul_mat(wt, n):
    ctx = Context()
    w = ctx.new_tensor(wt, (576, 48), "w").set_data(RNG.normal(0, 0.05, (48, 576)))
    x = ctx.new_tensor(T.F32, (576, n), "x").set_data(RNG.normal(0, 1, (n, 576)))
    ref, got, plain = _both(O.mul_mat(w, x).set_output())
    assert np.array_equal(ref, got)
    assert not np.array_equal(ref, plain) and nmse(ref, plain) < 1e-5   # the default mode


def test_f16_mul_mat_on_a_strided_cache_view():
    ctx = Context()
    cache = ctx.new_tensor(T.F16, (192, 32), "cache").set_data(RNG.normal(0, 1, (32, 192)))
    k = O.view_3d(cache, 64, 32, 3, cache.nb[1], 64 * 2, 0)          # 3 heads of 64
    q = ctx.new_tensor(T.F32, (64, 5, 9), "q").set_data(RNG.normal(0, 1, (9, 5, 64)))
    ref, got, _ = _both(O.mul_mat(k, q).set_output())                  # GQA broadcast 9/3
    assert np.array_equal(ref, got)


def test_rms_norm_rope_softmax_swiglu():
    ctx = Context()
    x = ctx.new_tensor(T.F32, (64, 4, 6), "x").set_data(RNG.normal(0, 1, (6, 4, 64)))
    pos = ctx.new_tensor(T.I32, (6,), "pos").set_data(np.arange(3, 9))
    for out in (O.rms_norm(x, 1e-5), O.rope_ext(x, pos, None, n_dims=64, mode=RopeMode.NORMAL,
                                                freq_base=100000.0)):
        ref, got, _ = _both(out.set_output())
        assert np.array_equal(ref, got), out.op
    kq = ctx.new_tensor(T.F32, (256, 6, 3), "kq").set_data(RNG.normal(0, 3, (3, 6, 256)))
    mask = np.zeros((6, 256), np.float32)
    mask[:, 200:] = -np.inf
    m = ctx.new_tensor(T.F32, (256, 6), "mask").set_data(mask)
    ref, got, _ = _both(O.soft_max_ext(kq, m, 0.125, 0.0).set_output())
    assert np.array_equal(ref, got) and not ref[..., 200:].any()
    g = ctx.new_tensor(T.F32, (1536, 3), "g").set_data(RNG.normal(0, 4, (3, 1536)))
    u = ctx.new_tensor(T.F32, (1536, 3), "u").set_data(RNG.normal(0, 1, (3, 1536)))
    ref, got, _ = _both(O.swiglu(g, u).set_output())
    assert np.array_equal(ref, got)
