"""End-of-generation tokens and special ids as llama.cpp derives them (graphs/tokenizers/special_tokens.py).

For SmolLM2, Gemma 3 and Qwen2.5 0.5B the EOG set is compared with llama.cpp's for every token
id: with llama-cpp-python's llama_vocab_is_eog when it is installed, and always with the sets
it gave, recorded in tests/data/eog/ (`python scripts/record_llama_cpp.py eog` writes them
again). The rules themselves (ids found by text, llama.cpp's exceptions, range checks naming
the key) run on small vocabularies built by hand.
"""
from __future__ import annotations

import json

import pytest

from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf
from ggraph.graphs.tokenizers.special_tokens import KEYS
from ggraph.graphs.tokenizers.tokenizer import Tokenizer
import paths

DATA = paths.DATA / "eog"
MODELS = ("default", "gemma3", "qwen2.5-coder-0.5b")
K = "tokenizer.ggml."


def model_tokenizer(name: str) -> tuple[str, Tokenizer]:
    from ggraph.graphs.gguf.fetch import resolve_model

    path = resolve_model(name)
    return path, Tokenizer(load_gguf(path, with_data=False).metadata, path)


def llama_cpp_special(path: str) -> dict:
    """llama.cpp's answers for a GGUF's vocabulary: every id's llama_vocab_is_eog, and the
    special ids (None where llama.cpp has none)."""
    import llama_cpp as L

    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(path.encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        vocab = L.llama_model_get_vocab(model)
        n = L.llama_vocab_n_tokens(vocab)
        ids = {name: getattr(L, f"llama_vocab_{name}")(vocab) for name in
               ("bos", "eos", "eot", "sep", "pad", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
                "fim_rep", "fim_sep")}
        return {"n_vocab": n, "eog": [i for i in range(n) if L.llama_vocab_is_eog(vocab, i)],
                "ids": {k: (None if v < 0 else v) for k, v in ids.items()}}
    finally:
        L.llama_model_free(model)


@pytest.mark.parametrize("name", MODELS)
def test_eog_equals_recorded_llama_cpp(name):
    _, tok = model_tokenizer(name)
    ref = json.loads((DATA / f"{name}.json").read_text())
    assert ref["n_vocab"] == tok.n_vocab
    assert sorted(tok.eog_ids) == ref["eog"]
    assert_same_ids(tok, ref["ids"])


def assert_same_ids(tok: Tokenizer, ref: dict) -> None:
    # not eot: where a vocabulary has two end-of-turn texts, llama.cpp takes whichever its
    # hash map yields first (both are in the EOG set)
    for k, v in ref.items():
        if k != "eot":
            assert getattr(tok.special, k) == v, k
    assert ref["eot"] is None or ref["eot"] in tok.eog_ids


@pytest.mark.parametrize("name", MODELS)
def test_eog_equals_llama_cpp_for_every_id(name):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama_vocab_is_eog) is not "
                                            "installed; the recorded sets are checked instead")
    path, tok = model_tokenizer(name)
    got = llama_cpp_special(path)
    assert got["n_vocab"] == tok.n_vocab
    mine = [i for i in range(tok.n_vocab) if i in tok.eog_ids]
    assert mine == got["eog"]
    assert_same_ids(tok, got["ids"])


def vocab(tokens: list[str], model: str = "gpt2", **keys) -> dict:
    """A byte-level BPE (or SentencePiece) vocabulary of `tokens`, no merges needed;
    keyword `x` sets tokenizer.ggml.x."""
    md = {K + "model": model, K + "tokens": tokens, K + "token_type": [1] * len(tokens),
          K + "merges": []}
    if model == "llama":
        md[K + "scores"] = [0.0] * len(tokens)
        md.pop(K + "merges")
    md.update({K + k: v for k, v in keys.items()})
    return md


def test_found_by_text_and_the_keys():
    toks = ["a", "b", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<eot>",
            "<mine>"]
    tok = Tokenizer(vocab(toks, eos_token_id=0, eot_token_id=7), "x.gguf")
    assert tok.eog_ids == {0, 2, 3, 4, 5, 7}
    assert (tok.special.fim_pad, tok.special.fim_rep, tok.special.fim_sep) == (3, 4, 5)
    # a FIM key names its own token: the text of another is not looked for
    tok = Tokenizer(vocab(toks, fim_pad_token_id=1), "x.gguf")
    assert tok.special.fim_pad == 1 and 1 in tok.eog_ids and 3 not in tok.eog_ids


def test_llama_cpp_exceptions():
    harmony = ["<|return|>", "<|call|>", "<|end|>", "x"]
    assert Tokenizer(vocab(harmony), "h.gguf").eog_ids == {0, 1}      # <|end|> is not EOG
    assert Tokenizer(vocab(["<|end|>", "x"]), "p.gguf").eog_ids == {0}  # alone it is
    gemma4 = ["<|tool_response>", "</s>", "x"]
    assert Tokenizer(vocab(gemma4), "g.gguf").eog_ids == {0}


def test_defaults_as_llama_cpp():
    # byte-level BPE starts from bos = eos = 11 (dropped when the vocabulary is smaller)
    twelve = [f"t{i}" for i in range(12)]
    assert Tokenizer(vocab(twelve), "b.gguf").eog_ids == {11}
    assert Tokenizer(vocab(twelve[:5]), "b.gguf").eog_ids == frozenset()
    # SentencePiece: unk 0, bos 1, eos 2
    tok = Tokenizer(vocab(["<unk>", "<s>", "</s>", "a"], model="llama"), "s.gguf")
    assert (tok.special.unk, tok.bos, tok.eos, tok.eog_ids) == (0, 1, 2, {2})


@pytest.mark.parametrize("key", sorted({k for _, k in KEYS}))
@pytest.mark.parametrize("value", [4, -1, 1 << 40, "2", 1.0, True])
def test_every_special_id_is_range_checked(key, value):
    with pytest.raises(GGUFError) as e:
        Tokenizer(vocab(["a", "b", "c", "d"], **{key: value}), "evil.gguf")
    msg = str(e.value)
    assert "\n" not in msg and f"{K}{key} must be a token id in [0, 4)" in msg, msg


def test_generation_ends_on_any_eog(tiny, monkeypatch):
    """Engine.generate stops at the first EOG token, not only at EOS."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    eng = Engine(str(tiny), EngineConfig(n_ctx=32))
    greedy = list(eng.generate([1, 3], 8, stop_at_eos=False))
    eng.reset()
    last = greedy[-1]                    # made this vocabulary's only EOG token
    monkeypatch.setattr(Engine, "eog", frozenset([last]))
    assert list(eng.generate([1, 3], 8)) == greedy[:greedy.index(last) + 1]
    assert last != eng.eos
