"""graphs/testing/synthetic.py: llama.cpp's Q4_K_M mix (against the real Qwen2.5-Coder-1.5B file when
it is in the cache), random blocks that are valid and unit-gain, big shapes' headers (the data
left a hole, so nothing big is written), and a tiny synthetic that ggraph and llama.cpp run."""
import math
import os

import numpy as np
import pytest
from llama_cpp_ref import array, live, recorded

from ggraph.codecs import quants
from ggraph.config import cache_dir
from ggraph.graphs.gguf.fetch import MODELS, resolve_model
from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.gguf.gguf_reader import read_header
from ggraph.graphs.testing.synthetic import (BLOCK_FILLS, SHAPES, q4_k_m_type, random_blocks,
                                     synthetic_model, tensor_plan, use_more_bits,
                                     write_synthetic)
from ggraph.graphs.gguf.tensor_check import check_tensors
from ggraph.ir.types import record
from ggraph.ir.types import GGMLType

Q4_K, Q6_K, F32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32
REAL_1_5B = cache_dir() / MODELS["qwen2.5-coder-1.5b"].gguf_name


def _types(shape: str) -> dict[str, GGMLType]:
    return {pt.name: pt.type for pt in tensor_plan(SHAPES[shape])}


def _q6_layers(types: dict[str, GGMLType], tensor: str, n_layer: int) -> list[int]:
    return [il for il in range(n_layer) if types[f"blk.{il}.{tensor}.weight"] == Q6_K]


# -- the type rule ---------------------------------------------------------------------------

def test_use_more_bits_is_llama_cpps():
    # 32 layers: the first and last 4, and every third from layer 6
    assert [i for i in range(32) if use_more_bits(i, 32)] == \
        [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


def test_llama3_8b_mix():
    t = _types("llama3-8b")
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert t["output.weight"] == Q6_K and t["token_embd.weight"] == Q4_K
    assert _q6_layers(t, "attn_v", 32) == more and _q6_layers(t, "ffn_down", 32) == more
    assert all(t[f"blk.7.{n}.weight"] == Q4_K
               for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"))
    assert t["blk.0.attn_norm.weight"] == F32 and t["output_norm.weight"] == F32


def test_tied_embeddings_take_the_outputs_type():
    t = _types("qwen2.5-3b")
    assert "output.weight" not in t and t["token_embd.weight"] == Q6_K
    assert t["blk.0.attn_q.bias"] == F32


def test_rows_that_are_not_whole_k_blocks_fall_back():
    # Qwen2.5-0.5B's 896 columns: llama-quantize falls back to 32-element blocks
    assert q4_k_m_type("blk.3.attn_q.weight", (896, 896), 3, 24, True) == GGMLType.Q5_0
    assert q4_k_m_type("blk.0.attn_v.weight", (896, 128), 0, 24, True) == GGMLType.Q8_0
    assert q4_k_m_type("token_embd.weight", (896, 151936), 0, 24, True) == GGMLType.Q8_0
    assert q4_k_m_type("blk.3.attn_q.bias", (896,), 3, 24, True) == F32


@pytest.mark.skipif(not REAL_1_5B.is_file(), reason=f"{REAL_1_5B} is not in the cache "
                    f"(ggraph.graphs.gguf.fetch.fetch_model('qwen2.5-coder-1.5b'), 1.1 GB)")
def test_the_1_5b_shape_is_the_real_files_tensors_and_keys(tmp_path):
    real = read_header(REAL_1_5B)
    plan = tensor_plan(SHAPES["qwen2.5-1.5b"])
    assert {t.name: (t.ne, GGMLType(t.type_id)) for t in real.tensors} == \
        {pt.name: (pt.ne, pt.type) for pt in plan}
    assert sum(t.nbytes for t in real.tensors) == sum(pt.nbytes for pt in plan)
    # the published file counted the layers in name order; numeric order would differ
    assert _q6_layers(_types("qwen2.5-1.5b"), "attn_v", 28) != \
        [i for i in range(28) if use_more_bits(i, 28)]
    mine = read_header(write_synthetic("qwen2.5-1.5b", tmp_path / "h.gguf", data=False))
    for key in ("general.architecture", "general.file_type", "qwen2.block_count",
                "qwen2.context_length", "qwen2.embedding_length", "qwen2.feed_forward_length",
                "qwen2.attention.head_count", "qwen2.attention.head_count_kv",
                "qwen2.rope.freq_base", "qwen2.attention.layer_norm_rms_epsilon",
                "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token"):
        assert mine.metadata[key] == real.metadata[key], key
    toks = mine.metadata["tokenizer.ggml.tokens"]
    assert len(toks) == len(real.metadata["tokenizer.ggml.tokens"])
    for i in (0, 255, 151643, 151644, 151645):
        assert toks[i] == real.metadata["tokenizer.ggml.tokens"][i]


# -- blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("t", list(BLOCK_FILLS), ids=str)
def test_random_blocks_are_finite_and_unit_gain(t):
    assert {at for at, _ in BLOCK_FILLS[t].scales} == set(record(t).scale_fields)
    rng = np.random.Generator(np.random.SFC64(0))
    blocks = random_blocks(rng, t, 4096, 4096 ** -0.5)
    assert quants.first_nonfinite(t, blocks.reshape(-1)) == -1
    x = quants.dequantize(t, blocks.reshape(-1))
    assert np.isfinite(x).all()
    assert abs(x.std() * 64 - 1) < 0.03 and abs(x.mean() * 64) < 0.1


# -- whole files -----------------------------------------------------------------------------

def test_7b_header_counts_and_sizes(tmp_path):
    """The header alone (the data a hole): 339 tensors, sizes as Q4_K_M's arithmetic says."""
    path = write_synthetic("qwen2.5-7b", tmp_path / "q7.gguf", data=False)
    hdr = read_header(path)
    e, ff, kv, n_layer, vocab = 3584, 18944, 512, 28, 152064
    assert len(hdr.tensors) == 3 + 12 * n_layer
    q4, q6 = 144 / 256, 210 / 256
    n_more = sum(use_more_bits(i, n_layer) for i in range(n_layer))
    per_layer = (e * e * 2 + e * kv + ff * e * 2) * q4 + 4 * (2 * e + e + 2 * kv)
    attn_v_down = (e * kv + ff * e) * (n_more * q6 + (n_layer - n_more) * q4)
    want = vocab * e * (q4 + q6) + 4 * e + n_layer * per_layer + attn_v_down
    assert sum(t.nbytes for t in hdr.tensors) == want
    assert hdr.metadata["qwen2.block_count"] == n_layer
    assert len(hdr.metadata["tokenizer.ggml.tokens"]) == vocab
    assert hdr.metadata["tokenizer.ggml.tokens"][151645] == "<|im_end|>"
    align = hdr.alignment
    assert hdr.file_size == hdr.data_offset + sum(-(-t.nbytes // align) * align
                                                  for t in hdr.tensors)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_synthetic("tiny", tmp_path_factory.mktemp("syn") / "tiny.gguf",
                               progress=False))


def test_tiny_passes_the_tensor_check_and_runs_in_ggraph(tiny):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    check_tensors(load_gguf(tiny))
    eng = Engine(tiny, EngineConfig(n_ctx=64, n_ubatch=16, check_tensors=True))
    ids = eng.tokenizer.encode("the synthetic model")
    assert 256 in ids                                   # MERGES' "th"
    logits = eng.eval([SHAPES["tiny"].bos] + ids, all_logits=True)
    assert logits.shape == (len(ids) + 1, 1024) and np.isfinite(logits).all()
    # unit-gain weights: logits of order one, not vanishing nor exploding
    assert 0.1 < logits.std() < 10


def _llama_cpp_loads(llama_cpp, path: str) -> bool:
    """llama_model_load_from_file with check_tensors (llama.cpp's --check-tensors)."""
    params = llama_cpp.llama_model_default_params()
    params.check_tensors = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if model:
        llama_cpp.llama_model_free(model)
    return bool(model)


def test_tiny_passes_llama_cpps_check(tiny, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                                    "(its tensor check cannot be recorded)")
    assert _llama_cpp_loads(llama_cpp, tiny)
    # the check is live: one inf scale fails the load
    hdr = read_header(tiny)
    t = next(t for t in hdr.tensors if t.name == "blk.1.ffn_up.weight")
    at = hdr.data_offset + t.offset + 5 * GGMLType(t.type_id).type_size  # block 5's d
    hdr.mm.close()
    bad = tmp_path / "bad.gguf"
    raw = bytearray(open(tiny, "rb").read())
    raw[at:at + 2] = np.array([np.inf], "<f2").tobytes()
    bad.write_bytes(raw)
    assert not _llama_cpp_loads(llama_cpp, str(bad))


SYNTHETIC_TEXT = "the synthetic model"


def llama_cpp_tokens_and_logits(llama_cpp, tiny: str) -> tuple[list[int], np.ndarray]:
    llm = llama_cpp.Llama(model_path=tiny, n_ctx=64, logits_all=True, verbose=False)
    toks = llm.tokenize(SYNTHETIC_TEXT.encode(), add_bos=False)
    llm.eval(toks)
    return toks, np.array(llm.scores[: len(toks)])


def test_tiny_computes_llama_cpps_logits_in_ggraph(tiny):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    llama_cpp = live()
    if llama_cpp is not None:
        toks, ref = llama_cpp_tokens_and_logits(llama_cpp, tiny)
    else:  # recorded by scripts/record_llama_cpp.py from the same file
        rec = recorded("synthetic_tiny", tiny, exact=True)
        toks, ref = rec["tokens"], array(rec["logits"])
    eng = Engine(tiny, EngineConfig(n_ctx=64, n_ubatch=16))
    assert toks == eng.tokenizer.encode(SYNTHETIC_TEXT)
    assert ref.shape == (len(toks), 1024) and np.isfinite(ref).all()
    # the same model: llama.cpp rounds activations to Q8_K, hence the loose bound
    got = eng.eval(toks, all_logits=True)
    nmse = ((ref - got) ** 2).mean(axis=1) / (ref ** 2).mean(axis=1)
    assert nmse.max() < 1e-2, nmse


def test_the_cache_writes_once_and_rewrites_a_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    path = synthetic_model("tiny", quiet=True)
    assert path.parent == tmp_path / "synthetic"
    mtime = path.stat().st_mtime_ns
    assert resolve_model("synthetic:tiny", quiet=True) == str(path)
    assert path.stat().st_mtime_ns == mtime            # reused
    size = path.stat().st_size
    os.truncate(path, size - 4096)
    assert synthetic_model("tiny", quiet=True).stat().st_size == size
    with pytest.raises(ValueError, match="unknown synthetic shape 'nope'.*qwen2.5-7b"):
        resolve_model("synthetic:nope")
    assert not any(p.name.endswith(".part") for p in path.parent.iterdir())


def test_writing_is_deterministic_per_seed(tmp_path):
    a = write_synthetic("tiny", tmp_path / "a.gguf", seed=3, progress=False).read_bytes()
    b = write_synthetic("tiny", tmp_path / "b.gguf", seed=3, progress=False).read_bytes()
    c = write_synthetic("tiny", tmp_path / "c.gguf", seed=4, progress=False).read_bytes()
    assert a == b and a != c and len(a) == len(c)
    assert math.isclose(len(a), 1.7e6, rel_tol=0.2)
