"""llama.cpp's own grammar sampler (through llama-cpp-python's C API) as the reference for
ggraph's grammars: which tokens it allows after a token sequence, and whether it accepts a whole
generated sequence (every token allowed when it came, and an end-of-generation token allowed at
the end). Only the model's vocabulary is loaded."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class LlamaGrammarRef:
    def __init__(self, llama_cpp: Any, model_path: str) -> None:
        lc = self.lc = llama_cpp
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.vocab_only = True
        self.model = lc.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.eog = [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)]

    def close(self) -> None:
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None

    def sampler(self, grammar: str) -> Any:
        s = self.lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not s:
            raise ValueError("llama.cpp refused the grammar")
        return s

    def _apply(self, s: Any, ids: np.ndarray) -> np.ndarray:
        lc = self.lc
        data = (lc.llama_token_data * len(ids))()
        for i, t in enumerate(ids):
            data[i].id = int(t)
            data[i].logit = 0.0
            data[i].p = 0.0
        arr = lc.llama_token_data_array(data=ctypes.cast(data, ctypes.POINTER(lc.llama_token_data)),
                                        size=len(ids), selected=-1, sorted=False)
        lc.llama_sampler_apply(s, ctypes.byref(arr))
        return np.array([data[i].logit != float("-inf") for i in range(len(ids))], dtype=bool)

    def mask(self, grammar: str, prefix: list[int]) -> np.ndarray:
        """Allowed tokens (bool per vocabulary id) after accepting `prefix`."""
        s = self.sampler(grammar)
        try:
            for t in prefix:
                self.lc.llama_sampler_accept(s, int(t))
            return self._apply(s, np.arange(self.n_vocab))
        finally:
            self.lc.llama_sampler_free(s)

    def accepts(self, grammar: str, tokens: list[int]) -> tuple[bool, str]:
        """Whether llama.cpp's grammar takes `tokens` and then allows ending; why not if not.
        A token that ends generation and is allowed ends the check there."""
        s = self.sampler(grammar)
        try:
            for i, t in enumerate(tokens):
                if not self._apply(s, np.array([t]))[0]:
                    return False, f"token {i} ({t}) is not allowed there"
                if t in self.eog:
                    return True, ""
                self.lc.llama_sampler_accept(s, int(t))
            if not self._apply(s, np.array(self.eog[:1]))[0]:
                return False, "the grammar is not complete at the end"
            return True, ""
        finally:
            self.lc.llama_sampler_free(s)


def llama_cpp_grammar_greedy(llama_cpp: Any, path: str, text: str, grammar: str, n: int) -> dict:
    """llama.cpp's greedy continuation of `text` under `grammar`: its prompt ids, the tokens
    (up to n, or to an end-of-generation token) and, per step, the margin between the two best
    logits the grammar allows."""
    ref = LlamaGrammarRef(llama_cpp, path)
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False)
    try:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.eval(prompt)
        s = ref.sampler(grammar)
        gen, margins = [], []
        for _ in range(n):
            lg = np.asarray(llm.scores[llm.n_tokens - 1], np.float32)
            allowed = ref._apply(s, np.arange(ref.n_vocab))
            lg = np.where(allowed, lg[:ref.n_vocab], -np.inf)
            order = np.argsort(lg)[::-1]
            gen.append(int(order[0]))
            margins.append(float(lg[order[0]] - lg[order[1]]) if np.isfinite(lg[order[1]])
                           else float("inf"))
            if gen[-1] in ref.eog:
                break
            llama_cpp.llama_sampler_accept(s, gen[-1])
            llm.eval([gen[-1]])
        llama_cpp.llama_sampler_free(s)
        return {"prompt": [int(t) for t in prompt], "tokens": gen, "margins": margins}
    finally:
        llm.close()
        ref.close()
