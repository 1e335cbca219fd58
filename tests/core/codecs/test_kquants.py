"""The K-quants, IQ4_NL, IQ4_XS and Q8_K (ggraph/codecs/quants_k.py) and the Q5 types: numpy codecs
bit-exact with gguf.quants and libggml, their records, and the compiled codecs
(backends/shared/codecs*.py) bit-exact with the numpy ones."""
from __future__ import annotations

import ctypes

import gguf
import gguf.quants
import numpy as np
import pytest

from ggraph.codecs.quants import dequantize, first_nonfinite, quantize
from ggraph.ir.types import kv_types, storable_types, weight_types
from ggraph.ir.types import GGMLType as T

NEW_WEIGHTS = [T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
ENCODED = [T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q8_K]  # the new types ggraph quantizes to


def random_blocks(t: T, nb: int, seed: int) -> np.ndarray:
    """nb random blocks of t: random bytes, finite f16 scales of mixed magnitudes."""
    rng = np.random.default_rng([seed, int(t)])
    b = rng.integers(0, 256, (nb, t.type_size), dtype=np.uint8)
    for at in t.traits.scale_fields:
        d = rng.standard_normal(nb) * 10.0 ** rng.uniform(-6, 4, nb)
        b[:, at:at + 2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return b


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("t", NEW_WEIGHTS, ids=str)
def test_dequantize_matches_gguf(t: T) -> None:
    gguf = pytest.importorskip("gguf", reason="gguf-py (the reference quantizers) is not installed")
    import gguf.quants as gq

    b = random_blocks(t, 3000, 1).reshape(10, -1)
    ours = dequantize(t, b)
    with np.errstate(all="ignore"):
        ref = gq.dequantize(b, gguf.GGMLQuantizationType[t.name]).astype(np.float32)
    assert ours.shape == (10, 300 * t.block_size)
    np.testing.assert_array_equal(bits(ours), bits(ref))


def test_records() -> None:
    for t in NEW_WEIGHTS:
        assert t in weight_types()
        assert t.is_quantized and t.traits.scale_fields
    assert [t for t in (T.Q5_0, T.Q5_1, T.IQ4_NL) if t in kv_types() and t in storable_types()] \
        == [T.Q5_0, T.Q5_1, T.IQ4_NL]
    for t in K_TYPES:
        assert t.block_size == 256 and t not in kv_types() and t not in storable_types()
        assert t.traits.vec_dot_type == T.Q8_K and t.traits.quantize is not None
    for t in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.Q4_1, T.Q5_1):
        assert t.traits.vec_dot_type == T.Q8_0  # Q8_1 for *_1: the same rounded values
    q8k = T.Q8_K.traits
    assert (q8k.block_size, q8k.type_size, q8k.weight, q8k.kv, q8k.storable) == \
        (256, 292, False, False, False)
    assert [int(t) for t in (T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K,
                             T.IQ4_NL, T.IQ4_XS)] == [6, 7, 10, 11, 12, 13, 14, 15, 20, 23]


@pytest.mark.parametrize("t", K_TYPES, ids=str)
def test_quantize_through_the_record(t: T) -> None:
    """ggraph.codecs.quants.quantize reaches the K-quant quantizers of ggraph/codecs/kquantize.py
    (bit-exact
    with libggml: tests/core/codecs/test_kquantize.py) and gguf.quants reads their bytes back."""
    x = np.random.default_rng(3).normal(size=(3, 512)).astype(np.float32)
    raw = quantize(t, x)
    assert raw.shape == (3, 2 * t.type_size)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t)))
    np.testing.assert_array_equal(back, dequantize(t, raw))
    assert np.mean((back - x) ** 2) < 0.2 * np.mean(x ** 2)


@pytest.mark.parametrize("t", NEW_WEIGHTS, ids=str)
def test_first_nonfinite_reads_the_scales(t: T) -> None:
    b = random_blocks(t, 6, 2)
    assert first_nonfinite(t, b.reshape(-1)) == -1
    at = t.traits.scale_fields[-1]
    b[4, at:at + 2] = np.array([np.inf], "<f2").view(np.uint8)
    assert first_nonfinite(t, b.reshape(-1)) == 4


def _data(kind: str, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((64, 512)).astype(np.float32)
    if kind == "scaled":
        x *= (10.0 ** rng.uniform(-8, 8, (64, 1))).astype(np.float32)
    elif kind == "sparse":
        x[rng.random(x.shape) < 0.9] = 0
        x[3] = 0
    elif kind == "grid":
        x = (rng.integers(-40, 41, x.shape) / 2).astype(np.float32)
    return x


@pytest.mark.parametrize("kind", ["normal", "scaled", "sparse", "grid"])
@pytest.mark.parametrize("t", [T.IQ4_NL, T.Q8_K], ids=str)
def test_quantizers_match_libggml(t: T, kind: str) -> None:
    """IQ4_NL: quantize_row_iq4_nl_ref (what ggml's set_rows/cpy use, not the searching
    quantizer ggml_quantize_chunk runs for files); Q8_K: quantize_row_q8_K_ref. Blocks that
    are all zero are compared by value: ggml leaves part of them unwritten."""
    pytest.importorskip("llama_cpp", reason="libggml comes with llama-cpp-python")
    from ggraph.check.ggml_cdefs import find_libggml

    lib = ctypes.CDLL(str(next(find_libggml().glob("libggml-base.*"))))
    fn = getattr(lib, {T.IQ4_NL: "quantize_row_iq4_nl_ref", T.Q8_K: "quantize_row_q8_K_ref"}[t])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    x = _data(kind, np.random.default_rng([5, int(t), len(kind)]))
    ref = np.zeros(x.size // t.block_size * t.type_size, np.uint8)
    fn(x.ctypes.data, ref.ctypes.data, x.size)
    ref = ref.reshape(-1, t.type_size)
    ours = quantize(t, x).reshape(-1, t.type_size)
    zero = (x.reshape(-1, t.block_size) == 0).all(axis=1)
    np.testing.assert_array_equal(ours[~zero], ref[~zero])
    np.testing.assert_array_equal(dequantize(t, ours[zero]), dequantize(t, ref[zero]))


# ---- compiled codecs (CPU target; the CUDA target compiles the same functions) ------------

@pytest.fixture(scope="module")
def target():
    pytest.importorskip("numba", reason="numba (the compiled codecs) is not installed")
    from ggraph.backends.cpu.kernels import TARGET

    return TARGET


@pytest.mark.parametrize("t", NEW_WEIGHTS, ids=str)
def test_compiled_dec_and_dot(target, t: T) -> None:
    n = 512
    b = random_blocks(t, 3 * n // t.block_size, 3).reshape(1, 1, 3, -1)
    ref = dequantize(t, b)[0, 0]
    c = target.codec(t)
    v = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)
    for r in range(3):
        c.dec(b, 0, 0, r, out, n)
        np.testing.assert_array_equal(bits(out), bits(ref[r]))
        exact = ref[r].astype(np.float64) @ v
        scale = np.abs(ref[r]).astype(np.float64) @ np.abs(v)
        assert abs(c.dot(b, 0, 0, r, v, n) - exact) <= 1e-5 * scale


@pytest.mark.parametrize("t", ENCODED, ids=str)
def test_compiled_enc_matches_numpy(target, t: T) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1] *= 1e-4
    x[2, :256] = 0
    x[3, 5] = 1e6
    q = quantize(t, x)
    out = np.zeros((1, 1, 4, q.shape[1]), np.uint8)
    c = target.codec(t)
    for r in range(4):
        c.enc(x[r], out, 0, 0, r, 512)
    np.testing.assert_array_equal(out[0, 0], q)


def test_vec_dot_types_derive_from_records(target) -> None:
    from ggraph.backends.cpu.kernels import VEC_DOT_TYPE

    for t in weight_types():
        vt = t.traits.vec_dot_type
        assert VEC_DOT_TYPE.get(t) == (None if vt == T.F32 else vt)
    assert VEC_DOT_TYPE[T.Q4_K] == T.Q8_K and VEC_DOT_TYPE[T.IQ4_NL] == T.Q8_0
