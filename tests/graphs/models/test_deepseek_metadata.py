"""The metadata-only attention stack of DeepSeek-V3 (MLA, absorbed) at full size.

61 layers, 128 heads, ctx 163840, a 512-token ubatch: the K*Q tensor of one layer alone is
163840*512*128*4 B = 40 GiB. Building the graph must allocate no tensor data (no `.data`, and
the process grows by far less than any big tensor would need) and take seconds.
"""
from __future__ import annotations

import gc
import math
import time

import psutil

from ggraph import Context, GGMLType, Graph, ops
from ggraph.ops import RopeMode

N_LAYER, N_EMBD, N_HEAD = 61, 7168, 128
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 1536, 512, 128, 64, 128
N_CTX, N_TOKENS = 163840, 512
YARN_FACTOR, YARN_ORIG, YARN_LOG_MUL = 40.0, 4096, 1.0
GIB = 1 << 30


def weight(ctx, type, ne, name):
    t = ctx.new_tensor(type, ne, name=name)
    t.buffer = "model"            # pre-allocated elsewhere: never planned, never touched here
    return t


def build_stack(ctx: Context):
    wt = GGMLType.Q8_0
    x = ctx.new_tensor("f32", (N_EMBD, N_TOKENS), name="inp_embd").set_input()
    pos = ctx.new_tensor("i32", (N_TOKENS,), name="inp_pos").set_input()
    mask = ctx.new_tensor("f16", (N_CTX, N_TOKENS), name="kq_mask").set_input()
    kv_idx = ctx.new_tensor("i64", (N_TOKENS,), name="kv_idxs").set_input()

    mscale = 1.0 + 0.1 * YARN_LOG_MUL * math.log(YARN_FACTOR)     # facts page, section 7
    kq_scale = mscale * mscale / math.sqrt(NOPE + ROPE)
    attn_factor = 1.0 / (1.0 + 0.1 * math.log(YARN_FACTOR))   # llama.cpp's deepseek2 setting
    rope_kw = dict(n_dims=ROPE, mode=RopeMode.NORMAL, n_ctx_orig=YARN_ORIG, freq_base=10000.0,
                   freq_scale=1.0 / YARN_FACTOR, ext_factor=1.0, attn_factor=attn_factor,
                   beta_fast=32.0, beta_slow=1.0)
    per_layer = []
    for il in range(N_LAYER):
        attn_norm = weight(ctx, "f32", (N_EMBD,), f"blk.{il}.attn_norm.weight")
        wq_a = weight(ctx, wt, (N_EMBD, Q_LORA), f"blk.{il}.attn_q_a.weight")
        q_a_norm = weight(ctx, "f32", (Q_LORA,), f"blk.{il}.attn_q_a_norm.weight")
        wq_b = weight(ctx, wt, (Q_LORA, N_HEAD * (NOPE + ROPE)), f"blk.{il}.attn_q_b.weight")
        wkv_a = weight(ctx, wt, (N_EMBD, KV_LORA + ROPE), f"blk.{il}.attn_kv_a_mqa.weight")
        kv_a_norm = weight(ctx, "f32", (KV_LORA,), f"blk.{il}.attn_kv_a_norm.weight")
        wk_b = weight(ctx, wt, (NOPE, KV_LORA, N_HEAD), f"blk.{il}.attn_k_b.weight")
        wv_b = weight(ctx, wt, (KV_LORA, V_DIM, N_HEAD), f"blk.{il}.attn_v_b.weight")
        wo = weight(ctx, wt, (N_HEAD * V_DIM, N_EMBD), f"blk.{il}.attn_output.weight")
        k_cache = ctx.new_tensor("f16", (KV_LORA + ROPE, N_CTX), name=f"cache_k_l{il}")
        k_cache.buffer = "kv_cache"

        cur = ops.mul(ops.rms_norm(x, 1e-6), attn_norm, name=f"attn_norm-{il}")
        # queries: low-rank q_a -> norm -> q_b, split into nope and rope parts per head
        q = ops.mul_mat(wq_a, cur, name=f"q_a-{il}")
        q = ops.mul(ops.rms_norm(q, 1e-6), q_a_norm, name=f"q_a_norm-{il}")
        q = ops.mul_mat(wq_b, q, name=f"q-{il}")                           # [24576, T]
        hs = (NOPE + ROPE) * 4
        q_nope = ops.view_3d(q, NOPE, N_HEAD, N_TOKENS, hs, q.nb[1], 0, name=f"q_nope-{il}")
        q_pe = ops.view_3d(q, ROPE, N_HEAD, N_TOKENS, hs, q.nb[1], NOPE * 4, name=f"q_pe-{il}")
        q_pe = ops.rope_ext(q_pe, pos, None, **rope_kw, name=f"q_pe_rope-{il}")
        # the compressed latent and the shared roped key: one 576-value cache row per token
        kv = ops.mul_mat(wkv_a, cur, name=f"kv_a-{il}")                    # [576, T]
        kv_cmpr = ops.view_2d(kv, KV_LORA, N_TOKENS, kv.nb[1], 0, name=f"kv_cmpr-{il}")
        kv_cmpr = ops.mul(ops.rms_norm(kv_cmpr, 1e-6), kv_a_norm, name=f"kv_norm-{il}")
        k_pe = ops.view_3d(kv, ROPE, 1, N_TOKENS, kv.nb[1], kv.nb[1], KV_LORA * 4,
                           name=f"k_pe-{il}")
        k_pe = ops.rope_ext(k_pe, pos, None, **rope_kw, name=f"k_pe_rope-{il}")
        kv_row = ops.concat(kv_cmpr, ops.reshape(k_pe, ROPE, N_TOKENS), 0, name=f"kv_row-{il}")
        k_written = ops.set_rows(k_cache, kv_row, kv_idx, name=f"k_store-{il}")
        # absorbed queries: wk_b per head maps q_nope into the latent space
        q_nope = ops.permute(q_nope, 0, 2, 1, 3)                           # [128, T, H]
        q_abs = ops.mul_mat(wk_b, q_nope, name=f"q_nope_absorbed-{il}")     # [512, T, H]
        q_full = ops.concat(q_abs, ops.permute(q_pe, 0, 2, 1, 3), 0, name=f"q_mla-{il}")
        # MQA over the single cache head, the whole context
        k = ops.view_2d(k_written, KV_LORA + ROPE, N_CTX, k_written.nb[1], 0, name=f"k-{il}")
        kq = ops.mul_mat(k, q_full, name=f"kq-{il}")                        # [n_kv, T, H]
        kq = ops.soft_max_ext(kq, mask, kq_scale, 0.0, name=f"kq_soft_max-{il}")
        v = ops.view_2d(k_written, KV_LORA, N_CTX, k_written.nb[1], 0, name=f"v-{il}")
        v_t = ops.cont(ops.transpose(v), name=f"v_t-{il}")                  # [n_kv, 512]
        kqv = ops.mul_mat(v_t, kq, name=f"kqv_latent-{il}")                 # [512, T, H]
        out = ops.mul_mat(wv_b, kqv, name=f"kqv-{il}")                      # [128, T, H]
        out = ops.cont(ops.permute(out, 0, 2, 1, 3), name=f"kqv_merged-{il}")   # [128, H, T]
        out = ops.reshape(out, N_HEAD * V_DIM, N_TOKENS)
        out = ops.mul_mat(wo, out, name=f"attn_out-{il}")
        x = ops.add(x, out, name=f"l_out-{il}")
        per_layer.append(dict(kq=kq, k_written=k_written, kq_scale=kq_scale))
    return x.set_output(), per_layer


def test_deepseek_v3_attention_stack_is_metadata_only():
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()

    ctx = Context("deepseek-v3")
    out, layers = build_stack(ctx)
    g = Graph(capacity=4096)
    g.build_forward_expand(out)

    elapsed = time.perf_counter() - t0
    gc.collect()
    grown = proc.memory_info().rss - rss0

    # the shapes are the real ones
    kq = layers[0]["kq"]
    assert kq.ne == (N_CTX, N_TOKENS, N_HEAD, 1)
    assert kq.nbytes == N_CTX * N_TOKENS * N_HEAD * 4 == 40 * GIB
    assert out.ne == (N_EMBD, N_TOKENS, 1, 1)
    assert abs(layers[0]["kq_scale"] - 0.13524) < 1e-5
    assert g.get_tensor("cache_k_l60").ne == (576, N_CTX, 1, 1)
    assert g.get_tensor("k_store-0").view_src is g.get_tensor("cache_k_l0")

    # every layer is in the graph, the cache write ordered before the K*Q that reads it
    order = {id(t): i for i, t in enumerate(g.nodes)}
    for il, layer in enumerate(layers):
        assert order[id(layer["k_written"])] < order[id(layer["kq"])], il
    assert g.n_nodes > 30 * N_LAYER and g.n_leafs == 10 * N_LAYER + 4

    # nothing was allocated: no host data anywhere, and the process barely grew
    tensors = g.nodes + g.leafs
    assert all(t.data is None for t in tensors)
    would_need = sum(t.nbytes for t in tensors if not t.is_view)
    assert would_need > 61 * 40 * GIB
    assert grown < 200 * (1 << 20), f"building the graph grew RSS by {grown / 2**20:.1f} MiB"
    assert elapsed < 10.0, f"building the graph took {elapsed:.2f} s"
