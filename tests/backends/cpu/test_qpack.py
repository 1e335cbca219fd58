"""The decode mat-vec over packed weights (backends/cpu/qpack.py, qtiles.py, qlanes.py): the
layout restores the original bytes exactly, and its products equal the row-by-row integer dots
(the same quantized activations, the same integer sums: only the order of float sums differs)
for every packed type, both widths (8 and 16 rows), several columns and row counts that are
not multiples of a group; the instruction choices without VNNI and without x86 vectors give
the same values; a model's decode reads its weights from the packed copies."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.codecs import quants
from ggraph.ir.types import TYPE_RECORDS
from ggraph.ir.types import GGMLType as T
from ggraph.backends.cpu import kernels as KK
from ggraph.backends.cpu import lane_ir, qlanes, qmem, qpack

PACKED = sorted(qpack.PACKS, key=int)


def _weights(t: T, m: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return quants.quantize(t, rng.standard_normal((m, k)).astype(np.float32)).reshape(m, -1)


@pytest.mark.parametrize("r", qlanes.WIDTHS)
@pytest.mark.parametrize("t", PACKED, ids=str)
def test_pack_restores_the_original_bytes(t, r):
    size = TYPE_RECORDS[t].type_size
    rng = np.random.default_rng(1)
    for m, nb in ((1, 1), (r, 2), (2 * r + 5, 3)):
        rows = rng.integers(0, 256, (m, nb * size), dtype=np.uint8)
        p = qpack.pack(t, rows, r, block_chunk=nb * 2)  # several runs of groups
        assert p.nbytes == qpack.packed_nbytes(t, (nb * TYPE_RECORDS[t].block_size, m), r)
        assert np.array_equal(qpack.unpack(t, p, m, nb, r), rows)


def _products(t: T, A: np.ndarray, xb: np.ndarray, r: int, **blocks: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(the packed product's result, the row-by-row integer dots' result) of A times xb;
    `blocks`: the packed kernel's cache blocks (l1, l2 bytes)."""
    m = A.shape[0]
    k, nn = xb.shape[-1], xb.shape[2]
    vt = KK.VEC_DOT_TYPE[t]
    nb = k // TYPE_RECORDS[t].block_size
    qw = vt.type_size * k // vt.block_size
    got = np.full((1, 1, nn, m), np.nan, np.float32)
    KK.packed_call(KK.packed_kernel(True, t, T.F32, r, **blocks), t, xb,
                   [(qpack.pack(t, A, r), got, m)], r)()
    if not TYPE_RECORDS[t].qdot:
        # no row dots to compare with (IQ4_XS): the dequantized weights times the
        # dequantized activation quants, in float64
        y = quants.dequantize(vt, quants.quantize(vt, xb.reshape(nn, k))).reshape(nn, k)
        w = quants.dequantize(t, A.reshape(-1)).reshape(m, k)
        return got, (y.astype(np.float64) @ w.T.astype(np.float64))[None, None]
    want = np.full((1, 1, nn, m), np.nan, np.float32)
    rd = KK.ROW_DOTS.get(t)
    KK._row_dot_kernel(True, t, T.F32)(
        A.reshape(1, 1, m, -1), xb, np.empty((1, 1, nn, qw), np.uint8),
        np.empty((1, 1, nn, k // 32), np.float32), want, k, nb, rd is not None and rd.sums)
    return got, want


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("t", PACKED, ids=str)
def test_packed_matvec_equals_the_row_dots(t):
    k = 512
    A = _weights(t, 2 * qlanes.R + 3, k)  # a partial last group
    xb = np.random.default_rng(2).standard_normal((1, 1, 3, k)).astype(np.float32)
    _close(*_products(t, A, xb, qlanes.R))


@pytest.mark.parametrize("t", PACKED, ids=str)
def test_packed_product_of_many_columns(t):
    """Columns 4 at a time, then 2, then one (3 left: a padded 4), quantized in parallel
    from 8 columns;
    with tiny cache blocks the rows are taken a block at a time (their sums kept between)
    and the columns in chunks of 4: every path of a prompt's product."""
    k = 1024
    A = _weights(t, qlanes.R + 5, k, seed=7)
    for nn in (6, 9):
        xb = np.random.default_rng(nn).standard_normal((1, 1, nn, k)).astype(np.float32)
        _close(*_products(t, A, xb, qlanes.R))
        _close(*_products(t, A, xb, qlanes.R, l1=1, l2=1))


@pytest.mark.parametrize("t", PACKED, ids=str)
def test_a_column_gets_the_same_sums_whichever_tile_takes_it(t):
    """1 to 7 columns take tile4, tile2 (2 or 3 left: a batched decode step), a padded tile4
    (3 left) and tile1: each column's result is the one column's alone, bit for bit (a token's
    logits must not depend on its batch: speculative decoding's greedy output)."""
    k = 512
    A = _weights(t, qlanes.R + 5, k, seed=11)
    xb = np.random.default_rng(5).standard_normal((1, 1, 7, k)).astype(np.float32)
    alone = [_products(t, A, xb[:, :, j:j + 1], qlanes.R)[0] for j in range(7)]
    for nn in range(2, 8):
        got = _products(t, A, xb[:, :, :nn], qlanes.R)[0]
        for j in range(nn):
            assert np.array_equal(got[:, :, j], alone[j][:, :, 0]), f"{nn} columns, column {j}"


@pytest.mark.parametrize("t", PACKED, ids=str)
def test_a_lone_last_column_sums_as_its_batch_does(t):
    """With small cache blocks a batch is cut into chunks of 4 columns and each row into runs
    of 3 blocks; a 5th column, alone in the last chunk, takes the one-column loop, which must
    sum in the batch's runs, not a decode step's: its result is column 0's, whose copy it is."""
    k = 2048
    A = _weights(t, qlanes.R + 5, k, seed=13)
    xb = np.random.default_rng(6).standard_normal((1, 1, 5, k)).astype(np.float32)
    xb[:, :, 4] = xb[:, :, 0]
    got = _products(t, A, xb, qlanes.R, l1=3 * qpack.PACKS[t].tile(qlanes.R), l2=1)[0]
    assert np.array_equal(got[:, :, 4], got[:, :, 0])


@pytest.mark.parametrize("t", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=str)
def test_the_other_width(t):
    r = 8 if qlanes.R == 16 else 16
    if r == 16 and not qlanes.AVX512:
        pytest.skip("16-row groups need AVX-512 here (the portable IR path is tested below)")
    A = _weights(t, 2 * r + 1, 256, seed=3)
    xb = np.random.default_rng(4).standard_normal((1, 1, 1, 256)).astype(np.float32)
    _close(*_products(t, A, xb, r))


def test_the_weight_prefetch_is_only_a_hint(monkeypatch):
    """With the weight lines asked for 8 KiB ahead and with none asked for (the two choices
    qmem.prefetch_choice makes per CPU), a product is the same, bit for bit."""
    A = _weights(T.Q4_K, qlanes.R + 3, 512, seed=9)
    xb = np.random.default_rng(8).standard_normal((1, 1, 3, 512)).astype(np.float32)
    got = {}
    for pf in (0, 8192):
        monkeypatch.setattr(KK, "PREFETCH", pf)
        got[pf] = _products(T.Q4_K, A, xb, qlanes.R)[0]
    assert np.array_equal(got[0], got[8192])
    _close(*_products(T.Q4_K, A, xb, qlanes.R))


@pytest.mark.parametrize("m", [40 * qlanes.R + 3, 3 * qlanes.R, 300 * qlanes.R + 5])
def test_threads_that_take_each_others_runs_compute_the_same(monkeypatch, m):
    """A packed product's threads that go on to the runs of the others' shares
    (kernels.PACKED_STEAL), and that take each share's last runs in quarters
    (kernels.PACKED_TAIL), give what threads that keep to their own whole runs give, and
    what one thread gives, bit for bit: every run is a row group's own sums, whoever takes
    it. More runs than threads with a partial last group; fewer groups than a tail; runs of
    many groups."""
    import numba
    t, k = T.Q4_K, 512
    A = _weights(t, m, k, seed=12)
    xb = np.random.default_rng(13).standard_normal((1, 1, 1, k)).astype(np.float32)
    got = {}
    was = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        for steal in (False, True):
            for tail in (0, 2):
                monkeypatch.setattr(KK, "PACKED_STEAL", steal)
                monkeypatch.setattr(KK, "PACKED_TAIL", tail)
                out = np.full((1, 1, 1, m), np.nan, np.float32)
                KK.packed_call(KK.packed_kernel(False, t, T.F32), t, xb,
                               [(qpack.pack(t, A, qlanes.R), out, m)], qlanes.R)()
                got[steal, tail] = out
    finally:
        numba.set_num_threads(was)
    for v in got.values():
        assert np.array_equal(v, got[False, 0])
    assert np.array_equal(got[True, 2], _products(t, A, xb, qlanes.R)[0])


@pytest.mark.parametrize("cols", [1, 5])
def test_a_bias_row_is_added_and_lives_as_long_as_its_call(cols):
    """A product with a bias (a folded add: backends/cpu/fusion.py) gives the product plus
    the bias, bit for bit, through the call made direct (compile.direct), whose bias row
    comes by address: the call keeps that row alive when nothing else does."""
    import gc

    from ggraph.backends.cpu.compile import direct
    t, m, k = T.Q4_K, 2 * qlanes.R + 3, 256
    P = qpack.pack(t, _weights(t, m, k, seed=21), qlanes.R)
    rng = np.random.default_rng(22)
    xb = rng.standard_normal((1, 1, cols, k)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    kern = KK.packed_kernel(True, t, T.F32)
    plain, biased = (np.full((1, 1, cols, m), np.nan, np.float32) for _ in range(2))
    direct(KK.packed_call(kern, t, xb, [(P, plain, m)]))()
    call = direct(KK.packed_call(kern, t, xb, [(P, biased, m, bias.copy())]))
    gc.collect()
    # numpy hands a freed small buffer to the next array of its size: a row not kept alive
    # would now hold these values
    junk = [np.full(m, 1e30, np.float32) for _ in range(8)]
    call()
    del junk
    assert np.array_equal(biased, plain + bias)


@pytest.mark.parametrize(("vendor", "family", "choice"), [
    ("GenuineIntel", 6, (3, 16384)), ("AuthenticAMD", 26, (0, 8192)),
    ("AuthenticAMD", 25, (0, 0)), ("", 0, (0, 0))])
def test_the_prefetch_choice_per_cpu(vendor, family, choice):
    """Intel: into L1 16 KiB ahead; Zen 5: non-temporal 8 KiB ahead; Zen 4 and CPUs not
    measured: no weight prefetch (the hardware's alone), as qmem.prefetch_choice measured."""
    assert qmem.prefetch_choice(vendor, family) == choice


@pytest.mark.parametrize("r", qlanes.WIDTHS)
def test_q4_k_high_nibbles_at_their_extremes(r):
    """Q4_K's high nibbles are dotted where they lie, as 16 times their value, where the dot
    allows it (qlanes.bytes_exact): every quant 15 and every 6-bit scale and min 63, against
    activations whose quants reach -128 and 127, still give the row dots' exact sums."""
    if r == 16 and not qlanes.AVX512:
        pytest.skip("16-row lanes need AVX-512 on this host")
    m, nb = r + 2, 2
    block = np.full(144, 0xFF, np.uint8)
    block[:4] = np.array([1.0, 0.5], np.float16).view(np.uint8)   # d, dmin
    A = np.tile(block, (m, nb))
    xb = np.empty((1, 1, 3, 256 * nb), np.float32)
    xb[0, 0, 0], xb[0, 0, 1] = 1.0, -1.0              # quants -128, then 127 (Q8_K's sign)
    xb[0, 0, 2] = np.where(np.arange(256 * nb) % 3 == 0, 1.0, -0.5)
    _close(*_products(T.Q4_K, A, xb, r))


@pytest.mark.parametrize("flags", [
    {"VNNI512": False, "VNNI256": False},                                   # vpmaddubsw
    {"VNNI512": False, "VNNI256": False, "AVX512": False, "AVX2": False},    # portable IR
], ids=["no-vnni", "portable"])
def test_instruction_choices_agree(monkeypatch, flags):
    """Without VNNI the bytes are multiplied by vpmaddubsw + vpmaddwd, without x86 vectors in
    portable IR: the same integers (types whose quants stay below 128 only: qpack.Pack)."""
    for name, v in flags.items():   # read where the dots are built and by the intrinsics
        monkeypatch.setattr(lane_ir, name, v)
        monkeypatch.setattr(qlanes, name, v)
    assert qlanes.byte_dot(qlanes.R) != "vnni"   # the patch reached the dots
    for t in (T.Q4_K, T.Q6_K, T.Q5_0):
        A = _weights(t, qlanes.R + 2, 256, seed=5)
        xb = np.random.default_rng(6).standard_normal((1, 1, 2, 256)).astype(np.float32)
        _close(*_products(t, A, xb, qlanes.R))


def test_full_byte_types_need_vnni(monkeypatch):
    """Q8_0 and IQ4_XS quants reach 255 once packed: without VNNI they keep the row dots."""
    assert qpack.packable(T.Q4_K, (256, 32))
    monkeypatch.setattr(lane_ir, "VNNI512", False)   # where bytes_exact reads them
    monkeypatch.setattr(lane_ir, "VNNI256", False)
    if qlanes.AVX512 or qlanes.AVX2:
        assert not qpack.packable(T.Q8_0, (256, 32)) and not qpack.packable(T.IQ4_XS, (256, 32))
    assert qpack.packable(T.Q4_K, (256, 32))
    assert not qpack.packable(T.Q4_K, (256, 32, 2))   # 3-D weights are not packed
    assert not qpack.packable(T.F16, (256, 32))


def test_decode_reads_the_packed_weights(tmp_path):
    """A tiny model's decode step packs each quantized weight once (2 layers x 7 matrices,
    the tied output), and its logits equal those of the row dots (a backend without packs)."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny

    path = write_tiny(tmp_path / "q4.gguf", TinyDense(n_embd=128, n_ff=256, weight_type="q4_0"))
    cfg = EngineConfig(n_ctx=64, n_ubatch=16, n_threads=1, reserve_outputs="last")
    eng = Engine(path, cfg)
    eng.eval([1, 2, 3])
    got = eng.eval([4])
    packs = eng.runner.backend.packs
    assert len(packs) == 2 * 7 + 1 and packs.nbytes > 0
    eng2 = Engine(path, cfg)
    eng2.runner.backend.packs = None   # no packed copies: the row dots
    eng2.eval([1, 2, 3])
    np.testing.assert_allclose(got, eng2.eval([4]), rtol=1e-4, atol=1e-4 * np.abs(got).max())


def test_weights_packed_at_load_from_the_file(tmp_path, monkeypatch):
    """The Engine's CPU backend packs its weights when the worst case is reserved, reading
    each weight's rows from the file in runs (here a group at a time) rather than through
    its mapping, and lets the mapped pages go: the copies equal packing the mapped bytes,
    which still read back the same afterwards."""
    from ggraph.backends.cpu.packstore import PackStore
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny

    path = write_tiny(tmp_path / "q5.gguf", TinyDense(n_embd=128, n_ff=256, weight_type="q4_1"))
    monkeypatch.setattr(PackStore, "CHUNK", 1)   # one group of rows per read
    reads, released = [], []
    eng = Engine(path, EngineConfig(n_ctx=64, n_ubatch=16, n_threads=1))
    packs = eng.runner.backend.packs
    assert packs.source is eng.file and len(packs) == 2 * 7 + 1   # before any evaluation
    real_read, real_release = eng.file.read_rows, eng.file.release
    monkeypatch.setattr(eng.file, "read_rows", lambda t, r0, out: (reads.append(r0),
                                                                     real_read(t, r0, out)))
    monkeypatch.setattr(eng.file, "release", lambda t: (released.append(t), real_release(t)))
    fresh = PackStore(eng.file)
    for t in packs.tensors():
        before = np.array(t.data)
        again = fresh.get(t, t.data)
        assert np.array_equal(again, packs.get(t, t.data))
        assert np.array_equal(again, qpack.pack(t.type, before.reshape(t.ne[1], -1)))
        assert np.array_equal(np.asarray(t.data), before)   # released pages read back
    assert len(released) == 2 * 7 + 1 and len(reads) > len(released)
    assert any(line.startswith("CPU_REPACK model buffer size") for line in eng.memory_lines())
    eng.eval([1, 2, 3])


@pytest.mark.parametrize("r", qlanes.WIDTHS)
def test_computed_fields_equal_numpy(r):
    """The packer's loops for the computed fields (fifth-bit masks) give what numpy's
    field-by-field version of the layout gives."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (3, r, 2, 176), dtype=np.uint8)
    assert np.array_equal(qpack._q5k_masks(x), qpack._masks(qpack._q5k_bits(x[..., 16:48])))
    for off in (2, 4):
        assert np.array_equal(qpack._q5_masks(x, off),
                              qpack._masks(qpack._q5_bits(x[..., off:off + 4])))


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K, T.Q4_0], ids=str)
def test_products_that_share_their_columns_in_one_call(t):
    """Weights of R + 5, 2R and 3 rows (partial last groups) times the same 1 and 3 columns
    in one call (a layer's gate and up, fused: backends/cpu/fusion.py): each destination
    gets its weight's own product bit for bit, and nothing past its rows."""
    k = 512
    weights = [_weights(t, m, k, seed=20 + m) for m in (qlanes.R + 5, 2 * qlanes.R, 3)]
    for nn in (1, 3):
        xb = np.random.default_rng(nn).standard_normal((1, 1, nn, k)).astype(np.float32)
        alone = [_products(t, A, xb, qlanes.R)[0] for A in weights]
        outs = [np.full((1, 1, nn, A.shape[0] + 1), np.nan, np.float32) for A in weights]
        kern = KK.packed_kernel(False, t, T.F32)
        KK.packed_call(kern, t, xb, [(qpack.pack(t, A, qlanes.R), d[..., :-1], A.shape[0])
                                     for A, d in zip(weights, outs)])()
        for d, want in zip(outs, alone):
            assert np.array_equal(d[..., :-1], want) and np.isnan(d[..., -1]).all()
