"""Small random-weight GGUF models of the dense llama-like architectures (llama, qwen2,
qwen3) with the real keys and tensor names, for tests and users who want a model that loads
in milliseconds. Written with ggraph's GGUF writer (graphs/gguf/gguf_writer.py); llama.cpp
loads them.

`DENSE_ARCHS` is the table of what each architecture's file holds beyond llama's (biases, Q/K
norms, the head-size key, the tokenizer's pre-tokenizer name); a `TinyDense` config names its
architecture. The vocabulary is byte-level BPE: GPT-2's byte alphabet plus the tokens of a
few merges (llama.cpp refuses a BPE vocabulary without merges), so the tokenizer loads
exactly as for a real model. The same seed draws llama's tensors in the same order in every
architecture (extras come after each layer's llama tensors), and a llama file is the same
bytes it always was.

The dense layout (`dense_tensors`: names, shapes, kinds), the model keys (`write_hparam_keys`)
and the byte alphabet are shared with graphs/testing/synthetic.py, which writes the same architectures
at real models' sizes with random quantized blocks.

    python -m ggraph.graphs.testing.tiny ARCH OUT.gguf [weight_type]
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ggraph.codecs import quants
from ggraph.ir.types import GGMLType
from ggraph.graphs.gguf.gguf_reader import ValueType
from ggraph.graphs.gguf.gguf_writer import GGUFWriter

from ggraph.graphs.models.tensor_names import TensorNames


@dataclass(frozen=True)
class DenseArch:
    """What one architecture's tiny GGUF holds beyond llama's.

    tokenizer_pre: tokenizer.ggml.pre (llama.cpp picks its pre-tokenizer by it).
    qkv_bias: attn_q/k/v biases. qk_norm: attn_q_norm / attn_k_norm (one per layer, head size).
    output_bias: TinyDense.output_bias may add output.bias (the builder reads it).
    head_dim_key: attention.key_length / value_length carry the head size, and
      rope.dimension_count is left out (llama.cpp's default: the head size), as the Qwen
      converters write; otherwise rope.dimension_count is written and the head size is
      n_embd / n_head.
    """
    tokenizer_pre: str
    qkv_bias: bool = False
    qk_norm: bool = False
    output_bias: bool = False
    head_dim_key: bool = False


DENSE_ARCHS: dict[str, DenseArch] = {
    "llama": DenseArch("default"),
    "qwen2": DenseArch("qwen2", qkv_bias=True, output_bias=True, head_dim_key=True),
    "qwen3": DenseArch("qwen2", qk_norm=True, head_dim_key=True),
}


@dataclass(frozen=True)
class TinyDense:
    arch: str = "llama"           # a key of DENSE_ARCHS
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    head_dim: int = 0             # 0: n_embd // n_head (only head_dim_key architectures differ)
    n_ctx_train: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    weight_type: str = "f32"      # f32, f16, bf16, q8_0, q4_0, q4_1 for the matrices
    tied_output: bool = True
    output_bias: bool = False     # architectures whose DenseArch allows it
    seed: int = 0

    @property
    def layout(self) -> DenseArch:
        spec = DENSE_ARCHS.get(self.arch)
        if spec is None:
            raise ValueError(f"no tiny writer for architecture {self.arch!r}; tiny.py writes "
                             f"{', '.join(DENSE_ARCHS)}")
        return spec

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


TinyLlama = TinyDense  # the name the llama-only writer had

MERGES = ["t h"]


def vocab() -> list[str]:
    """Control tokens, GPT-2's byte-level alphabet, then the tokens that MERGES make."""
    return ["<unk>", "<|im_start|>", "<|im_end|>"] + byte_alphabet() + merged_tokens()


def merged_tokens() -> list[str]:
    """The tokens that MERGES make, in order."""
    return ["".join(m.split(" ")) for m in MERGES]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet in its vocabulary's order (printable bytes map to
    themselves, the others are shifted past 255): the first 256 tokens of GPT-2, Llama 3
    and Qwen2."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _matrix(rng: np.random.Generator, ne0: int, ne1: int, scale: float) -> np.ndarray:
    return (rng.standard_normal((ne1, ne0)) * scale).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _vector(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (scale * rng.standard_normal(n)).astype(np.float32)


@dataclass(frozen=True)
class DenseTensor:
    """One tensor of a dense model: GGUF name, ne (ggml order) and what it holds: `embd`
    (token embedding), `matrix`, `norm`, `bias` or `head_norm` (Q/K norms)."""
    name: str
    ne: tuple[int, ...]
    kind: str

    @property
    def is_matrix(self) -> bool:
        return self.kind in ("embd", "matrix")


def dense_tensors(cfg: TinyDense, n_vocab: int) -> list[DenseTensor]:
    """The tensors of cfg's architecture at cfg's sizes, in the order tiny files draw them:
    the same names and shapes as a converted model of that architecture."""
    spec = cfg.layout
    if cfg.head_dim and not spec.head_dim_key and cfg.head_dim != cfg.n_embd // cfg.n_head:
        raise ValueError(f"{cfg.arch}: the head size is n_embd / n_head; head_dim="
                         f"{cfg.head_dim} needs an architecture with attention.key_length")
    if cfg.output_bias and not spec.output_bias:
        raise ValueError(f"{cfg.arch} has no output.bias")
    e, hd = cfg.n_embd, cfg.hd
    nq, kv = hd * cfg.n_head, hd * cfg.n_head_kv
    tn = TensorNames.of(cfg.arch)
    t = [DenseTensor(tn("token_embd"), (e, n_vocab), "embd"),
         DenseTensor(tn("output_norm"), (e,), "norm")]
    if not cfg.tied_output:
        t.append(DenseTensor(tn("output"), (e, n_vocab), "matrix"))
    for il in range(cfg.n_layer):
        t += [DenseTensor(tn(name, il), ne, kind) for name, ne, kind in (
            ("attn_norm", (e,), "norm"),
            ("attn_q", (e, nq), "matrix"),
            ("attn_k", (e, kv), "matrix"),
            ("attn_v", (e, kv), "matrix"),
            ("attn_output", (nq, e), "matrix"),
            ("ffn_norm", (e,), "norm"),
            ("ffn_gate", (e, cfg.n_ff), "matrix"),
            ("ffn_up", (e, cfg.n_ff), "matrix"),
            ("ffn_down", (cfg.n_ff, e), "matrix"))]
        if spec.qkv_bias:
            t += [DenseTensor(tn(name, il, "bias"), (width,), "bias")
                  for name, width in (("attn_q", nq), ("attn_k", kv), ("attn_v", kv))]
        if spec.qk_norm:
            t += [DenseTensor(tn(name, il), (hd,), "head_norm")
                  for name in ("attn_q_norm", "attn_k_norm")]
    if cfg.output_bias:
        t.append(DenseTensor(tn("output", None, "bias"), (n_vocab,), "bias"))
    return t


def tiny_tensors(cfg: TinyDense) -> dict[str, tuple[np.ndarray, bool]]:
    """name -> (values in numpy order, is a matrix that takes weight_type)."""
    rng = np.random.default_rng(cfg.seed)
    out: dict[str, tuple[np.ndarray, bool]] = {}
    for t in dense_tensors(cfg, len(vocab())):
        if t.kind == "embd":
            arr = _matrix(rng, t.ne[0], t.ne[1], 0.5)
        elif t.kind == "matrix":
            arr = _matrix(rng, t.ne[0], t.ne[1], t.ne[0] ** -0.5)
        elif t.kind == "norm":
            arr = _norm(rng, t.ne[0])
        elif t.kind == "bias":   # large enough to move the logits visibly
            arr = _vector(rng, t.ne[0], 0.5)
        else:                    # head norms spread around 1 so a missing or misplaced one shows
            arr = (1 + 0.3 * rng.standard_normal(t.ne[0])).astype(np.float32)
        out[t.name] = (arr, t.is_matrix)
    return out


def write_size_keys(w: GGUFWriter, name: str, n_layer: int, n_ctx_train: int, n_embd: int,
                    n_ff: int, n_head: int, n_head_kv: int) -> None:
    """general.name and the sizes every architecture has, under the writer's arch name."""
    a = w.arch
    w.add_str("general.name", name)
    w.add_u32(f"{a}.block_count", n_layer)
    w.add_u32(f"{a}.context_length", n_ctx_train)
    w.add_u32(f"{a}.embedding_length", n_embd)
    w.add_u32(f"{a}.feed_forward_length", n_ff)
    w.add_u32(f"{a}.attention.head_count", n_head)
    w.add_u32(f"{a}.attention.head_count_kv", n_head_kv)


def write_hparam_keys(w: GGUFWriter, cfg: TinyDense, n_vocab: int, name: str) -> None:
    """The model keys of cfg (general.name, sizes, attention, rope, norm) to the writer `w`
    (keys under its architecture name, cfg.arch's unless the file names another), as a
    converter writes them."""
    spec, a = cfg.layout, w.arch or cfg.arch
    write_size_keys(w, name, cfg.n_layer, cfg.n_ctx_train, cfg.n_embd, cfg.n_ff, cfg.n_head,
                    cfg.n_head_kv)
    if spec.head_dim_key:
        w.add_u32(f"{a}.attention.key_length", cfg.hd)
        w.add_u32(f"{a}.attention.value_length", cfg.hd)
    else:
        w.add_u32(f"{a}.rope.dimension_count", cfg.hd)
    w.add_f32(f"{a}.rope.freq_base", cfg.rope_freq_base)
    w.add_f32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_u32(f"{a}.vocab_size", n_vocab)


def write_tokenizer_keys(w: GGUFWriter, pre: str, tokens: list[str], types: list[int],
                         merges: list[str], bos: int, eos: int, add_bos: bool) -> None:
    """A byte-level BPE tokenizer's keys, as a converter writes them."""
    w.add_str("tokenizer.ggml.model", "gpt2")
    w.add_str("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens, ValueType.STRING)
    w.add_array("tokenizer.ggml.token_type", types, ValueType.INT32)
    w.add_array("tokenizer.ggml.merges", merges, ValueType.STRING)
    w.add_u32("tokenizer.ggml.bos_token_id", bos)
    w.add_u32("tokenizer.ggml.eos_token_id", eos)
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)


def _write_keys(w: GGUFWriter, cfg: TinyDense, tokens: list[str]) -> None:
    write_hparam_keys(w, cfg, len(tokens), f"tiny-{cfg.arch}")
    write_tokenizer_keys(w, cfg.layout.tokenizer_pre, tokens,
                         [3, 3, 3] + [1] * (len(tokens) - 3), MERGES, 1, 2, False)


def write_tiny(path: str | os.PathLike, cfg: TinyDense = TinyDense(),
               skip: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None,
               arch: str | None = None) -> str:
    """Write a tiny GGUF of cfg.arch. `skip` drops tensors and `reshape` changes their shapes
    (ne order), for bad-input tests; `arch` writes another `general.architecture` name over
    cfg.arch's layout."""
    tokens = vocab()
    w = GGUFWriter(path, arch or cfg.arch)
    _write_keys(w, cfg, tokens)
    wt = GGMLType.parse(cfg.weight_type)
    for tname, (arr, is_matrix) in tiny_tensors(cfg).items():
        if tname in skip:
            continue
        if reshape and tname in reshape:
            arr = np.resize(arr, tuple(reversed(reshape[tname])))
        add_weight(w, tname, arr, wt if is_matrix else GGMLType.F32)
    return w.write()


def write_tiny_llama(path: str | os.PathLike, cfg: TinyDense = TinyDense(),
                     skip: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None,
                     arch: str = "") -> str:
    """write_tiny under its first name (cfg.arch is llama unless the config says otherwise)."""
    return write_tiny(path, cfg, skip, reshape, arch or None)


def write_tiny_gguf(path: str | os.PathLike, arch: str = "llama", **kw: Any) -> str:
    """A tiny model of `arch` (a key of DENSE_ARCHS) with TinyDense fields from kw."""
    return write_tiny(path, replace(TinyDense(arch=arch), **kw))


def add_weight(w: GGUFWriter, name: str, arr: np.ndarray, t: GGMLType) -> None:
    """Add `arr` (numpy order) to the writer `w` as tensor `name`, stored (quantized) as
    type t."""
    ne = tuple(reversed(arr.shape))
    if t == GGMLType.F32:
        w.add_tensor(name, ne, t, arr.astype(np.float32))
    elif t == GGMLType.F16:
        w.add_tensor(name, ne, t, arr.astype(np.float16))
    else:
        w.add_tensor(name, ne, t, quants.quantize(t, arr))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: python -m ggraph.graphs.testing.tiny {{{','.join(DENSE_ARCHS)}}} OUT.gguf "
                 f"[weight_type]")
    try:
        print(write_tiny_gguf(sys.argv[2], sys.argv[1],
                              weight_type=sys.argv[3] if len(sys.argv) == 4 else "f32"))
    except ValueError as e:
        sys.exit(f"error: {e}")
