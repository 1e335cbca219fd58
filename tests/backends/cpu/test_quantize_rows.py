"""backends/cpu/quantize_rows.py (numba ports of ggml's quantizers) against ggml itself.

With libggml (llama-cpp-python's build, or $GGRAPH_LIBGGML): for every type, with and without
an importance matrix, the bytes must equal what `ggml_quantize_chunk(type, x, dst, 0, nrows,
n_per_row, imatrix)` writes, on many kinds of data (normal, outliers, constant, zero, tiny,
subnormal, huge, heavy-tailed, sparse, one-signed, ties, rows of several blocks) and on real
weights of the Gemma-3 270M and SmolLM2 135M models, dequantized and requantized. These tests
are skipped, saying why, where libggml (or the model files) are absent. Without libggml: the
bytes must equal the numpy quantizers of ggraph.codecs (bit-exact with ggml themselves, imatrix
None), rows are independent (so a caller can split them across threads), the scalar helpers
(f16 rounding, nearest_int, roundf) are exact, and bad arguments are refused with a message
naming the type and the problem.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from ggml_quantize_ref import GGML_TYPE_ID, QUANTIZE_CHUNK, needs_ggml

from ggraph.backends.cpu.quant_search import (
    KVALUES_IQ4NL, best_index_int8, fp16_to_fp32, fp32_to_fp16, iq4_block_scale, iq4_nl_index, make_qkx2_quants, make_qx_quants, nearest_int, roundf_i32,
)
from ggraph.backends.cpu.quant_lanes import (
    iq4_scale_lanes, make_qkx_quants_lanes, make_qx_quants_lanes,
)
from ggraph.backends.cpu.quantize_rows import (
    BLOCK_LAYOUT, QUANTIZABLE, USES_IMATRIX, quantize_rows, row_bytes,
)

SMALL_BLOCK = [t for t in QUANTIZABLE if BLOCK_LAYOUT[t][0] == 32]
GEMMA = Path("/root/.cache/ggraph/gemma-3-270m-q4_k_m.gguf")
SMOLLM = Path("/root/.cache/ggraph/SmolLM2-135M-Instruct.Q4_1.gguf")




def ggml(name: str, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], row_bytes(name, x.shape[1])), dtype=np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32).ctypes.data
    written = QUANTIZE_CHUNK(GGML_TYPE_ID[name], x.ctypes.data, out.ctypes.data, 0,
                             x.shape[0], x.shape[1], qw)
    assert written == out.nbytes
    return out


def data_kinds(seed: int, nrows: int, n: int) -> dict[str, np.ndarray]:
    """(nrows, n) float32 rows of each kind the quantizers must get right."""
    rng = np.random.default_rng(seed)

    def normal() -> np.ndarray:
        return rng.standard_normal((nrows, n))

    outliers = normal()
    outliers[np.arange(nrows), rng.integers(0, n, nrows)] = (rng.choice([-1, 1], nrows)
                                                             * rng.uniform(10, 100, nrows))
    constant = np.repeat(rng.standard_normal((nrows, 1)) * 3, n, axis=1)
    constant[0] = 0.5
    constant[1] = -0.5
    zero = np.zeros((nrows, n))
    zero[1, 3] = -0.0
    partly_zero = normal()
    partly_zero[:, 32:96] = 0.0                      # whole zero (sub-)blocks inside a row
    kinds = dict(
        normal=normal(), outliers=outliers, constant=constant,
        constant_blocks=np.repeat(rng.standard_normal((nrows, n // 16)), 16, axis=1),
        zero=zero, partly_zero=partly_zero,
        subnormal=normal() * 1e-40,
        tiny=normal() * 10.0 ** rng.uniform(-44, -30, (nrows, 1)),
        near_eps=normal() * 10.0 ** rng.uniform(-17, -13, (nrows, 1)),   # GROUP_MAX_EPS edge
        magnitudes=normal() * 10.0 ** rng.uniform(-8, 6, (nrows, 1)),
        huge=normal() * 10.0 ** rng.uniform(6, 37, (nrows, 1)),          # f16 / f32 overflow
        block_magnitudes=normal() * np.repeat(10.0 ** rng.uniform(-3, 3, (nrows, n // 32)),
                                              32, axis=1),
        sparse=np.where(rng.random((nrows, n)) < 0.9, 0.0, normal()),
        very_sparse=np.where(rng.random((nrows, n)) < 0.99, 0.0, normal()),
        positive=np.abs(normal()) + 0.1,
        negative=-np.abs(normal()),
        shifted=rng.uniform(-1, 1, (nrows, n)) * 0.1 + rng.uniform(-2, 2, (nrows, 1)),
        cauchy=rng.standard_cauchy((nrows, n)),
        laplace=rng.laplace(size=(nrows, n)) * 0.02,
        small_ints=rng.integers(-4, 5, (nrows, n)).astype(float),
        halves=rng.integers(-16, 17, (nrows, n)) * 0.5,                   # rounding ties
        f16_values=normal().astype(np.float16).astype(float),
    )
    return {k: v.astype(np.float32) for k, v in kinds.items()}


def imatrices(seed: int, n: int) -> dict[str, np.ndarray]:
    """n_per_row importance weights: random positive, some zero, whole zero blocks."""
    rng = np.random.default_rng(seed)
    some_zero = rng.uniform(0.1, 3, n)
    some_zero[rng.random(n) < 0.3] = 0
    zero_blocks = rng.uniform(0.1, 3, n)
    zero_blocks[:16] = 0
    zero_blocks[32:64] = 0
    kinds = dict(uniform=rng.uniform(0.01, 5, n), lognormal=np.exp(rng.standard_normal(n) * 2),
                 some_zero=some_zero, zero_blocks=zero_blocks, huge=rng.uniform(0, 1, n) * 1e20)
    return {k: v.astype(np.float32) for k, v in kinds.items()}


def assert_same(name: str, got: np.ndarray, want: np.ndarray, what: str) -> None:
    size = BLOCK_LAYOUT[name][1]
    bad = np.nonzero((got.reshape(-1, size) != want.reshape(-1, size)).any(axis=1))[0]
    assert bad.size == 0, (f"{name} {what}: {bad.size} of {got.size // size} blocks differ "
                           f"from ggml, first {bad[:8].tolist()}")


# -- against libggml ----------------------------------------------------------------------------

@needs_ggml
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_bytes_equal_ggml_on_every_kind_of_data(name):
    # 3 super-blocks per row (the K-quants) or 5 blocks and 24 blocks (32-element types)
    widths = (768,) if BLOCK_LAYOUT[name][0] == 256 else (160, 768)
    cases = 0
    for n in widths:
        weights = imatrices(1, n)
        kinds = data_kinds(0, 4, n)
        for kind, x in kinds.items():
            assert_same(name, quantize_rows(name, x), ggml(name, x), f"{kind} n={n}")
            cases += 1
            for wkind, w in weights.items():
                assert_same(name, quantize_rows(name, x, w), ggml(name, x, w),
                            f"{kind} n={n} imatrix {wkind}")
                cases += 1
    assert cases == len(widths) * len(kinds) * (1 + len(weights))


@needs_ggml
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_bytes_equal_ggml_on_more_random_rows(name):
    rng = np.random.default_rng(7)
    n = 512
    x = (rng.standard_normal((48, n)) * rng.uniform(0.01, 2, (48, 1))).astype(np.float32)
    w = (rng.standard_normal(n) ** 2).astype(np.float32)
    assert_same(name, quantize_rows(name, x), ggml(name, x), "normal rows")
    assert_same(name, quantize_rows(name, x, w), ggml(name, x, w), "normal rows, imatrix")


def _model_rows(path: Path, tensor: str, nrows: int) -> np.ndarray:
    """The first nrows rows of a model tensor, dequantized to float32 by gguf."""
    if not path.is_file():
        pytest.skip(f"{path} not present (ggraph.graphs.gguf.fetch.resolve_model downloads it)")
    gguf = pytest.importorskip("gguf", reason="gguf-py (the reference dequantizer) is missing")
    from gguf.quants import dequantize

    from ggraph.graphs.gguf.gguf_reader import read_header

    hdr = read_header(str(path))
    info = next(t for t in hdr.tensors if t.name == tensor)
    row = info.nbytes // int(np.prod(info.ne[1:]))
    start = hdr.data_offset + info.offset
    raw = np.frombuffer(hdr.mm, dtype=np.uint8)[start:start + nrows * row]
    x = dequantize(raw.reshape(nrows, row), gguf.GGMLQuantizationType(info.type_id))
    return np.ascontiguousarray(x, dtype=np.float32)


# (file, tensor): Gemma's Q4_K / Q6_K / Q5_0 / Q8_0 weights (rows of 1024, 2048, 640, 640) and
# SmolLM2's Q4_1 (rows of 1536); a dequantized weight sits on its own type's grid, the
# hardest case for tie-breaking when requantized to that type
MODEL_TENSORS = [(GEMMA, "blk.0.attn_output.weight"), (GEMMA, "blk.0.ffn_down.weight"),
                 (GEMMA, "blk.0.attn_q.weight"), (GEMMA, "blk.0.attn_v.weight"),
                 (SMOLLM, "blk.0.ffn_down.weight")]


@needs_ggml
@pytest.mark.parametrize("path,tensor", MODEL_TENSORS, ids=lambda v: getattr(v, "stem", v))
def test_real_weights_requantize_like_ggml(path, tensor):
    x = _model_rows(path, tensor, 16)
    n = x.shape[1]
    rng = np.random.default_rng(3)
    imatrix = (rng.standard_normal((64, n)) ** 2).mean(axis=0).astype(np.float32)
    for name in QUANTIZABLE:
        if n % BLOCK_LAYOUT[name][0]:
            continue
        assert_same(name, quantize_rows(name, x), ggml(name, x), tensor)
        assert_same(name, quantize_rows(name, x, imatrix), ggml(name, x, imatrix),
                    f"{tensor} imatrix")


# -- without libggml ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", [t for t in QUANTIZABLE if t != "IQ4_NL"])
def test_equals_the_numpy_quantizers(name):
    # IQ4_NL is left out: ggraph.codecs' numpy IQ4_NL is quantize_row_iq4_nl_ref (no scale
    # search), while ggml_quantize_chunk runs quantize_iq4_nl with ntry = 7
    from ggraph.codecs.quants import quantize

    from ggraph.ir.types import GGMLType

    for kind, x in data_kinds(5, 2, 768).items():
        if kind == "huge":
            # beyond |x| ~ 1e12 the numpy Q3_K / Q6_K / IQ4_XS quantizers part from ggml
            # (where x^3 overflows f32); these kernels follow ggml there (tested above)
            continue
        want = quantize(GGMLType[name], x)
        got = quantize_rows(name, x)
        assert np.array_equal(got, want), f"{name} {kind}: differs from ggraph.codecs"


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_rows_are_independent_and_out_is_filled(name):
    x = np.concatenate(list(data_kinds(9, 2, 512).values()))
    w = imatrices(2, 512)["some_zero"]
    for imatrix in (None, w):
        whole = quantize_rows(name, x, imatrix)
        assert whole.shape == (len(x), row_bytes(name, 512)) and whole.dtype == np.uint8
        perm = np.random.default_rng(4).permutation(len(x))
        assert np.array_equal(quantize_rows(name, np.ascontiguousarray(x[perm]), imatrix),
                              whole[perm])
        out = np.full_like(whole, 0xAB)
        halves = [(0, len(x) // 2), (len(x) // 2, len(x))]
        threads = [threading.Thread(target=quantize_rows,
                                    args=(name, x[a:b], imatrix), kwargs=dict(out=out[a:b]))
                   for a, b in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert np.array_equal(out, whole)


def test_imatrix_use():
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    w = np.random.default_rng(7).uniform(0.01, 10, 256).astype(np.float32)
    assert set(USES_IMATRIX) == set(QUANTIZABLE)
    for name in QUANTIZABLE:
        same = np.array_equal(quantize_rows(name, x, w), quantize_rows(name, x))
        assert same == (not USES_IMATRIX[name]), name


def test_empty_inputs():
    assert quantize_rows("Q4_K", np.zeros((0, 512), np.float32)).shape == (0, 288)
    assert quantize_rows("Q8_0", np.zeros((3, 0), np.float32)).shape == (3, 0)


def test_f16_rounding_is_ggmls():
    # every half value, the midpoints between neighbours and one float32 ulp either side
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = (h[:-1].astype(np.float64) + h[1:]) / 2
    f = np.concatenate([h, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf),
                        [65504, 65519.99, 65520, 1e6, 3e38, 2.0 ** -25, 2.0 ** -26, 1e-45]]
                       ).astype(np.float32)
    f = np.concatenate([f, -f])
    with np.errstate(over="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    got = np.array([fp32_to_fp16(v) for v in f], dtype=np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"fp32_to_fp16 wrong for {f[bad[:5]]}"
    back = np.array([fp16_to_fp32(int(b)) for b in want[::97]], dtype=np.float32)
    assert np.array_equal(back.view(np.uint32),
                          want[::97].view(np.float16).astype(np.float32).view(np.uint32))
    assert fp32_to_fp16(np.float32(np.nan)) & 0x7FFF == 0x7E00


def test_nearest_int_and_roundf_are_ggmls():
    f32 = np.float32
    for v, want in [(0.5, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-1.5, -2), (3.49, 3),
                    (4194303.0, 4194303), (-4194303.0, -4194303), (0.0, 0)]:
        assert nearest_int(f32(v)) == want, v
    # beyond |f| < 2^22 ggml's trick yields its own integers; emulate it on the bits
    for v in (1e7, -1e7, 3e38, np.inf, -np.inf, 8388608.0):
        bits = (np.array([v], f32) + f32(12582912.0)).view(np.int32)[0]
        assert nearest_int(f32(v)) == (int(bits) & 0x7FFFFF) - 0x400000, v
    for v, want in [(0.5, 1), (-0.5, -1), (2.5, 3), (-2.5, -3), (0.49999997, 0),
                    (126.5, 127), (8388609.0, 8388609), (np.nan, -2 ** 31), (1e10, -2 ** 31)]:
        assert roundf_i32(f32(v)) == want, v


def bits(v) -> int:
    """A float32's bits: NaN equals NaN of the same bits, -0 differs from +0."""
    return int(np.float32(v).view(np.uint32))


def _groups(n: int) -> np.ndarray:
    """(n, G) float32 groups in columns, of the kinds the searches must get right."""
    cols = [v.reshape(-1, n) for v in data_kinds(11, 2, 64).values()]
    return np.ascontiguousarray(np.concatenate(cols).T)


@pytest.mark.parametrize("n", [16, 32])
def test_lane_searches_equal_the_scalar_ports(n):
    f32 = np.float32
    xt = _groups(n)
    G = xt.shape[1]
    rng = np.random.default_rng(12)
    with np.errstate(over="ignore"):                 # the huge kind overflows x*x, as in C
        x2 = xt * xt
    weights = {"abs": np.abs(xt), "x2": x2,
               "imatrix": (rng.uniform(0, 2, xt.shape) * (rng.random(xt.shape) > 0.2)
                           ).astype(f32)}
    L = np.empty(xt.shape, f32)
    s = np.empty(G, f32)
    m = np.empty(G, f32)
    Lk = np.empty(n, np.int64)
    Laux = np.empty(n, np.int64)
    for wname, wt in weights.items():
        wt = np.ascontiguousarray(wt, dtype=f32)
        for nmax, rmin, rdelta, nstep, mad in [(3, -0.5, 0.1, 15, True), (15, -1.0, 0.1, 20, False),
                                               (31, -0.9, 0.05, 36, False)]:
            make_qkx_quants_lanes(xt, wt, nmax, f32(rmin), f32(rdelta), nstep, mad, L, s, m)
            for k in range(G):
                col = np.ascontiguousarray(xt[:, k])
                sk, mk = make_qkx2_quants(n, nmax, col, np.ascontiguousarray(wt[:, k]), Lk,
                                          Laux, f32(rmin), f32(rdelta), nstep, mad)
                assert (bits(s[k]), bits(m[k]), L[:, k].tolist()) == (
                    bits(sk), bits(mk), Lk.tolist()), (
                    f"make_qkx lanes, group {k}, weights {wname}, nmax {nmax}")
        for nmax in (4, 8, 32):
            make_qx_quants_lanes(xt, wt, nmax, L, s)
            for k in range(G):
                sk = make_qx_quants(n, nmax, np.ascontiguousarray(xt[:, k]), Lk,
                                    np.ascontiguousarray(wt[:, k]), True)
                assert (bits(s[k]), L[:, k].tolist()) == (bits(sk), Lk.tolist()), (
                    f"make_qx lanes, group {k}, weights {wname}, nmax {nmax}")
        if n == 32:
            iq4_scale_lanes(xt, wt, s)
            for k in range(G):
                d = iq4_block_scale(np.ascontiguousarray(xt[:, k]), np.ascontiguousarray(wt[:, k]))
                assert bits(s[k]) == bits(d), f"iq4 lanes, group {k}"


def test_iq4_index_equals_best_index_int8():
    f32 = np.float32
    grid = np.arange(-140, 140, 0.25, dtype=f32)
    mid = (KVALUES_IQ4NL[:-1] + KVALUES_IQ4NL[1:]) / 2
    xs = np.concatenate([grid, mid, np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf),
                         KVALUES_IQ4NL, np.nextafter(KVALUES_IQ4NL, np.inf),
                         np.random.default_rng(13).standard_normal(2000) * 80,
                         [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30]]).astype(f32)
    for v in xs:
        idx, val = iq4_nl_index(f32(v))
        want = best_index_int8(16, KVALUES_IQ4NL, f32(v))
        assert (idx, val) == (want, KVALUES_IQ4NL[want]), v


# -- argument checks ----------------------------------------------------------------------------

def test_bad_arguments_are_refused_naming_type_and_problem():
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match=r"cannot quantize to 'Q4_Z': not one of Q4_0, "):
        quantize_rows("Q4_Z", x)
    with pytest.raises(ValueError, match=r"cannot quantize to 'q4_k'"):
        quantize_rows("q4_k", x)
    with pytest.raises(ValueError, match=r"Q4_K: x must be a float32 \(nrows, n_per_row\) "
                                         r"array, got float64 array of shape \(2, 256\)"):
        quantize_rows("Q4_K", x.astype(np.float64))
    with pytest.raises(ValueError, match=r"Q8_0: x must be a float32 .* got float32 array of "
                                         r"shape \(256,\)"):
        quantize_rows("Q8_0", x[0])
    with pytest.raises(ValueError, match=r"Q8_0: x must be a float32 .* got list"):
        quantize_rows("Q8_0", [[0.0] * 32])
    with pytest.raises(ValueError, match=r"Q6_K: x must be C-contiguous"):
        quantize_rows("Q6_K", np.zeros((256, 2), np.float32).T)
    with pytest.raises(ValueError, match=r"Q5_K: n_per_row 288 is not a multiple of the "
                                         r"block size 256"):
        quantize_rows("Q5_K", np.zeros((2, 288), np.float32))
    with pytest.raises(ValueError, match=r"Q4_0: n_per_row 48 is not a multiple of the "
                                         r"block size 32"):
        quantize_rows("Q4_0", np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match=r"IQ4_XS: imatrix must be a float32 array of shape "
                                         r"\(256,\), got float32 array of shape \(128,\)"):
        quantize_rows("IQ4_XS", x, np.ones(128, np.float32))
    with pytest.raises(ValueError, match=r"Q3_K: imatrix must be .* got float64 array"):
        quantize_rows("Q3_K", x, np.ones(256))
    with pytest.raises(ValueError, match=r"Q2_K: out must be a C-contiguous uint8 array of "
                                         r"shape \(2, 84\), got uint8 array of shape \(2, 85\)"):
        quantize_rows("Q2_K", x, out=np.zeros((2, 85), np.uint8))
    with pytest.raises(ValueError, match=r"IQ4_NL: out must be .* got int8 array"):
        quantize_rows("IQ4_NL", x, out=np.zeros((2, 144), np.int8))
    with pytest.raises(ValueError, match=r"Q4_1: n_per_row 40 is not a multiple"):
        row_bytes("Q4_1", 40)
