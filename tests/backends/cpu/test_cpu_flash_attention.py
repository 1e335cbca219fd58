"""The CPU's flash_attn_ext kernels against the reference executor where their work splits:
decode's runs of cells (backends/cpu/attn_decode.py: several runs, a run wholly masked, a
query that sees nothing, GQA heads sharing K/V rows, per-head masks, ALiBi, softcap) and a
prompt's query blocks (backends/cpu/attention.py: causal and sliding-window masks whose blocks
skip cells, heads together or apart)."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends import get_backend
from ggraph.backends.cpu import attn_bind
from ggraph.check.reference import run_reference


def _case(nt: int, n_kv: int, nh: int, nkv_h: int, mask_heads: int, visible, dk: int = 64,
          seed: int = 0, **kw):
    ctx = Context()
    q = ctx.new_tensor("f32", (dk, nt, nh), name="q").set_input()
    k = ctx.new_tensor("f16", (dk, n_kv, nkv_h), name="k").set_input()
    v = ctx.new_tensor("f16", (dk, n_kv, nkv_h), name="v").set_input()
    m = ctx.new_tensor("f16", (n_kv, nt, mask_heads), name="mask").set_input()
    out = ops.flash_attn_ext(q, k, v, m, scale=dk ** -0.5, **kw).set_output()
    g = build_graph(out)
    rng = np.random.default_rng(seed)
    inputs = {t: rng.uniform(-1, 1, t.shape).astype(np.float32) for t in (q, k, v)}
    mm = np.full((mask_heads, nt, n_kv), -np.inf, np.float32)
    for h in range(mask_heads):
        for t in range(nt):
            mm[h, t, visible(h, t)] = 0.0
    inputs[m] = mm.reshape(m.shape)
    want = run_reference(g, inputs).read(out)
    got = get_backend("cpu", n_threads=2).session().run(g, inputs).read(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=3e-3, rtol=3e-3)
    return got


@pytest.mark.parametrize("nh,nkv_h", [(6, 1), (4, 4), (4, 2)])
def test_decode_runs_of_cells(nh, nkv_h):
    n_kv = 3 * attn_bind.DECODE_CELLS + 37
    # query 0 sees a middle stretch (the first run wholly masked), query 1 everything but the
    # last cells, query 2 nothing (its output is zeros)
    spans = [slice(attn_bind.DECODE_CELLS + 5, n_kv - 9), slice(0, n_kv - 3), slice(0, 0)]
    got = _case(3, n_kv, nh, nkv_h, 1, lambda h, t: spans[t])
    assert np.all(got.reshape(3, nh, 64)[2] == 0.0)   # (T, H, Dv): query 2 sees nothing


@pytest.mark.parametrize("n_kv", [attn_bind.DECODE_CELLS - 21, 2 * attn_bind.DECODE_CELLS + 3])
def test_decode_cells_hidden_inside(n_kv):
    """Cells hidden from some rows, from every row (skipped: one in three), and at both ends
    (dropped), as sequences interleaved in one cache leave them; one run of cells, whose rows
    are written directly, and several, combined after."""
    _case(2, n_kv, 6, 2, 1, lambda h, t: np.arange(5 + t, n_kv - 4, 3))
    _case(2, n_kv, 4, 4, 4, lambda h, t: np.arange(5 + (t + h) % 2, n_kv - 4 - h, 3),
          max_bias=8.0)


def test_decode_per_head_masks_alibi_softcap():
    n_kv = 2 * attn_bind.DECODE_CELLS + 11
    _case(1, n_kv, 4, 2, 4, lambda h, t: slice(17 * h, n_kv - h), max_bias=8.0, softcap=30.0)


@pytest.mark.parametrize("together", [True, False])
def test_prompt_blocks_skip_hidden_cells(together):
    nt, n_kv = 150, 300   # three query blocks, the first cells already in the cache
    past = n_kv - nt
    window = 40
    causal = (lambda h, t: slice(0, past + t + 1)) if together else \
        (lambda h, t: slice(max(0, past + t + 1 - window - 7 * h), past + t + 1))
    _case(nt, n_kv, 4, 2, 1 if together else 4, causal,
          **({} if together else {"max_bias": 4.0}))


def _causal_rows(nt: int, start: int, n_kv: int, q_all: np.ndarray, kv: np.ndarray
                 ) -> np.ndarray:
    """Decode attention of queries start..start+nt-1 over a causal cache (SmolLM2's heads:
    9 query heads on 3 K/V heads of 64)."""
    nh, nkvh, dk = 9, 3, 64
    ctx = Context()
    q = ctx.new_tensor("f32", (dk, nt, nh), name="q").set_input()
    k = ctx.new_tensor("f16", (dk, n_kv, nkvh), name="k").set_input()
    v = ctx.new_tensor("f16", (dk, n_kv, nkvh), name="v").set_input()
    m = ctx.new_tensor("f16", (n_kv, nt, 1), name="mask").set_input()
    out = ops.flash_attn_ext(q, k, v, m, scale=dk ** -0.5).set_output()
    mm = np.full((1, nt, n_kv), -np.inf, np.float32)
    for t in range(nt):
        mm[0, t, :start + t + 1] = 0.0
    inputs = {q: q_all[:, start:start + nt].copy(), k: kv[0], v: kv[1], m: mm}
    got = get_backend("cpu", n_threads=2).session().run(build_graph(out), inputs).read(out)
    return got.reshape(nt, nh, dk)


@pytest.mark.parametrize("start", [6, 11, 40, attn_bind.DECODE_CELLS - 3])
def test_decode_rows_do_not_depend_on_their_batch(start):
    """A query's output is the same, bit for bit, alone or with the queries after it (whose
    rows keep more cells in the unit): speculative decoding checks a draft in one batch and
    its greedy output must be the model's own. Before the softmax sum ran in fixed lanes it
    differed by ~1e-7 from 5 queries on, and a greedy text changed."""
    n_kv = 2 * attn_bind.DECODE_CELLS
    rng = np.random.default_rng(start)
    q_all = rng.uniform(-1, 1, (9, start + 8, 64)).astype(np.float32)
    kv = rng.uniform(-1, 1, (2, 3, n_kv, 64)).astype(np.float32)
    for nt in (2, 5, 7):
        batch = _causal_rows(nt, start, n_kv, q_all, kv)
        alone = np.stack([_causal_rows(1, start + t, n_kv, q_all, kv)[0] for t in range(nt)])
        assert np.array_equal(batch, alone), f"{nt} queries from {start}"


def test_sequences_decoding_together_take_the_per_row_kernel(monkeypatch):
    """A batched decode step: 12 sequences, one query each (at least BLOCK_MIN_QUERIES), each
    seeing its own prompt stretch and its own generated cells, interleaved after the prompts
    as a shared cache leaves them. The mask is sparse, so the per-row kernel runs it (not the
    query blocks, whose products would span every sequence's cells): the reference's output,
    and each row what its query gets alone up to float rounding (bit for bit only among rows
    that share their first cells, one sequence's tokens: test above; here the unit's cells
    start at the first sequence's, so the sums group another row's cells differently)."""
    n_seq, n_prompt, n_gen, nh, nkvh, dk = 12, 40, 9, 6, 2, 64
    assert n_seq >= attn_bind.BLOCK_MIN_QUERIES
    n_kv = n_seq * (n_prompt + n_gen)

    def own(s: int) -> np.ndarray:
        gen = n_seq * n_prompt + np.arange(n_gen) * n_seq + s
        return np.concatenate((np.arange(s * n_prompt, (s + 1) * n_prompt), gen))

    seen = []
    monkeypatch.setattr(attn_bind, "flash_attn_blocks", lambda *a: seen.append("blocks"))
    got = _case(n_seq, n_kv, nh, nkvh, 1, lambda h, t: own(t))
    assert not seen                       # the query blocks never ran
    rng = np.random.default_rng(0)        # _case's inputs, to run each query alone
    q_all = rng.uniform(-1, 1, (nh, n_seq, dk)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (nkvh, n_kv, dk)).astype(np.float32) for _ in range(2))
    for s in (0, 5, n_seq - 1):
        ctx = Context()
        q1 = ctx.new_tensor("f32", (dk, 1, nh), name="q").set_input()
        k1 = ctx.new_tensor("f16", (dk, n_kv, nkvh), name="k").set_input()
        v1 = ctx.new_tensor("f16", (dk, n_kv, nkvh), name="v").set_input()
        m1 = ctx.new_tensor("f16", (n_kv, 1, 1), name="mask").set_input()
        out = ops.flash_attn_ext(q1, k1, v1, m1, scale=dk ** -0.5).set_output()
        mm = np.full((1, 1, n_kv), -np.inf, np.float32)
        mm[0, 0, own(s)] = 0.0
        alone = get_backend("cpu", n_threads=2).session().run(
            build_graph(out), {q1: q_all[:, s:s + 1].copy(), k1: k, v1: v, m1: mm}).read(out)
        np.testing.assert_allclose(got.reshape(n_seq, nh, dk)[s], alone.reshape(nh, dk),
                                   rtol=1e-5, atol=1e-6, err_msg=str(s))
