"""graphs/quantize (`ggraph quantize`): the file llama-quantize writes, byte for byte.

The reference is libllama's `llama_model_quantize` (the code behind llama-quantize) through
llama-cpp-python (tests/llama_quantize_ref.py), given the same F32 input. The inputs are tiny
llama models shaped to reach llama.cpp's rules: 8 layers (use_more_bits picks layers 0, 3, 6
and 7), 4 query heads on 1 KV head (GQA 4: IQ4_XS gives attn_v Q5_K), n_ff 352 (ffn_down rows
are not whole 256-blocks: the K-quant fallbacks), an output.weight of its own or tied
embeddings of 96 columns (everything falls back). Every file type ggraph makes is compared,
without and with an importance matrix.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.gguf.gguf_reader import read_header
from ggraph.graphs.quantize.imatrix_file import (ImatrixError, ImatrixStats, ImatrixEntry,
                                                 load_imatrix_for_quantize, read_imatrix,
                                                 write_imatrix_dat, write_imatrix_gguf)
from ggraph.graphs.quantize.mix import (FTYPES, MixError, MixOptions, parse_ftype,
                                        parse_tensor_type, tensor_order, use_more_bits)
from ggraph.graphs.quantize.quantize import (Imatrix, QuantizeOptions, describe,
                                             quantize_model)
from ggraph.graphs.testing.tiny import TinyDense, write_tiny
from llama_quantize_ref import WHY, first_difference, llama_quantize

needs_llama = pytest.mark.skipif(bool(WHY), reason=WHY or "")

UNTIED = TinyDense(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_ff=352, tied_output=False,
                   seed=3)
TIED = TinyDense(n_layer=3, n_embd=96, n_head=4, n_head_kv=2, n_ff=160, tied_output=True,
                 seed=4)
NEEDS_IMATRIX = {"Q2_K_S"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("quantize")
    return {"untied": write_tiny(d / "untied.gguf", UNTIED),
            "tied": write_tiny(d / "tied.gguf", TIED)}


def _imatrix(path: str, seed: int) -> Imatrix:
    """Weights for every blk.* matrix, some of them zero (as columns never used are)."""
    rng = np.random.default_rng(seed)
    vals = {}
    for t in read_header(path).tensors:
        if t.name.startswith("blk.") and len(t.ne) >= 2:
            v = rng.gamma(0.5, 2.0, t.ne[0]).astype(np.float32)
            v[rng.random(t.ne[0]) < 0.05] = 0
            vals[t.name] = v
    return Imatrix(vals, "imatrix.gguf", ["calibration.txt"], 7)


def _both(tmp_path, src: str, ftype: str, im: Imatrix | None = None, **kw) -> str | None:
    ours, ref = tmp_path / f"g-{ftype}.gguf", tmp_path / f"l-{ftype}.gguf"
    mix = MixOptions(ftype=ftype, **kw)
    quantize_model(src, ours, QuantizeOptions(mix, im, threads=2))
    why = llama_quantize(src, ref, FTYPES[ftype][0], im, threads=2, **kw)
    assert why is None, why
    return first_difference(ours, ref)


# the tied model's 96 columns send every K-quant and IQ4_XS to its fallback: one type of
# each fallback (and a 32-block type) is enough there
TIED_TYPES = ("Q4_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_S", "Q6_K", "IQ4_XS")


@needs_llama
@pytest.mark.parametrize("model,ftype", [
    *(("untied", f) for f in FTYPES if f not in NEEDS_IMATRIX),
    *(("tied", f) for f in TIED_TYPES)])
def test_same_bytes_as_llama_quantize(models, tmp_path, ftype, model):
    assert _both(tmp_path, models[model], ftype) is None


@needs_llama
@pytest.mark.parametrize("ftype", [f for f in FTYPES if f not in ("F32", "F16", "BF16")])
def test_same_bytes_with_an_imatrix(models, tmp_path, ftype):
    im = _imatrix(models["untied"], 1)
    assert _both(tmp_path, models["untied"], ftype, im) is None


@needs_llama
@pytest.mark.parametrize("kw", [
    dict(output_tensor_type="Q8_0", token_embedding_type="Q4_0"),
    dict(tensor_types=(("attn_q", "Q8_0"), ("ffn_.*", "Q5_1"))),
    dict(pure=True),
    dict(leave_output_tensor=True),
], ids=["types", "patterns", "pure", "leave-output"])
def test_same_bytes_with_overrides(models, tmp_path, kw):
    assert _both(tmp_path, models["untied"], "Q4_K_M", **kw) is None


@needs_llama
def test_a_quantized_input_dequantized_to_f32(models, tmp_path):
    q8 = tmp_path / "q8.gguf"
    quantize_model(models["untied"], q8, QuantizeOptions(MixOptions(ftype="Q8_0")))
    ours, ref = tmp_path / "g.gguf", tmp_path / "l.gguf"
    quantize_model(q8, ours, QuantizeOptions(MixOptions(ftype="F32")))
    assert llama_quantize(q8, ref, 0, allow_requantize=True) is None
    assert first_difference(ours, ref) is None


def test_requantizing_needs_the_flag(models, tmp_path):
    q8 = tmp_path / "q8.gguf"
    quantize_model(models["untied"], q8, QuantizeOptions(MixOptions(ftype="Q8_0")))
    with pytest.raises(MixError, match="'output.weight' is Q8_0 already.*--allow-requantize"):
        quantize_model(q8, tmp_path / "out.gguf", QuantizeOptions(MixOptions(ftype="Q4_0")))
    assert not (tmp_path / "out.gguf").exists()
    quantize_model(q8, tmp_path / "out.gguf", QuantizeOptions(MixOptions(ftype="Q4_0"),
                                                              allow_requantize=True))


def test_q2_k_s_needs_an_imatrix(models, tmp_path):
    with pytest.raises(MixError, match=r"'blk\.0\.\w+\.weight': Q2_K_S needs an importance"):
        quantize_model(models["untied"], tmp_path / "o.gguf",
                       QuantizeOptions(MixOptions(ftype="Q2_K_S")))


def test_dry_run_sizes_are_the_written_file(models, tmp_path):
    opts = MixOptions(ftype="Q4_K_M")
    dry = quantize_model(models["untied"], None, QuantizeOptions(opts, dry_run=True))
    out = tmp_path / "q.gguf"
    real = quantize_model(models["untied"], out, QuantizeOptions(opts))
    assert dry.file_size == real.file_size == out.stat().st_size
    assert dry.per_type() == real.per_type()
    kinds = dry.per_type()
    assert set(kinds) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}, kinds   # Q8_0: ffn_down
    lines = describe(dry)
    assert lines[0].startswith("model size") and "BPW" in lines[1]
    assert any("fallback" in s for s in lines)


def test_metadata_order_and_types(models, tmp_path):
    out = tmp_path / "q.gguf"
    quantize_model(models["untied"], out, QuantizeOptions(MixOptions(ftype="Q5_K_M"),
                                                          _imatrix(models["untied"], 2)))
    src, h = read_header(models["untied"]), read_header(out)
    keys = list(h.metadata)
    assert keys[:len(src.metadata)] == list(src.metadata)
    assert keys[len(src.metadata):] == [
        "general.quantization_version", "general.file_type", "quantize.imatrix.file",
        "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
        "quantize.imatrix.chunks_count"]
    assert h.metadata["general.file_type"] == 17
    assert [t.name for t in h.tensors] == tensor_order([t.name for t in src.tensors])
    assert tensor_order(["blk.10.a", "blk.2.b", "output.weight", "blk.2.a"]) == \
        ["output.weight", "blk.2.a", "blk.2.b", "blk.10.a"]


def test_use_more_bits_is_llama_cpps():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20,
                                                            21, 22, 23]


def test_names_and_errors():
    assert parse_ftype("q4_k") == "Q4_K_M" and parse_ftype("15") == "Q4_K_M"
    with pytest.raises(MixError, match="(?i)IQ2_XXS.*no quantizer"):
        parse_ftype("iq2_xxs")
    with pytest.raises(MixError, match="'Q9_K' is not one of"):
        parse_ftype("Q9_K")
    assert parse_tensor_type("ATTN_Q=q8_0") == ("attn_q", "Q8_0")
    with pytest.raises(MixError, match="PATTERN=TYPE"):
        parse_tensor_type("attn_q")
    with pytest.raises(MixError, match="cannot write it"):
        parse_tensor_type("attn_q=iq3_s")
    with pytest.raises(MixError, match="not a regular expression"):
        parse_tensor_type("attn_(q=q8_0")


# ----------------------------------------------------------------------------- imatrix files

def _stats() -> ImatrixStats:
    rng = np.random.default_rng(0)
    return ImatrixStats({
        "blk.0.ffn_down.weight": ImatrixEntry(rng.random(64, dtype=np.float32) * 9,
                                              np.array([40])),
        "blk.0.attn_q.weight": ImatrixEntry(rng.random(32, dtype=np.float32), np.array([40])),
        "blk.0.ffn_up_exps.weight": ImatrixEntry(rng.random(3 * 16, dtype=np.float32),
                                                 np.array([5, 0, 7])),
    }, ["train.txt"], 3, 16)


def test_imatrix_gguf_round_trip_and_quantize_values(tmp_path):
    st = _stats()
    p = write_imatrix_gguf(tmp_path / "im.gguf", st)
    back = read_imatrix(p)
    assert (back.datasets, back.chunk_count, back.chunk_size) == (["train.txt"], 3, 16)
    for k, e in st.entries.items():
        np.testing.assert_array_equal(back.entries[k].sums, e.sums)
        np.testing.assert_array_equal(back.entries[k].counts, e.counts)
    im = load_imatrix_for_quantize(p)
    e = st.entries["blk.0.ffn_up_exps.weight"]
    want = np.concatenate([e.sums[:16] / np.float32(5), np.ones(16, np.float32),
                           e.sums[32:] / np.float32(7)])
    np.testing.assert_array_equal(im.values["blk.0.ffn_up_exps.weight"], want)
    assert im.chunk_count == 3 and im.datasets == ["train.txt"]
    only = load_imatrix_for_quantize(p, include=["attn"])
    assert list(only.values) == ["blk.0.attn_q.weight"]
    assert "blk.0.attn_q.weight" not in load_imatrix_for_quantize(p, exclude=["attn"]).values


def test_imatrix_legacy_round_trip(tmp_path):
    st = _stats()
    p = write_imatrix_dat(tmp_path / "im.dat", st, "train.txt")
    back = read_imatrix(p)
    assert back.is_legacy and back.chunk_count == 3 and back.datasets == ["train.txt"]
    # stored as sum / count * ncall with ncall = ceil(max count / chunk size); read back / ncall
    e = st.entries["blk.0.ffn_down.weight"]
    ncall = 3   # ceil(40 / 16)
    np.testing.assert_array_equal(back.entries["blk.0.ffn_down.weight"].counts, [ncall])
    got = load_imatrix_for_quantize(p).values["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(got, ((e.sums / np.float32(40)) * np.float32(ncall))
                                  / np.float32(ncall))


def test_imatrix_files_that_lie(tmp_path):
    p = write_imatrix_dat(tmp_path / "im.dat", _stats(), "x")
    raw = bytearray(open(p, "rb").read())
    bad = tmp_path / "bad.dat"
    bad.write_bytes(bytes(raw[:-40]))
    with pytest.raises(ImatrixError, match=r"bad\.dat: entry .* needs \d+ bytes; the file ends"):
        read_imatrix(bad)
    raw[4:8] = (2 ** 31 - 1).to_bytes(4, "little")      # the first name's length
    bad.write_bytes(bytes(raw))
    with pytest.raises(ImatrixError, match="name at byte 8 needs 2147483647 bytes"):
        read_imatrix(bad)
    bad.write_bytes(b"\xff\xff\xff\x7f")
    with pytest.raises(ImatrixError, match="not a legacy imatrix file"):
        read_imatrix(bad)
    with pytest.raises(ImatrixError, match="no such file"):
        read_imatrix(tmp_path / "none.dat")


def test_a_type_ggraph_cannot_decode_is_copied_or_refused(tmp_path):
    from ggraph.graphs.gguf.gguf_writer import GGUFWriter

    def odd(path, name):
        w = GGUFWriter(path, "llama")
        w.add_u32("llama.block_count", 1)
        w.add_tensor("blk.0.attn_norm.weight", (256,), 0, np.ones(256, np.float32))
        w.add_tensor(name, (256, 2), 16, bytes(range(132)))     # IQ2_XXS: 66 bytes a block
        return w.write()

    with pytest.raises(MixError, match="'blk.0.odd.weight' is IQ2_XXS: ggraph cannot decode"):
        quantize_model(odd(tmp_path / "a.gguf", "blk.0.odd.weight"), tmp_path / "o.gguf",
                       QuantizeOptions(MixOptions(ftype="Q8_0")))
    assert not (tmp_path / "o.gguf").exists()
    # a tensor the mix leaves alone (a norm) is copied whatever its type
    src = odd(tmp_path / "b.gguf", "blk.0.odd_norm.weight")
    quantize_model(src, tmp_path / "o.gguf", QuantizeOptions(MixOptions(ftype="Q8_0")))
    h = read_header(tmp_path / "o.gguf")
    t = next(t for t in h.tensors if t.name == "blk.0.odd_norm.weight")
    assert t.type_id == 16
    raw = open(tmp_path / "o.gguf", "rb").read()
    assert raw[h.data_offset + t.offset:h.data_offset + t.offset + 132] == bytes(range(132))


@needs_llama
@pytest.mark.parametrize("arch", ["deepseek2", "gemma3"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS", "Q2_K"])
def test_other_architectures_with_3d_weights(tmp_path, arch, ftype):
    """DeepSeek2's per-head attn_k_b/attn_v_b and experts (3-D: an imatrix row per matrix)
    and Gemma 3's layout: the same bytes, with a per-matrix importance matrix."""
    if arch == "deepseek2":
        from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2

        src = write_tiny_deepseek2(tmp_path / "m.gguf")
    else:
        from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf

        src = write_tiny_gguf(tmp_path / "m.gguf")
    rng = np.random.default_rng(5)
    vals = {t.name: rng.gamma(0.5, 2.0, t.ne[0] * (t.ne[2] if len(t.ne) > 2 else 1))
            .astype(np.float32) for t in read_header(src).tensors
            if t.name.startswith("blk.") and len(t.ne) >= 2}
    assert any(len(t.ne) > 2 for t in read_header(src).tensors) or arch == "gemma3"
    assert _both(tmp_path, src, ftype) is None
    assert _both(tmp_path, src, ftype, Imatrix(vals, "im.gguf", ["d"], 3)) is None
