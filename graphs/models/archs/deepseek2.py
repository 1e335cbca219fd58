"""The deepseek2 architecture (DeepSeek-V2/V2-Lite/V3/R1), built as llama.cpp builds it.

Per layer: rms_norm * attn_norm; queries through the low-rank pair attn_q_a -> rms_norm ->
attn_q_b (or one attn_q on Lite), split per head into a non-rotary part and a roped part;
attn_kv_a_mqa gives the compressed latent (normalized with attn_kv_a_norm) and one shared key
part (roped); both go into the K-only MLA cache as one row (graphs/models/mla.py); attention by one of
the MLA paths, iterating over head groups within `amb`; attn_output and the residual; then
rms_norm * ffn_norm and a dense SwiGLU FFN (the first `leading_dense_block_count` layers) or
the MoE with its shared expert (graphs/models/moe.py), and the residual. YaRN rope (mode NORMAL) and
the attention scale follow llama.cpp's mscale rules (DeepSeek2HParams). The split attention
joins its head groups with graphs/models/attention.py's HeadJoin, as llama's does.

Both GGUF layouts load: MLA files carry attn_k_b/attn_v_b (wkv_b is rebuilt from them when
the decompress path needs it), legacy files carry attn_kv_b (split into wk_b/wv_b at load).
Weights without data (planning) get metadata-only derived tensors. The model declares the
MLAPlanner capability (graphs/models/arch.py): `ggraph plan` builds it over presets' and GGUF headers'
metadata-only weights (graphs/deploy/presets.py), from `weight_shapes`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ggraph.codecs import buffers
from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ops.rope import RopeMode
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.models.arch import Architecture, MLAPlanner, register_arch
from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel
from ggraph.graphs.models.hparams import DeepSeek2HParams
from ggraph.graphs.models.kv_cache import (MIB, UNIFIED, KVCache, StreamRange, cache_type,
                                           n_streams)
from ggraph.graphs.models.mla import (
    DECOMPRESS_MIN_TOKENS,
    PATHS,
    MLAShape,
    MLAWeights,
    build_mla_attention,
    choose_path,
    decompress_supported,
    path_groups,
)
from ggraph.graphs.models.model_graph import GraphInputs, ModelGraph, causal_batch
from ggraph.graphs.models.lora import lora_get_rows, lora_mm
from ggraph.graphs.models.moe import MoEConfig, build_ffn, build_moe_ffn
from ggraph.graphs.models.tensor_names import TensorNames, io_weights

# node counts used to size the graph (checked against real graphs by the tests): per layer
# without the attention groups, and per attention group
NODES_LAYER_BASE = 48
NODES_MOE = 40
NODES_PER_GROUP = 14
NODES_FIXED = 32


class MLACache(KVCache):
    """The K-only MLA cache: per layer [kv_lora + n_rot, size] of the K cache type; V is a view
    of each row's latent part, so there is no V buffer (and -ctv does not apply)."""

    @classmethod
    def create_mla(cls, ctx: Context, n_layer: int, row: int, size: int,
                   type_k: GGMLType | str = "f16", flash_attn: bool = False,
                   n_seq_max: int = 1, unified: bool = True) -> MLACache:
        tk = cache_type("K", type_k)
        if row % tk.block_size:
            raise ValueError(f"MLA cache rows of {row} values (kv_lora_rank + n_rot) do not fit "
                             f"{tk} blocks of {tk.block_size}")
        if tk.is_quantized and not flash_attn:
            raise ValueError(f"a quantized MLA cache ({tk}) needs flash attention (--fa): "
                             f"without it the latent is read transposed, one value per row, "
                             f"which blocks of 32 values cannot give")
        ns = n_streams(n_seq_max, unified)
        c = cls(size, n_layer, tk, tk, v_trans=False, n_seq_max=n_seq_max, n_stream=ns)
        for il in range(n_layer):
            k = ctx.new_tensor(tk, (row, size * ns), name=f"cache_k_l{il}")
            k.buffer = "kv_cache"
            c.k.append(k)
        return c

    def summary(self) -> str:
        return (f"llama_kv_cache: size = {self.nbytes / MIB:7.2f} MiB ({self.size:6d} cells, "
                f"{self.n_layer:3d} layers, {self.seqs_word()} seqs), K ({self.type_k}): "
                f"{self.bytes_k / MIB:7.2f} MiB, V: none (MLA: a view of K's latent part)")


def mla_cache_bytes(n_layer: int, row: int, size: int, type_k: GGMLType | str) -> int:
    """row_size(type, kv_lora + n_rot) * size per layer."""
    t = GGMLType.parse(type_k)
    return n_layer * size * (t.type_size * row // t.block_size)


@register_arch("deepseek2")
class DeepSeek2Model(Architecture, MLAPlanner):
    hparams_class = DeepSeek2HParams
    tensors = TensorNames.of("deepseek2")
    # flash attention decompresses K/V per head group for ubatches of at least this many tokens
    decompress_min_tokens = DECOMPRESS_MIN_TOKENS

    def __init__(self, gguf: GGUFModel, **overrides: Any) -> None:
        self.hp: DeepSeek2HParams = self.load_hparams(gguf, overrides)
        self.path = gguf.path
        self._derived_ctx = Context(f"{gguf.path} (derived)")
        self.w = self._weights()

    # -- weights ----------------------------------------------------------------------------
    def _weights(self) -> dict[str, Any]:
        hp = self.hp
        e, H = hp.n_embd, hp.n_head
        w: dict[str, Any] = io_weights(self.gguf, self.tensors, e, hp.n_vocab)
        layers = []
        for il in range(hp.n_layer):
            L: dict[str, Any] = {
                "attn_norm": self.weight("attn_norm", (e,), il),
                "attn_kv_a_mqa": self.weight("attn_kv_a_mqa", (e, hp.mla_row), il),
                "attn_kv_a_norm": self.weight("attn_kv_a_norm", (hp.kv_lora_rank,), il),
                "attn_output": self.weight("attn_output", (H * hp.head_v, e), il),
                "ffn_norm": self.weight("ffn_norm", (e,), il),
            }
            if hp.q_lora_rank:
                L["attn_q_a"] = self.weight("attn_q_a", (e, hp.q_lora_rank), il)
                L["attn_q_a_norm"] = self.weight("attn_q_a_norm", (hp.q_lora_rank,), il)
                L["attn_q_b"] = self.weight("attn_q_b", (hp.q_lora_rank, H * hp.head_k), il)
            else:
                L["attn_q"] = self.weight("attn_q", (e, H * hp.head_k), il)
            k_b = self.optional_weight("attn_k_b", (hp.n_nope, hp.kv_lora_rank, H), il)
            v_b = self.optional_weight("attn_v_b", (hp.kv_lora_rank, hp.head_v, H), il)
            kv_b = self.optional_weight("attn_kv_b", (hp.kv_lora_rank,
                                                      H * (hp.n_nope + hp.head_v)), il)
            if (k_b is None or v_b is None) and kv_b is None:
                raise GGUFError(f"{self.path}: layer {il} has neither "
                                f"{self.tensors('attn_kv_b', il)!r} nor both "
                                f"{self.tensors('attn_k_b', il)!r} and "
                                f"{self.tensors('attn_v_b', il)!r}")
            L["mla"] = MLAWeights(k_b, v_b, kv_b)
            if il < hp.n_layer_dense_lead:
                for n in ("ffn_gate", "ffn_up"):
                    L[n] = self.weight(n, (e, hp.n_ff), il)
                L["ffn_down"] = self.weight("ffn_down", (hp.n_ff, e), il)
            else:
                E, ff = hp.n_expert, hp.n_ff_exp
                L["ffn_gate_inp"] = self.weight("ffn_gate_inp", (e, E), il)
                L["exp_probs_b"] = self.optional_weight("exp_probs_b", (E,), il, "bias")
                for n in ("ffn_gate_exps", "ffn_up_exps"):
                    L[n] = self.weight(n, (e, ff, E), il)
                L["ffn_down_exps"] = self.weight("ffn_down_exps", (ff, e, E), il)
                if hp.n_expert_shared:
                    sh = ff * hp.n_expert_shared
                    for n in ("ffn_gate_shexp", "ffn_up_shexp"):
                        L[n] = self.weight(n, (e, sh), il)
                    L["ffn_down_shexp"] = self.weight("ffn_down_shexp", (sh, e), il)
            layers.append(L)
        w["layers"] = layers
        return w

    def mla_weights(self, il: int, path: str) -> MLAWeights:
        """The layer's MLA weights for `path`, splitting attn_kv_b or rebuilding it from
        attn_k_b/attn_v_b the first time a path needs the missing form."""
        m: MLAWeights = self.w["layers"][il]["mla"]
        if path == "decompress-fa" and m.wkv_b is None:
            m.wkv_b = self._rebuild_kv_b(il, m.wk_b, m.wv_b)
        if path != "decompress-fa" and (m.wk_b is None or m.wv_b is None):
            m.wk_b, m.wv_b = self._split_kv_b(il, m.wkv_b)
        return m

    def _derived(self, name: str, like: Tensor, ne: tuple[int, ...],
                 values: np.ndarray | None) -> Tensor:
        # keep the source type where its blocks still fit the new rows, else f16
        t_type = like.type if ne[0] % like.type.block_size == 0 else GGMLType.F16
        t = self._derived_ctx.new_tensor(t_type, ne, name=name)
        if values is not None:
            t.set_data(values)
        t.buffer = "model"  # pre-allocated like every weight (metadata-only when planning)
        return t

    def _split_kv_b(self, il: int, kv_b: Tensor) -> tuple[Tensor, Tensor]:
        hp = self.hp
        H, nope, v, r = hp.n_head, hp.n_nope, hp.head_v, hp.kv_lora_rank
        k_vals = v_vals = None
        if kv_b.data is not None:
            W = buffers.read(kv_b.data, 0, kv_b).reshape(H, nope + v, r)   # rows per head
            k_vals = np.ascontiguousarray(W[:, :nope, :].transpose(0, 2, 1))  # (H, r, nope)
            v_vals = np.ascontiguousarray(W[:, nope:, :])                     # (H, v, r)
        return (self._derived(self.tensors("attn_k_b", il), kv_b, (nope, r, H), k_vals),
                self._derived(self.tensors("attn_v_b", il), kv_b, (r, v, H), v_vals))

    def _rebuild_kv_b(self, il: int, k_b: Tensor, v_b: Tensor) -> Tensor:
        hp = self.hp
        H, nope, v, r = hp.n_head, hp.n_nope, hp.head_v, hp.kv_lora_rank
        vals = None
        if k_b.data is not None and v_b.data is not None:
            K = buffers.read(k_b.data, 0, k_b).reshape(H, r, nope).transpose(0, 2, 1)
            V = buffers.read(v_b.data, 0, v_b).reshape(H, v, r)
            vals = np.concatenate([K, V], axis=1).reshape(H * (nope + v), r)
        return self._derived(self.tensors("attn_kv_b", il), v_b, (r, H * (nope + v)), vals)

    # -- cache, shapes, paths ------------------------------------------------------------------
    def new_cache(self, ctx: Context, size: int, type_k: str = "f16", type_v: str = "f16",
                  flash_attn: bool = False, n_ubatch: int = 512,
                  swa_full: bool = False, n_seq_max: int = 1, unified: bool = True
                  ) -> MLACache:
        """type_v, n_ubatch and swa_full are accepted for the engine's signature and ignored:
        MLA has no V cache, and its cache does not slide."""
        return MLACache.create_mla(ctx, self.hp.n_layer, self.hp.mla_row, size, type_k,
                                   flash_attn, n_seq_max, unified)

    def mla_shape(self, n_tokens: int, n_kv: int) -> MLAShape:
        hp = self.hp
        return MLAShape(hp.n_head, hp.kv_lora_rank, hp.n_rot, hp.n_nope, hp.head_v, n_tokens,
                        n_kv)

    def attention_path(self, n_tokens: int, n_kv: int, flash: bool,
                       cache_type: GGMLType | str = GGMLType.F16) -> str:
        return choose_path(flash, n_tokens, GGMLType.parse(cache_type),
                           self.mla_shape(n_tokens, n_kv), self.decompress_min_tokens)

    def cache_bytes(self, size: int, type_k: GGMLType | str) -> int:
        return mla_cache_bytes(self.hp.n_layer, self.hp.mla_row, size, type_k)

    @classmethod
    def weight_shapes(cls, hp: DeepSeek2HParams, kv_b: str = "split",
                      tied_output: bool = False) -> dict[str, tuple[int, ...]]:
        """Every weight's name and ne, as the converter writes them (kv_b: split or legacy)."""
        e, H, r = hp.n_embd, hp.n_head, hp.kv_lora_rank
        tn = cls.tensors
        out: dict[str, tuple[int, ...]] = {tn("token_embd"): (e, hp.n_vocab),
                                           tn("output_norm"): (e,)}
        if not tied_output:
            out[tn("output")] = (e, hp.n_vocab)
        for il in range(hp.n_layer):
            def put(logical: str, *ne: int, il: int = il, suffix: str = "weight") -> None:
                out[tn(logical, il, suffix)] = ne
            put("attn_norm", e)
            if hp.q_lora_rank:
                put("attn_q_a", e, hp.q_lora_rank)
                put("attn_q_a_norm", hp.q_lora_rank)
                put("attn_q_b", hp.q_lora_rank, H * hp.head_k)
            else:
                put("attn_q", e, H * hp.head_k)
            put("attn_kv_a_mqa", e, hp.mla_row)
            put("attn_kv_a_norm", r)
            if kv_b == "legacy":
                put("attn_kv_b", r, H * (hp.n_nope + hp.head_v))
            else:
                put("attn_k_b", hp.n_nope, r, H)
                put("attn_v_b", r, hp.head_v, H)
            put("attn_output", H * hp.head_v, e)
            put("ffn_norm", e)
            if il < hp.n_layer_dense_lead:
                put("ffn_gate", e, hp.n_ff)
                put("ffn_up", e, hp.n_ff)
                put("ffn_down", hp.n_ff, e)
                continue
            put("ffn_gate_inp", e, hp.n_expert)
            put("exp_probs_b", hp.n_expert, suffix="bias")
            put("ffn_gate_exps", e, hp.n_ff_exp, hp.n_expert)
            put("ffn_up_exps", e, hp.n_ff_exp, hp.n_expert)
            put("ffn_down_exps", hp.n_ff_exp, e, hp.n_expert)
            if hp.n_expert_shared:
                sh = hp.n_ff_exp * hp.n_expert_shared
                put("ffn_gate_shexp", e, sh)
                put("ffn_up_shexp", e, sh)
                put("ffn_down_shexp", sh, e)
        return out

    def graph_capacity(self, n_tokens: int, n_kv: int, amb_mib: int, flash: bool = False,
                       cache_type: GGMLType | str = GGMLType.F16, path: str | None = None) -> int:
        """Nodes per layer plus nodes per attention group: the budget grows with the
        iterations over heads (ik_llama.cpp grows it by 10 per extra step and layer)."""
        hp = self.hp
        path = path or self.attention_path(n_tokens, n_kv, flash, cache_type)
        groups = len(path_groups(path, self.mla_shape(n_tokens, n_kv), amb_mib,
                                 GGMLType.parse(cache_type)))
        n_moe = hp.n_layer - min(hp.n_layer, hp.n_layer_dense_lead)
        return max(2048, NODES_FIXED + hp.n_layer * (NODES_LAYER_BASE + NODES_PER_GROUP * groups)
                   + n_moe * NODES_MOE)

    # -- graph --------------------------------------------------------------------------------
    def build(self, ctx: Context, cache: KVCache, n_tokens: int, n_kv: int, n_outputs: int,
              flash_attn: bool = False, amb_mib: int = 0, streams: StreamRange = UNIFIED,
              path: str | None = None, capacity: int | None = None
              ) -> ModelGraph[GraphInputs]:
        """The graph of one ubatch of n_tokens attending to the first n_kv cache cells.

        path: force an MLA path (see graphs/models/mla.py; default: chosen by flash_attn and the
        ubatch size). capacity: the graph's node budget (default: graph_capacity); a graph
        that outgrows it raises GraphCapacityError naming the capacity."""
        hp, w = self.hp, self.w
        if n_kv > cache.size:
            raise ValueError(f"n_kv={n_kv} exceeds the KV cache size {cache.size}")
        if not 0 < n_outputs <= n_tokens:
            raise ValueError(f"n_outputs={n_outputs} must be in 1..n_tokens={n_tokens}")
        if cache.k[0].ne[0] != hp.mla_row:
            raise ValueError(f"the cache rows hold {cache.k[0].ne[0]} values, this model's MLA "
                             f"rows {hp.mla_row}: create the cache with model.new_cache")
        if path is None:
            path = self.attention_path(n_tokens, n_kv, flash_attn, cache.type_k)
            if path == "decompress-fa" and streams != UNIFIED:   # (a unified stream only)
                path = "absorbed-fa"
        if path not in PATHS:
            raise ValueError(f"unknown MLA path {path!r}; expected one of {', '.join(PATHS)}")
        flash = path != "absorbed"
        shape = replace(self.mla_shape(n_tokens, n_kv), streams=streams,
                        cache_streams=cache.n_stream)
        if path == "decompress-fa":
            why = decompress_supported(cache.type_k, shape)
            if why:
                raise ValueError(f"the decompress-fa path cannot run: {why}")
        H, nope, rope = hp.n_head, hp.n_nope, hp.n_rot

        inputs = GraphInputs.create(ctx, n_tokens, n_kv, n_outputs, flash)   # no V cache
        pos, kq_mask, k_idxs, out_ids = inputs.pos, inputs.kq_mask, inputs.k_idxs, inputs.out_ids
        rope_kw: dict[str, Any] = {
            "n_dims": rope, "mode": RopeMode.NORMAL, "n_ctx_orig": hp.yarn_orig_ctx,
            "freq_base": hp.rope_freq_base, "freq_scale": hp.freq_scale,
            "ext_factor": hp.ext_factor, "attn_factor": hp.rope_attn_factor_arg,
            "beta_fast": hp.yarn_beta_fast, "beta_slow": hp.yarn_beta_slow}
        moe = MoEConfig(hp.n_expert, hp.n_expert_used, hp.expert_gating_func,
                        hp.expert_weights_norm, hp.expert_weights_scale, hp.n_expert_groups,
                        hp.n_group_used)
        graph = Graph(capacity or self.graph_capacity(n_tokens, n_kv, amb_mib,
                                                      cache_type=cache.type_k, path=path))
        eps = hp.rms_eps

        lo = self.loras
        cur = lora_get_rows(w["token_embd"], inputs.tokens, lo, name="inp_embd")
        for il, L in enumerate(w["layers"]):
            inp_sa = cur
            x = O.mul(O.rms_norm(cur, eps, name=f"norm-{il}"), L["attn_norm"],
                      name=f"attn_norm-{il}")
            if hp.q_lora_rank:
                q = lora_mm(L["attn_q_a"], x, lo, name=f"q_a-{il}")
                q = O.mul(O.rms_norm(q, eps, name=f"q_a_rms-{il}"), L["attn_q_a_norm"],
                          name=f"q_a_norm-{il}")
                q = lora_mm(L["attn_q_b"], q, lo, name=f"q-{il}")
            else:
                q = lora_mm(L["attn_q"], x, lo, name=f"q-{il}")         # [H*head_k, T]
            hk = hp.head_k * 4
            q_nope = O.view_3d(q, nope, H, n_tokens, hk, hk * H, 0, name=f"q_nope-{il}")
            q_pe = O.view_3d(q, rope, H, n_tokens, hk, hk * H, nope * 4, name=f"q_pe-{il}")
            q_pe = O.rope_ext(q_pe, pos, None, name=f"q_pe_rope-{il}", **rope_kw)
            kv = lora_mm(L["attn_kv_a_mqa"], x, lo, name=f"kv_cmpr_pe-{il}")  # [row, T]
            kv_cmpr = O.view_2d(kv, hp.kv_lora_rank, n_tokens, kv.nb[1], 0,
                                name=f"kv_cmpr-{il}")
            k_pe = O.view_3d(kv, rope, 1, n_tokens, kv.nb[1], kv.nb[1], hp.kv_lora_rank * 4,
                             name=f"k_pe-{il}")
            k_pe = O.rope_ext(k_pe, pos, None, name=f"k_pe_rope-{il}", **rope_kw)
            kv_cmpr = O.mul(O.rms_norm(kv_cmpr, eps, name=f"kv_cmpr_rms-{il}"),
                            L["attn_kv_a_norm"], name=f"kv_cmpr_norm-{il}")
            # one cache row per token: [latent | roped shared key]
            row = O.concat(kv_cmpr, O.reshape(k_pe, rope, n_tokens), 0, name=f"Kcur-{il}")
            k_store = O.set_rows(cache.k[il], row, k_idxs, name=f"k_store-{il}")
            att = build_mla_attention(q_nope, q_pe, k_store, kq_mask, shape=shape,
                                      w=self.mla_weights(il, path), kq_scale=hp.kq_scale,
                                      path=path, amb_mib=amb_mib, il=il, graph=graph)
            cur = lora_mm(L["attn_output"], att, lo, name=f"attn_out-{il}")
            if il == hp.n_layer - 1:  # only the requested rows go on
                cur = O.get_rows(cur, out_ids)
                inp_sa = O.get_rows(inp_sa, out_ids)
            ffn_inp = O.add(cur, inp_sa, name=f"ffn_inp-{il}")
            x = O.mul(O.rms_norm(ffn_inp, eps, name=f"ffn_rms-{il}"), L["ffn_norm"],
                      name=f"ffn_norm-{il}")
            if il < hp.n_layer_dense_lead:
                ff = build_ffn(x, L["ffn_up"], L["ffn_gate"], L["ffn_down"], il, loras=lo)
            else:
                ff = build_moe_ffn(x, L["ffn_gate_inp"], L["ffn_up_exps"], L["ffn_gate_exps"],
                                   L["ffn_down_exps"], L["exp_probs_b"], moe, il, graph,
                                   loras=lo)
                if hp.n_expert_shared:
                    sh = build_ffn(x, L["ffn_up_shexp"], L["ffn_gate_shexp"],
                                   L["ffn_down_shexp"], il, "_shexp", loras=lo)
                    ff = O.add(ff, sh, name=f"ffn_out-{il}")
            cur = O.add(ff, ffn_inp, name=f"l_out-{il}")
            graph.build_forward_expand(cur)
        cur = O.mul(O.rms_norm(cur, eps, name="norm"), w["output_norm"], name="result_norm")
        logits = lora_mm(w["output"], cur, lo, name="result_output").set_output()
        graph.build_forward_expand(logits)
        return ModelGraph(graph, inputs, logits, n_tokens, n_kv, n_outputs, path)

    def batch_inputs(self, mg: ModelGraph[GraphInputs], cache: KVCache, tokens: np.ndarray,
                     n_past: int, out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
        """Input values for tokens at positions n_past.. written into cells n_past.."""
        return causal_batch(mg, cache, tokens, n_past, out_rows)
