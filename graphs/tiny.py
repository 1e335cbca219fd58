"""Small random-weight GGUF models with the real keys and tensor names, for tests and users
who want a model that loads in milliseconds. Written with the `gguf` package's writer.

The vocabulary is byte-level BPE: GPT-2's byte alphabet plus the tokens of a few merges
(llama.cpp refuses a BPE vocabulary without merges), so the tokenizer loads exactly as for a
real model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggraph import quants
from ggraph.types import GGMLType

from .tensor_names import TensorNames

LLAMA_TENSORS = TensorNames.of("llama")


@dataclass(frozen=True)
class TinyLlama:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    weight_type: str = "f32"      # f32, f16, q8_0, q4_0, q4_1 for the matrices
    tied_output: bool = True
    seed: int = 0


MERGES = ["t h"]


def vocab() -> list[str]:
    """Control tokens, GPT-2's byte-level alphabet, then the tokens that MERGES make."""
    return _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]


def _byte_alphabet() -> list[str]:
    # the byte-level alphabet of GPT-2 (printable bytes map to themselves, others shifted)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in cs]


def _matrix(rng: np.random.Generator, ne0: int, ne1: int, scale: float) -> np.ndarray:
    return (rng.standard_normal((ne1, ne0)) * scale).astype(np.float32)


def write_tiny_llama(path: str | os.PathLike, cfg: TinyLlama = TinyLlama(),
                     skip: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None,
                     arch: str = "llama") -> str:
    """Write a tiny llama GGUF. `skip` drops tensors and `reshape` changes their shapes
    (for bad-input tests); `arch` writes another architecture name."""
    import gguf

    rng = np.random.default_rng(cfg.seed)
    tokens = vocab()
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    hd = cfg.n_embd // cfg.n_head
    e, kv = cfg.n_embd, hd * cfg.n_head_kv
    tn = LLAMA_TENSORS
    tensors: dict[str, tuple[np.ndarray, bool]] = {
        tn("token_embd"): (_matrix(rng, e, len(tokens), 0.5), True),
        tn("output_norm"): ((1 + 0.1 * rng.standard_normal(e)).astype(np.float32), False),
    }
    if not cfg.tied_output:
        tensors[tn("output")] = (_matrix(rng, e, len(tokens), e ** -0.5), True)
    for il in range(cfg.n_layer):
        tensors.update({
            tn("attn_norm", il): ((1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
                                  False),
            tn("attn_q", il): (_matrix(rng, e, e, e ** -0.5), True),
            tn("attn_k", il): (_matrix(rng, e, kv, e ** -0.5), True),
            tn("attn_v", il): (_matrix(rng, e, kv, e ** -0.5), True),
            tn("attn_output", il): (_matrix(rng, e, e, e ** -0.5), True),
            tn("ffn_norm", il): ((1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
                                 False),
            tn("ffn_gate", il): (_matrix(rng, e, cfg.n_ff, e ** -0.5), True),
            tn("ffn_up", il): (_matrix(rng, e, cfg.n_ff, e ** -0.5), True),
            tn("ffn_down", il): (_matrix(rng, cfg.n_ff, e, cfg.n_ff ** -0.5), True),
        })
    wt = GGMLType.parse(cfg.weight_type)
    for name, (arr, is_matrix) in tensors.items():
        if name in skip:
            continue
        if reshape and name in reshape:
            arr = np.resize(arr, tuple(reversed(reshape[name])))
        add_weight(w, name, arr, wt if is_matrix else GGMLType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


def add_weight(w: Any, name: str, arr: np.ndarray, t: GGMLType) -> None:
    """Add `arr` to the gguf writer `w` as tensor `name`, stored (quantized) as type t."""
    import gguf

    if t == GGMLType.F32:
        w.add_tensor(name, arr.astype(np.float32))
    elif t == GGMLType.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        raw = quants.quantize(t, arr)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(int(t)))
