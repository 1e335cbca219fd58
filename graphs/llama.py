"""The llama architecture (GQA), built as llama.cpp builds `general.architecture = llama`.

Per layer: rms_norm * attn_norm, Q/K/V projections, rope (NORMAL), K/V written into the cache
with set_rows, attention (mul_mat + soft_max_ext + mul_mat, or flash_attn_ext; split over head
groups with amb), output projection and residual, rms_norm * ffn_norm, SwiGLU FFN and residual.
Only the requested rows reach the output head (get_rows on out_ids in the last layer); the
output matrix is tied to the token embedding when output.weight is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggraph import ops as O
from ggraph.graph import Graph
from ggraph.ops.rope import RopeMode
from ggraph.tensor import Context, Tensor
from ggraph.types import GGMLType

from .arch import expect_tensor, io_weights, register_arch, vocab_size
from .attention import AttentionShape, build_attention, split_heads
from .gguf_file import GGUFModel
from .hparams import LlamaHParams, read_hparams
from .kv_cache import KVCache
from .moe import build_ffn

NODES_PER_LAYER = 40  # generous bound used to size the graph (split attention adds more)


@dataclass
class GraphInputs:
    tokens: Tensor
    pos: Tensor
    kq_mask: Tensor
    k_idxs: Tensor
    v_idxs: Tensor
    out_ids: Tensor


@dataclass
class ModelGraph:
    graph: Graph
    inputs: GraphInputs
    logits: Tensor
    n_tokens: int
    n_kv: int
    n_outputs: int


@register_arch("llama")
class LlamaModel:
    hparams_class = LlamaHParams

    def __init__(self, gguf: GGUFModel, **overrides: object) -> None:
        self.gguf = gguf
        self.hp: LlamaHParams = read_hparams(LlamaHParams, gguf.metadata, gguf.arch, gguf.path,
                                             **overrides)
        hp = self.hp
        if hp.n_vocab == 0:
            object.__setattr__(hp, "n_vocab", vocab_size(gguf))
        self.w = self._weights()

    # -- weights ------------------------------------------------------------------------------
    def _expect(self, logical: str, ne: tuple[int, ...], il: int | None = None) -> Tensor:
        return expect_tensor(self.gguf, logical, ne, il)

    def _weights(self) -> dict[str, object]:
        hp = self.hp
        e, hd = hp.n_embd, hp.head_dim
        w: dict[str, object] = io_weights(self.gguf, e, hp.n_vocab)
        layers = []
        for il in range(hp.n_layer):
            layers.append({
                "attn_norm": self._expect("attn_norm", (e,), il),
                "attn_q": self._expect("attn_q", (e, hd * hp.n_head), il),
                "attn_k": self._expect("attn_k", (e, hp.n_embd_gqa), il),
                "attn_v": self._expect("attn_v", (e, hp.n_embd_gqa), il),
                "attn_output": self._expect("attn_output", (hd * hp.n_head, e), il),
                "ffn_norm": self._expect("ffn_norm", (e,), il),
                "ffn_gate": self._expect("ffn_gate", (e, hp.n_ff), il),
                "ffn_up": self._expect("ffn_up", (e, hp.n_ff), il),
                "ffn_down": self._expect("ffn_down", (hp.n_ff, e), il),
            })
        w["layers"] = layers
        return w

    def batch_inputs(self, mg: ModelGraph, cache: KVCache, tokens: np.ndarray, n_past: int,
                     out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
        return batch_inputs(mg, cache, tokens, n_past, out_rows)

    def new_cache(self, ctx: Context, size: int, type_k: str = "f16", type_v: str = "f16",
                  flash_attn: bool = False) -> KVCache:
        return KVCache.create(ctx, self.hp.n_layer, self.hp.n_embd_gqa, self.hp.n_embd_gqa,
                              size, type_k, type_v, flash_attn)

    def graph_capacity(self, n_tokens: int, n_kv: int, amb_mib: int) -> int:
        hp = self.hp
        steps = len(split_heads(hp.n_head, hp.n_head_kv, n_kv, n_tokens, amb_mib))
        # ik_llama.cpp's rule: 10 nodes per extra attention step per layer
        return max(2048, hp.n_layer * (NODES_PER_LAYER + 10 * (steps - 1)) + 64)

    # -- graph --------------------------------------------------------------------------------
    def build(self, ctx: Context, cache: KVCache, n_tokens: int, n_kv: int, n_outputs: int,
              flash_attn: bool = False, amb_mib: int = 0) -> ModelGraph:
        """The graph of one ubatch of n_tokens attending to the first n_kv cache cells."""
        hp, w = self.hp, self.w
        if n_kv > cache.size:
            raise ValueError(f"n_kv={n_kv} exceeds the KV cache size {cache.size}")
        if flash_attn == cache.v_trans:
            raise ValueError("the KV cache layout does not match the attention path: create the "
                             "cache with the same flash_attn setting")
        hd = hp.head_dim
        tokens = ctx.new_tensor(GGMLType.I32, (n_tokens,), "inp_tokens").set_input()
        pos = ctx.new_tensor(GGMLType.I32, (n_tokens,), "inp_pos").set_input()
        mask_type = GGMLType.F16 if flash_attn else GGMLType.F32
        kq_mask = ctx.new_tensor(mask_type, (n_kv, n_tokens), "kq_mask").set_input()
        k_idxs = ctx.new_tensor(GGMLType.I64, (n_tokens,), "k_idxs").set_input()
        n_v_idx = n_tokens * hp.n_embd_gqa if cache.v_trans else n_tokens
        v_idxs = ctx.new_tensor(GGMLType.I64, (n_v_idx,), "v_idxs").set_input()
        out_ids = ctx.new_tensor(GGMLType.I32, (n_outputs,), "inp_out_ids").set_input()
        inputs = GraphInputs(tokens, pos, kq_mask, k_idxs, v_idxs, out_ids)
        shape = AttentionShape(hd, hp.n_head, hp.n_head_kv, n_tokens, n_kv)
        kq_scale = 1.0 / float(np.sqrt(hd))
        rope = dict(n_dims=hp.n_rot, mode=RopeMode.NORMAL, n_ctx_orig=hp.n_ctx_train,
                    freq_base=hp.rope_freq_base, freq_scale=hp.freq_scale)

        graph = Graph(self.graph_capacity(n_tokens, n_kv, amb_mib))
        cur = O.get_rows(w["tok_embd"], tokens, name="inp_embd")
        for il, L in enumerate(w["layers"]):
            inp_sa = cur
            x = O.mul(O.rms_norm(cur, hp.rms_eps, name=f"norm-{il}"), L["attn_norm"],
                      name=f"attn_norm-{il}")
            q = O.reshape(O.mul_mat(L["attn_q"], x, name=f"Qcur-{il}"), hd, hp.n_head, n_tokens)
            k = O.reshape(O.mul_mat(L["attn_k"], x, name=f"Kcur-{il}"), hd, hp.n_head_kv,
                          n_tokens)
            v = O.mul_mat(L["attn_v"], x, name=f"Vcur-{il}")
            q = O.rope_ext(q, pos, None, name=f"Qcur-{il} (roped)", **rope)
            k = O.rope_ext(k, pos, None, name=f"Kcur-{il} (roped)", **rope)
            k_store = O.set_rows(cache.k[il], O.reshape(k, hp.n_embd_gqa, n_tokens), k_idxs)
            if cache.v_trans:  # every value is its own row of the transposed V cache
                v_view = O.reshape(cache.v[il], 1, cache.size * hp.n_embd_gqa)
                v_store = O.set_rows(v_view, O.reshape(v, 1, n_tokens * hp.n_embd_gqa), v_idxs)
            else:
                v_store = O.set_rows(cache.v[il], v, v_idxs)
            # attention reads the caches through the stores (views of the cache), so every
            # order the allocator may choose writes the new K/V before reading them
            v_cache = v_store if not cache.v_trans else O.view_2d(
                v_store, cache.v[il].ne[0], cache.v[il].ne[1], cache.v[il].nb[1], 0)
            att = build_attention(q, k_store, v_cache, kq_mask, shape=shape, kq_scale=kq_scale,
                                  flash=flash_attn, amb_mib=amb_mib, il=il,
                                  v_trans=cache.v_trans, graph=graph)
            cur = O.mul_mat(L["attn_output"], att, name=f"attn_out-{il}")
            if il == hp.n_layer - 1:  # only the requested rows go on
                cur = O.get_rows(cur, out_ids)
                inp_sa = O.get_rows(inp_sa, out_ids)
            ffn_inp = O.add(cur, inp_sa, name=f"ffn_inp-{il}")
            x = O.mul(O.rms_norm(ffn_inp, hp.rms_eps, name=f"norm-{il}"), L["ffn_norm"],
                      name=f"ffn_norm-{il}")
            x = build_ffn(x, L["ffn_up"], L["ffn_gate"], L["ffn_down"], il)
            cur = O.add(x, ffn_inp, name=f"l_out-{il}")
        cur = O.mul(O.rms_norm(cur, hp.rms_eps, name="norm"), w["output_norm"],
                    name="result_norm")
        logits = O.mul_mat(w["output"], cur, name="result_output").set_output()
        graph.build_forward_expand(logits)
        return ModelGraph(graph, inputs, logits, n_tokens, n_kv, n_outputs)


def causal_inputs(mg: ModelGraph, n: int, n_past: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions n_past.. and the causal mask over the graph's n_kv cells for n new tokens of
    one sequence (every architecture with a single-sequence KV cache uses these)."""
    if n != mg.n_tokens:
        raise ValueError(f"the graph was built for {mg.n_tokens} tokens, got {n}")
    if n_past + n > mg.n_kv:
        raise ValueError(f"{n_past + n} tokens do not fit the graph's n_kv={mg.n_kv}")
    pos = np.arange(n_past, n_past + n, dtype=np.int32)
    mask = np.full((n, mg.n_kv), -np.inf, np.float32)
    for i in range(n):
        mask[i, : n_past + i + 1] = 0.0
    return pos, mask


def batch_inputs(mg: ModelGraph, cache: KVCache, tokens: np.ndarray, n_past: int,
                 out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
    """Input values for tokens at positions n_past.. written into cells n_past.."""
    pos, mask = causal_inputs(mg, len(tokens), n_past)
    cells = pos.astype(np.int64)
    inp = mg.inputs
    if cache.v_trans:
        n_embd_v = cache.v[0].ne[1]
        v_idx = (np.arange(n_embd_v, dtype=np.int64)[None, :] * cache.size + cells[:, None])
    else:
        v_idx = cells
    return {inp.tokens: np.asarray(tokens, np.int32), inp.pos: pos, inp.kq_mask: mask,
            inp.k_idxs: cells, inp.v_idxs: v_idx.reshape(-1),
            inp.out_ids: np.asarray(out_rows, np.int32)}
