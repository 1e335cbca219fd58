"""Greedy generation under a grammar equals llama.cpp's greedy under the same grammar, token for
token, up to the first step where llama.cpp's two best allowed logits are closer than
MIN_MARGIN (there either may win, in either program). SmolLM2, llama.cpp's grammar files and a
JSON schema's grammar; live through llama-cpp-python, else as scripts/record_llama_cpp.py
recorded it (tests/data/llama_cpp/grammar_greedy.json)."""
from __future__ import annotations

import pytest

pytest.importorskip("llguidance", reason="the grammar engine is the ggraph[grammar] extra")

from grammar_files import grammar_files  # noqa: E402
from llama_cpp_ref import MIN_MARGIN, live, recorded, sha256_text, sure_steps  # noqa: E402
from ggraph.graphs.gguf.fetch import default_model  # noqa: E402

N_GREEDY = 32
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = {
    "json": CHAT.format("Describe a cat as a JSON object."),
    "list": "List three fruits:",
    "arithmetic": "Twelve plus seven, as a formula:",
    "chess": "The shortest chess game:",
    "c": "A C function that adds two numbers:",
}


def grammar_for(name: str) -> str:
    files = grammar_files()
    if name not in files:
        pytest.skip(f"llama.cpp's {name}.gbnf is not here (its source tree or llama-cpp-python)")
    return files[name]


@pytest.fixture(scope="module")
def smollm2_engine():
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    return Engine(str(default_model()), EngineConfig(n_ctx=256))


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_equals_llama_cpp(name, smollm2_engine):
    from ggraph.graphs.runtime.sampling import Sampler, SamplerParams

    grammar, text = grammar_for(name), CASES[name]
    path = str(default_model())
    llama_cpp = live()
    if llama_cpp is not None:
        from llama_grammar_ref import llama_cpp_grammar_greedy
        ref = llama_cpp_grammar_greedy(llama_cpp, path, text, grammar, N_GREEDY)
    else:
        ref = recorded("grammar_greedy", path, case=name)
        if ref.get("grammar_sha256") != sha256_text(grammar):
            pytest.skip(f"the recording was made with another {name}.gbnf")
    eng = smollm2_engine
    eng.reset()
    prompt = eng.tokenizer.encode(text)
    assert prompt == ref["prompt"]
    s = Sampler(SamplerParams(temp=0.0, grammar=grammar), eng.tokenizer)
    gen = list(eng.generate(prompt, N_GREEDY, sampler=s))
    k = sure_steps(ref["margins"])
    if k == 0 and llama_cpp is not None:
        # llama-cpp-python's own copy of a grammar (its llama_grammar constants, older than
        # the source tree's file the recording used) may leave the first step open: then no
        # step of llama.cpp's greedy text is safe to compare
        pytest.skip(f"llama.cpp's first greedy step under {name}.gbnf has a top-2 margin of "
                    f"{ref['margins'][0]:.3f} (< {MIN_MARGIN}): no step is safe to compare")
    assert k >= 1, ref["margins"]
    assert gen[:k] == ref["tokens"][:k], (name, k, eng.tokenizer.decode(gen),
                                          eng.tokenizer.decode(ref["tokens"]))
