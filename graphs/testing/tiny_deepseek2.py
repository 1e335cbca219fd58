"""Small random-weight DeepSeek2 GGUFs with the real keys and tensor names (the `gguf`
writer), for tests and for users who want an MLA + MoE model that loads in milliseconds.

The defaults exercise everything the builder does: the q_lora pair, YaRN with a log
multiplier, one dense leading layer, sigmoid-gated MoE with exp_probs_b, group-limited
routing, normalized and scaled weights and a shared expert. `kv_b` picks the attention
tensor layout: "split" (attn_k_b/attn_v_b with the MLA keys, as today's converter writes),
"legacy" (attn_kv_b with per-head key widths) or "both". The same seed gives the same model
in every layout, so their logits must agree. q_lora_rank 0 writes the Lite form (attn_q);
llama.cpp only reads it as Lite at 26 or 27 layers.

    python -m ggraph.graphs.testing.tiny_deepseek2 out.gguf
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from ggraph.ir.types import GGMLType

from ggraph.graphs.models.tensor_names import TensorNames
from ggraph.graphs.gguf.gguf_writer import GGUFWriter
from ggraph.graphs.testing.tiny import MERGES, add_weight, vocab as _tiny_vocab, write_tokenizer_keys

DEEPSEEK2_TENSORS = TensorNames.of("deepseek2")


@dataclass(frozen=True)
class TinyDeepSeek2:
    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 8
    q_lora_rank: int = 64          # 0: Lite (one attn_q matrix)
    kv_lora_rank: int = 64
    n_nope: int = 32
    n_rot: int = 32
    head_v: int = 32
    n_ff: int = 128                # dense leading layers
    n_layer_dense_lead: int = 1
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 32
    n_expert_groups: int = 4       # 0: no group-limited routing
    n_group_used: int = 2
    gating: int = 2                # 1 softmax, 2 sigmoid
    expert_weights_norm: bool = True
    expert_weights_scale: float = 2.5
    exp_probs_b: bool = True
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    yarn_factor: float = 4.0       # 0: no rope scaling
    yarn_orig_ctx: int = 1024
    yarn_log_mul: float = 0.1      # the GGUF value: 0.1 * mscale_all_dim
    rms_eps: float = 1e-6
    kv_b: str = "split"            # split | legacy | both
    weight_type: str = "f32"       # f32, f16, q8_0, q4_0, q4_1 (rows not a block multiple: f32)
    tied_output: bool = False
    seed: int = 0


def _m(rng: np.random.Generator, ne0: int, *rest: int, scale: float | None = None) -> np.ndarray:
    """A matrix of ggml shape [ne0, *rest] (numpy reversed), entries ~ N(0, 1/ne0)."""
    s = ne0 ** -0.5 if scale is None else scale
    return (rng.standard_normal(tuple(reversed((ne0,) + rest))) * s).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def tiny_deepseek2_tensors(cfg: TinyDeepSeek2) -> dict[str, tuple[np.ndarray, bool]]:
    """name -> (values in numpy order, is a matrix that takes weight_type)."""
    if cfg.kv_b not in ("split", "legacy", "both"):
        raise ValueError(f"kv_b must be split, legacy or both, got {cfg.kv_b!r}")
    rng = np.random.default_rng(cfg.seed)
    e, H, r = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank
    nope, rope, v = cfg.n_nope, cfg.n_rot, cfg.head_v
    hk = nope + rope
    n_vocab = len(_tiny_vocab())
    tn = DEEPSEEK2_TENSORS
    t: dict[str, tuple[np.ndarray, bool]] = {
        tn("token_embd"): (_m(rng, e, n_vocab, scale=0.5), True),
        tn("output_norm"): (_norm(rng, e), False),
    }
    if not cfg.tied_output:
        t[tn("output")] = (_m(rng, e, n_vocab), True)
    for il in range(cfg.n_layer):
        t[tn("attn_norm", il)] = (_norm(rng, e), False)
        if cfg.q_lora_rank:
            t[tn("attn_q_a", il)] = (_m(rng, e, cfg.q_lora_rank), True)
            t[tn("attn_q_a_norm", il)] = (_norm(rng, cfg.q_lora_rank), False)
            t[tn("attn_q_b", il)] = (_m(rng, cfg.q_lora_rank, H * hk), True)
        else:
            t[tn("attn_q", il)] = (_m(rng, e, H * hk), True)
        t[tn("attn_kv_a_mqa", il)] = (_m(rng, e, r + rope), True)
        t[tn("attn_kv_a_norm", il)] = (_norm(rng, r), False)
        kv_b = _m(rng, r, H * (nope + v))                     # numpy (H*(nope+v), r)
        per_head = kv_b.reshape(H, nope + v, r)
        if cfg.kv_b in ("legacy", "both"):
            t[tn("attn_kv_b", il)] = (kv_b, True)
        if cfg.kv_b in ("split", "both"):
            t[tn("attn_k_b", il)] = (np.ascontiguousarray(
                per_head[:, :nope, :].transpose(0, 2, 1)), True)    # ne [nope, r, H]
            t[tn("attn_v_b", il)] = (np.ascontiguousarray(per_head[:, nope:, :]), True)
        t[tn("attn_output", il)] = (_m(rng, H * v, e), True)
        t[tn("ffn_norm", il)] = (_norm(rng, e), False)
        if il < cfg.n_layer_dense_lead:
            t[tn("ffn_gate", il)] = (_m(rng, e, cfg.n_ff), True)
            t[tn("ffn_up", il)] = (_m(rng, e, cfg.n_ff), True)
            t[tn("ffn_down", il)] = (_m(rng, cfg.n_ff, e), True)
            continue
        E, ff = cfg.n_expert, cfg.n_ff_exp
        t[tn("ffn_gate_inp", il)] = (_m(rng, e, E, scale=2 * e ** -0.5), True)
        if cfg.exp_probs_b:
            bias = (0.3 * rng.standard_normal(E)).astype(np.float32)
            t[tn("exp_probs_b", il, "bias")] = (bias, False)
        t[tn("ffn_gate_exps", il)] = (_m(rng, e, ff, E), True)
        t[tn("ffn_up_exps", il)] = (_m(rng, e, ff, E), True)
        t[tn("ffn_down_exps", il)] = (_m(rng, ff, e, E), True)
        if cfg.n_expert_shared:
            sh = ff * cfg.n_expert_shared
            t[tn("ffn_gate_shexp", il)] = (_m(rng, e, sh), True)
            t[tn("ffn_up_shexp", il)] = (_m(rng, e, sh), True)
            t[tn("ffn_down_shexp", il)] = (_m(rng, sh, e), True)
    return t


def write_tiny_deepseek2(path: str | os.PathLike, cfg: TinyDeepSeek2 = TinyDeepSeek2(),
                         skip: tuple[str, ...] = ()) -> str:
    """Write a tiny deepseek2 GGUF (`skip` drops tensors, for bad-input tests)."""
    vocab = _tiny_vocab()
    H, r, rope = cfg.n_head, cfg.kv_lora_rank, cfg.n_rot
    a = "deepseek2"
    w = GGUFWriter(path, a)
    w.add_str("general.name", "tiny-deepseek2")
    w.add_u32(f"{a}.block_count", cfg.n_layer)
    w.add_u32(f"{a}.context_length", cfg.n_ctx_train)
    w.add_u32(f"{a}.embedding_length", cfg.n_embd)
    w.add_u32(f"{a}.feed_forward_length", cfg.n_ff)
    w.add_u32(f"{a}.attention.head_count", H)
    if cfg.kv_b == "legacy":   # per-head widths under the plain keys, no _mla keys
        w.add_u32(f"{a}.attention.head_count_kv", H)
        w.add_u32(f"{a}.attention.key_length", cfg.n_nope + rope)
        w.add_u32(f"{a}.attention.value_length", cfg.head_v)
    else:                      # MLA: compressed widths, one K/V head, per-head widths in _mla
        w.add_u32(f"{a}.attention.head_count_kv", 1)
        w.add_u32(f"{a}.attention.key_length", r + rope)
        w.add_u32(f"{a}.attention.value_length", r)
        w.add_u32(f"{a}.attention.key_length_mla", cfg.n_nope + rope)
        w.add_u32(f"{a}.attention.value_length_mla", cfg.head_v)
    if cfg.q_lora_rank:
        w.add_u32(f"{a}.attention.q_lora_rank", cfg.q_lora_rank)
    w.add_u32(f"{a}.attention.kv_lora_rank", r)
    w.add_f32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_u32(f"{a}.rope.dimension_count", rope)
    w.add_f32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    if cfg.yarn_factor:
        w.add_str(f"{a}.rope.scaling.type", "yarn")
        w.add_f32(f"{a}.rope.scaling.factor", cfg.yarn_factor)
        w.add_u32(f"{a}.rope.scaling.original_context_length", cfg.yarn_orig_ctx)
        if cfg.yarn_log_mul:
            w.add_f32(f"{a}.rope.scaling.yarn_log_multiplier", cfg.yarn_log_mul)
    w.add_u32(f"{a}.leading_dense_block_count", cfg.n_layer_dense_lead)
    w.add_u32(f"{a}.expert_count", cfg.n_expert)
    w.add_u32(f"{a}.expert_used_count", cfg.n_expert_used)
    w.add_u32(f"{a}.expert_shared_count", cfg.n_expert_shared)
    w.add_u32(f"{a}.expert_feed_forward_length", cfg.n_ff_exp)
    w.add_f32(f"{a}.expert_weights_scale", cfg.expert_weights_scale)
    w.add_bool(f"{a}.expert_weights_norm", cfg.expert_weights_norm)
    w.add_u32(f"{a}.expert_gating_func", int(cfg.gating))
    if cfg.n_expert_groups:
        w.add_u32(f"{a}.expert_group_count", cfg.n_expert_groups)
        w.add_u32(f"{a}.expert_group_used_count", cfg.n_group_used)
    w.add_u32(f"{a}.vocab_size", len(vocab))
    # llama.cpp refuses a BPE vocabulary without merges
    write_tokenizer_keys(w, "default", vocab, [3, 3, 3] + [1] * (len(vocab) - 3), MERGES,
                         1, 2, False)
    wt = GGMLType.parse(cfg.weight_type)
    for name, (arr, is_matrix) in tiny_deepseek2_tensors(cfg).items():
        if name in skip:
            continue
        t = wt if is_matrix and arr.shape[-1] % wt.block_size == 0 else GGMLType.F32
        add_weight(w, name, arr, t)
    return w.write()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ggraph.graphs.testing.tiny_deepseek2 OUT.gguf")
    print(write_tiny_deepseek2(sys.argv[1]))
