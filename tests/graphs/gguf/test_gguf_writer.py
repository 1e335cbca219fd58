"""ggraph's GGUF writer (graphs/gguf/gguf_writer.py): what it writes reads back through the
bounded reader with every type and value, the bytes are gguf-py's writer's for the same content,
tensor data streams from a source in table order, and everything the reader would refuse is
refused when writing, naming the key or tensor, with no file left behind."""
from __future__ import annotations

import os

import numpy as np
import pytest

from ggraph.codecs import quants
from ggraph.graphs.gguf.gguf_reader import GGUFError, ValueType as VT, read_header
from ggraph.graphs.gguf.gguf_writer import GGUFWriter
from ggraph.ir.types import GGMLType as T

RNG = np.random.default_rng(3)
W = RNG.standard_normal((4, 64)).astype(np.float32)          # numpy order: 4 rows of 64
Q = quants.quantize(T.Q8_0, W)
NORM = RNG.standard_normal(64).astype(np.float32)


def sample(w: GGUFWriter) -> None:
    w.add_str("general.name", "écrit")
    w.add_u32("llama.block_count", 2)
    w.add_i32("x.i32", -5)
    w.add_u64("x.u64", 2 ** 40)
    w.add_f32("x.f32", 0.5)
    w.add_bool("x.bool", True)
    w.add("x.i8", -3, VT.INT8)
    w.add("x.f64", 1e300, VT.FLOAT64)
    w.add_array("x.tokens", ["a", "b", "\u00e9"], VT.STRING)
    w.add_array("x.scores", [0.25, -1.0, 3.0], VT.FLOAT32)
    w.add_array("x.types", [1, 3, 6], VT.INT32)
    w.add_array("x.flags", [True, False], VT.BOOL)
    w.add_array("x.empty", [], VT.UINT32)
    w.add_tensor("blk.0.w", (64, 4), T.Q8_0, Q)
    w.add_tensor("norm", (64,), T.F32, NORM)
    w.add_tensor("none", (0, 3), T.F32, np.zeros(0, np.float32))


def test_round_trip(tmp_path):
    w = GGUFWriter(tmp_path / "a.gguf", "llama")
    sample(w)
    path = w.write()
    h = read_header(path)
    md = h.metadata
    assert list(md)[:3] == ["general.architecture", "general.name", "llama.block_count"]
    assert md["general.name"] == "écrit" and md["x.u64"] == 2 ** 40 and md["x.bool"] is True
    assert md["x.i8"] == -3 and md["x.f64"] == 1e300 and md["x.f32"] == 0.5
    assert md["x.tokens"] == ["a", "b", "é"] and md["x.flags"] == [True, False]
    assert md["x.scores"] == [0.25, -1.0, 3.0] and md["x.empty"] == []
    assert h.kv_types["x.types"].element == VT.INT32
    by = {t.name: t for t in h.tensors}
    assert by["blk.0.w"].ne == (64, 4) and by["none"].nbytes == 0
    raw = np.frombuffer(h.mm, np.uint8)
    t = by["blk.0.w"]
    got = raw[h.data_offset + t.offset:h.data_offset + t.offset + t.nbytes]
    assert got.tobytes() == Q.tobytes()
    assert all(t.offset % 32 == 0 for t in h.tensors)
    assert os.path.getsize(path) == w.file_size()


def test_same_bytes_as_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    ours = GGUFWriter(tmp_path / "ours.gguf", "llama")
    theirs = gguf.GGUFWriter(os.fspath(tmp_path / "theirs.gguf"), "llama")
    ours.add_str("general.name", "x")
    theirs.add_name("x")
    ours.add_u32("llama.block_count", 2)
    theirs.add_block_count(2)
    ours.add_array("tokenizer.ggml.tokens", ["a", "bc"], VT.STRING)
    theirs.add_token_list(["a", "bc"])
    ours.add_array("tokenizer.ggml.scores", [0.5, 1.5], VT.FLOAT32)
    theirs.add_token_scores([0.5, 1.5])
    ours.add_tensor("blk.0.w", (64, 4), T.Q8_0, Q)
    theirs.add_tensor("blk.0.w", Q, raw_shape=Q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    ours.add_tensor("norm", (64,), T.F32, NORM)
    theirs.add_tensor("norm", NORM)
    ours.write()
    theirs.write_header_to_file()
    theirs.write_kv_data_to_file()
    theirs.write_tensors_to_file()
    theirs.close()
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


def test_streamed_data_and_a_hole(tmp_path):
    w = GGUFWriter(tmp_path / "s.gguf", "llama", alignment=64)
    w.add_tensor("a", (64, 4), T.Q8_0)
    w.add_tensor("b", (64,), T.F32)
    asked = []

    def source(spec):
        asked.append(spec.name)
        return Q if spec.name == "a" else NORM
    h = read_header(w.write(source, progress=lambda s: None))
    assert asked == ["a", "b"] and h.alignment == 64
    assert all(t.offset % 64 == 0 for t in h.tensors)
    w2 = GGUFWriter(tmp_path / "hole.gguf", "llama")
    w2.add_tensor("a", (64, 4), T.Q8_0)
    read_header(w2.write(data=False))
    assert os.path.getsize(tmp_path / "hole.gguf") == w2.file_size()


@pytest.mark.parametrize("act, says", [
    (lambda w: (w.add_u32("k", 1), w.add_u32("k", 2)), "key 'k' is added twice"),
    (lambda w: w.add_u32("k", -1), "key 'k': -1 does not fit a UINT32"),
    (lambda w: w.add("k", 300, VT.UINT8), "does not fit a UINT8"),
    (lambda w: w.add_u32("k", 1.5), "must be an integer"),
    (lambda w: w.add_bool("k", 1), "must be True or False"),
    (lambda w: w.add_str("k", "\ud800"), "not valid UTF-8"),
    (lambda w: w.add_array("k", [1, "a"], VT.INT32), "k[1]"),
    (lambda w: w.add_array("k", [2 ** 40], VT.INT32), "outside INT32's range"),
    (lambda w: w.add("k", [1], VT.ARRAY, VT.ARRAY), "element type other than ARRAY"),
    (lambda w: w.add_tensor("x" * 64, (4,), T.F32), "at most 63 bytes"),
    (lambda w: (w.add_tensor("t", (4,), T.F32), w.add_tensor("t", (4,), T.F32)),
     "tensor 't' is added twice"),
    (lambda w: w.add_tensor("t", (1, 1, 1, 1, 1), T.F32), "1 to 4 dimensions"),
    (lambda w: w.add_tensor("t", (4, -1), T.F32), "none negative"),
    (lambda w: w.add_tensor("t", (48, 2), T.Q8_0), "ne[0]=48 is not a multiple of the block"),
    (lambda w: w.add_tensor("t", (64,), 99), "type id 99 is not a ggml type"),
    (lambda w: w.add_tensor("t", (64, 4), T.Q8_0, Q[:2]), "needs 272 bytes of data, got 136"),
])
def test_refusals_name_the_key_or_tensor(tmp_path, act, says):
    w = GGUFWriter(tmp_path / "bad.gguf", "llama")
    with pytest.raises(GGUFError) as e:
        act(w)
    assert says in str(e.value) and str(tmp_path / "bad.gguf") in str(e.value)


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(GGUFError, match="power of two"):
        GGUFWriter(tmp_path / "x.gguf", alignment=48)
    w = GGUFWriter(tmp_path / "x.gguf", "llama")
    w.add_tensor("a", (64,), T.F32)
    with pytest.raises(GGUFError, match="no data and no source"):
        w.write()
    w.add_tensor("b", (64,), T.F32, NORM)
    with pytest.raises(GGUFError, match="needs 256 bytes"):
        w.write(lambda spec: NORM[:10])
    assert os.listdir(tmp_path) == []
