"""The CPU backend's ggml_exact mode (backends/cpu/ggml_exact.py) against the real libggml: every
kernel it replaces gives ggml's result bit for bit (np.array_equal, not a tolerance).

Skipped, saying why, without libggml (llama-cpp-python) or on a CPU without AVX512F/DQ (the
mode reproduces ggml's AVX512 build: tinyBLAS's 16-lane F16 products and the AVX512
ggml_v_expf; an AVX2-only ggml rounds differently).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, GGMLType as T, build_graph, ops as O

from ggraph.check import ggml_ref
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.cpu.ggml_exact import host_matches_ggml_build
from ggraph.check.conformance import nmse
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
    # the default mode: close (its Q8_0 mat-vec, backends/cpu/qrows.py, sums 8 lanes as
    # ggml's AVX2 loop does, and here lands on ggml's very bits)
    assert nmse(ref, plain) < 1e-5


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


@pytest.fixture
def plain_buffers(monkeypatch):
    """libggml run directly keeps weights in a plain buffer: no Q4_K repacking."""
    from ggraph.backends.cpu import ggml_exact_kquants as kq

    monkeypatch.setattr(kq, "PATHS", kq.KQuantPaths(repack=False))


@pytest.mark.parametrize("wt", [T.Q5_0, T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("n", [1, 5, 9])   # vec_dot below 8 rows, the tiled K-quant path from 8
def test_gemma_weight_types(wt, n, plain_buffers):
    ctx = Context()
    w = ctx.new_tensor(wt, (512, 40), "w").set_data(RNG.normal(0, 0.05, (40, 512)))
    x = ctx.new_tensor(T.F32, (512, n), "x").set_data(RNG.normal(0, 1, (n, 512)))
    ref, got, _ = _both(O.mul_mat(w, x).set_output())
    assert np.array_equal(ref, got), (np.abs(ref - got).max(), np.sum(ref != got))


def test_gelu_table_is_ggmls():
    """The table ggml builds at ggml_cpu_init, read from libggml-cpu, entry by entry."""
    import ctypes
    import os

    from ggraph.backends.cpu.ggml_exact import gelu_table

    llama_cpp = pytest.importorskip("llama_cpp", reason="no llama-cpp-python (the reference)")
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    if not os.path.exists(path):
        pytest.skip(f"{path} missing: llama-cpp-python without its bundled libggml-cpu")
    lib = ctypes.CDLL(path)
    lib.ggml_cpu_init()
    theirs = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16"))
    ours = gelu_table()
    # x = +-inf and NaN give NaN payloads that differ; ggml never reads them (|x| >= 10 skips)
    finite = np.isfinite(np.arange(65536, dtype=np.uint16).view(np.float16))
    assert np.array_equal(ours[finite], theirs[finite])


def test_gelu():
    ctx = Context()
    x = ctx.new_tensor(T.F32, (1000, 3), "x").set_data(RNG.normal(0, 4, (3, 1000)))
    ref, got, _ = _both(O.gelu(x).set_output())
    assert np.array_equal(ref, got)


@pytest.mark.parametrize("k", [256, 100])   # a multiple of 64, and a tail added in f64
def test_f16_mul_mat_one_row(k):
    """One src1 row (decoding's K*Q and V*softmax): ggml_vec_dot_f16, not tinyBLAS."""
    ctx = Context()
    a = ctx.new_tensor(T.F16, (k, 8, 2), "a").set_data(RNG.normal(0, 1, (2, 8, k)))
    b = ctx.new_tensor(T.F32, (k, 1, 4), "b").set_data(RNG.normal(0, 1, (4, 1, k)))
    ref, got, _ = _both(O.mul_mat(a, b).set_output())
    assert np.array_equal(ref, got)


def test_f16_mul_mat_tinyblas_declines():
    """6 src0 rows (not a multiple of 4): tinyBLAS declines, ggml_vec_dot_f16 computes."""
    ctx = Context()
    a = ctx.new_tensor(T.F16, (128, 6), "a").set_data(RNG.normal(0, 1, (6, 128)))
    b = ctx.new_tensor(T.F32, (128, 3), "b").set_data(RNG.normal(0, 1, (3, 128)))
    ref, got, _ = _both(O.mul_mat(a, b).set_output())
    assert np.array_equal(ref, got)


def test_gemma3_logits_are_llama_cpps(monkeypatch):
    """The real Gemma 3 270M Q4_K_M (Q4_K repacked by llama.cpp, Q6_K, Q5_0, Q8_0): a 9-token
    prompt (repacked gemm and gemv, the tiled Q6_K path) and 2 decoded tokens (vec_dot paths,
    ggml_vec_dot_f16 attention) give llama.cpp's logits bit for bit."""
    import os

    from ggraph.backends.cpu import fusion
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    llama_cpp = pytest.importorskip("llama_cpp", reason="no llama-cpp-python (the reference)")
    path = os.path.expanduser("~/.cache/ggraph/gemma-3-270m-q4_k_m.gguf")
    if not os.path.exists(path):
        pytest.skip(f"{path} not downloaded (ggraph.graphs.gguf.fetch.resolve_model('gemma3'))")
    monkeypatch.setattr(fusion, "ENABLED", False)   # its fused norm chain rounds as ggraph's
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=64, n_ubatch=64, swa_full=False,
                          n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(b"The old lighthouse keeper lit the lamp at dusk", add_bos=True, special=False)
    assert len(toks) >= 8
    eng = Engine(path, EngineConfig(n_ctx=256, n_ubatch=64, n_threads=2, ggml_exact=True))
    got = [eng.eval(toks, all_logits=True)]
    llm.eval(toks)
    for t in (toks[1], toks[2]):
        got.append(eng.eval([t])[None])
        llm.eval([t])
    ref = np.array(llm.scores[:llm.n_tokens], np.float32)
    assert np.array_equal(ref, np.concatenate(got))
