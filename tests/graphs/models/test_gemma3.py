"""The gemma3 builder and llama.cpp's iswa KV cache on tiny random Gemma 3 GGUFs
(graphs/testing/tiny_gemma3.py): logits against a plain numpy forward pass written here from the model
description, sliding-window masking past the window and past the ring of cells, decode steps
against one prompt pass, cutting the sequence back, the cache's sizes and memory lines, and
(with llama-cpp-python installed) logits against llama.cpp itself. The real Gemma 3 270M is
compared with llama.cpp by benchmarks/compare_gemma3_llama_cpp.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from llama_cpp_ref import array, live, recorded

from ggraph.check.conformance import nmse
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf
from ggraph.graphs.models.kv_cache import KVCache, kv_cache_bytes
from ggraph.graphs.models.kv_iswa import IswaKVCache, swa_cache_size
from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf
from ggraph.ir.types import GGMLType

N_SWA = 16
CFG = dict(n_ctx=512, n_ubatch=64)   # ring: pad256(16 + 64) = 256 cells


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models.made(write_tiny_gguf, n_swa=N_SWA)


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, EngineConfig(**CFG))


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 272, n)]


# -- a plain numpy Gemma 3 ------------------------------------------------------------------------

def reference_logits(path: str, tokens: list[int], n_swa: int | None = None) -> np.ndarray:
    """Gemma 3's forward pass in float64 from the file's weights: every layer slides except
    every sixth (5, 11, ...) when the file has a window, local rope base 10000, global rope.freq_base, queries scaled by
    1/sqrt(head size). K and V are rounded to float16 as both runtimes' F16 caches store them."""
    import gguf

    r = gguf.GGUFReader(path)
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    W = {t.name: np.asarray(t.data, np.float64) for t in r.tensors}
    n_layer, e = md["gemma3.block_count"], md["gemma3.embedding_length"]
    n_head, n_kv = md["gemma3.attention.head_count"], md["gemma3.attention.head_count_kv"]
    hd, eps = md["gemma3.attention.key_length"], md["gemma3.attention.layer_norm_rms_epsilon"]
    window = md["gemma3.attention.sliding_window"] if n_swa is None else n_swa
    T = len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, base):  # NEOX: rotate (x[i], x[i + hd/2]); x [T, heads, hd]
        half = hd // 2
        theta = np.arange(T)[:, None] * base ** (-2.0 * np.arange(half) / hd)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    def gelu(x):  # tanh approximation, as ggml_gelu
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = W["token_embd.weight"][tokens] * np.sqrt(np.float32(e))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    for il in range(n_layer):
        L = {k.split(".", 2)[2].removesuffix(".weight"): v for k, v in W.items()
             if k.startswith(f"blk.{il}.")}
        slides = window > 0 and il % 6 < 5   # without a window every layer is global
        h = rms(x, L["attn_norm"])
        q = rms((h @ L["attn_q"].T).reshape(T, n_head, hd), L["attn_q_norm"])
        k = rms((h @ L["attn_k"].T).reshape(T, n_kv, hd), L["attn_k_norm"])
        v = (h @ L["attn_v"].T).reshape(T, n_kv, hd)
        base = 10000.0 if slides else md["gemma3.rope.freq_base"]
        q, k = rope(q, base) / np.sqrt(hd), rope(k, base)
        k, v = (a.astype(np.float16).astype(np.float64) for a in (k, v))
        seen = (j <= i) & ((i - j < window) if slides else True)
        out = np.empty((T, n_head, hd))
        for hh in range(n_head):
            kv = hh // (n_head // n_kv)
            s = np.where(seen, q[:, hh] @ k[:, kv].T, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + rms(out.reshape(T, -1) @ L["attn_output"].T, L["post_attention_norm"])
        h = rms(x, L["ffn_norm"])
        d = (gelu(h @ L["ffn_gate"].T) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
        x = x + rms(d, L["post_ffw_norm"])
    return rms(x, W["output_norm.weight"]) @ W["token_embd.weight"].T


# -- the builder ----------------------------------------------------------------------------------

def test_hparams_and_layer_kinds(engine):
    hp = engine.model.hp
    assert hp.head_dim == 32 != hp.n_embd // hp.n_head
    assert hp.is_swa == (True,) * 5 + (False, True)
    assert hp.rope_freq_base_swa == 10000.0 and hp.rope_freq_base == 1e6
    assert hp.attention_scale == pytest.approx(32 ** -0.5)
    assert isinstance(engine.cache, IswaKVCache)


def test_logits_match_numpy_reference_past_window_and_ring(engine, tiny):
    toks = prompt(300)   # past the window (16) and past the ring (256 cells)
    engine.reset()
    got = engine.eval(toks, all_logits=True)
    ref = reference_logits(tiny, toks)
    assert nmse(ref, got) < 1e-4
    assert nmse(ref[-40:], got[-40:]) < 1e-4   # the positions whose cells wrapped
    # the window matters: without it the reference is far from what the engine computes
    assert nmse(reference_logits(tiny, toks, n_swa=10 ** 6)[-40:], got[-40:]) > 1e-2


def test_decode_steps_match_the_prompt_pass(engine):
    toks = prompt(270, seed=1)
    engine.reset()
    full = engine.eval(toks, all_logits=True)
    engine.reset()
    engine.eval(toks[:248])
    steps = np.stack([engine.eval([t]) for t in toks[248:]])   # crosses the ring's end (256)
    assert nmse(full[248:], steps) < 1e-6


def test_cutting_back_inside_and_outside_the_ring(engine):
    toks = prompt(300, seed=2)
    engine.reset()
    engine.eval(toks)
    # positions 185..199 are still in the ring: the cut sequence continues exactly
    again = engine.eval(toks[200:210], all_logits=True, n_past=200)
    engine.reset()
    fresh = engine.eval(toks[:210], all_logits=True)[200:]
    assert nmse(fresh, again) < 1e-6
    engine.eval(toks[210:300])
    # position 25..39 (the window before 40) were overwritten by 281..295
    with pytest.raises(ValueError, match="no longer holds positions 25..39"):
        engine.eval(toks[40:41], n_past=40)
    assert engine.cache.n_used == 300


def test_swa_mask_of_a_ubatch():
    """One sequence appended 8 tokens at a time: the sliding-window cells become a ring
    (cell = position % 256), and a ubatch's mask sees the window only."""
    from ggraph.graphs.models.batch import UBatch
    from ggraph.ir.tensor import Context

    c = IswaKVCache.create(Context(), [True, False], 8, 8, 512, n_swa=4, n_ubatch=8)
    assert c.swa.size == 256 and c.base.size == 512 and c.swa_n_kv(256) == 256

    def ub(p0: int, n: int) -> UBatch:
        pos = np.arange(p0, p0 + n, dtype=np.int32)
        return UBatch(pos.copy(), pos, ((0,),) * n, np.zeros(n, bool))

    for p0 in range(0, 296, 8):        # positions 0..295
        c.place(ub(p0, 8))
    c.place(ub(296, 4))                # 296..299: positions 44..299 in the ring
    assert c.swa.seq_pos_min(0) == 44 and c.swa.seq_pos_max(0) == 299
    assert c.base.seq_pos_min(0) == 0
    u = ub(300, 3)
    slots = c.place(u)
    assert list(slots.swa) == [300 % 256, 301 % 256, 302 % 256]
    assert list(slots.cells) == [300, 301, 302]
    mask = c.swa.mask(u, 256)
    seen = [np.flatnonzero(row == 0).tolist() for row in mask]
    # query 300 sees 297, 298, 299, 300; query 302 sees 299..302
    assert seen[0] == sorted(p % 256 for p in (297, 298, 299, 300))
    assert seen[2] == sorted(p % 256 for p in (299, 300, 301, 302))
    assert np.isneginf(mask).sum() == 3 * 256 - 12


def test_cache_sizes_and_memory_lines(tmp_path):
    p = write_tiny_gguf(tmp_path / "w512.gguf", n_swa=512, n_ctx_train=8192)
    eng = Engine(p, EngineConfig(n_ctx=4096, n_ubatch=512))
    c = eng.cache
    assert (c.base.size, c.base.n_layer, c.swa.size, c.swa.n_layer) == (4096, 1, 1024, 6)
    assert swa_cache_size(4096, 512, 512) == 1024 and swa_cache_size(300, 512, 512) == 512
    assert swa_cache_size(4096, 512, 512, swa_full=True) == 4096
    # every sequence keeps its own window (llama.cpp: n_swa * n_seq_max + n_ubatch, unified)
    assert swa_cache_size(4096, 512, 512, n_seq_max=4) == 2560
    assert swa_cache_size(2048, 512, 512, n_seq_max=4) == 2048
    gqa = eng.model.hp.n_embd_gqa
    f16 = GGMLType.F16
    assert c.nbytes == kv_cache_bytes(1, gqa, gqa, 4096, f16, f16) + \
        kv_cache_bytes(6, gqa, gqa, 1024, f16, f16)
    lines = eng.memory_lines()
    at = lines.index("llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells")
    assert lines[at + 1] == ("llama_kv_cache: size =    1.00 MiB (  4096 cells,   1 layers,  "
                             "1/1 seqs), K (f16):    0.50 MiB, V (f16):    0.50 MiB")
    assert lines[at + 2] == "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells"
    assert lines[at + 3].startswith("llama_kv_cache: size =    1.50 MiB (  1024 cells,   6 "
                                    "layers,  1/1 seqs)")
    # the worst case attends to every cell of each cache: 4096 global, 1024 sliding
    masks = {n.name: n.ne[:2] for n in eng.worst_case.graph.leafs if n.name.startswith("kq_")}
    assert masks == {"kq_mask": (4096, 512), "kq_mask_swa": (1024, 512)}
    assert c.k[5] is c.base.k[0] and c.k[6] is c.swa.k[5] and c.k[5].name == "cache_k_l5"


def test_pattern_keys_and_no_window(tmp_path):
    from ggraph.graphs.models.arch import build_model

    m = build_model(load_gguf(write_tiny_gguf(tmp_path / "p3.gguf", swa_pattern=3)))
    assert m.hp.is_swa == (True, True, False) * 2 + (True,)
    flags = [False, True, True, False, True, True, True]
    m = build_model(load_gguf(write_tiny_gguf(tmp_path / "pa.gguf", swa_pattern=flags)))
    assert list(m.hp.is_swa) == flags
    p = write_tiny_gguf(tmp_path / "none.gguf", n_swa=0)
    eng = Engine(p, EngineConfig(**CFG))
    assert not any(eng.model.hp.is_swa) and isinstance(eng.cache, KVCache)
    toks = prompt(40, seed=3)
    assert nmse(reference_logits(p, toks), eng.eval(toks, all_logits=True)) < 1e-4


def test_flash_attention_matches_plain(engine, tiny):
    fa = Engine(tiny, EngineConfig(flash_attn=True, **CFG))
    toks = prompt(280, seed=4)
    engine.reset()
    assert nmse(engine.eval(toks, all_logits=True), fa.eval(toks, all_logits=True)) < 5e-4


def test_a_ubatch_longer_than_the_ring_allows_is_refused(tiny):
    from ggraph.ir.tensor import Context

    eng_model = Engine(tiny, EngineConfig(**CFG)).model
    cache = eng_model.new_cache(Context(), 1024, n_ubatch=64)
    with pytest.raises(ValueError, match="does not fit the sliding-window cache"):
        eng_model.build(Context(), cache, 256, 1024, 1)


def test_bad_pattern_key(tmp_path):
    from ggraph.graphs.models.arch import build_model

    p = write_tiny_gguf(tmp_path / "bad.gguf", swa_pattern=[True, False])
    with pytest.raises(GGUFError, match="sliding_window_pattern' must hold 7 per-layer flags"):
        build_model(load_gguf(p))


def test_a_vocabulary_ggraph_cannot_build_leaves_token_ids(tiny, tmp_path):
    from gguf.constants import GGUFValueType as VT

    from ggraph.graphs.testing.gguf_fuzz import rewrite_gguf

    p = rewrite_gguf(tiny, tmp_path / "t5.gguf", {"tokenizer.ggml.model": ("t5", VT.STRING, None)})
    eng = Engine(p, EngineConfig(**CFG))
    toks = prompt(20, seed=6)
    assert nmse(reference_logits(tiny, toks), eng.eval(toks, all_logits=True)) < 1e-4
    assert eng.eos == 1
    with pytest.raises(GGUFError, match="not supported.*evaluate token ids with Engine.eval"):
        eng.tokenizer.encode("the")


# -- llama.cpp ------------------------------------------------------------------------------------

LLAMA_CPP_PROMPT = dict(n=300, seed=5)
RECORDED_ROWS = slice(None, None, 5)  # the recording keeps every fifth position's logits


def llama_cpp_logits(llama_cpp, tiny: str, toks: list[int]) -> np.ndarray:
    lm = llama_cpp.Llama(model_path=tiny, n_ctx=CFG["n_ctx"], n_batch=CFG["n_ubatch"],
                         n_ubatch=CFG["n_ubatch"], logits_all=True, verbose=False,
                         swa_full=False)
    lm.eval(toks)
    return np.asarray(lm.scores[:len(toks)])


def test_logits_match_llama_cpp(tiny, engine):
    llama_cpp = live()
    toks = prompt(**LLAMA_CPP_PROMPT)
    if llama_cpp is not None:
        ref = llama_cpp_logits(llama_cpp, tiny, toks)
        rows = slice(None)
    else:  # recorded by scripts/record_llama_cpp.py from the same file: some positions
        ref = array(recorded("gemma3_tiny", tiny, exact=True)["logits"])
        rows = RECORDED_ROWS
    engine.reset()
    assert nmse(ref, engine.eval(toks, all_logits=True)[rows]) < 1e-4


def test_swa_full_keeps_every_position_and_the_same_logits(tiny):
    """--swa-full (llama.cpp's): the sliding-window layers get a cache of n_ctx cells instead
    of a ring of pad256(n_swa + n_ubatch), and the logits do not change, past the window too
    (the window is the mask's, not the ring's)."""
    cfg = dict(n_ctx=512, n_ubatch=16)
    ring = Engine(tiny, EngineConfig(**cfg))
    full = Engine(tiny, EngineConfig(**cfg, swa_full=True))
    assert full.cache.swa.size == 512 and ring.cache.swa.size == swa_cache_size(512, N_SWA, 16)
    assert ring.cache.swa.size < 512
    # past the ring's length (its cells reused) and many windows, in ubatches of 16
    n_ring = ring.cache.swa.size
    toks = [(7 * i) % 50 + 3 for i in range(n_ring + 3 * N_SWA)]
    a, b = full.eval(toks, all_logits=True), ring.eval(toks, all_logits=True)
    # the same cells in the same order until the ring wraps: bit for bit
    np.testing.assert_array_equal(a[:n_ring], b[:n_ring])
    # after it, the window's cells sit in another order, so softmax and V sum them in another
    # order: float32 rounding (about 2e-5 of the largest logit here), not other values
    np.testing.assert_allclose(a[n_ring:], b[n_ring:], rtol=0, atol=1e-4 * np.abs(a).max())
    assert (a.argmax(axis=1) == b.argmax(axis=1)).all()
    assert "creating     SWA KV cache, size = 512 cells" in "\n".join(full.memory_lines())


def test_plan_swa_full_flag(tiny, capsys):
    from ggraph.cli import main

    assert main(["plan", str(tiny), "-c", "512", "-ub", "16", "--swa-full"]) == 0
    assert "creating     SWA KV cache, size = 512 cells" in capsys.readouterr().out
