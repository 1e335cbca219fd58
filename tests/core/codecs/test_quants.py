"""ggraph.codecs.quants must be bit-exact with gguf.quants (itself bit-exact with ggml's C code).

The types here are those gguf.quants can quantize too; the K-quants, IQ4 and Q8_K are checked
in tests/core/codecs/test_kquants.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

gguf = pytest.importorskip("gguf", reason="gguf-py (the reference quantizers) is not installed")
import gguf.quants as gq  # noqa: E402

from ggraph.codecs.quants import dequantize, quantize  # noqa: E402
from ggraph.ir.types import GGMLType, row_size  # noqa: E402

FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
BLOCK_TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES


def ref_quantize(t: GGMLType, x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        out = gq.quantize(np.asarray(x, dtype=np.float32), gguf.GGMLQuantizationType[t.name])
    return np.ascontiguousarray(out).view(np.uint8)


def ref_dequantize(t: GGMLType, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(b, gguf.GGMLQuantizationType[t.name]).astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    """float32 as raw bits, so that NaN == NaN and -0 != +0 in comparisons."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def check_against_gguf(t: GGMLType, x: np.ndarray) -> None:
    x = np.asarray(x, dtype=np.float32)
    q = quantize(t, x)
    ref = ref_quantize(t, x)
    assert q.dtype == np.uint8
    assert q.shape == (*x.shape[:-1], row_size(t, x.shape[-1]))
    if not np.array_equal(q, ref):
        rows = np.unique(np.nonzero(q.reshape(-1, t.type_size) != ref.reshape(-1, t.type_size))[0])
        blk = x.reshape(-1, t.block_size)[rows[0]] if t.block_size > 1 else x.reshape(-1)[rows[0]]
        pytest.fail(f"{t}: {len(rows)} blocks differ from gguf; first input block {blk!r}")
    y = dequantize(t, q)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(bits(y), bits(ref_dequantize(t, ref)))


# ----------------------------------------------------------------------------- bulk numpy data

RNG_SEED = 1234


def _blocks(kind: str, nb: int, rng: np.random.Generator) -> np.ndarray:
    """nb blocks of 32 float32 values of a given flavour."""
    shape = (nb, 32)
    if kind == "uniform":
        return rng.uniform(-1, 1, shape).astype(np.float32)
    if kind == "normal":
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == "positive":
        return rng.uniform(0, 3, shape).astype(np.float32)
    if kind == "negative":
        return rng.uniform(-3, 0, shape).astype(np.float32)
    if kind == "scaled":  # every block its own magnitude, 1e-45 .. 1e38
        scale = 10.0 ** rng.uniform(-45, 38, (nb, 1))
        return np.clip(rng.standard_normal(shape) * scale, -3e38, 3e38).astype(np.float32)
    if kind == "bits":  # any finite f32 bit pattern: subnormals, huge, mixed in a block
        u = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
        x = u.view(np.float32)
        return np.where(np.isfinite(x), x, np.float32(1)).astype(np.float32)
    if kind == "grid":  # small integers and halves: exact ties in every rounding step
        x = rng.integers(-16, 17, shape).astype(np.float32) / 2
        x[:, 0] = rng.choice([-8, 8, 15, -15, 127, -127], nb)
        return x
    if kind == "sparse":  # mostly zeros, some all-zero blocks
        x = rng.standard_normal(shape).astype(np.float32)
        x[rng.random(shape) < 0.9] = 0
        return x
    raise AssertionError(kind)


KINDS = ["uniform", "normal", "positive", "negative", "scaled", "bits", "grid", "sparse"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", ALL_TYPES, ids=str)
def test_bulk_matches_gguf(t: GGMLType, kind: str) -> None:
    rng = np.random.default_rng([RNG_SEED, int(t), KINDS.index(kind)])
    x = _blocks(kind, 4096, rng).reshape(64, 64 * 32)
    check_against_gguf(t, x)


SPECIAL_BLOCKS = {
    "zeros": np.zeros(32),
    "neg_zeros": -np.zeros(32),
    "const_pos": np.full(32, 3.25),
    "const_neg": np.full(32, -3.25),
    "const_huge": np.full(32, 1e30),
    "const_tiny": np.full(32, -1e-30),
    "neg_max": np.r_[np.linspace(-1, 1, 31), -2.0],           # largest |x| is negative
    "pos_max_tie": np.r_[2.0, -2.0, np.zeros(30)],            # |max| tie: first one wins
    "neg_max_tie": np.r_[-2.0, 2.0, np.zeros(30)],
    "one_nonzero": np.r_[np.zeros(31), 1e-3],
    "huge": np.linspace(-1e30, 1e30, 32),
    "f32_max": np.r_[np.float32(3.4028235e38), -np.float32(3.4028235e38), np.ones(30)],
    "f16_max": np.linspace(-65504, 65504, 32),
    "above_f16_max": np.linspace(-70000, 65520, 32),
    "d_near_f16_max_q8": np.linspace(-65504 * 127, 65504 * 127, 32),
    "d_above_f16_max_q8": np.linspace(-65520 * 127, 1, 32),
    "d_near_f16_max_q4": np.linspace(0, 65504 * 15, 32),
    "tiny": np.linspace(-1e-30, 1e-30, 32),
    "f16_subnormal_d": np.linspace(-1e-6, 1e-6, 32),
    "f32_min_normal": np.r_[np.float32(1.1754944e-38) * np.linspace(-1, 1, 32)],
    "subnormal": np.linspace(-1e-40, 1e-40, 32),
    "subnormal_pos": np.linspace(1e-42, 1e-40, 32),
    "min_subnormal": np.r_[np.float32(1e-45), -np.float32(1e-45), np.zeros(30)],
    "q8_ties": np.r_[127.0, np.arange(-15.5, 15.5, 1.0)],     # d == 1: x*id hits .5 exactly
    "q4_0_ties": np.r_[-8.0, np.arange(-7.5, 8.0, 0.5)],
    "q4_1_ties": np.r_[0.0, 15.0, np.arange(0.5, 15.5, 0.5)],
    "q5_0_ties": np.r_[-16.0, np.arange(-15.5, 15.0, 1.0)],   # d == 1: x + 16.5 hits .0
    "q5_1_ties": np.r_[0.0, 31.0, np.arange(0.5, 30.5, 1.0)],
    "inf": np.r_[np.inf, np.ones(31)],
    "neg_inf": np.r_[np.linspace(-1, 1, 31), -np.inf],
}


@pytest.mark.parametrize("name", list(SPECIAL_BLOCKS))
@pytest.mark.parametrize("t", ALL_TYPES, ids=str)
def test_special_blocks_match_gguf(t: GGMLType, name: str) -> None:
    block = np.asarray(SPECIAL_BLOCKS[name], dtype=np.float32)
    assert block.shape == (32,), name
    # alone, and sandwiched between ordinary blocks of the same row
    rng = np.random.default_rng(7)
    row = np.concatenate([rng.standard_normal(32), block, block[::-1], rng.standard_normal(32)])
    check_against_gguf(t, block[None])
    check_against_gguf(t, row.astype(np.float32)[None])


def test_special_block_values() -> None:
    """A few results worked out by hand from ggml's formulas."""
    # Q4_0 of an all-zero block: d = 0 / -8 = -0.0 (stored f16 0x8000), every q = 8
    q = quantize(GGMLType.Q4_0, np.zeros((1, 32), np.float32))
    assert q[0, :2].tolist() == [0x00, 0x80] and (q[0, 2:] == 0x88).all()
    # Q4_0 nibble order: qs[j] = q[j] | q[j+16] << 4
    x = np.r_[np.full(16, -8.0), np.full(16, 7.0)].astype(np.float32)[None]
    q = quantize(GGMLType.Q4_0, x)  # d = -8 / -8 = 1: q = 0 for -8, 15 for 7
    assert (q[0, 2:] == 0xF0).all()
    np.testing.assert_array_equal(dequantize(GGMLType.Q4_0, q), x)
    # Q8_0 rounds half away from zero: d = 1, 0.5 -> 1, -2.5 -> -3, 1.5 -> 2
    x = np.r_[127.0, 0.5, -2.5, 1.5, -0.5, np.zeros(27)].astype(np.float32)[None]
    q = quantize(GGMLType.Q8_0, x)
    assert q[0, 2:7].view(np.int8).tolist() == [127, 1, -3, 2, -1]
    # Q4_1 constant block: d = 0, q = 0, value = m
    q = quantize(GGMLType.Q4_1, np.full((1, 32), -3.25, np.float32))
    np.testing.assert_array_equal(dequantize(GGMLType.Q4_1, q), np.full((1, 32), -3.25))


# ----------------------------------------------------------------------------- BF16 specifics

def _bf16_expected(u: int) -> int:
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 64
    return (u + (0x7FFF + ((u >> 16) & 1))) >> 16


BF16_CASES = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000,
    0x7F800000, 0xFF800000,                          # +-inf stay inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # quiet and signalling NaNs
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000, 0x7F80FFFF,
    0x3F808000, 0x3F818000,                          # exact ties: to even (down, up)
    0x3F808001, 0x3F807FFF,
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # largest finite: rounds to inf or not
    0x00000001, 0x80008000, 0x00018000, 0x007FFFFF,  # subnormals
]


def test_bf16_nan_inf_rounding() -> None:
    u = np.array(BF16_CASES, dtype=np.uint32)
    x = u.view(np.float32)[None]
    q = quantize(GGMLType.BF16, x)
    assert q.view(np.uint16)[0].tolist() == [_bf16_expected(int(v)) for v in BF16_CASES]
    assert np.array_equal(q, ref_quantize(GGMLType.BF16, x))
    y = dequantize(GGMLType.BF16, q)
    assert np.array_equal(bits(y), bits(ref_dequantize(GGMLType.BF16, q)))
    assert np.isnan(y[0, 6:12]).all() and np.isinf(y[0, 4:6]).all()
    assert np.isinf(y[0, 18:21]).all() and y[0, 21] == np.float32(3.3895314e38)


def test_bf16_all_half_patterns_roundtrip() -> None:
    """Every bf16 bit pattern survives dequantize -> quantize (NaNs become quiet)."""
    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    y = dequantize(GGMLType.BF16, b.view(np.uint8)[None])
    back = quantize(GGMLType.BF16, y).view(np.uint16)[0]
    nan = np.isnan(y[0])
    np.testing.assert_array_equal(back[~nan], b[~nan])
    np.testing.assert_array_equal(back[nan], b[nan] | 64)


def test_float_types_nan_inf_match_gguf() -> None:
    x = np.array([[np.nan, -np.nan, np.inf, -np.inf, 65504, 65519, 65520, -1e6, 1e-8, 6e-8]],
                 dtype=np.float32)
    for t in FLOAT_TYPES:
        check_against_gguf(t, x)


# ----------------------------------------------------------------------------- hypothesis

_SCALES = [1.0, 1e-3, 1e3, 1e-30, 1e30, 1e-38, 1e-40, 1e-44, 1e38, 65504.0, 65520.0,
           65504.0 * 15, 65504.0 * 127, 65520.0 * 127, 6e-8 * 8, 6e-8 * 127]
_unit = st.floats(-1, 1, width=32)
_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
_scale = st.sampled_from(_SCALES).map(np.float32)


@st.composite
def _block(draw: st.DrawFn) -> np.ndarray:
    kind = draw(st.sampled_from(["scaled", "any", "const", "neg_max", "grid", "zero_mix"]))
    if kind == "scaled":
        a = draw(arrays(np.float32, 32, elements=_unit)) * draw(_scale)
    elif kind == "any":
        a = draw(arrays(np.float32, 32, elements=_finite))
    elif kind == "const":
        a = np.full(32, draw(_finite), dtype=np.float32)
    elif kind == "neg_max":
        a = draw(arrays(np.float32, 32, elements=_unit)) * draw(_scale)
        i = draw(st.integers(0, 31))
        a[i] = -np.abs(a).max() * np.float32(draw(st.sampled_from([1.0, 1.5])))
    elif kind == "grid":
        a = np.array(draw(st.lists(st.integers(-32, 32), min_size=32, max_size=32)),
                     dtype=np.float32) / np.float32(draw(st.sampled_from([1, 2, 4])))
    else:
        a = draw(arrays(np.float32, 32, elements=st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5])))
    return a.astype(np.float32)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.sampled_from(ALL_TYPES), blocks=st.lists(_block(), min_size=1, max_size=6),
       rows=st.integers(1, 3))
def test_hypothesis_matches_gguf(t: GGMLType, blocks: list[np.ndarray], rows: int) -> None:
    row = np.concatenate(blocks)
    x = np.stack([np.roll(row, 32 * r) for r in range(rows)])
    check_against_gguf(t, x)


@settings(max_examples=60, deadline=None)
@given(t=st.sampled_from(ALL_TYPES),
       x=arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3), st.just(64)),
                elements=_finite))
def test_hypothesis_leading_shapes(t: GGMLType, x: np.ndarray) -> None:
    q = quantize(t, x)
    assert q.shape == (*x.shape[:-1], row_size(t, 64))
    np.testing.assert_array_equal(q.reshape(-1, q.shape[-1]), quantize(t, x.reshape(-1, 64)))
    y = dequantize(t, q, 64)
    assert y.shape == x.shape
    np.testing.assert_array_equal(bits(y).reshape(-1, 64),
                                  bits(dequantize(t, q.reshape(-1, q.shape[-1]))))


# ----------------------------------------------------------------------------- API behaviour

@pytest.mark.parametrize("t", ALL_TYPES, ids=str)
def test_float64_and_noncontiguous_input(t: GGMLType) -> None:
    rng = np.random.default_rng(3)
    x64 = rng.standard_normal((4, 128)) * 10
    np.testing.assert_array_equal(quantize(t, x64), quantize(t, x64.astype(np.float32)))
    xt = np.asfortranarray(x64.astype(np.float32))[:, ::-1]
    np.testing.assert_array_equal(quantize(t, xt), quantize(t, np.ascontiguousarray(xt)))
    q = quantize(t, xt)
    np.testing.assert_array_equal(dequantize(t, np.asfortranarray(q)), dequantize(t, q))


def test_roundtrip_exact_for_representable() -> None:
    x = np.arange(-16, 16, dtype=np.float32).reshape(1, 32)
    for t in FLOAT_TYPES:
        np.testing.assert_array_equal(dequantize(t, quantize(t, x)), x)
    q8 = np.r_[127.0, np.arange(-15, 16)].astype(np.float32)[None]
    np.testing.assert_array_equal(dequantize(GGMLType.Q8_0, quantize(GGMLType.Q8_0, q8)), q8)


def test_empty_rows() -> None:
    for t in ALL_TYPES:
        q = quantize(t, np.zeros((0, 64), np.float32))
        assert q.shape == (0, row_size(t, 64))
        assert dequantize(t, q).shape == (0, 64)


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=str)
@pytest.mark.parametrize("n", [1, 16, 31, 33, 100])
def test_row_length_not_multiple_of_block(t: GGMLType, n: int) -> None:
    with pytest.raises(ValueError) as e:
        quantize(t, np.zeros((2, n), np.float32))
    assert str(t) in str(e.value) and str(n) in str(e.value)


@pytest.mark.parametrize("t", ALL_TYPES, ids=str)
def test_bad_byte_length(t: GGMLType) -> None:
    nbytes = t.type_size * 3 + 1
    with pytest.raises(ValueError) as e:
        dequantize(t, np.zeros((2, nbytes), np.uint8))
    msg = str(e.value)
    assert str(t) in msg and str(nbytes) in msg and str(t.type_size) in msg


def test_dequantize_n_mismatch_and_dtype() -> None:
    q = quantize(GGMLType.Q8_0, np.ones((2, 64), np.float32))
    assert dequantize(GGMLType.Q8_0, q, 64).shape == (2, 64)
    with pytest.raises(ValueError, match="64"):
        dequantize(GGMLType.Q8_0, q, 32)
    with pytest.raises(TypeError):
        dequantize(GGMLType.Q8_0, q.view(np.int8))


@pytest.mark.parametrize("t", [GGMLType.I32, GGMLType.I64], ids=str)
def test_int_types_rejected(t: GGMLType) -> None:
    with pytest.raises(ValueError, match=str(t)):
        quantize(t, np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match=str(t)):
        dequantize(t, np.zeros((1, 32), np.uint8))
