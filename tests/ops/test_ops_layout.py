"""Views, copies and row ops against independent computations.

Views are checked by gathering elements straight from the root's bytes with the view's own
ne/nb/offset (loops); cpy/set_rows into quantized types are compared byte for byte with
gguf.quants (and ggraph.codecs.quants) and bounded by one quantization step; rows not written keep
their bytes. get_rows reads quantized rows; concat covers every dim; repeat tiles by modulo.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gguf
import gguf.quants as gq

from ggraph import Context, GGMLType, build_graph, ops

from ggraph.codecs import quants
from ggraph.check.reference import run_reference
from ggraph.ir.types import row_size

FEW = settings(max_examples=30, deadline=None)
QTYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1]


def run(*outs, inputs=None):
    return run_reference(build_graph(*outs), inputs)


def compute(*outs, inputs=None):
    ex = run(*outs, inputs=inputs)
    return [ex.read(o) for o in outs]


def root_bytes(ex, t) -> np.ndarray:
    """All bytes of t's root tensor in the executor's memory (a copy)."""
    return ex._buffer(t.owner).copy()


def gguf_bytes(x: np.ndarray, t: GGMLType) -> np.ndarray:
    qt = gguf.GGMLQuantizationType[t.name]
    return np.ascontiguousarray(gq.quantize(np.ascontiguousarray(x, np.float32), qt)
                                ).view(np.uint8)


def gguf_values(x: np.ndarray, t: GGMLType) -> np.ndarray:
    qt = gguf.GGMLQuantizationType[t.name]
    return gq.dequantize(gguf_bytes(x, t), qt).reshape(np.shape(x))


def step_bound(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """One quantization step per element (the block's scale d), per the facts page."""
    blocks = np.asarray(x, np.float64).reshape(-1, 32)
    if t == GGMLType.Q8_0:
        d = np.abs(blocks).max(1) / 127
    elif t == GGMLType.Q4_0:
        d = np.abs(blocks).max(1) / 8
    else:
        d = (blocks.max(1) - blocks.min(1)) / 15
    return np.repeat(d * 1.001 + 1e-7, 32).reshape(np.shape(x))


def gather(flat: np.ndarray, ne, nb, offs: int, esize: int) -> np.ndarray:
    """Loop-level strided read: element (i3, i2, i1, i0) sits at byte offs + sum(i_k nb_k)."""
    out = np.zeros(tuple(reversed(ne)), dtype=flat.dtype)
    for i0, i1, i2, i3 in itertools.product(*(range(n) for n in ne)):
        byte = offs + i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]
        assert byte % esize == 0
        out[i3, i2, i1, i0] = flat[byte // esize]
    return out


# -- views --------------------------------------------------------------------------------

def test_views_read_the_right_bytes():
    x = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)   # ne [5, 6, 4]
    flat = x.ravel()
    ctx = Context()
    a = ctx.from_numpy(x, name="x")
    E = 4
    views = [
        ops.view_1d(a, 7, 3 * E),
        ops.view_2d(a, 3, 4, a.nb[1], a.nb[1] + 2 * E),              # a sub-block
        ops.view_2d(a, 5, 4, 3 * a.nb[1], 0),                        # every third row
        ops.view_2d(a, 4, 6, 2 * E, E),                              # overlapping windows
        ops.view_3d(a, 2, 3, 4, a.nb[1], a.nb[2], 2 * a.nb[1] + E),
        ops.view_4d(a, 2, 2, 2, 2, 2 * a.nb[1], a.nb[2], 2 * a.nb[2], E),
        ops.reshape(a, 10, 12),
        ops.reshape(a, 120),
        ops.permute(a, 2, 0, 1, 3),
        ops.permute(a, 1, 2, 0, 3),
        ops.transpose(a),
    ]
    got = compute(*views)
    for v, g in zip(views, got):
        assert v.view_src is a and v.is_view and v.type == a.type
        np.testing.assert_array_equal(g, gather(flat, v.ne, v.nb, v.view_offs, E), err_msg=repr(v))
    # permute semantics by index: input dim i becomes output dim p_i
    p = (2, 0, 1, 3)
    g = got[8]
    for i0, i1, i2 in itertools.product(range(5), range(6), range(4)):
        o = [0, 0, 0, 0]
        o[p[0]], o[p[1]], o[p[2]] = i0, i1, i2
        assert g[o[3], o[2], o[1], o[0]] == x[i2, i1, i0]
    np.testing.assert_array_equal(got[10][0], np.swapaxes(x, 1, 2))


def test_view_of_view_points_at_root_with_summed_offset():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    ctx = Context()
    a = ctx.from_numpy(x, name="x")
    v1 = ops.view_2d(a, 8, 4, a.nb[1], 2 * a.nb[1])        # rows 2..5
    v2 = ops.view_1d(v1, 3, a.nb[1] + 8)                  # row 1 of v1, from column 2
    v3 = ops.view_1d(v1, 2, -a.nb[1])                      # before v1, still inside a
    assert v2.view_src is a and v2.view_offs == 2 * a.nb[1] + a.nb[1] + 8
    assert v3.view_src is a and v3.view_offs == a.nb[1]
    g2, g3 = compute(v2, v3)
    np.testing.assert_array_equal(g2.ravel(), x[3, 2:5])
    np.testing.assert_array_equal(g3.ravel(), x[1, :2])


@pytest.mark.parametrize("src_type", [GGMLType.F32, GGMLType.F16, GGMLType.I32])
def test_cont_of_strided_sources(src_type):
    rng = np.random.default_rng(11)
    x = rng.integers(-50, 50, (2, 3, 4, 5)).astype(np.float32)
    ctx = Context()
    a = ctx.from_numpy(x, src_type, name="x")
    p = ops.permute(a, 1, 3, 0, 2)
    t = ops.transpose(a)
    c1, c2, c3 = ops.cont(p), ops.cont(t), ops.cont(t, 20, 6)
    assert all(c.is_contiguous() and not c.is_view and c.type == src_type for c in (c1, c2, c3))
    assert c3.ne == (20, 6, 1, 1)
    g1, g2, g3 = compute(c1, c2, c3)
    want1 = np.zeros(c1.shape)
    for i0, i1, i2, i3 in itertools.product(range(5), range(4), range(3), range(2)):
        o = [0, 0, 0, 0]
        o[1], o[3], o[0], o[2] = i0, i1, i2, i3
        want1[o[3], o[2], o[1], o[0]] = x[i3, i2, i1, i0]
    np.testing.assert_array_equal(g1, want1)
    np.testing.assert_array_equal(g2, np.swapaxes(x, 2, 3))
    # ggml element order: ne0 fastest over the source's logical shape
    np.testing.assert_array_equal(g3.ravel(), np.swapaxes(x, 2, 3).ravel())


@pytest.mark.parametrize("qt", QTYPES)
def test_cont_of_quantized_rows_keeps_bytes(qt):
    """A same-type copy is exact (facts: exact for same-type copies): the bytes move."""
    rng = np.random.default_rng(12)
    x = rng.uniform(-1, 1, (2, 3, 64)).astype(np.float32)       # ne [64, 3, 2]
    ctx = Context()
    a = ctx.from_numpy(x, qt, name="w")
    c = ops.cont(ops.permute(a, 0, 2, 1, 3))                    # [64, 2, 3]
    ex = run(c)
    rb = row_size(qt, 64)
    src = gguf_bytes(x, qt).reshape(2, 3, rb)
    got = root_bytes(ex, c).reshape(3, 2, rb)
    np.testing.assert_array_equal(got, np.swapaxes(src, 0, 1))


# -- cpy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dst_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16] + QTYPES)
@pytest.mark.parametrize("strided_src", [False, True])
def test_cpy_converts(dst_type, strided_src):
    rng = np.random.default_rng(13)
    x = rng.uniform(-2, 2, (3, 64)).astype(np.float32)          # ne [64, 3]
    ctx = Context()
    if strided_src:   # the source is a transposed view of [3, 64]
        src = ops.transpose(ctx.from_numpy(np.ascontiguousarray(x.T), name="xT"))
    else:
        src = ctx.from_numpy(x, name="x")
    dst = ctx.new_tensor(dst_type, (64, 3), name="dst")
    out = ops.cpy(src, dst)
    assert out.view_src is dst and out.ne == dst.ne and out.type == dst_type
    ex = run(out)
    got = ex.read(dst)[0, 0]
    raw = root_bytes(ex, dst).reshape(3, row_size(dst_type, 64))
    if dst_type == GGMLType.F32:
        np.testing.assert_array_equal(got, x)
    elif dst_type == GGMLType.F16:
        np.testing.assert_array_equal(raw.view(np.float16), x.astype(np.float16))
    else:
        np.testing.assert_array_equal(raw, gguf_bytes(x, dst_type))
        np.testing.assert_array_equal(got, gguf_values(x, dst_type))
        if dst_type.is_quantized:
            assert np.all(np.abs(got - x) <= step_bound(x, dst_type))
        np.testing.assert_array_equal(raw, quants.quantize(dst_type, x))


@pytest.mark.parametrize("dst_type", [GGMLType.F16] + QTYPES)
def test_cpy_into_rows_of_a_cache_leaves_the_rest(dst_type):
    """Older KV-cache writes: cpy into a view of the cache; other rows keep their bytes."""
    rng = np.random.default_rng(14)
    init = rng.uniform(-1, 1, (10, 64)).astype(np.float32)
    new = rng.uniform(-3, 3, (3, 64)).astype(np.float32)
    ctx = Context()
    cache = ctx.from_numpy(init, dst_type, name="cache")
    before = cache.data.copy().reshape(10, -1)
    dst = ops.view_2d(cache, 64, 3, cache.nb[1], 4 * cache.nb[1])
    out = ops.cpy(ctx.from_numpy(new, name="new"), dst)
    ex = run(out)
    after = root_bytes(ex, cache).reshape(10, -1)
    np.testing.assert_array_equal(after[[0, 1, 2, 3, 7, 8, 9]], before[[0, 1, 2, 3, 7, 8, 9]])
    np.testing.assert_array_equal(after[4:7], gguf_bytes(new, dst_type))


def test_cpy_into_strided_float_destination():
    """cpy into a column block of a bigger F16 tensor (destination rows strided)."""
    rng = np.random.default_rng(15)
    big = rng.uniform(-1, 1, (4, 10)).astype(np.float16)
    x = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    ctx = Context()
    b = ctx.from_numpy(big.astype(np.float32), "f16", name="big")
    win = ops.view_2d(b, 3, 4, b.nb[1], 5 * 2)                   # columns 5..7
    ex = run(ops.cpy(ctx.from_numpy(x, name="x"), win))
    want = big.copy()
    want[:, 5:8] = x.astype(np.float16)
    np.testing.assert_array_equal(ex.read(b)[0, 0], want.astype(np.float32))


def test_cpy_int():
    ctx = Context()
    x = np.array([[1, -2, 3], [2**31 - 1, -2**31, 0]], np.int32)
    out = ops.cpy(ctx.from_numpy(x, "i32"), ctx.new_tensor("i64", (3, 2)))
    (got,) = compute(out)
    np.testing.assert_array_equal(got[0, 0], x.astype(np.int64))


# -- get_rows / set_rows ------------------------------------------------------------------

@pytest.mark.parametrize("a_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32]
                         + QTYPES)
def test_get_rows_loops(a_type):
    rng = np.random.default_rng(16)
    A3, A2, nr, ne0, n = 2, 3, 5, 64, 4
    a = rng.uniform(-2, 2, (A3, A2, nr, ne0)).astype(np.float32)
    if a_type == GGMLType.I32:
        a = np.round(a * 1000)
    idx = rng.integers(0, nr, (A3, A2, n)).astype(np.int32)      # ne [n, A2, A3]
    ctx = Context()
    out = ops.get_rows(ctx.from_numpy(a, a_type, name="a"), ctx.from_numpy(idx, "i32"))
    assert out.ne == (ne0, n, A2, A3)
    assert out.type == (GGMLType.I32 if a_type == GGMLType.I32 else GGMLType.F32)
    (got,) = compute(out)
    if a_type in (GGMLType.F32, GGMLType.I32):
        vals = a
    elif a_type == GGMLType.F16:
        vals = a.astype(np.float16).astype(np.float32)
    else:
        vals = gguf_values(a, a_type)
    for i3, i2, j in itertools.product(range(A3), range(A2), range(n)):
        np.testing.assert_array_equal(got[i3, i2, j], vals[i3, i2, idx[i3, i2, j]])


@pytest.mark.parametrize("idx_type", [GGMLType.I64, GGMLType.I32])
@pytest.mark.parametrize("dst_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16] + QTYPES)
def test_set_rows_bytes(dst_type, idx_type):
    rng = np.random.default_rng(17)
    D3, D2, n_rows, ne0, n = 2, 4, 9, 64, 3
    I1, I2 = 2, 1                                                # idx broadcast over dims 2, 3
    init = rng.uniform(-1, 1, (D3, D2, n_rows, ne0)).astype(np.float32)
    src = rng.uniform(-4, 4, (D3, D2, n, ne0)).astype(np.float32)
    idx = np.stack([np.stack([rng.permutation(n_rows)[:n] for _ in range(I1)])
                    for _ in range(I2)])                         # (I2, I1, n), distinct rows
    ctx = Context()
    dst = ctx.from_numpy(init, dst_type, name="cache")
    before = dst.data.copy()
    out = ops.set_rows(dst, ctx.from_numpy(src, name="src"),
                       ctx.from_numpy(idx, idx_type, name="idx"))
    assert out.view_src is dst and out.ne == dst.ne and out.type == dst_type
    ex = run(out)
    rb = row_size(dst_type, ne0)
    after = root_bytes(ex, dst).reshape(D3, D2, n_rows, rb)
    before = before.reshape(D3, D2, n_rows, rb)
    for i3, i2 in itertools.product(range(D3), range(D2)):
        rows = idx[i3 % I2, i2 % I1]
        for r in range(n_rows):
            if r in rows:
                i = list(rows).index(r)
                want = (gguf_bytes(src[i3, i2, i], dst_type) if dst_type != GGMLType.F32
                        else src[i3, i2, i].view(np.uint8))
                np.testing.assert_array_equal(after[i3, i2, r], want)
                np.testing.assert_array_equal(after[i3, i2, r],
                                              quants.quantize(dst_type, src[i3, i2, i]))
            else:
                np.testing.assert_array_equal(after[i3, i2, r], before[i3, i2, r])
    # reading through the returned view sees the new rows
    got = ex.read(out)
    for i3, i2 in itertools.product(range(D3), range(D2)):
        for i, r in enumerate(idx[i3 % I2, i2 % I1]):
            v = got[i3, i2, r]
            if dst_type.is_quantized:
                assert np.all(np.abs(v - src[i3, i2, i]) <= step_bound(src[i3, i2, i], dst_type))


def test_set_rows_index_out_of_range_at_run_time():
    ctx = Context()
    dst = ctx.new_tensor("f16", (32, 4), name="cache")
    src = ctx.from_numpy(np.zeros((1, 32), np.float32), name="src")
    idx = ctx.from_numpy(np.array([4], np.int64), "i64", name="idx")
    with pytest.raises(ValueError, match=r"set_rows: row index 4 in 'idx'.*outside \[0, 4\)"):
        run(ops.set_rows(dst, src, idx))


# -- concat / repeat ----------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("type", [GGMLType.F32, GGMLType.F16, GGMLType.I32])
def test_concat_every_dim(dim, type):
    rng = np.random.default_rng(18)
    ne_a = [3, 2, 4, 2]
    ne_b = list(ne_a)
    ne_b[dim] = 5 - dim
    a = rng.integers(-99, 99, ne_a[::-1]).astype(np.float32)
    b = rng.integers(-99, 99, ne_b[::-1]).astype(np.float32)
    ctx = Context()
    out = ops.concat(ctx.from_numpy(a, type), ctx.from_numpy(b, type), dim)
    ne_o = list(ne_a)
    ne_o[dim] += ne_b[dim]
    assert list(out.ne) == ne_o and out.type == type
    (got,) = compute(out)
    want = np.zeros(ne_o[::-1])
    for i in itertools.product(*(range(n) for n in ne_o)):   # i in ne order
        if i[dim] < ne_a[dim]:
            want[i[::-1]] = a[i[::-1]]
        else:
            j = list(i)
            j[dim] -= ne_a[dim]
            want[i[::-1]] = b[tuple(j[::-1])]
    np.testing.assert_array_equal(got, want)


def test_concat_of_strided_views():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)          # ne [6, 4]
    ctx = Context()
    a = ctx.from_numpy(x)
    left = ops.view_2d(a, 2, 4, a.nb[1], 0)
    right = ops.transpose(ops.view_2d(a, 4, 4, a.nb[1], 2 * 4))  # [4, 4] transposed
    (got,) = compute(ops.concat(left, right, 0))
    np.testing.assert_array_equal(got[0, 0], np.concatenate([x[:, :2], x[:, 2:].T], axis=1))


@FEW
@given(ne=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       reps=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       type=st.sampled_from([GGMLType.F32, GGMLType.F16, GGMLType.I32]))
def test_repeat_modulo(ne, reps, type):
    x = np.arange(int(np.prod(ne)), dtype=np.float32).reshape(ne[::-1]) - 5
    ctx = Context()
    big = ctx.new_tensor("f32", [n * r for n, r in zip(ne, reps)], name="shape")
    out = ops.repeat(ctx.from_numpy(x, type, name="x"), big)
    assert out.ne == big.ne and out.type == type
    (got,) = compute(out)
    for i in np.ndindex(*got.shape):
        assert got[i] == x[tuple(k % n for k, n in zip(i, x.shape))]
