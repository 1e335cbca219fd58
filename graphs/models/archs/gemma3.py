"""The gemma3 architecture (Gemma 3 text models), built as llama.cpp builds
`general.architecture = gemma3`, over llama.cpp's iswa KV cache.

Token embeddings scaled by sqrt(n_embd); per layer: rms_norm * attn_norm; Q/K/V projections
with heads of attention.key_length (256 for 270M, not n_embd / n_head); per-head rms_norm *
attn_q_norm / attn_k_norm; rope NEOX with the global base (rope.freq_base, scaled by
rope.scaling.factor) on global layers and the local base (rope.freq_base_swa, 10000 when
absent, unscaled) on sliding-window layers; Q scaled by the attention scale (1/sqrt(key_length);
1/sqrt(n_embd / n_head) for the 62-layer 27B, as llama.cpp decides) and attention with scale 1;
rms_norm * post_attention_norm; residual; rms_norm * ffn_norm; gelu(gate) * up -> down;
rms_norm * post_ffw_norm; residual. Final rms_norm * output_norm and the output matrix, tied
to the token embedding when output.weight is absent, with final_logit_softcapping when the file
sets it (gemma3 files do not).

Which layers slide: attention.sliding_window_pattern (an array of per-layer flags, or a period
n: layer il slides unless il % n == n - 1), else period 6 (layers 5, 11, 17, ... are global).
With a sliding window the cache is an IswaKVCache (graphs/models/kv_iswa.py) and each layer kind
has its own mask (kq_mask, kq_mask_swa); without one (sliding_window 0) a plain KVCache.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from gguf.constants import Keys

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ops.rope import RopeMode
from ggraph.ir.tensor import Context, Tensor

from ggraph.graphs.models.arch import Architecture, KShift, register_arch
from ggraph.graphs.models.attention import AttentionShape, build_attention, split_heads, store_kv
from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel
from ggraph.graphs.models.hparams import key, settle_heads
from ggraph.graphs.models.kv_cache import (UNIFIED, KVCache, StreamRange, check_graph_fits,
                                           check_head_blocks)
from ggraph.graphs.models.kv_iswa import IswaKVCache
from ggraph.graphs.models.lora import lora_get_rows, lora_mm
from ggraph.graphs.models.model_graph import (GraphInputs, IswaInputs, KindInputs, ModelGraph, causal_batch,
                           iswa_batch)
from ggraph.graphs.models.tensor_names import TensorNames, io_weights

NODES_PER_LAYER = 48  # generous bound used to size the graph (split attention adds more)
SWA_PERIOD = 6        # llama.cpp's default pattern for gemma3 (load_swa_pattern(ml, 6))
LAYERS_27B = 62       # llama.cpp scales the 27B's queries by 1/sqrt(n_embd / n_head)


@dataclass(frozen=True)
class Gemma3HParams:
    n_layer: int = key(Keys.LLM.BLOCK_COUNT, lo=1)
    n_embd: int = key(Keys.LLM.EMBEDDING_LENGTH, lo=1)
    n_ctx_train: int = key(Keys.LLM.CONTEXT_LENGTH, lo=1)
    n_ff: int = key(Keys.LLM.FEED_FORWARD_LENGTH, lo=1)
    n_head: int = key(Keys.Attention.HEAD_COUNT, lo=1)
    rms_eps: float = key(Keys.Attention.LAYERNORM_RMS_EPS, lo=0)   # required by llama.cpp
    n_head_kv: int = key(Keys.Attention.HEAD_COUNT_KV, 0, lo=1)
    key_length: int = key(Keys.Attention.KEY_LENGTH, 0, lo=1)
    value_length: int = key(Keys.Attention.VALUE_LENGTH, 0, lo=1)
    n_rot: int = key(Keys.Rope.DIMENSION_COUNT, 0, lo=2)
    rope_freq_base: float = key(Keys.Rope.FREQ_BASE, 10000.0, lo=1e-30)
    rope_freq_base_swa: float = key(Keys.Rope.FREQ_BASE_SWA, 10000.0, lo=1e-30)
    rope_scaling_type: str = key(Keys.Rope.SCALING_TYPE, "linear")
    rope_scaling_factor: float = key(Keys.Rope.SCALING_FACTOR, 0.0, lo=0)
    n_swa: int = key(Keys.Attention.SLIDING_WINDOW, 0, lo=0)
    final_logit_softcapping: float = key(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0, lo=0)
    n_vocab: int = key(Keys.LLM.VOCAB_SIZE, 0, lo=1)
    # per layer: slides (set from attention.sliding_window_pattern by the model)
    is_swa: tuple[bool, ...] = field(default=())

    def __post_init__(self) -> None:
        problems = settle_heads(self)
        if self.rope_scaling_type not in ("none", "linear"):
            problems.append(f"rope.scaling.type {self.rope_scaling_type!r}: ggraph builds "
                            f"gemma3 with none or linear")
        if self.is_swa and len(self.is_swa) != self.n_layer:
            problems.append(f"{len(self.is_swa)} sliding-window flags for {self.n_layer} "
                            f"layers")
        if problems:
            raise GGUFError("gemma3 hyperparameters: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.key_length

    @property
    def n_embd_gqa(self) -> int:
        return self.key_length * self.n_head_kv

    @property
    def freq_scale(self) -> float:
        """The global layers' rope scale; sliding-window layers use 1 (llama.cpp's
        rope_freq_scale_train_swa)."""
        if self.rope_scaling_type == "none" or not self.rope_scaling_factor:
            return 1.0
        return 1.0 / self.rope_scaling_factor

    @property
    def attention_scale(self) -> float:
        """What llama.cpp multiplies the queries by (gemma_pytorch's query_pre_attn_scalar)."""
        width = self.n_embd // self.n_head if self.n_layer == LAYERS_27B else self.key_length
        return float(np.float32(1.0) / np.sqrt(np.float32(width)))


def swa_layers(metadata: dict[str, Any], arch: str, n_layer: int, n_swa: int,
               path: str = "") -> tuple[bool, ...]:
    """Per layer, whether it slides: llama.cpp's load_swa_pattern (an array of flags, or a
    period n where layer il slides unless il % n == n - 1; default 6; period 0: every layer);
    no layer slides without a window."""
    if n_swa <= 0:
        return (False,) * n_layer
    name = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)
    v = metadata.get(name, SWA_PERIOD)
    if isinstance(v, list):
        if len(v) != n_layer or not all(isinstance(x, (bool, int)) for x in v):
            raise GGUFError(f"{path or 'model'}: key {name!r} must hold {n_layer} per-layer "
                            f"flags, got {str(v)[:60]}")
        return tuple(bool(x) for x in v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GGUFError(f"{path or 'model'}: key {name!r} is {v!r}; expected a layer period "
                        f"or per-layer flags")
    return tuple(v == 0 or il % v < v - 1 for il in range(n_layer))


@register_arch("gemma3")
class Gemma3Model(Architecture, KShift):
    hparams_class = Gemma3HParams
    tensors = TensorNames.of("gemma3")

    def __init__(self, gguf: GGUFModel, **overrides: Any) -> None:
        hp = self.load_hparams(gguf, overrides)
        if "is_swa" not in overrides:
            flags = swa_layers(gguf.metadata, gguf.arch, hp.n_layer, hp.n_swa, gguf.path)
            hp = self.hp = replace(hp, is_swa=flags)
        self.hp: Gemma3HParams = hp
        self.w = self._weights()

    @property
    def iswa(self) -> bool:
        return any(self.hp.is_swa)

    # -- weights ------------------------------------------------------------------------------
    def _weights(self) -> dict[str, Any]:
        hp = self.hp
        e, hd = hp.n_embd, hp.head_dim
        w: dict[str, Any] = io_weights(self.gguf, self.tensors, e, hp.n_vocab)
        w["layers"] = [{
            "attn_norm": self.weight("attn_norm", (e,), il),
            "attn_q": self.weight("attn_q", (e, hd * hp.n_head), il),
            "attn_k": self.weight("attn_k", (e, hp.n_embd_gqa), il),
            "attn_v": self.weight("attn_v", (e, hp.n_embd_gqa), il),
            "attn_q_norm": self.weight("attn_q_norm", (hd,), il),
            "attn_k_norm": self.weight("attn_k_norm", (hd,), il),
            "attn_output": self.weight("attn_output", (hd * hp.n_head, e), il),
            "post_attention_norm": self.weight("post_attention_norm", (e,), il),
            "ffn_norm": self.weight("ffn_norm", (e,), il),
            "ffn_gate": self.weight("ffn_gate", (e, hp.n_ff), il),
            "ffn_up": self.weight("ffn_up", (e, hp.n_ff), il),
            "ffn_down": self.weight("ffn_down", (hp.n_ff, e), il),
            "post_ffw_norm": self.weight("post_ffw_norm", (e,), il),
        } for il in range(hp.n_layer)]
        return w

    # -- the cache ------------------------------------------------------------------------------
    def new_cache(self, ctx: Context, size: int, type_k: str = "f16", type_v: str = "f16",
                  flash_attn: bool = False, n_ubatch: int = 512, swa_full: bool = False,
                  n_seq_max: int = 1, unified: bool = True) -> KVCache | IswaKVCache:
        """The iswa cache (a full cache for the global layers, a ring of
        pad256(min(size, n_swa * n_seq_max + n_ubatch)) cells for the sliding ones, or of all
        `size` cells with swa_full), or a single cache when no layer slides; `size` cells
        per stream, and a stream per sequence unless unified."""
        hp = self.hp
        check_head_blocks(hp.head_dim, hp.head_dim, type_k, type_v)
        if not self.iswa:
            return KVCache.create(ctx, hp.n_layer, hp.n_embd_gqa, hp.n_embd_gqa, size, type_k,
                                  type_v, flash_attn, n_seq_max=n_seq_max, unified=unified)
        return IswaKVCache.create(ctx, hp.is_swa, hp.n_embd_gqa, hp.n_embd_gqa, size, hp.n_swa,
                                  n_ubatch, type_k, type_v, flash_attn, swa_full=swa_full,
                                  n_seq_max=n_seq_max, unified=unified)

    def batch_inputs(self, mg: ModelGraph[Any], cache: KVCache | IswaKVCache,
                     tokens: np.ndarray, n_past: int, out_rows: np.ndarray
                     ) -> dict[Tensor, np.ndarray]:
        if isinstance(mg.inputs, IswaInputs):
            assert isinstance(cache, IswaKVCache)
            return iswa_batch(mg, cache, tokens, n_past, out_rows)
        assert isinstance(cache, KVCache)
        return causal_batch(mg, cache, tokens, n_past, out_rows)

    def graph_capacity(self, n_tokens: int, n_kv: int, amb_mib: int) -> int:
        hp = self.hp
        steps = len(split_heads(hp.n_head, hp.n_head_kv, n_kv, n_tokens, amb_mib))
        return max(2048, hp.n_layer * (NODES_PER_LAYER + 10 * (steps - 1)) + 64)

    # -- graph --------------------------------------------------------------------------------
    def build(self, ctx: Context, cache: KVCache | IswaKVCache, n_tokens: int, n_kv: int,
              n_outputs: int, flash_attn: bool = False, amb_mib: int = 0,
              streams: StreamRange = UNIFIED) -> ModelGraph[GraphInputs]:
        """The graph of one ubatch of n_tokens attending to the first n_kv cells of the global
        cache (and the first min(n_kv, ring size) cells of the sliding-window ring), of each
        of `streams` with a cache stream per sequence."""
        hp, w = self.hp, self.w
        check_graph_fits(cache, n_kv, flash_attn)
        hd, gqa = hp.head_dim, hp.n_embd_gqa
        n_v_idx = n_tokens * gqa if cache.v_trans else n_tokens
        inputs: GraphInputs = GraphInputs.create(ctx, n_tokens, n_kv, n_outputs, flash_attn,
                                                 n_v_idx)
        if isinstance(cache, IswaKVCache):
            cache.check_ubatch(n_tokens)
            n_kv_swa = cache.swa_n_kv(n_kv)
            inputs = IswaInputs(**vars(inputs), n_kv_swa=n_kv_swa, swa=KindInputs.create(
                ctx, n_tokens, n_kv_swa, flash_attn, n_v_idx, "_swa"))
        graph = Graph(self.graph_capacity(n_tokens, n_kv, amb_mib))
        cur = lora_get_rows(w["token_embd"], inputs.tokens, self.loras, name="inp_embd")
        cur = O.scale(cur, float(np.sqrt(np.float32(hp.n_embd), dtype=np.float32)),
                      name="inp_scaled")
        for il, L in enumerate(w["layers"]):
            slides = hp.is_swa[il]
            if isinstance(cache, IswaKVCache) and isinstance(inputs, IswaInputs):
                sub, i = cache.part(il)
                att_in = inputs.swa if slides else inputs
                n_kv_l = inputs.n_kv_swa if slides else n_kv
            else:
                sub, i, att_in, n_kv_l = cache, il, inputs, n_kv
            inp_sa = cur
            x = self._norm(cur, L["attn_norm"], f"attn_norm-{il}")
            q = O.reshape(lora_mm(L["attn_q"], x, self.loras, name=f"Qcur-{il}"), hd, hp.n_head,
                          n_tokens)
            k = O.reshape(lora_mm(L["attn_k"], x, self.loras, name=f"Kcur-{il}"), hd,
                          hp.n_head_kv, n_tokens)
            v = lora_mm(L["attn_v"], x, self.loras, name=f"Vcur-{il}")
            rope = self.rope(il)
            q = self._norm(q, L["attn_q_norm"], f"Qcur_normed-{il}")
            q = O.rope_ext(q, inputs.pos, None, name=f"Qcur-{il} (roped)", **rope)
            k = self._norm(k, L["attn_k_norm"], f"Kcur_normed-{il}")
            k = O.rope_ext(k, inputs.pos, None, name=f"Kcur-{il} (roped)", **rope)
            q = O.scale(q, hp.attention_scale, name=f"Qcur_scaled-{il}")
            k_cache, v_cache = store_kv(sub, i, O.reshape(k, gqa, n_tokens), v, att_in.k_idxs,
                                        att_in.v_idxs)
            shape = AttentionShape(hd, hp.n_head, hp.n_head_kv, n_tokens, n_kv_l, streams,
                                   cache.n_stream)
            att = build_attention(q, k_cache, v_cache, att_in.kq_mask, shape=shape,
                                  kq_scale=1.0, flash=flash_attn, amb_mib=amb_mib, il=il,
                                  v_trans=cache.v_trans, graph=graph)
            cur = lora_mm(L["attn_output"], att, self.loras, name=f"attn_out-{il}")
            if il == hp.n_layer - 1:  # only the requested rows go on
                cur = O.get_rows(cur, inputs.out_ids)
                inp_sa = O.get_rows(inp_sa, inputs.out_ids)
            cur = self._norm(cur, L["post_attention_norm"], f"attn_post_norm-{il}")
            sa_out = O.add(cur, inp_sa, name=f"sa_out-{il}")
            x = self._norm(sa_out, L["ffn_norm"], f"ffn_norm-{il}")
            gate = O.gelu(lora_mm(L["ffn_gate"], x, self.loras, name=f"ffn_gate-{il}"),
                          name=f"ffn_gelu-{il}")
            x = O.mul(gate, lora_mm(L["ffn_up"], x, self.loras, name=f"ffn_up-{il}"),
                      name=f"ffn_geglu-{il}")
            x = lora_mm(L["ffn_down"], x, self.loras, name=f"ffn_out-{il}")
            x = self._norm(x, L["post_ffw_norm"], f"ffn_post_norm-{il}")
            cur = O.add(x, sa_out, name=f"l_out-{il}")
        cur = self._norm(cur, w["output_norm"], "result_norm")
        logits = lora_mm(w["output"], cur, self.loras, name="result_output")
        if hp.final_logit_softcapping:
            cap = hp.final_logit_softcapping
            logits = O.scale(O.tanh(O.scale(logits, 1.0 / cap)), cap, name="result_softcap")
        logits.set_output()
        graph.build_forward_expand(logits)
        return ModelGraph(graph, inputs, logits, n_tokens, n_kv, n_outputs)

    def rope(self, il: int) -> dict[str, Any]:
        """rope_ext's settings for layer il: NEOX, the local base and no scaling on
        sliding-window layers, the global base and scale on the others."""
        hp = self.hp
        slides = hp.is_swa[il]
        return dict(n_dims=hp.n_rot, mode=RopeMode.NEOX, n_ctx_orig=hp.n_ctx_train,
                    freq_base=hp.rope_freq_base_swa if slides else hp.rope_freq_base,
                    freq_scale=1.0 if slides else hp.freq_scale)

    def shift_k(self, layer: int, rows: Tensor, pos: Tensor) -> Tensor:
        """Cached K rows of `layer` roped by pos as build ropes that layer's K."""
        hp = self.hp
        k = O.reshape(rows, hp.head_dim, hp.n_head_kv, rows.ne[1])
        k = O.rope_ext(k, pos, None, name=f"k_shift-{layer}", **self.rope(layer))
        return O.reshape(k, hp.n_embd_gqa, rows.ne[1])

    def _norm(self, x: Tensor, weight: Tensor, name: str) -> Tensor:
        """rms_norm of each row (each head for Q/K) times the weight, as build_norm."""
        return O.mul(O.rms_norm(x, self.hp.rms_eps), weight, name=name)
