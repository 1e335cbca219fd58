"""The llama architecture (GQA), built as llama.cpp builds `general.architecture = llama`.

Per layer: rms_norm * attn_norm, Q/K/V projections, rope (NORMAL), K/V written into the cache
with set_rows, attention (mul_mat + soft_max_ext + mul_mat, or flash_attn_ext; split over head
groups with amb), output projection and residual, rms_norm * ffn_norm, SwiGLU FFN and residual.
Only the requested rows reach the output head (get_rows on out_ids in the last layer); the
output matrix is tied to the token embedding when output.weight is absent. An Architecture
(graphs/arch.py) found by the registry as this module of graphs/archs/; its tensors are
gguf-py's llama table (graphs/tensor_names.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ggraph import ops as O
from ggraph.graph import Graph
from ggraph.ops.rope import RopeMode
from ggraph.tensor import Context, Tensor

from ..arch import Architecture, register_arch
from ..attention import AttentionShape, build_attention, split_heads
from ..gguf_file import GGUFModel
from ..hparams import LlamaHParams
from ..kv_cache import KVCache
from ..model_graph import GraphInputs, ModelGraph, causal_batch
from ..moe import build_ffn
from ..tensor_names import TensorNames, io_weights

NODES_PER_LAYER = 40  # generous bound used to size the graph (split attention adds more)


@register_arch("llama")
class LlamaModel(Architecture):
    hparams_class = LlamaHParams
    tensors = TensorNames.of("llama")

    def __init__(self, gguf: GGUFModel, **overrides: Any) -> None:
        self.hp: LlamaHParams = self.load_hparams(gguf, overrides)
        self.w = self._weights()

    # -- weights ------------------------------------------------------------------------------
    def _weights(self) -> dict[str, Any]:
        hp = self.hp
        e, hd = hp.n_embd, hp.head_dim
        w: dict[str, Any] = io_weights(self.gguf, self.tensors, e, hp.n_vocab)
        layers = []
        for il in range(hp.n_layer):
            layers.append({
                "attn_norm": self.weight("attn_norm", (e,), il),
                "attn_q": self.weight("attn_q", (e, hd * hp.n_head), il),
                "attn_k": self.weight("attn_k", (e, hp.n_embd_gqa), il),
                "attn_v": self.weight("attn_v", (e, hp.n_embd_gqa), il),
                "attn_output": self.weight("attn_output", (hd * hp.n_head, e), il),
                "ffn_norm": self.weight("ffn_norm", (e,), il),
                "ffn_gate": self.weight("ffn_gate", (e, hp.n_ff), il),
                "ffn_up": self.weight("ffn_up", (e, hp.n_ff), il),
                "ffn_down": self.weight("ffn_down", (hp.n_ff, e), il),
            })
        w["layers"] = layers
        return w

    def batch_inputs(self, mg: ModelGraph[GraphInputs], cache: KVCache, tokens: np.ndarray,
                     n_past: int, out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
        """Input values for tokens at positions n_past.. written into cells n_past.."""
        return causal_batch(mg, cache, tokens, n_past, out_rows)

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
              flash_attn: bool = False, amb_mib: int = 0) -> ModelGraph[GraphInputs]:
        """The graph of one ubatch of n_tokens attending to the first n_kv cache cells."""
        hp, w = self.hp, self.w
        if n_kv > cache.size:
            raise ValueError(f"n_kv={n_kv} exceeds the KV cache size {cache.size}")
        if flash_attn == cache.v_trans:
            raise ValueError("the KV cache layout does not match the attention path: create the "
                             "cache with the same flash_attn setting")
        hd = hp.head_dim
        n_v_idx = n_tokens * hp.n_embd_gqa if cache.v_trans else n_tokens
        inputs = GraphInputs.create(ctx, n_tokens, n_kv, n_outputs, flash_attn, n_v_idx)
        pos, kq_mask, k_idxs, v_idxs, out_ids = (inputs.pos, inputs.kq_mask, inputs.k_idxs,
                                                 inputs.v_idxs, inputs.out_ids)
        shape = AttentionShape(hd, hp.n_head, hp.n_head_kv, n_tokens, n_kv)
        kq_scale = 1.0 / float(np.sqrt(hd))
        rope = dict(n_dims=hp.n_rot, mode=RopeMode.NORMAL, n_ctx_orig=hp.n_ctx_train,
                    freq_base=hp.rope_freq_base, freq_scale=hp.freq_scale)

        graph = Graph(self.graph_capacity(n_tokens, n_kv, amb_mib))
        cur = O.get_rows(w["token_embd"], inputs.tokens, name="inp_embd")
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

