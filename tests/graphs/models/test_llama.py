"""The llama builder on tiny random GGUFs (fast, exact checks) and on the real SmolLM2
(memory figures against llama.cpp's, coherent text). Comparisons with llama.cpp itself live
in benchmarks/compare_llama_cpp.py (it builds llama-cpp-python from source)."""
from __future__ import annotations

import numpy as np
import pytest
from llama_cpp_ref import live, recorded, sure_steps

from ggraph.check.conformance import nmse
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.models.model_graph import causal_batch
from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Context
from ggraph.ir.types import MIB



@pytest.fixture(scope="module")
def tiny(tiny_models):
    # head_dim 32
    return tiny_models.made(write_tiny_llama, TinyLlama(n_embd=128, weight_type="q8_0"))


def reference_logits(eng: Engine, tokens: list[int], amb: int = 0, flash: bool = False):
    """All-token logits of one ubatch in the reference executor (a fresh, zero cache)."""
    ctx = Context()
    cache = eng.model.new_cache(ctx, eng.cfg.n_ctx, flash_attn=flash)
    mg = eng.model.build(ctx, cache, len(tokens), eng.cfg.n_ctx, len(tokens), flash, amb)
    inputs = causal_batch(mg, cache, np.array(tokens), 0, np.arange(len(tokens)))
    return run_reference(mg.graph, inputs).read(mg.logits).reshape(len(tokens), -1), mg


def test_cpu_logits_match_reference(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32))
    toks = eng.tokenizer.encode("the quick brown fox")
    ref, _ = reference_logits(eng, toks)
    got = eng.eval(toks, all_logits=True)
    assert nmse(ref, got) < 5e-4


def test_decode_steps_match_one_batch(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32))
    # fewer tokens than BLAS_MIN_N: the batch takes the decode steps' integer mat-vec, so the
    # two differ only in how the cache is filled and read. (From 16 tokens the batch rounds
    # its activations through BLAS in another order; a difference of 1e-7 then flips an int8
    # activation quant here and there, ~5e-5 NMSE at those positions.)
    toks = eng.tokenizer.encode("jumps over the lazy dog")[:12]
    full = eng.eval(toks, all_logits=True)
    eng.reset()
    eng.eval(toks[:3])
    steps = [eng.eval([t]) for t in toks[3:]]
    assert nmse(full[3:], np.stack(steps)) < 1e-6


def test_split_attention_is_exact_in_the_reference(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=4096, n_ubatch=64))
    toks = list(np.random.default_rng(1).integers(3, 200, 64))
    plain, mg0 = reference_logits(eng, toks)
    split, mg1 = reference_logits(eng, toks, amb=1)  # K*Q is 4 MiB: 4 steps of one head
    assert mg1.graph.n_nodes > mg0.graph.n_nodes
    kq = [n for n in mg1.graph.nodes if n.name.startswith("kq-0")]
    assert len(kq) == 4 and all(n.nbytes <= MIB for n in kq)
    assert nmse(plain, split) < 1e-10


def test_split_attention_on_cpu(tiny):
    base = Engine(tiny, EngineConfig(n_ctx=4096, n_ubatch=64))
    split = Engine(tiny, EngineConfig(n_ctx=4096, n_ubatch=64, amb_mib=1))
    toks = list(np.random.default_rng(2).integers(3, 200, 40))
    assert nmse(base.eval(toks, all_logits=True), split.eval(toks, all_logits=True)) < 1e-6
    assert split.reserve_plan.size < base.reserve_plan.size


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q4_1")])
def test_quantized_kv_cache_with_flash_attention(tiny, tk, tv):
    ref = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32, flash_attn=True))
    eng = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32, type_k=tk, type_v=tv,
                                    flash_attn=True))
    from ggraph.graphs.models.kv_cache import kv_cache_bytes
    from ggraph.ir.types import GGMLType

    hp = eng.model.hp
    assert eng.cache.nbytes == kv_cache_bytes(hp.n_layer, hp.n_embd_gqa, hp.n_embd_gqa, 256,
                                              GGMLType.parse(tk), GGMLType.parse(tv))
    toks = ref.tokenizer.encode("a quantized cache")
    err = nmse(ref.eval(toks, all_logits=True), eng.eval(toks, all_logits=True))
    assert err < 5e-2, err


def test_flash_attention_matches_plain(tiny):
    a = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32))
    b = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=32, flash_attn=True))
    toks = a.tokenizer.encode("flash or not")
    # like ggml, the mul_mat path multiplies F16-rounded queries and probabilities by the F16
    # cache; flash attention reads the cache with float32 queries: mul_mat's tolerance
    assert nmse(a.eval(toks, all_logits=True), b.eval(toks, all_logits=True)) < 5e-4


def test_quantized_v_cache_needs_flash_attention(tiny):
    with pytest.raises(ValueError, match="needs flash attention"):
        Engine(tiny, EngineConfig(n_ctx=256, type_v="q8_0"))


# -- bad input through the CLI: one clear line, no traceback ------------------------------

def _run_cli(capsys, *argv):
    from ggraph.cli import main

    rc = main(["run", *argv, "-n", "1", "-c", "256"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    return err


def test_bad_files(tmp_path, capsys, tiny):
    data = open(tiny, "rb").read()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    assert "truncated" in _run_cli(capsys, str(tmp_path / "trunc.gguf"))
    bad = bytearray(data)
    bad[:4] = b"XXXX"
    (tmp_path / "bad.gguf").write_bytes(bytes(bad))
    assert "not a readable GGUF" in _run_cli(capsys, str(tmp_path / "bad.gguf"))
    assert "nope.gguf: no such" in _run_cli(capsys, str(tmp_path / "nope.gguf"))


def test_bad_models(tmp_path, capsys):
    p = write_tiny_llama(tmp_path / "m1.gguf", skip=("blk.1.ffn_up.weight",))
    assert "'blk.1.ffn_up.weight' is missing" in _run_cli(capsys, p)
    p = write_tiny_llama(tmp_path / "m2.gguf", reshape={"blk.0.attn_k.weight": (64, 48)})
    assert "'blk.0.attn_k.weight' has ne=[64, 48], expected [64, 32]" in _run_cli(capsys, p)
    p = write_tiny_llama(tmp_path / "m3.gguf", arch="mamba9")
    assert "unknown architecture 'mamba9'" in _run_cli(capsys, p)
    p = write_tiny_llama(tmp_path / "m4.gguf", TinyLlama(n_ctx_train=128))
    assert "larger than the model's training context 128" in _run_cli(capsys, p)


# -- the real model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from ggraph.graphs.gguf.fetch import default_model

    return str(default_model())


def test_smollm2_memory_matches_llama_cpp(smollm2):
    """llama.cpp at -c 4096 -ub 512 without flash attention: CPU compute buffer 99.38 MiB,
    KV cache 90.00 MiB (f16)."""
    eng = Engine(smollm2, EngineConfig(n_ctx=4096, n_ubatch=512, strategy="default"))
    plan = eng.reserve_plan
    assert eng.cache.nbytes == 90 * MIB
    assert abs(plan.ggml_size / MIB - 99.38) / 99.38 < 0.02
    assert plan.size / MIB <= 99.38
    assert "llama_kv_cache: size =   90.00 MiB" in "\n".join(eng.memory_lines())


def test_smollm2_split_attention_caps_kq(smollm2):
    """With every token's logits reserved (llama.cpp) the 96 MiB logits dominate; reserving
    the last token's only shows what the cap saves."""
    cfg = dict(n_ctx=4096, n_ubatch=512, reserve_outputs="last")
    plain = Engine(smollm2, EngineConfig(**cfg))
    split = Engine(smollm2, EngineConfig(amb_mib=16, **cfg))
    kq = [n for n in split.worst_case.graph.nodes if n.name.startswith("kq-")]
    assert kq and max(n.nbytes for n in kq) <= 16 * MIB
    assert max(n.nbytes for n in plain.worst_case.graph.nodes if n.name.startswith("kq-")) \
        == 72 * MIB
    assert split.reserve_plan.size < plain.reserve_plan.size - 48 * MIB


GREEDY_PROMPT = "The capital of France is"
N_GREEDY = 8


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2):
    """ggraph's prompt ids and greedy continuation (N_GREEDY tokens) of GREEDY_PROMPT."""
    eng = Engine(smollm2, EngineConfig(n_ctx=512, n_ubatch=64))
    prompt = eng.tokenizer.encode(GREEDY_PROMPT)
    return eng, prompt, list(eng.generate(prompt, N_GREEDY, stop_at_eos=False))


def test_smollm2_says_paris(smollm2_greedy):
    eng, _, gen = smollm2_greedy
    text = eng.tokenizer.decode(gen[:4])
    assert "Paris" in text, text


def llama_cpp_greedy(llama_cpp, path: str, text: str, n: int) -> dict:
    """llama.cpp's prompt ids, greedy continuation of `text` (n tokens) and the margin between
    its two best logits at each step."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False)
    prompt = llm.tokenize(text.encode("utf-8"), add_bos=True)
    llm.eval(prompt)
    gen, margins = [], []
    for _ in range(n):
        lg = np.asarray(llm.scores[llm.n_tokens - 1], np.float32)
        top2 = np.sort(lg)[-2:]
        gen.append(int(np.argmax(lg)))
        margins.append(float(top2[1] - top2[0]))
        llm.eval([gen[-1]])
    llm.close()
    return {"prompt": prompt, "tokens": gen, "margins": margins}


def test_smollm2_greedy_matches_llama_cpp(smollm2, smollm2_greedy):
    """The same prompt ids and greedy tokens as llama.cpp up to the first step where its two
    best logits are closer than MIN_MARGIN (there either may win, in either program)."""
    _, prompt, gen = smollm2_greedy
    llama_cpp = live()
    ref = (llama_cpp_greedy(llama_cpp, smollm2, GREEDY_PROMPT, N_GREEDY)
           if llama_cpp is not None else recorded("greedy_smollm2", smollm2))
    assert prompt == ref["prompt"]
    k = sure_steps(ref["margins"])
    assert k >= 1, ref["margins"]
    assert gen[:k] == ref["tokens"][:k], (gen, ref)
