"""soft_max_ext and attention against torch (CPU, float64) as the independent oracle.

Covers masks (padded rows, -inf entries, broadcast over heads/sequences by modulo, F16 and
F32), ALiBi (slopes recomputed here from the facts page, power-of-two and not), sinks, the
head_offset/n_head slice used by split attention, GQA broadcast in mul_mat and
flash_attn_ext, softcap, and quantized K/V (the oracle sees gguf's dequantized values).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ggraph import Context, GGMLType, build_graph, ops
from ggraph.check.reference import run_reference
from stored_values import stored

SLOW_OK = settings(max_examples=50, deadline=None)


# -- helpers ------------------------------------------------------------------------------

def compute(*outs, inputs=None):
    ex = run_reference(build_graph(*outs), inputs)
    return [ex.read(o).astype(np.float64) for o in outs]


def hand_slopes(n: int, max_bias: float, first: int = 0, n_head: int | None = None):
    """ALiBi slopes exactly as written on the facts page (not ggraph's alibi_slopes)."""
    n_head = n_head or n
    if max_bias == 0.0:
        return [1.0] * n
    n_log2 = 2 ** math.floor(math.log2(n_head))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    out = []
    for h in range(first, first + n):
        out.append(m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1))
    return out


def causal_mask(n_kv: int, rows: int, n_tokens: int, alibi: bool, rng) -> np.ndarray:
    """(rows, n_kv): token t sits at position n_kv - n_tokens + t; rows past n_tokens are
    padding filled with garbage that must not be read. ALiBi masks hold -|i - j|."""
    m = np.zeros((rows, n_kv), dtype=np.float32)
    p0 = n_kv - n_tokens
    for t in range(rows):
        for j in range(n_kv):
            if t >= n_tokens:
                m[t, j] = rng.uniform(-3, 3)
            elif j > p0 + t:
                m[t, j] = -np.inf
            elif alibi:
                m[t, j] = -abs(p0 + t - j)
    return m


def t64(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64)


# -- soft_max_ext -------------------------------------------------------------------------

def test_soft_max_plain_matches_torch():
    rng = np.random.default_rng(0)
    x = rng.uniform(-4, 4, (2, 3, 5, 7)).astype(np.float32)
    ctx = Context()
    out = ops.soft_max(ctx.from_numpy(x, name="x"))
    (got,) = compute(out)
    want = torch.softmax(t64(x), dim=-1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)


@SLOW_OK
@given(n_kv=st.integers(1, 9), n_tokens=st.integers(1, 5), pad=st.integers(0, 3),
       n_head=st.integers(1, 6), n_seq=st.integers(1, 2),
       mask_heads=st.sampled_from(["1", "all", "div"]),
       mask_type=st.sampled_from([GGMLType.F16, GGMLType.F32]),
       scale=st.floats(0.05, 2.0), max_bias=st.sampled_from([0.0, 8.0, 3.5]),
       seed=st.integers(0, 2**31 - 1))
def test_soft_max_ext_mask_alibi_matches_torch(n_kv, n_tokens, pad, n_head, n_seq, mask_heads,
                                               mask_type, scale, max_bias, seed):
    rng = np.random.default_rng(seed)
    n_tokens = min(n_tokens, n_kv)
    m2 = {"1": 1, "all": n_head, "div": next(d for d in (3, 2, 1) if n_head % d == 0)}[mask_heads]
    m3 = 1 if n_seq == 1 else int(rng.integers(1, 3))
    x = rng.uniform(-3, 3, (n_seq, n_head, n_tokens, n_kv)).astype(np.float32)
    mask = np.stack([np.stack([causal_mask(n_kv, n_tokens + pad, n_tokens, max_bias > 0, rng)
                               + np.float32(0.25 * (h + 2 * s)) * (max_bias == 0)
                               for h in range(m2)]) for s in range(m3)])
    mask = np.where(np.isfinite(mask), mask, -np.inf).astype(np.float32)
    if mask_type == GGMLType.F16:
        mask = mask.astype(np.float16).astype(np.float32)  # exact in f16 by construction
    ctx = Context()
    a = ctx.from_numpy(x, name="kq")
    mt = ctx.from_numpy(mask, mask_type, name="mask")
    (got,) = compute(ops.soft_max_ext(a, mt, scale=scale, max_bias=max_bias))

    # torch: pick mask rows 0..T-1, broadcast heads/sequences by modulo, slope per head
    idx3 = np.arange(n_seq) % m3
    idx2 = np.arange(n_head) % m2
    mb = t64(mask[idx3][:, idx2][:, :, :n_tokens, :])
    slopes = t64(hand_slopes(n_head, max_bias)).view(1, n_head, 1, 1)
    w = t64(x) * scale + slopes * mb
    want = torch.softmax(w, dim=-1).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n_head", [4, 6, 12])
def test_alibi_slopes_non_power_of_two(n_head):
    """Heads past 2^floor(log2 n_head) use m1 (odd powers): check via a one-column softmax."""
    # row [0, 1] with mask [0, 1]: softmax weight of column 1 is sigmoid(1 + slope)
    max_bias = 8.0
    x = np.zeros((1, n_head, 1, 2), dtype=np.float32)
    x[..., 1] = 1.0
    mask = np.array([[[[0.0, 1.0]]]], dtype=np.float32)
    ctx = Context()
    (got,) = compute(ops.soft_max_ext(ctx.from_numpy(x), ctx.from_numpy(mask, "f16"),
                                      max_bias=max_bias))
    slopes = hand_slopes(n_head, max_bias)
    want = 1.0 / (1.0 + np.exp(-(1.0 + np.array(slopes))))
    np.testing.assert_allclose(got[0, :, 0, 1], want, rtol=1e-6)
    if n_head not in (1, 2, 4, 8, 16):
        assert len(set(np.round(slopes, 12))) == n_head  # the m1 branch gives new slopes


@pytest.mark.parametrize("with_mask", [False, True])
def test_soft_max_ext_sinks_match_torch(with_mask):
    rng = np.random.default_rng(1)
    n_kv, T, H = 6, 3, 4
    x = rng.uniform(-3, 3, (1, H, T, n_kv)).astype(np.float32)
    sinks = rng.uniform(-2, 5, H).astype(np.float32)   # some sinks dominate the row max
    mask = causal_mask(n_kv, T + 1, T, False, rng)[None, None]
    ctx = Context()
    a = ctx.from_numpy(x, name="kq")
    s = ctx.from_numpy(sinks, name="sinks")
    mt = ctx.from_numpy(mask, "f16", name="mask") if with_mask else None
    (got,) = compute(ops.soft_max_ext(a, mt, scale=0.7, sinks=s))
    w = t64(x) * 0.7
    if with_mask:
        w = w + t64(mask.astype(np.float16).astype(np.float32))[..., :T, :]
    sink_col = t64(sinks).view(1, H, 1, 1).expand(1, H, T, 1)
    want = torch.softmax(torch.cat([w, sink_col], dim=-1), dim=-1)[..., :n_kv].numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert np.all(got.sum(-1) < 1.0)  # the sink takes its share


@pytest.mark.parametrize("n_head,first,count", [(8, 0, 3), (8, 3, 5), (12, 8, 4), (6, 2, 3)])
def test_soft_max_head_slice_equals_full(n_head, first, count):
    """A softmax over heads first..first+count-1 (split attention) with head_offset/n_head
    equals those heads of the full softmax: each head keeps its true ALiBi slope."""
    rng = np.random.default_rng(2)
    n_kv, T, max_bias = 7, 3, 8.0
    x = rng.uniform(-3, 3, (1, n_head, T, n_kv)).astype(np.float32)
    mask = causal_mask(n_kv, T, T, True, rng)[None, None]
    ctx = Context()
    a = ctx.from_numpy(x, name="kq")
    mt = ctx.from_numpy(mask, "f16", name="mask")
    full = ops.soft_max_ext(a, mt, 0.5, max_bias)
    sl = ops.view_3d(a, n_kv, T, count, a.nb[1], a.nb[2], first * a.nb[2])
    part = ops.soft_max_ext(sl, mt, 0.5, max_bias, head_offset=first, n_head=n_head)
    naive = ops.soft_max_ext(sl, mt, 0.5, max_bias)  # loses the offset: must differ
    got_full, got_part, got_naive = compute(full, part, naive)
    np.testing.assert_array_equal(got_part, got_full[:, first:first + count])
    if first:
        assert not np.allclose(got_naive, got_full[:, first:first + count])
    slopes = t64(hand_slopes(count, max_bias, first, n_head)).view(1, count, 1, 1)
    want = torch.softmax(t64(x[:, first:first + count]) * 0.5 + slopes * t64(mask), -1).numpy()
    np.testing.assert_allclose(got_part, want, rtol=2e-6, atol=1e-7)


# -- attention: mul_mat -> soft_max_ext -> mul_mat ------------------------------------------

@SLOW_OK
@given(D=st.sampled_from([4, 8]), Dv=st.sampled_from([4, 6]), n_kv=st.integers(2, 8),
       T=st.integers(1, 4), Hkv=st.integers(1, 3), gqa=st.sampled_from([1, 2, 3]),
       max_bias=st.sampled_from([0.0, 8.0]), seed=st.integers(0, 2**31 - 1))
def test_attention_mul_mat_path_matches_sdpa(D, Dv, n_kv, T, Hkv, gqa, max_bias, seed):
    rng = np.random.default_rng(seed)
    T = min(T, n_kv)
    H = Hkv * gqa
    scale = 1.0 / math.sqrt(D)
    q = rng.uniform(-1, 1, (T, H, D)).astype(np.float32)        # ne [D, H, T] as projected
    k = rng.uniform(-1, 1, (Hkv, n_kv, D)).astype(np.float32)   # ne [D, n_kv, Hkv]
    v = rng.uniform(-1, 1, (Hkv, n_kv, Dv)).astype(np.float32)
    mask = causal_mask(n_kv, T + 2, T, max_bias > 0, rng)
    ctx = Context()
    qt = ctx.from_numpy(q, name="q")
    kt = ctx.from_numpy(k, "f16", name="k")
    vt = ctx.from_numpy(np.ascontiguousarray(np.swapaxes(v, 1, 2)), "f16", name="vT")
    mt = ctx.from_numpy(mask, "f16", name="mask")
    qp = ops.permute(qt, 0, 2, 1, 3)                                 # [D, T, H], strided
    kq = ops.mul_mat(kt, qp)                                        # [n_kv, T, H]
    kq = ops.soft_max_ext(kq, mt, scale, max_bias)
    kqv = ops.mul_mat(vt, kq)                                       # [Dv, T, H]
    (got,) = compute(kqv)

    Q = t64(np.swapaxes(q, 0, 1))[None]                             # (1, H, T, D)
    K = t64(stored(k, GGMLType.F16))[None]
    V = t64(stored(v, GGMLType.F16))[None]
    slopes = t64(hand_slopes(H, max_bias)).view(1, H, 1, 1)
    m = slopes * t64(mask.astype(np.float16).astype(np.float32)[:T])
    want = F.scaled_dot_product_attention(Q, K, V, attn_mask=m, scale=scale,
                                          enable_gqa=True).numpy()
    np.testing.assert_allclose(got, want[0][None], rtol=1e-5, atol=1e-6)


# -- flash_attn_ext -----------------------------------------------------------------------

def torch_attention(Q, K, V, mask, scale, softcap, gqa):
    """(S, H, T, D) x (S, Hkv, n_kv, D): SDPA when there is no softcap, else explicit."""
    if softcap == 0.0:
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa > 1)
    K = K.repeat_interleave(gqa, dim=1)
    V = V.repeat_interleave(gqa, dim=1)
    s = Q @ K.transpose(-1, -2)
    s = softcap * torch.tanh(s * scale / softcap) + mask
    return torch.softmax(s, dim=-1) @ V


@SLOW_OK
@given(D=st.sampled_from([32, 64]), Dv=st.sampled_from([32, 16]), n_kv=st.integers(2, 8),
       T=st.integers(1, 4), Hkv=st.integers(1, 2), gqa=st.sampled_from([1, 2, 4]),
       S=st.integers(1, 2), kv_type=st.sampled_from([GGMLType.F32, GGMLType.F16,
                                                   GGMLType.Q8_0, GGMLType.Q4_0]),
       max_bias=st.sampled_from([0.0, 8.0]), softcap=st.sampled_from([0.0, 0.0, 20.0, 1.5]),
       mask_heads=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_flash_attn_ext_matches_torch(D, Dv, n_kv, T, Hkv, gqa, S, kv_type, max_bias,
                                      softcap, mask_heads, seed):
    rng = np.random.default_rng(seed)
    T = min(T, n_kv)
    H = Hkv * gqa
    if kv_type.is_quantized:
        Dv = max(Dv, 32)
    scale = 1.0 / math.sqrt(D)
    q = rng.uniform(-1, 1, (S, H, T, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (S, Hkv, n_kv, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (S, Hkv, n_kv, Dv)).astype(np.float32)
    m2 = H if mask_heads else 1
    mask = np.stack([causal_mask(n_kv, T + 1, T, max_bias > 0, rng) - 0.5 * h * (max_bias == 0)
                     for h in range(m2)])[None].astype(np.float16).astype(np.float32)
    ctx = Context()
    qt = ctx.from_numpy(q, name="q")                 # [D, T, H, S]
    kt = ctx.from_numpy(k, kv_type, name="k")       # [D, n_kv, Hkv, S]
    vt = ctx.from_numpy(v, kv_type, name="v")       # [Dv, n_kv, Hkv, S]
    mt = ctx.from_numpy(mask, "f16", name="mask")
    out = ops.flash_attn_ext(qt, kt, vt, mt, scale, max_bias, softcap)
    assert out.ne == (Dv, H, T, S)
    (got,) = compute(out)                            # numpy (S, T, H, Dv)

    slopes = t64(hand_slopes(H, max_bias)).view(1, H, 1, 1)
    m = slopes * t64(mask[:, np.arange(H) % m2, :T, :])
    want = torch_attention(t64(q), t64(stored(k, kv_type)), t64(stored(v, kv_type)), m,
                           scale, softcap, gqa)
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), rtol=1e-5, atol=1e-6)


def test_flash_attn_equals_mul_mat_path():
    """Both attention paths of a GQA layer agree (flash output has heads and tokens swapped)."""
    rng = np.random.default_rng(3)
    D, n_kv, T, Hkv, H = 16, 9, 4, 2, 6
    q = rng.uniform(-1, 1, (H, T, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (Hkv, n_kv, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (Hkv, n_kv, D)).astype(np.float32)
    mask = causal_mask(n_kv, T, T, True, rng)
    ctx = Context()
    qt, kt, vt = ctx.from_numpy(q), ctx.from_numpy(k, "f16"), ctx.from_numpy(v, "f16")
    vT = ops.cont(ops.transpose(vt))
    mt = ctx.from_numpy(mask, "f16")
    fa = ops.flash_attn_ext(qt, kt, vt, mt, 0.25, 4.0, 0.0)
    mm = ops.mul_mat(vT, ops.soft_max_ext(ops.mul_mat(kt, qt), mt, 0.25, 4.0))
    got_fa, got_mm = compute(fa, mm)
    np.testing.assert_allclose(got_fa[0], np.swapaxes(got_mm[0], 0, 1), rtol=1e-6, atol=1e-7)


def test_flash_attn_fully_masked_row_gives_zeros_as_ggml():
    """ggml's flash-attention kernels keep S == 0 for a row with every entry -inf and scale
    by S_inv = 0 (ggml-cpu ops.cpp), so the row is 0, not NaN; other rows are unaffected."""
    rng = np.random.default_rng(19)
    D, n_kv, T, H = 32, 5, 3, 2
    q = rng.uniform(-1, 1, (1, H, T, D)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, H, n_kv, D)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, H, n_kv, D)).astype(np.float32)
    mask = np.zeros((T, n_kv), np.float32)
    mask[1] = -np.inf
    ctx = Context()
    out = ops.flash_attn_ext(ctx.from_numpy(q), ctx.from_numpy(k), ctx.from_numpy(v),
                             ctx.from_numpy(mask, "f16"), 0.3)
    (got,) = compute(out)                                # (1, T, H, D)
    assert np.all(got[0, 1] == 0.0)
    want = F.scaled_dot_product_attention(t64(q), t64(k), t64(v), scale=0.3)
    np.testing.assert_allclose(got[0, [0, 2]], want[0].transpose(0, 1).numpy()[[0, 2]],
                               rtol=1e-5, atol=1e-6)
