"""The token masks of ggraph's grammars against llama.cpp's own grammar sampler, on real
vocabularies (SmolLM2's 49k byte-level BPE, Qwen2.5's 152k): equal along random walks through
each of llama.cpp's grammar files, and every sequence the sampler draws under a grammar (random
logits, several seeds) accepted by llama.cpp to the end. Live only: llama.cpp is the reference.

Known and kept differences, left out of the mask comparison: tokens that are lone bytes F5..FF
(no UTF-8 character starts with them; llama.cpp lets them into a [^...] class, ggraph never
writes invalid UTF-8 under a grammar) and the tokens graphs/grammar/constraint.py refuses for
ending inside a character at a [^...] class (a subset of what llama.cpp allows)."""
from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="the grammar engine is the ggraph[grammar] extra")

from grammar_files import grammar_files  # noqa: E402
from llama_cpp_ref import live  # noqa: E402
from ggraph.graphs.gguf.fetch import default_model, fetch_model  # noqa: E402
from ggraph.graphs.gguf.gguf_reader import read_header  # noqa: E402
from ggraph.graphs.grammar.constraint import compile_grammar  # noqa: E402
from ggraph.graphs.runtime.sampling import Sampler, SamplerParams  # noqa: E402
from ggraph.graphs.tokenizers.tokenizer import Tokenizer  # noqa: E402


def _setup(model: str):
    llama_cpp = live()
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed (the reference grammar)")
    files = grammar_files()
    if not files:
        pytest.skip("no llama.cpp grammar files here")
    from llama_grammar_ref import LlamaGrammarRef
    path = str(default_model() if model == "smollm2" else fetch_model(model))
    tok = Tokenizer(read_header(path).metadata, path)
    return tok, LlamaGrammarRef(llama_cpp, path), files


def _comparable(tok: Tokenizer, cg) -> np.ndarray:
    lone = np.array([len(p) == 1 and p[0] >= 0xF5 for p in cg.vocab.pieces])
    return ~(lone | (cg.refused & ~cg.vocab.never))


@pytest.mark.parametrize("model, steps", [("smollm2", 10), ("qwen2.5-coder-0.5b", 5)])
def test_masks_equal_llama_cpp(model, steps):
    tok, ref, files = _setup(model)
    rng = random.Random(7)
    try:
        for name, text in files.items():
            cg = compile_grammar(text, tok)
            keep = _comparable(tok, cg)
            st, prefix = cg.start(), []
            for step in range(steps):
                ours, theirs = st.mask(), ref.mask(text, prefix)
                diff = np.nonzero((ours != theirs) & keep)[0]
                assert diff.size == 0, (name, step, [(int(t), tok.piece(int(t)), bool(ours[t]))
                                                     for t in diff[:8]])
                choices = [int(t) for t in np.nonzero(ours)[0] if t not in tok.eog_ids]
                if not choices:
                    break
                t = rng.choice(choices)
                st.accept(t)
                prefix.append(t)
    finally:
        ref.close()


def test_sampled_sequences_accepted_by_llama_cpp():
    """Random logits, 4 seeds per grammar: the sampler's rejection path and its masked
    redraw both run; llama.cpp's grammar takes every token and allows the end."""
    tok, ref, files = _setup("smollm2")
    try:
        for name, text in files.items():
            for seed in range(4):
                rng = np.random.default_rng(seed)
                s = Sampler(SamplerParams(seed=seed, temp=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                          grammar=text), tok)
                out = []
                for _ in range(24):
                    logits = rng.normal(0, 3, tok.n_vocab).astype(np.float32)
                    t = s.sample(logits)
                    out.append(t)
                    if t in tok.eog_ids:
                        break
                # cut where the grammar is complete, or check the prefix only
                ok, why = ref.accepts(text, out) if out[-1] in tok.eog_ids else \
                    (ref_prefix_ok(ref, text, out), "")
                assert ok, (name, seed, why, tok.decode(out))
                assert s.n_resampled > 0
    finally:
        ref.close()


def ref_prefix_ok(ref, text: str, tokens: list[int]) -> bool:
    s = ref.sampler(text)
    try:
        for t in tokens:
            if not ref._apply(s, np.array([t]))[0]:
                return False
            ref.lc.llama_sampler_accept(s, int(t))
        return True
    finally:
        ref.lc.llama_sampler_free(s)
