"""Tiny random-weight Gemma 3 GGUFs (`general.architecture = gemma3`) with the real keys and
tensor names, for tests: small enough to load in milliseconds, shaped to exercise what Gemma 3
adds (a head size from attention.key_length unlike n_embd / n_head, GQA, per-head Q/K norms,
sliding-window layers with a window shorter than a test prompt, a global layer every sixth).

The vocabulary is SentencePiece-style (`tokenizer.ggml.model` "llama", as Gemma's): control
tokens <pad> <eos> <bos>, <unk>, the 256 byte-fallback tokens <0x00>..<0xFF>, then a few
pieces with scores, which llama.cpp loads. Weights are F32 unless `weight_type` says otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ggraph.ir.types import GGMLType

from ggraph.graphs.models.tensor_names import TensorNames
from ggraph.graphs.gguf.gguf_reader import ValueType
from ggraph.graphs.gguf.gguf_writer import GGUFWriter
from ggraph.graphs.testing.tiny import add_weight, write_size_keys

GEMMA3_TENSORS = TensorNames.of("gemma3")
PIECES = ["▁", "▁the", "▁a", "▁of", "▁and", "ing", "ed", "s", "e", "t", "▁to", "▁in"]
# token types (llama.cpp's llama_token_attr values in GGUF): normal, unknown, control, byte
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class TinyGemma3:
    n_layer: int = 7            # layers 0-4 and 6 slide, layer 5 is global
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32          # attention.key_length: not n_embd / n_head (16)
    n_ff: int = 96
    n_swa: int = 16             # attention.sliding_window
    n_ctx_train: int = 2048
    rope_freq_base: float = 1_000_000.0
    rope_freq_base_swa: float | None = None   # written when set (llama.cpp: 10000 if absent)
    swa_pattern: int | list[bool] | None = None  # written when set (llama.cpp: 6 if absent)
    final_logit_softcapping: float | None = None
    rms_eps: float = 1e-6
    weight_type: str = "f32"
    tied_output: bool = True
    seed: int = 0


def vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SentencePiece vocabulary."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN] + [BYTE] * 256 + [NORMAL] * len(PIECES)
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(PIECES))]
    return tokens, scores, types


def _norm_weight(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _matrix(rng: np.random.Generator, ne0: int, ne1: int, scale: float) -> np.ndarray:
    return (rng.standard_normal((ne1, ne0)) * scale).astype(np.float32)


def write_tiny_gguf(path: str | os.PathLike, **hparams: Any) -> str:
    """Write a tiny Gemma 3 GGUF; keyword arguments override TinyGemma3's fields."""
    known = {f.name for f in fields(TinyGemma3)}
    if unknown := sorted(set(hparams) - known):
        raise TypeError(f"write_tiny_gguf: unknown hyperparameters {unknown}; known: "
                        f"{sorted(known)}")
    cfg = TinyGemma3(**hparams)
    rng = np.random.default_rng(cfg.seed)
    tokens, scores, types = vocab()
    w = GGUFWriter(path, "gemma3")
    a = "gemma3"
    write_size_keys(w, "tiny-gemma3", cfg.n_layer, cfg.n_ctx_train, cfg.n_embd, cfg.n_ff,
                    cfg.n_head, cfg.n_head_kv)
    w.add_u32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_u32(f"{a}.attention.value_length", cfg.head_dim)
    w.add_f32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    w.add_f32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_u32(f"{a}.attention.sliding_window", cfg.n_swa)
    if cfg.rope_freq_base_swa is not None:
        w.add_f32(f"{a}.rope.freq_base_swa", cfg.rope_freq_base_swa)
    if isinstance(cfg.swa_pattern, int):
        w.add_u32(f"{a}.attention.sliding_window_pattern", cfg.swa_pattern)
    elif cfg.swa_pattern is not None:
        w.add_array(f"{a}.attention.sliding_window_pattern", list(cfg.swa_pattern),
                    ValueType.BOOL)
    if cfg.final_logit_softcapping is not None:
        w.add_f32(f"{a}.final_logit_softcapping", cfg.final_logit_softcapping)
    w.add_str("tokenizer.ggml.model", "llama")
    w.add_str("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens, ValueType.STRING)
    w.add_array("tokenizer.ggml.scores", scores, ValueType.FLOAT32)
    w.add_array("tokenizer.ggml.token_type", types, ValueType.INT32)
    w.add_u32("tokenizer.ggml.padding_token_id", 0)
    w.add_u32("tokenizer.ggml.eos_token_id", 1)
    w.add_u32("tokenizer.ggml.bos_token_id", 2)
    w.add_u32("tokenizer.ggml.unknown_token_id", 3)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    e, hd, n_v = cfg.n_embd, cfg.head_dim, len(tokens)
    q, kv = hd * cfg.n_head, hd * cfg.n_head_kv
    tn = GEMMA3_TENSORS
    tensors: dict[str, tuple[np.ndarray, bool]] = {
        tn("token_embd"): (_matrix(rng, e, n_v, 1.0), True),
        tn("output_norm"): (_norm_weight(rng, e), False),
    }
    if not cfg.tied_output:
        tensors[tn("output")] = (_matrix(rng, e, n_v, e ** -0.5), True)
    for il in range(cfg.n_layer):
        tensors.update({
            tn("attn_norm", il): (_norm_weight(rng, e), False),
            tn("attn_q", il): (_matrix(rng, e, q, e ** -0.5), True),
            tn("attn_k", il): (_matrix(rng, e, kv, e ** -0.5), True),
            tn("attn_v", il): (_matrix(rng, e, kv, e ** -0.5), True),
            tn("attn_q_norm", il): (_norm_weight(rng, hd), False),
            tn("attn_k_norm", il): (_norm_weight(rng, hd), False),
            tn("attn_output", il): (_matrix(rng, q, e, q ** -0.5), True),
            tn("post_attention_norm", il): (_norm_weight(rng, e), False),
            tn("ffn_norm", il): (_norm_weight(rng, e), False),
            tn("ffn_gate", il): (_matrix(rng, e, cfg.n_ff, e ** -0.5), True),
            tn("ffn_up", il): (_matrix(rng, e, cfg.n_ff, e ** -0.5), True),
            tn("ffn_down", il): (_matrix(rng, cfg.n_ff, e, cfg.n_ff ** -0.5), True),
            tn("post_ffw_norm", il): (_norm_weight(rng, e), False),
        })
    wt = GGMLType.parse(cfg.weight_type)
    for name, (arr, is_matrix) in tensors.items():
        add_weight(w, name, arr, wt if is_matrix else GGMLType.F32)
    return w.write()
