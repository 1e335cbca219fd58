"""The dense llama-like decoder that llama, qwen2 and qwen3 share: one layer loop, with what
differs between them (rope mode, optional Q/K/V and output biases, per-head Q/K RMS norms)
declared by each architecture's `DenseSpec` rather than tested by name.

Per layer: rms_norm * attn_norm; Q/K/V projections (+ bias where the file has one); per-head
rms_norm * attn_{q,k}_norm (qk_norm); rope; K/V written into the cache with set_rows;
attention (graphs/models/attention.py, split over head groups with amb, or flash_attn_ext); output
projection and residual; rms_norm * ffn_norm, SwiGLU FFN and residual. Only the requested rows
reach the output head (get_rows on out_ids in the last layer); the output matrix is tied to
the token embedding when output.weight is absent.

This module registers nothing: each architecture is its own module of graphs/models/archs/
(llama.py, qwen2.py, qwen3.py) subclassing `DenseDecoder`. `DenseHParams` adds what llama.cpp
reads for every architecture but ggraph's llama keeps out: a head size from
attention.key_length (Qwen3: 128 with n_embd / n_head = 64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from gguf.constants import Keys

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ops.rope import RopeMode
from ggraph.ir.tensor import Context, Tensor

from ggraph.graphs.models.arch import Architecture, KShift
from ggraph.graphs.models.attention import AttentionShape, build_attention, split_heads, store_kv
from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel
from ggraph.graphs.models.hparams import LlamaHParams, key, settle_heads
from ggraph.graphs.models.lora import lora_get_rows, lora_mm
from ggraph.graphs.models.kv_cache import (UNIFIED, KVCache, StreamRange, check_graph_fits,
                                           check_head_blocks)
from ggraph.graphs.models.model_graph import GraphInputs, ModelGraph, causal_batch
from ggraph.graphs.models.moe import build_ffn
from ggraph.graphs.models.tensor_names import io_weights

NODES_PER_LAYER = 40  # generous bound used to size the graph (split attention adds more)
QK_NORM_NODES = 4     # rms_norm and mul for each of Q and K


@dataclass(frozen=True)
class DenseSpec:
    """What a dense decoder architecture adds to llama's layer, as llama.cpp builds it.

    rope_mode: llama_model_rope_type (NORMAL rotates adjacent pairs, NEOX halves).
    qkv_bias: attn_q/k/v biases are read where the file has them (llama.cpp's
      create_tensor_qkv marks them not required); False refuses them (the file's tensors are
      then left unused).
    output_bias: output.bias is read where present (qwen2).
    qk_norm: per-head RMS norms attn_q_norm / attn_k_norm on Q and K before rope (qwen3).
    """
    rope_mode: RopeMode = RopeMode.NORMAL
    qkv_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False


@dataclass(frozen=True)
class DenseHParams(LlamaHParams):
    """Llama's hyperparameters plus the head size llama.cpp reads from attention.key_length /
    value_length (default n_embd / n_head). rope.dimension_count defaults to that head size.
    `full_rope` (architectures whose builder asserts n_rot == head size) refuses others."""
    key_length: int = key(Keys.Attention.KEY_LENGTH, 0, lo=1)
    value_length: int = key(Keys.Attention.VALUE_LENGTH, 0, lo=1)
    full_rope: ClassVar[bool] = False

    def __post_init__(self) -> None:
        problems = settle_heads(self)
        if self.full_rope and self.n_rot != self.head_dim:
            problems.append(f"rope.dimension_count {self.n_rot} must equal the head size "
                            f"{self.head_dim} (llama.cpp asserts it for this architecture)")
        if problems:
            raise GGUFError("; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.key_length


class DenseDecoder(Architecture, KShift):
    """A llama-like decoder; subclasses set hparams_class, tensors and spec, and register."""
    spec: ClassVar[DenseSpec] = DenseSpec()

    def __init__(self, gguf: GGUFModel, **overrides: Any) -> None:
        self.hp: LlamaHParams = self.load_hparams(gguf, overrides)
        self.w = self._weights()

    # -- weights ------------------------------------------------------------------------------
    def _weights(self) -> dict[str, Any]:
        hp, spec = self.hp, self.spec
        e, hd = hp.n_embd, hp.head_dim
        nq, nkv = hd * hp.n_head, hp.n_embd_gqa
        w: dict[str, Any] = io_weights(self.gguf, self.tensors, e, hp.n_vocab)
        w["output_b"] = self.optional_weight("output", (hp.n_vocab,), suffix="bias") \
            if spec.output_bias else None
        layers = []
        for il in range(hp.n_layer):
            L = {
                "attn_norm": self.weight("attn_norm", (e,), il),
                "attn_q": self.weight("attn_q", (e, nq), il),
                "attn_k": self.weight("attn_k", (e, nkv), il),
                "attn_v": self.weight("attn_v", (e, nkv), il),
                "attn_output": self.weight("attn_output", (nq, e), il),
                "ffn_norm": self.weight("ffn_norm", (e,), il),
                "ffn_gate": self.weight("ffn_gate", (e, hp.n_ff), il),
                "ffn_up": self.weight("ffn_up", (e, hp.n_ff), il),
                "ffn_down": self.weight("ffn_down", (hp.n_ff, e), il),
            }
            for name, width in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
                L[name + "_b"] = self.optional_weight(name, (width,), il, suffix="bias") \
                    if spec.qkv_bias else None
            if spec.qk_norm:
                L["attn_q_norm"] = self.weight("attn_q_norm", (hd,), il)
                L["attn_k_norm"] = self.weight("attn_k_norm", (hd,), il)
            layers.append(L)
        w["layers"] = layers
        return w

    def batch_inputs(self, mg: ModelGraph[GraphInputs], cache: KVCache, tokens: np.ndarray,
                     n_past: int, out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
        """Input values for tokens at positions n_past.. written into cells n_past.."""
        return causal_batch(mg, cache, tokens, n_past, out_rows)

    def new_cache(self, ctx: Context, size: int, type_k: str = "f16", type_v: str = "f16",
                  flash_attn: bool = False, n_ubatch: int = 512,
                  swa_full: bool = False, n_seq_max: int = 1, unified: bool = True) -> KVCache:
        check_head_blocks(self.hp.head_dim, self.hp.head_dim, type_k, type_v)
        return KVCache.create(ctx, self.hp.n_layer, self.hp.n_embd_gqa, self.hp.n_embd_gqa,
                              size, type_k, type_v, flash_attn, n_seq_max=n_seq_max,
                              unified=unified)

    def rope(self) -> dict[str, Any]:
        """rope_ext's settings for Q and K (every layer's)."""
        hp = self.hp
        return dict(n_dims=hp.n_rot, mode=self.spec.rope_mode, n_ctx_orig=hp.n_ctx_train,
                    freq_base=hp.rope_freq_base, freq_scale=hp.freq_scale)

    def shift_k(self, layer: int, rows: Tensor, pos: Tensor) -> Tensor:
        """Cached K rows roped by pos as build ropes K."""
        hp = self.hp
        k = O.reshape(rows, hp.head_dim, hp.n_head_kv, rows.ne[1])
        k = O.rope_ext(k, pos, None, name=f"k_shift-{layer}", **self.rope())
        return O.reshape(k, hp.n_embd_gqa, rows.ne[1])

    def graph_capacity(self, n_tokens: int, n_kv: int, amb_mib: int) -> int:
        hp = self.hp
        steps = len(split_heads(hp.n_head, hp.n_head_kv, n_kv, n_tokens, amb_mib))
        per_layer = NODES_PER_LAYER + (QK_NORM_NODES if self.spec.qk_norm else 0)
        # ik_llama.cpp's rule: 10 nodes per extra attention step per layer
        return max(2048, hp.n_layer * (per_layer + 10 * (steps - 1)) + 64)

    # -- graph --------------------------------------------------------------------------------
    def _project(self, L: dict[str, Any], x: Tensor, name: str, il: int) -> Tensor:
        """x times the layer's `name` matrix (node `{Qcur,Kcur,Vcur}-{il}`), plus its bias
        where the file has one (node `..._b-{il}`)."""
        label = {"attn_q": "Qcur", "attn_k": "Kcur", "attn_v": "Vcur"}[name]
        cur = lora_mm(L[name], x, self.loras, name=f"{label}-{il}")
        bias = L.get(name + "_b")
        return cur if bias is None else O.add(cur, bias, name=f"{label}_b-{il}")

    def _head_norm(self, t: Tensor, weight: Tensor | None, label: str, il: int) -> Tensor:
        """Each head's rms_norm times the per-head weight (qk_norm), before rope."""
        if weight is None:
            return t
        return O.mul(O.rms_norm(t, self.hp.rms_eps, name=f"norm-{il}"), weight,
                     name=f"{label}_normed-{il}")

    def build(self, ctx: Context, cache: KVCache, n_tokens: int, n_kv: int, n_outputs: int,
              flash_attn: bool = False, amb_mib: int = 0,
              streams: StreamRange = UNIFIED) -> ModelGraph[GraphInputs]:
        """The graph of one ubatch of n_tokens attending to the first n_kv cache cells (of
        each of `streams`, with a cache stream per sequence)."""
        hp, w = self.hp, self.w
        check_graph_fits(cache, n_kv, flash_attn)
        hd = hp.head_dim
        n_v_idx = n_tokens * hp.n_embd_gqa if cache.v_trans else n_tokens
        inputs = GraphInputs.create(ctx, n_tokens, n_kv, n_outputs, flash_attn, n_v_idx)
        pos, kq_mask, k_idxs, v_idxs, out_ids = (inputs.pos, inputs.kq_mask, inputs.k_idxs,
                                                 inputs.v_idxs, inputs.out_ids)
        shape = AttentionShape(hd, hp.n_head, hp.n_head_kv, n_tokens, n_kv, streams,
                               cache.n_stream)
        kq_scale = 1.0 / float(np.sqrt(hd))
        rope = self.rope()

        graph = Graph(self.graph_capacity(n_tokens, n_kv, amb_mib))
        cur = lora_get_rows(w["token_embd"], inputs.tokens, self.loras, name="inp_embd")
        for il, L in enumerate(w["layers"]):
            inp_sa = cur
            x = O.mul(O.rms_norm(cur, hp.rms_eps, name=f"norm-{il}"), L["attn_norm"],
                      name=f"attn_norm-{il}")
            q = O.reshape(self._project(L, x, "attn_q", il), hd, hp.n_head, n_tokens)
            k = O.reshape(self._project(L, x, "attn_k", il), hd, hp.n_head_kv, n_tokens)
            v = self._project(L, x, "attn_v", il)
            q = self._head_norm(q, L.get("attn_q_norm"), "Qcur", il)
            k = self._head_norm(k, L.get("attn_k_norm"), "Kcur", il)
            q = O.rope_ext(q, pos, None, name=f"Qcur-{il} (roped)", **rope)
            k = O.rope_ext(k, pos, None, name=f"Kcur-{il} (roped)", **rope)
            k_store, v_cache = store_kv(cache, il, O.reshape(k, hp.n_embd_gqa, n_tokens), v,
                                        k_idxs, v_idxs)
            att = build_attention(q, k_store, v_cache, kq_mask, shape=shape, kq_scale=kq_scale,
                                  flash=flash_attn, amb_mib=amb_mib, il=il,
                                  v_trans=cache.v_trans, graph=graph)
            cur = lora_mm(L["attn_output"], att, self.loras, name=f"attn_out-{il}")
            if il == hp.n_layer - 1:  # only the requested rows go on
                cur = O.get_rows(cur, out_ids)
                inp_sa = O.get_rows(inp_sa, out_ids)
            ffn_inp = O.add(cur, inp_sa, name=f"ffn_inp-{il}")
            x = O.mul(O.rms_norm(ffn_inp, hp.rms_eps, name=f"norm-{il}"), L["ffn_norm"],
                      name=f"ffn_norm-{il}")
            x = build_ffn(x, L["ffn_up"], L["ffn_gate"], L["ffn_down"], il, loras=self.loras)
            cur = O.add(x, ffn_inp, name=f"l_out-{il}")
        cur = O.mul(O.rms_norm(cur, hp.rms_eps, name="norm"), w["output_norm"],
                    name="result_norm")
        logits = lora_mm(w["output"], cur, self.loras, name="result_output")
        if w["output_b"] is not None:
            logits = O.add(logits, w["output_b"], name="result_output_b")
        logits.set_output()
        graph.build_forward_expand(logits)
        return ModelGraph(graph, inputs, logits, n_tokens, n_kv, n_outputs)
