"""Hostile GGUF files: each case of issue #13 is one clear GGUFError (a ValueError naming the
file and the key, tensor or byte offset), never a hang, a traceback or silent garbage."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ggraph.graphs.models.arch import build_model
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf
from ggraph.graphs.testing.gguf_fuzz import patch_field, rewrite_gguf
from ggraph.graphs.gguf.gguf_reader import ValueType as VT, read_header
from ggraph.graphs.gguf.tensor_check import check_tensors
from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models.made(write_tiny_llama, TinyLlama(weight_type="q4_1"))


def _load_error(path, match: str, *, engine: bool = False) -> str:
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as e:
        if engine:
            Engine(path, EngineConfig(n_ctx=64, n_ubatch=16, check_tensors=True))
        else:
            build_model(load_gguf(path))
    assert time.perf_counter() - t0 < 30, "an error must come quickly, not after a hang"
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_unmodified_tiny_model_loads(tiny):
    m = load_gguf(tiny)
    build_model(m)
    assert m.kv_types["llama.block_count"].type == VT.UINT32
    assert m.kv_types["tokenizer.ggml.tokens"].element == VT.STRING


# -- the header: counts and lengths bounded by the bytes in the file ----------------------

def test_huge_array_count_is_refused_at_once(tiny, tmp_path):
    p = tmp_path / "huge.gguf"
    p.write_bytes(open(tiny, "rb").read())
    patch_field(p, "'tokenizer.ggml.token_type': the length of the value", 1 << 62)
    msg = _load_error(p, "declares 4611686018427387904 elements")
    assert "tokenizer.ggml.token_type" in msg


def test_array_of_arrays_is_refused(tiny, tmp_path):
    p = tmp_path / "nested.gguf"
    p.write_bytes(open(tiny, "rb").read())
    patch_field(p, "'tokenizer.ggml.tokens': the element type", int(VT.ARRAY))
    _load_error(p, "array of arrays")


def test_huge_counts_and_string_lengths(tiny, tmp_path):
    for field, value, match in (("the tensor count", 1 << 40, "declares 1099511627776 tensors"),
                                ("the metadata count", (1 << 64) - 1, "metadata entries"),
                                ("'general.name': the length of the value", 1 << 50,
                                 "needs 1125899906842624 bytes")):
        p = tmp_path / "counts.gguf"
        p.write_bytes(open(tiny, "rb").read())
        patch_field(p, field, value)
        _load_error(p, match)


def test_wrong_version_and_big_endian(tiny, tmp_path):
    p = tmp_path / "v.gguf"
    for v, match in ((1, "version 1"), (3 << 24, "big-endian")):
        p.write_bytes(open(tiny, "rb").read())
        patch_field(p, "the version", v)
        _load_error(p, match)


# -- tensors: aligned, inside the data section, no overlap, exactly the expected set ---------

def test_unaligned_offset(tiny, tmp_path):
    p = tmp_path / "unaligned.gguf"
    p.write_bytes(open(tiny, "rb").read())
    patch_field(p, "'blk.0.attn_q.weight': the data offset", lambda v: v + 4)
    _load_error(p, "not a multiple of general.alignment 32")


def test_offset_wrapping_onto_the_header(tiny, tmp_path):
    # gguf-py adds offsets in wrapping uint64: 2^64 - data_offset lands on byte 0
    p = tmp_path / "wrap.gguf"
    p.write_bytes(open(tiny, "rb").read())
    hdr = read_header(tiny)
    patch_field(p, "'output_norm.weight': the data offset", (1 << 64) - hdr.data_offset)
    _load_error(p, "file ends at")


def test_overlapping_tensors(tiny, tmp_path):
    p = tmp_path / "overlap.gguf"
    p.write_bytes(open(tiny, "rb").read())
    q = read_header(tiny).tensors
    q_offset = next(t.offset for t in q if t.name == "blk.0.attn_q.weight")
    patch_field(p, "'blk.0.attn_k.weight': the data offset", q_offset)
    _load_error(p, "overlap")


def test_block_count_lower_than_the_layers_in_the_file(tiny, tmp_path):
    p = rewrite_gguf(tiny, tmp_path / "fewer.gguf", {"llama.block_count": (1, VT.UINT32, None)})
    msg = _load_error(p, "wrong number of tensors; expected 11, got 20")
    assert "blk.1." in msg


def test_missing_and_extra_tensors(tiny, tmp_path):
    p = rewrite_gguf(tiny, tmp_path / "missing.gguf", drop_tensors=("blk.1.ffn_up.weight",))
    _load_error(p, "'blk.1.ffn_up.weight' is missing")


# -- hyperparameters: present, of the right GGUF type, in range -------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("llama.attention.head_count", (0, VT.UINT32, None), "at least 1"),
    ("llama.block_count", (0, VT.UINT32, None), "at least 1"),
    ("llama.block_count", (-1, VT.INT32, None), "is -1; it must be at least 1"),
    ("llama.embedding_length", ("64", VT.STRING, None), "holds a str"),
    ("llama.attention.layer_norm_rms_epsilon", (5, VT.INT32, None), "holds a int"),
    ("llama.rope.freq_base", (float("nan"), VT.FLOAT32, None), "finite"),
    ("llama.attention.head_count_kv", ([2, 4], VT.ARRAY, VT.UINT32), "differs between layers"),
    ("llama.attention.head_count", (3, VT.UINT32, None), "not a multiple"),
])
def test_bad_hyperparameters(tiny, tmp_path, key, value, match):
    p = rewrite_gguf(tiny, tmp_path / "hp.gguf", {key: value})
    msg = _load_error(p, match)
    assert key.split(".", 1)[1] in msg or match == "not a multiple"


def test_empty_per_layer_array():
    from ggraph.graphs.models.hparams import LlamaHParams, read_hparams

    meta = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.context_length": 64,
            "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
            "llama.attention.head_count_kv": []}
    with pytest.raises(GGUFError, match="'llama.attention.head_count_kv' is an array of 0"):
        read_hparams(LlamaHParams, meta, "llama", "f.gguf")


# -- the tokenizer's metadata ------------------------------------------------------------------

def test_tokenizer_metadata(tiny, tmp_path):
    tokens = load_gguf(tiny, with_data=False).metadata["tokenizer.ggml.tokens"]
    cases = [
        ({}, ("tokenizer.ggml.merges",), "merges"),                         # BPE without merges
        ({"tokenizer.ggml.tokens": (tokens[:-5], VT.ARRAY, VT.STRING)}, (), "has 255 tokens"),
        ({"tokenizer.ggml.tokens": (list(range(len(tokens))), VT.ARRAY, VT.INT32)}, (),
         "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": (["th"], VT.ARRAY, VT.STRING)}, (), "merges"),
        ({"tokenizer.ggml.merges": (["t zz"], VT.ARRAY, VT.STRING)}, (), "merges"),
    ]
    for set_kv, drop, match in cases:
        p = rewrite_gguf(tiny, tmp_path / "tok.gguf", set_kv, drop_kv=drop)
        _load_error(p, match, engine=True)


def test_token_that_is_not_utf8(tiny, tmp_path):
    p = tmp_path / "utf8.gguf"
    data = bytearray(open(tiny, "rb").read())
    at = data.index(b"<|im_end|>")
    data[at + 2] = 0xFF
    p.write_bytes(bytes(data))
    _load_error(p, r"tokenizer.ggml.tokens': the value\[2\] is not valid UTF-8")


# -- --check-tensors ----------------------------------------------------------------------------

def test_check_tensors_names_the_first_bad_tensor_and_block(tiny, tmp_path):
    hdr = read_header(tiny)
    info = next(t for t in hdr.tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(open(tiny, "rb").read())
    row_blocks = info.ne[0] // 32
    at = hdr.data_offset + info.offset + (3 * row_blocks + 1) * 20  # row 3, block 1 (Q4_1)
    data[at:at + 2] = np.float16(np.nan).tobytes()
    p = tmp_path / "nan.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"'blk.1.ffn_up.weight' \(q4_1.*row 3, block 1"):
        check_tensors(load_gguf(p))
    # without the flag a NaN weight loads and runs, as in llama.cpp (where the Q8 rounding
    # of the next activations turns the NaN into a 0, the logits may even stay finite)
    eng = Engine(str(p), EngineConfig(n_ctx=64, n_ubatch=16, check_tensors=False))
    assert eng.eval([5, 6, 7]).shape == (eng.model.hp.n_vocab,)
    _load_error(p, "holds inf or NaN", engine=True)


@pytest.mark.parametrize("ty", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_first_nonfinite_every_type(ty):
    from ggraph.codecs import quants
    from ggraph.ir.types import GGMLType

    t = GGMLType.parse(ty)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    raw = quants.quantize(t, x)
    assert quants.first_nonfinite(t, raw) == -1
    x[2, 40] = np.inf
    bad = quants.quantize(t, x) if not t.is_quantized else raw.copy()
    if t.is_quantized:  # an inf scale in row 2, block 1
        bad[2, t.type_size:t.type_size + 2] = np.frombuffer(np.float16(np.inf).tobytes(),
                                                               np.uint8)
    want = 2 * 64 + 40 if not t.is_quantized else 2 * 2 + 1
    assert quants.first_nonfinite(t, bad) == want
