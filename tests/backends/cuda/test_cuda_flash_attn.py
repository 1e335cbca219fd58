"""CUDA flash attention's two geometries (backends/cuda/templates_attn.py) under numba's CUDA
simulator, against the numpy reference: decode split over KV chunks and merged by the combine
kernel (a chunk masked everywhere, a row masked everywhere, ALiBi, softcap), prefill in tiles of
query rows (T not a multiple of the tile, a causal mask, sequences broadcast over K/V), GQA, and
quantized K/V. Shapes come from the geometry's constants, so the same tests take the same paths
at the simulator's small sizes and at the GPU's (GGRAPH_CUDASIM_GEOMETRY=gpu, slow).

Runs in the simulator's own process (tests/run_cudasim.sh; NUMBA_ENABLE_CUDASIM=1 before numba
is imported); otherwise the module skips.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()


from ggraph import Context, GGMLType as T, build_graph, ops as O  # noqa: E402
from ggraph.backends.cuda import CUDABackend  # noqa: E402
from ggraph.backends.cuda import templates_attn as KA  # noqa: E402
from ggraph.check.conformance import compare  # noqa: E402
from ggraph.check.reference import run_reference  # noqa: E402

pytestmark = pytest.mark.cudasim
sys.setswitchinterval(5e-4)  # simulated threads wait on each other at barriers: switch sooner

BACKEND = CUDABackend()
TOL = 1e-9  # float32 kernels against the float64 reference on the same stored K/V: ~1e-14
KV_TYPES = [T.F16, T.Q8_0, T.Q4_0]


def _attention(hd, nt, nh, nkv, kvt, mask, hkv=1, ns=1, nks=1, scale=None, **params):
    """flash_attn_ext of random q (hd, nt, nh, ns) over K/V (hd, nkv, hkv, nks) of type kvt,
    with `mask` (numpy, (ns|1, nh|1, nt, nkv)) as an F16 input; (node, inputs)."""
    rng = np.random.default_rng(nt * 1000 + nkv)
    ctx = Context()
    q = ctx.new_tensor(T.F32, (hd, nt, nh, ns)).set_input()
    k = ctx.new_tensor(kvt, (hd, nkv, hkv, nks)).set_data(
        rng.uniform(-1, 1, (nks, hkv, nkv, hd)))
    v = ctx.new_tensor(kvt, (hd, nkv, hkv, nks)).set_data(
        rng.uniform(-1, 1, (nks, hkv, nkv, hd)))
    m = ctx.new_tensor(T.F16, tuple(reversed(mask.shape))).set_input()
    out = O.flash_attn_ext(q, k, v, m, scale or hd ** -0.5, **params).set_output()
    return out, {q: rng.uniform(-1, 1, q.shape), m: mask}


def _run(out, inputs, session=None):
    """The CUDA result and the reference's, compared at TOL; the CUDA result."""
    g = build_graph(out)
    ref = run_reference(g, inputs).read(out)
    s = session or BACKEND.session()
    got = s.run(g, inputs).read(out)
    ok, err, why = compare(ref, got, TOL)
    assert ok, f"nmse={err:.3e} > {TOL} {why}"
    return got


# -- the launch choice ------------------------------------------------------------------------

def test_plan_splits_few_rows_and_tiles_many():
    qt, splits, chunk = KA.fa_plan(2, 1, 8 * KA.FA_MIN_CHUNK)
    assert qt == 1 and splits > 1 and chunk % KA.FA_NT == 0 and chunk >= KA.FA_MIN_CHUNK
    assert (splits - 1) * chunk < 8 * KA.FA_MIN_CHUNK <= splits * chunk  # no empty chunk
    assert splits <= KA.FA_MAX_SPLITS
    assert 2 * splits <= KA.FA_TARGET_BLOCKS + 2       # about the target, not far above
    assert KA.fa_plan(2, 1, KA.FA_MIN_CHUNK - 1) == (1, 1, KA.FA_MIN_CHUNK - 1)  # short KV
    many = KA.FA_SPLIT_ROWS
    assert KA.fa_plan(many, KA.FA_QT, 100) == (KA.FA_QT, 1, 100)   # prefill: tiles
    assert KA.fa_plan(many, 1, 100) == (1, 1, 100)                  # T=1 rows: no tile
    assert KA.fa_plan(many, KA.FA_QT - 1, 100)[0] == 1
    assert KA.fa_plan(1, 1, 0) == (1, 1, 1)


# -- decode: one query row per block, KV split over blocks ----------------------------------

def _decode_nkv():
    """A KV length that the plan for 2 decode rows cuts into at least 3 chunks."""
    nkv = 3 * max(KA.FA_MIN_CHUNK, 2 * KA.FA_NT)
    _, splits, chunk = KA.fa_plan(2, 1, nkv)
    assert splits >= 3, (splits, chunk)
    return nkv, chunk


@pytest.mark.parametrize("kvt", KV_TYPES, ids=str)
def test_decode_split_with_masked_chunk_and_masked_row(kvt):
    """T=1, 2 heads sharing one K/V head (GQA): head 0 has its second chunk masked everywhere
    (that chunk's max is -inf and its sum 0) and scattered masked positions; head 1 is masked
    everywhere and gives 0, as the current kernel and ggml do."""
    nkv, chunk = _decode_nkv()
    mask = np.zeros((1, 2, 1, nkv))
    mask[0, 0, 0, chunk:2 * chunk] = -np.inf
    mask[0, 0, 0, ::7] = -np.inf
    mask[0, 1] = -np.inf
    out, inputs = _attention(32, 1, 2, nkv, kvt, mask)
    got = _run(out, inputs)
    assert np.all(got[0, 0, 1] == 0) and np.all(np.isfinite(got))
    assert np.abs(got[0, 0, 0]).max() > 0


def test_decode_split_alibi_softcap_and_dv_ne_dk():
    """The split path with ALiBi slopes (per head), a softcap and a V head shorter than K's."""
    nkv, chunk = _decode_nkv()
    rng = np.random.default_rng(5)
    ctx = Context()
    q = ctx.new_tensor(T.F32, (64, 1, 2)).set_input()
    k = ctx.new_tensor(T.F16, (64, nkv, 1)).set_data(rng.uniform(-1, 1, (1, nkv, 64)))
    v = ctx.new_tensor(T.Q8_0, (32, nkv, 1)).set_data(rng.uniform(-1, 1, (1, nkv, 32)))
    m = ctx.new_tensor(T.F16, (nkv, 1)).set_input()
    mask = -np.abs(rng.normal(0, 2, (1, nkv)))
    mask[0, :chunk] = -np.inf
    out = O.flash_attn_ext(q, k, v, m, 0.125, max_bias=8.0, softcap=30.0).set_output()
    _run(out, {q: rng.uniform(-1, 1, q.shape), m: mask})


def test_decode_steps_rerun_the_bound_split():
    """A session binds the split launch (and its scratch) once; the next decode step runs the
    same launches on new q values and must not see the first step's partials."""
    nkv, chunk = _decode_nkv()
    mask = np.zeros((1, 1, 1, nkv))
    mask[..., 2 * chunk:] = -np.inf  # the last chunk(s) masked: their partials must weigh 0
    out, inputs = _attention(32, 1, 2, nkv, T.F16, mask)
    s = BACKEND.session()
    first = _run(out, inputs, s)
    q = next(t for t in inputs if t.type == T.F32)
    inputs[q] = -inputs[q]
    second = _run(out, inputs, s)
    assert not np.allclose(first, second)


# -- prefill: QT query rows per block -------------------------------------------------------

@pytest.mark.parametrize("kvt", KV_TYPES, ids=str)
def test_prefill_tiles_with_a_short_last_tile(kvt, monkeypatch):
    """T = 2 tiles + 1 row, causal mask (with one query row masked everywhere), 4 heads over 2
    K/V heads and 2 sequences over 1 K/V sequence; every tile decodes a K row and V block
    once for all of its rows. At GPU geometry the row count is far below the tile threshold,
    so the threshold is lowered (it is only the host's choice)."""
    nt, nh, ns, nkv = 2 * KA.FA_QT + 1, 4, 2, 40
    monkeypatch.setattr(KA, "FA_SPLIT_ROWS", min(KA.FA_SPLIT_ROWS, nt * nh * ns))
    assert KA.fa_plan(nt * nh * ns, nt, nkv) == (KA.FA_QT, 1, nkv)
    mask = np.zeros((1, 1, nt, nkv))
    for t in range(nt):
        mask[0, 0, t, nkv - nt + t + 1:] = -np.inf  # causal: the last nt positions are new
    mask[0, 0, 1] = -np.inf
    out, inputs = _attention(32, nt, nh, nkv, kvt, mask, hkv=2, ns=ns, nks=1)
    got = _run(out, inputs)
    assert np.all(got[:, 1] == 0)


def test_prefill_tiles_alibi_softcap(monkeypatch):
    nt, nh, nkv = KA.FA_QT + 1, 2, 2 * KA.FA_NT + 3
    monkeypatch.setattr(KA, "FA_SPLIT_ROWS", min(KA.FA_SPLIT_ROWS, nt * nh))
    rng = np.random.default_rng(7)
    mask = -np.abs(rng.normal(0, 2, (1, 1, nt, nkv)))
    out, inputs = _attention(32, nt, nh, nkv, T.Q4_1, mask, max_bias=8.0, softcap=20.0)
    _run(out, inputs)


@pytest.mark.parametrize("path", ["split", "tile"])
def test_large_scores_take_the_true_row_max(path, monkeypatch):
    """Scores in the hundreds: exp overflows float32 unless each tile's row max is the true
    one (the two-step reduction over segments) and the combine rescales every chunk to the
    largest of their maxima (the first chunk's is 300 below the others')."""
    if path == "split":
        nkv, chunk = _decode_nkv()
        nt, nh = 1, 2
    else:
        nt, nh, nkv = KA.FA_QT + 1, 2, 2 * KA.FA_NT
        monkeypatch.setattr(KA, "FA_SPLIT_ROWS", min(KA.FA_SPLIT_ROWS, nt * nh))
    mask = np.zeros((1, 1, nt, nkv))
    if path == "split":
        mask[..., :chunk] = -300.0  # the first chunk's max far below the others'
    mask[..., 1::3] = -np.inf
    out, inputs = _attention(32, nt, nh, nkv, T.F16, mask, scale=40.0)
    got = _run(out, inputs)
    assert np.all(np.isfinite(got))
