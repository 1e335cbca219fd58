"""The qwen2 and qwen3 builders (graphs/models/archs/qwen2.py, qwen3.py over graphs/models/archs/dense.py)
on tiny random GGUFs (graphs/testing/tiny.py): against a numpy forward pass written here from the
architectures' definitions (reading the file with gguf-py, not ggraph's loader), decode
steps against one batch, tied and untied output, the tensors each architecture requires or
refuses, and, where llama-cpp-python is installed, against llama.cpp itself."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from llama_cpp_ref import array, live, recorded

from ggraph.check.conformance import nmse
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import GGUFError
from ggraph.graphs.testing.tiny import TinyDense, write_tiny

QWEN2 = TinyDense(arch="qwen2", n_embd=64, n_head=4, n_head_kv=2, rms_eps=1e-6,
                  rope_freq_base=1e6)
# head size 32 while n_embd / n_head is 16: the head size must come from key_length
QWEN3 = TinyDense(arch="qwen3", n_embd=64, n_head=4, n_head_kv=2, head_dim=32, rms_eps=1e-6,
                  rope_freq_base=1e6)
CASES = {
    "qwen2-tied": QWEN2,
    "qwen2-untied-bias": replace(QWEN2, tied_output=False, output_bias=True, seed=1),
    "qwen3-tied": QWEN3,
    "qwen3-untied": replace(QWEN3, tied_output=False, n_head_kv=1, seed=2),
}
TOKENS = [5, 70, 80, 90, 100, 3, 200, 150, 33, 44, 7, 250]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    return {name: write_tiny(d / f"{name}.gguf", cfg) for name, cfg in CASES.items()}


# -- an independent forward pass --------------------------------------------------------------

def _weights(path: str) -> dict[str, np.ndarray]:
    import gguf

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(data, np.float64).reshape([int(n) for n in
                                                            reversed(t.shape)])
    return out


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_neox(x: np.ndarray, base: float) -> np.ndarray:
    """x (T, H, d): rotate (x[i], x[i + d/2]) by pos * base^(-2i/d)."""
    T, _, d = x.shape
    half = d // 2
    theta = np.arange(T)[:, None] * base ** (-np.arange(half) * 2.0 / d)[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def numpy_logits(path: str, cfg: TinyDense, tokens: list[int]) -> np.ndarray:
    """All-position logits (T, n_vocab) of the Qwen2/Qwen3 decoder, in float64."""
    W = _weights(path)
    T, hd, H, Hkv, eps = len(tokens), cfg.hd, cfg.n_head, cfg.n_head_kv, cfg.rms_eps
    x = W["token_embd.weight"][tokens]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0.0)
                   for n in "qkv")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if p + "attn_q_norm.weight" in W:
            q = _rms(q, W[p + "attn_q_norm.weight"], eps)
            k = _rms(k, W[p + "attn_k_norm.weight"], eps)
        q, k = _rope_neox(q, cfg.rope_freq_base), _rope_neox(k, cfg.rope_freq_base)
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", a, v).reshape(T, H * hd)
        x = x + att @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    x = _rms(x, W["output_norm.weight"], eps)
    out = W.get("output.weight", W["token_embd.weight"])
    return x @ out.T + W.get("output.bias", 0.0)


# -- ggraph against the numpy pass -------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_numpy(models, name):
    eng = Engine(models[name], EngineConfig(n_ctx=64, n_ubatch=16))
    got = eng.eval(TOKENS, all_logits=True)
    want = numpy_logits(models[name], CASES[name], TOKENS)
    assert got.shape == want.shape
    assert nmse(want, got) < 1e-5, nmse(want, got)   # the F16 KV cache rounds K and V


@pytest.mark.parametrize("name", ["qwen2-untied-bias", "qwen3-tied"])
def test_decode_steps_match_one_batch(models, name):
    eng = Engine(models[name], EngineConfig(n_ctx=64, n_ubatch=16))
    full = eng.eval(TOKENS, all_logits=True)
    eng.reset()
    eng.eval(TOKENS[:4])
    steps = np.stack([eng.eval([t]) for t in TOKENS[4:]])
    assert nmse(full[4:], steps) < 1e-6


def test_flash_attention_matches_plain(models):
    plain = Engine(models["qwen3-untied"], EngineConfig(n_ctx=64, n_ubatch=16))
    flash = Engine(models["qwen3-untied"], EngineConfig(n_ctx=64, n_ubatch=16,
                                                        flash_attn=True))
    assert nmse(plain.eval(TOKENS, all_logits=True),
                flash.eval(TOKENS, all_logits=True)) < 5e-4


def test_tied_and_untied_output(models):
    tied = Engine(models["qwen2-tied"], EngineConfig(n_ctx=64)).model
    untied = Engine(models["qwen2-untied-bias"], EngineConfig(n_ctx=64)).model
    assert tied.w["output"] is tied.w["token_embd"] and tied.w["output_b"] is None
    assert untied.w["output"].name == "output.weight"
    assert untied.w["output_b"].name == "output.bias"


def test_head_size_from_key_length(models):
    m = Engine(models["qwen3-tied"], EngineConfig(n_ctx=64)).model
    assert (m.hp.head_dim, m.hp.n_rot, m.hp.n_embd_gqa) == (32, 32, 64)
    assert m.w["layers"][0]["attn_q"].ne[:2] == (64, 128)
    assert m.w["layers"][0]["attn_q_norm"].ne[0] == 32


def test_the_graph_carries_each_architectures_nodes(models):
    """Qwen2's biases and Qwen3's head norms are nodes of the graph; NEOX rope in both."""
    from ggraph.ops.rope import RopeMode
    from ggraph.ir.tensor import Context

    for name, want, absent in [("qwen2-untied-bias", ["Qcur_b-0", "Vcur_b-1",
                                                      "result_output_b"], "Qcur_normed-0"),
                               ("qwen3-tied", ["Qcur_normed-0", "Kcur_normed-1"], "Qcur_b-0")]:
        m = Engine(models[name], EngineConfig(n_ctx=64)).model
        ctx = Context()
        mg = m.build(ctx, m.new_cache(ctx, 64), 4, 64, 4)
        names = {n.name for n in mg.graph.nodes}
        assert set(want) <= names and absent not in names, name
        ropes = [n for n in mg.graph.nodes if n.name.endswith("(roped)")]
        assert ropes and all(n.params.mode == RopeMode.NEOX for n in ropes)


# -- what each architecture requires or refuses -------------------------------------------------

def test_qwen2_biases_are_optional_as_in_llama_cpp(tmp_path):
    skip = tuple(f"blk.{il}.attn_{n}.bias" for il in range(2) for n in "qkv")
    p = write_tiny(tmp_path / "nobias.gguf", QWEN2, skip=skip)
    eng = Engine(p, EngineConfig(n_ctx=64))
    assert eng.model.w["layers"][0]["attn_q_b"] is None
    assert nmse(numpy_logits(p, QWEN2, TOKENS), eng.eval(TOKENS, all_logits=True)) < 1e-5


def test_qwen3_needs_its_head_norms(tmp_path):
    p = write_tiny(tmp_path / "nonorm.gguf", QWEN3, skip=("blk.1.attn_k_norm.weight",))
    with pytest.raises(GGUFError, match=r"'blk\.1\.attn_k_norm\.weight' is missing"):
        Engine(p, EngineConfig(n_ctx=64))


def test_llama_refuses_qwen2s_biases(tmp_path):
    """The same file under the llama name: llama's spec reads no biases, so they are left
    over (llama.cpp reads them for llama too; ggraph's llama keeps its graph unchanged)."""
    p = write_tiny(tmp_path / "biased-llama.gguf", QWEN2, arch="llama")
    with pytest.raises(GGUFError, match=r"not used by llama.*attn_q\.bias"):
        Engine(p, EngineConfig(n_ctx=64))


def test_partial_rope_is_refused_for_qwen(tmp_path):
    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.models.hparams import read_hparams

    meta = {"qwen3.block_count": 1, "qwen3.embedding_length": 64, "qwen3.context_length": 64,
            "qwen3.feed_forward_length": 96, "qwen3.attention.head_count": 4,
            "qwen3.attention.key_length": 32, "qwen3.rope.dimension_count": 16}
    with pytest.raises(GGUFError, match=r"f\.gguf: rope\.dimension_count 16 must equal the "
                                        r"head size 32"):
        read_hparams(model_class("qwen3").hparams_class, meta, "qwen3", "f.gguf")
    del meta["qwen3.rope.dimension_count"]
    hp = read_hparams(model_class("qwen3").hparams_class, meta, "qwen3", "f.gguf")
    assert (hp.head_dim, hp.n_rot, hp.n_head_kv) == (32, 32, 4)


def test_an_unknown_architecture_is_still_an_error(tmp_path):
    p = write_tiny(tmp_path / "m.gguf", QWEN3, arch="qwen9")
    with pytest.raises(GGUFError, match=r"unknown architecture 'qwen9'; ggraph builds .*"
                                        r"llama, qwen2, qwen3"):
        Engine(p, EngineConfig(n_ctx=64))


# -- llama.cpp ---------------------------------------------------------------------------------

def llama_cpp_logits(llama_cpp, path: str) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, verbose=False)
    llm.eval(TOKENS)
    return np.array(llm.scores[: len(TOKENS)])


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_llama_cpp(models, name):
    llama_cpp = live()
    if llama_cpp is not None:
        ref = llama_cpp_logits(llama_cpp, models[name])
    else:  # recorded by scripts/record_llama_cpp.py from the same file
        ref = array(recorded("qwen_tiny", models[name], exact=True, case=name)["logits"])
    got = Engine(models[name], EngineConfig(n_ctx=64, n_ubatch=16)).eval(TOKENS,
                                                                         all_logits=True)
    per_row = [nmse(a, b) for a, b in zip(ref, got)]
    assert max(per_row) < 1e-4, per_row
