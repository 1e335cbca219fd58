"""Synthetic GGUFs at real models' sizes: Llama-3-8B, Qwen2.5-7B, -3B and -1.5B shaped files in
llama.cpp's Q4_K_M type mix, with random but valid blocks, for measuring speed where the
text does not matter (it is garbage). Made in seconds, not through a quantizer.

Owns the table of shapes (`SHAPES`: the real models' hyperparameters and vocabulary sizes,
over tiny.py's dense layout and keys), llama.cpp's Q4_K_M type rule (`q4_k_m_type`, from
llama_tensor_get_type in src/llama-quant.cpp), the random blocks, the streaming writer
(`write_synthetic`) and the cache of written files (`synthetic_model`, under
ggraph.config.cache_dir()/synthetic/; graphs/gguf/fetch.py resolves `synthetic:NAME` through it).

Blocks are random bytes (numpy's Generator, all blocks of a tensor at once) whose f16 scale
fields are then overwritten with finite values, so llama.cpp's --check-tensors and ggraph's
(graphs/gguf/tensor_check.py) pass. The scales are sized so that each matrix maps unit-RMS inputs
to unit-RMS outputs (element std 1/sqrt(ne[0])): activations stay finite through every layer
in f32 and in an f16 KV cache. Tensors are written one at a time, so an 8B file never sits in
memory. The vocabulary is tiny.py's byte-level BPE padded with `[PADn]` tokens (UNUSED, as
Qwen's own padding) to the real size, with the real model's control tokens at their ids.

    python -m ggraph.graphs.testing.synthetic NAME OUT.gguf [--seed N] [--header-only]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ggraph.config import cache_dir
from ggraph.ir.types import GGMLType

from ggraph.graphs.testing.tiny import (DenseTensor, TinyDense, byte_alphabet, dense_tensors,
                                        merged_tokens)
from ggraph.graphs.testing.tiny import MERGES, write_hparam_keys, write_tokenizer_keys
from ggraph.graphs.gguf.gguf_writer import GGUFWriter

FILE_TYPE_Q4_K_M = 15    # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (general.file_type)
QUANT_VERSION = 2        # GGML_QNT_VERSION (general.quantization_version)

__all__ = ["Shape", "SHAPES", "PlannedTensor", "BLOCK_FILLS", "use_more_bits", "q4_k_m_type",
           "layer_ranks", "tensor_plan", "random_blocks", "vocab", "write_synthetic",
           "synthetic_model", "synthetic_path"]

# llama_token_type values (gguf.TokenType)
NORMAL, CONTROL, UNUSED = 1, 3, 5
QK_K = 256


@dataclass(frozen=True)
class Shape:
    """A published model's shape. `dense` carries the architecture and hyperparameters (the
    keys and tensors tiny.py writes for it); `specials` are the control tokens at their real
    ids; `tokenizer_pre` overrides the architecture's pre-tokenizer name.

    `layer_order` is the order in which llama-quantize met the layers, which decides where
    attn_v and ffn_down get Q6_K: "numeric" (today's llama.cpp sorts its weights by layer
    number) or "name" (older llama-quantize walked the converted file, whose layers follow
    the checkpoint's sorted names: 0, 1, 10, 11, ..., 19, 2, 20, ...; Qwen's published GGUFs
    were made so)."""
    dense: TinyDense
    n_vocab: int
    specials: tuple[tuple[int, str], ...]
    bos: int
    eos: int
    add_bos: bool = False
    tokenizer_pre: str = ""
    layer_order: str = "numeric"
    about: str = ""

    @property
    def pre(self) -> str:
        return self.tokenizer_pre or self.dense.layout.tokenizer_pre


def _qwen_specials(first: int) -> tuple[tuple[int, str], ...]:
    return ((first, "<|endoftext|>"), (first + 1, "<|im_start|>"), (first + 2, "<|im_end|>"))


def _qwen2(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int,
           tied: bool, about: str, layer_order: str = "numeric") -> Shape:
    # Qwen2.5 config.json: rope_theta 1e6, rms_norm_eps 1e-6, 32768 tokens (the Instruct
    # models' max_position_embeddings); <|endoftext|> is bos (and pad), <|im_end|> eos
    dense = TinyDense("qwen2", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                      n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=32768,
                      rope_freq_base=1000000.0, rms_eps=1e-6, tied_output=tied)
    return Shape(dense, n_vocab, _qwen_specials(151643), bos=151643, eos=151645,
                 layer_order=layer_order, about=about)


SHAPES: dict[str, Shape] = {
    # Meta-Llama-3-8B config.json: untied output, rope_theta 500000, 8192 tokens
    "llama3-8b": Shape(
        TinyDense("llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336,
                  n_ctx_train=8192, rope_freq_base=500000.0, rms_eps=1e-5, tied_output=False),
        n_vocab=128256, specials=((128000, "<|begin_of_text|>"), (128001, "<|end_of_text|>"),
                                  (128009, "<|eot_id|>")),
        bos=128000, eos=128001, add_bos=True, tokenizer_pre="llama-bpe",
        about="Llama-3-8B (llama, 8.03B weights)"),
    "qwen2.5-7b": _qwen2(28, 3584, 28, 4, 18944, 152064, tied=False,
                         about="Qwen2.5-7B (qwen2, 7.62B weights, untied output)"),
    # tied embeddings: convert_hf_to_gguf writes no output.weight, so token_embd is Q6_K
    "qwen2.5-3b": _qwen2(36, 2048, 16, 2, 11008, 151936, tied=True,
                         about="Qwen2.5-3B (qwen2, 3.09B weights, tied embeddings)"),
    # as Qwen's published Qwen2.5-Coder-1.5B-Instruct Q4_K_M (fetch.py's qwen2.5-coder-1.5b),
    # to check the type rule against: it holds output.weight although config.json ties it
    "qwen2.5-1.5b": _qwen2(28, 1536, 12, 2, 8960, 151936, tied=False, layer_order="name",
                           about="Qwen2.5-1.5B (qwen2) as Qwen's own Q4_K_M file"),
    # for tests: every row a whole number of K-quant blocks, Q4_K and Q6_K layers both
    "tiny": Shape(
        TinyDense("qwen2", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                  n_ctx_train=2048, rope_freq_base=1000000.0, rms_eps=1e-6, tied_output=True),
        n_vocab=1024, specials=_qwen_specials(1021), bos=1021, eos=1023,
        about="a 4-layer qwen2 for tests"),
}


# -- llama.cpp's Q4_K_M mix ----------------------------------------------------------------

def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and
    every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or \
        (i_layer - n_layer // 8) % 3 == 2


def _fallback(t: GGMLType, ncols: int) -> GGMLType:
    """tensor_type_fallback: a row that is not whole blocks of t takes a 32-block type."""
    if ncols % t.block_size == 0:
        return t
    to = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q5_K: GGMLType.Q5_1,
          GGMLType.Q6_K: GGMLType.Q8_0}.get(t)
    if to is None:
        raise ValueError(f"llama.cpp defines no fallback for {t} at {ncols} columns")
    return to if ncols % to.block_size == 0 else GGMLType.F16


def q4_k_m_type(name: str, ne: Sequence[int], rank: int, n_layer: int,
                tied: bool) -> GGMLType:
    """The type llama-quantize gives tensor `name` (ne in ggml order, from an F32/F16 source)
    for LLAMA_FTYPE_MOSTLY_Q4_K_M, on a dense model (no experts, not Falcon, not llama.cpp's
    70B type). `rank` is how many attn_v (resp. ffn_down) tensors the quantizer met before
    this one; `tied`: the file has no output.weight, so token_embd is the output too."""
    # tensor_allows_quantization: matrices named *weight, except norms; the rest keep their
    # source type (the converter's F32 for norms and biases)
    if len(ne) < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return GGMLType.F32
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return GGMLType.Q8_0 if ne[0] % QK_K else GGMLType.Q6_K
    t = GGMLType.Q4_K
    attn_v_like = any(k in name for k in ("attn_v.weight", "attn_qkv.weight",
                                          "attn_kv_b.weight"))
    if (attn_v_like or "ffn_down" in name) and use_more_bits(rank, n_layer):
        t = GGMLType.Q6_K
    return _fallback(t, ne[0])


def layer_ranks(n_layer: int, order: str) -> list[int]:
    """rank[il]: how many layers the quantizer met before layer il."""
    if order == "numeric":
        return list(range(n_layer))
    if order == "name":
        met = sorted(range(n_layer), key=str)
        return [met.index(il) for il in range(n_layer)]
    raise ValueError(f"layer_order {order!r}: numeric or name")


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    ne: tuple[int, ...]
    type: GGMLType
    kind: str            # tiny.py's DenseTensor kind

    @property
    def nbytes(self) -> int:
        return math.prod(self.ne) // self.type.block_size * self.type.type_size


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def tensor_plan(shape: Shape) -> list[PlannedTensor]:
    """The file's tensors with their Q4_K_M types, in the order llama-quantize writes them
    (the tensors outside the layers, then layer by layer; by name within each)."""
    cfg = shape.dense
    ranks = layer_ranks(cfg.n_layer, shape.layer_order)
    tensors: list[DenseTensor] = dense_tensors(cfg, shape.n_vocab)
    tensors.sort(key=lambda t: (_layer(t.name), t.name))
    return [PlannedTensor(t.name, t.ne, q4_k_m_type(
        t.name, t.ne, ranks[_layer(t.name)] if _layer(t.name) >= 0 else 0, cfg.n_layer,
        cfg.tied_output), t.kind) for t in tensors]


# -- random valid blocks -------------------------------------------------------------------

@dataclass(frozen=True)
class BlockFill:
    """Where a type's f16 scales sit in its block, each as a multiple of the block's d, and
    the std of its elements per unit d when every other byte is uniformly random (worked
    out from the block's formula; tests/graphs/testing/test_synthetic.py checks it by
    dequantizing)."""
    scales: tuple[tuple[int, float], ...]
    std_per_d: float


# Q4_K/Q5_K: x = d*sc*q - dmin*m with 6-bit sc, m; dmin = d*E[q] centres the elements on 0.
# Q6_K: x = d*sc*(q - 32), int8 sc. Q5_0: d*(q - 16). Q8_0: d*q, int8 q.
BLOCK_FILLS: dict[GGMLType, BlockFill] = {
    GGMLType.Q4_K: BlockFill(((0, 1.0), (2, 7.5)), 258.3),
    GGMLType.Q5_K: BlockFill(((0, 1.0), (2, 15.5)), 526.9),
    GGMLType.Q6_K: BlockFill(((208, 1.0),), 1365.7),
    GGMLType.Q5_0: BlockFill(((0, 1.0),), 9.25),
    GGMLType.Q8_0: BlockFill(((0, 1.0),), 73.9),
}
_U64_MAX = np.iinfo(np.uint64).max


def random_blocks(rng: np.random.Generator, t: GGMLType, n_blocks: int,
                  std: float) -> np.ndarray:
    """n_blocks random blocks of type t (uint8, n_blocks x type_size) whose elements have
    standard deviation about `std`: random bytes, then finite f16 scales (d drawn per block
    within a factor 3 of its mean)."""
    fill = BLOCK_FILLS.get(t)
    if fill is None:
        raise ValueError(f"no random block filler for {t}; synthetic files use "
                         f"{', '.join(str(k) for k in BLOCK_FILLS)}")
    n = n_blocks * t.type_size
    # 64-bit draws are the Generator's fastest path (several GB/s with SFC64)
    raw = rng.integers(_U64_MAX, size=-(-n // 8), dtype=np.uint64, endpoint=True)
    blocks = raw.view(np.uint8)[:n].reshape(n_blocks, t.type_size)
    # d uniform in [0.5, 1.5] x d0: E[d^2] = 13/12 d0^2
    d0 = std / (fill.std_per_d * math.sqrt(13 / 12))
    d = (0.5 + rng.random(n_blocks, dtype=np.float32)) * np.float32(d0)
    for at, rel in fill.scales:
        blocks[:, at:at + 2] = (d * np.float32(rel)).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks


def tensor_data(rng: np.random.Generator, pt: PlannedTensor) -> np.ndarray:
    """Random values for one planned tensor: unit-gain matrices, norms near 1, small biases."""
    if pt.type == GGMLType.F32:
        if pt.kind in ("norm", "head_norm"):
            return (1 + 0.1 * rng.standard_normal(pt.ne[0])).astype(np.float32)
        return (0.1 * rng.standard_normal(pt.ne[0])).astype(np.float32)
    n_blocks = math.prod(pt.ne) // pt.type.block_size
    return random_blocks(rng, pt.type, n_blocks, pt.ne[0] ** -0.5).reshape(-1)


# -- the file ------------------------------------------------------------------------------

def vocab(shape: Shape) -> tuple[list[str], list[int]]:
    """(tokens, token types): the byte alphabet and MERGES' tokens, `[PADn]` fillers, and the
    shape's control tokens at their ids."""
    base = byte_alphabet() + merged_tokens()
    if shape.n_vocab < len(base) + len(shape.specials):
        raise ValueError(f"a vocabulary of {shape.n_vocab} has no room for the "
                         f"{len(base)} byte-level tokens")
    tokens = base + [f"[PAD{i}]" for i in range(len(base), shape.n_vocab)]
    types = [NORMAL] * len(base) + [UNUSED] * (shape.n_vocab - len(base))
    for i, text in shape.specials:
        if not len(base) <= i < shape.n_vocab:
            raise ValueError(f"special token {text!r} at {i}: outside the filler ids")
        tokens[i], types[i] = text, CONTROL
    return tokens, types


def _shape(shape: str | Shape) -> tuple[str, Shape]:
    if isinstance(shape, Shape):
        return shape.about or "custom", shape
    s = SHAPES.get(shape)
    if s is None:
        raise ValueError(f"unknown synthetic shape {shape!r}; known: {', '.join(SHAPES)}")
    return shape, s


def write_synthetic(shape: str | Shape, path: str | os.PathLike, seed: int = 0,
                    progress: bool = True, data: bool = True) -> Path:
    """Write the shape's Q4_K_M GGUF to `path` (through `path`.part, renamed when complete),
    tensor by tensor. `data=False` writes the header and leaves the data section a hole of
    its full size (zeros; a sparse file): headers and layout without the cost."""
    from tqdm import tqdm

    name, s = _shape(shape)
    cfg = s.dense
    plan = tensor_plan(s)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, cfg.arch)
    write_hparam_keys(w, cfg, s.n_vocab, f"synthetic {name} Q4_K_M (random weights)")
    w.add_u32("general.file_type", FILE_TYPE_Q4_K_M)
    w.add_u32("general.quantization_version", QUANT_VERSION)
    tokens, types = vocab(s)
    write_tokenizer_keys(w, s.pre, tokens, types, MERGES, s.bos, s.eos, s.add_bos)
    for pt in plan:
        w.add_tensor(pt.name, pt.ne, pt.type)
    rng = np.random.Generator(np.random.SFC64(seed))
    total = sum(pt.nbytes for pt in plan)
    by_name = {pt.name: pt for pt in plan}
    with tqdm(total=total, unit="B", unit_scale=True, disable=not (progress and data),
              desc=path.name, file=sys.stderr) as bar:
        w.write(lambda spec: tensor_data(rng, by_name[spec.name]),
                progress=lambda spec: bar.update(spec.nbytes), data=data)
    return path


def synthetic_path(name: str) -> Path:
    _shape(name)
    return cache_dir() / "synthetic" / f"{name}-q4_k_m.gguf"


def _complete(path: Path, s: Shape) -> bool:
    """The file at path holds exactly the shape's tensor table and all of its data."""
    from ggraph.graphs.gguf.gguf_reader import GGUFError, read_header

    try:
        hdr = read_header(path)
    except GGUFError:
        return False
    try:
        want = [(pt.name, pt.ne, int(pt.type)) for pt in tensor_plan(s)]
        have = [(t.name, t.ne, t.type_id) for t in hdr.tensors]
        last = max(t.offset + t.nbytes for t in hdr.tensors)
        return have == want and hdr.file_size >= hdr.data_offset + last
    finally:
        hdr.mm.close()


def synthetic_model(name: str, quiet: bool = False) -> Path:
    """The cached synthetic file of shape `name` (seed 0), written the first time (and again
    when the cached one is incomplete or of another layout)."""
    path = synthetic_path(name)
    if path.is_file() and _complete(path, SHAPES[name]):
        return path
    if not quiet:
        print(f"writing synthetic {name} ({SHAPES[name].about}) to {path} ...",
              file=sys.stderr)
    return write_synthetic(name, path, progress=not quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ggraph.graphs.testing.synthetic",
                                 description="write a synthetic Q4_K_M GGUF of a real shape")
    ap.add_argument("name", choices=list(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--header-only", action="store_true",
                    help="leave the data section a hole (zeros, a sparse file)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = write_synthetic(args.name, args.out, args.seed, data=not args.header_only)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
