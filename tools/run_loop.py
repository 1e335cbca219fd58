"""The text side of `ggraph run` (tools/run.py): streaming generated text as whole UTF-8
characters, the interactive chat loop, and llama_perf's timing lines."""
from __future__ import annotations

import sys
from typing import Any, Iterator

from ggraph.cli import fail


class TextStream:
    """Prints tokens as text as they come, holding back an incomplete UTF-8 character; `done`
    once the text ends with one of the stop strings (llama-cli's -r)."""

    def __init__(self, eng: Any, stops: list[str] | None = None) -> None:
        self.eng = eng
        self.ids: list[int] = []
        self.shown = ""
        self.stops = [s for s in (stops or []) if s]
        self.done = False

    def add(self, tok: int) -> None:
        self.ids.append(tok)
        full = self.eng.tokenizer.decode(self.ids)
        if not full.endswith("\ufffd"):  # wait for whole UTF-8 characters
            print(full[len(self.shown):], end="", flush=True)
            self.shown = full
            self.done = any(full.endswith(s) for s in self.stops)

    def text(self) -> str:
        return self.eng.tokenizer.decode(self.ids)


def stream(eng: Any, prompt: list[int], n_predict: int, sampling: Any,
           out: TextStream) -> None:
    """Generate after `prompt` (continuing the KV cache) until n_predict tokens, an
    end-of-generation token or a stop string; each kept token goes to out."""
    ends = eng.eog  # llama.cpp's end-of-generation set (graphs/special_tokens.py)
    for tok in generate(eng, prompt, n_predict, sampling):
        if tok in ends:
            break
        out.add(tok)
        if out.done:
            break


def generate(eng: Any, prompt: list[int], n_predict: int, sampling: Any) -> Iterator[int]:
    """Engine.generate with the sampler chain of `sampling` (graphs/sampling.py; temp <= 0 is
    greedy, as in llama.cpp)."""
    from ggraph.graphs.sampling import Sampler

    sampler = Sampler(sampling)
    return eng.generate(prompt, n_predict, stop_at_eos=False, sampler=sampler)


def prompt_ids(eng: Any, path: str, user: str, text: str) -> list[int]:
    """The prompt's tokens; a prompt with none is an error (checked before anything runs)."""
    prompt = eng.tokenizer.encode(text)
    if not prompt:  # llama.cpp: "input is empty" unless the model adds a BOS token
        what = "the prompt is empty" if not user else f"the prompt {user!r} has no tokens"
        raise ValueError(f"{what} and {path} adds no BOS token "
                         f"(tokenizer.ggml.add_bos_token is false), so there is nothing to "
                         f"evaluate; give a prompt with -p (llama.cpp refuses it too)")
    return prompt


def generate_text(eng: Any, user: str, prompt: list[int], n_predict: int, sampling: Any,
                  echo: bool, stops: list[str] | None = None) -> int:
    """One prompt: print it (unless it is wrapped in a chat template), then the generated
    text; a context overflow ends the line before the error. The exit status."""
    n = n_predict if n_predict >= 0 else max(eng.cfg.n_ctx - len(prompt), 0)
    print(user if echo else "", end="", flush=True)
    out = TextStream(eng, stops)
    try:
        stream(eng, prompt, n, sampling, out)
    except ValueError as e:  # e.g. the context overflows: end the line, say why
        print(flush=True)
        fail("run", e)
        return 1
    print("\n", flush=True)
    return 0


class Conversation:
    """llama-cli's -cnv: read a user turn, render the whole chat with the template and
    evaluate only what is new since the last turn (the KV cache keeps the rest), generate the
    answer, repeat until end of input or /exit."""

    def __init__(self, eng: Any, sampling: Any, system: str | None, n_predict: int,
                 stops: list[str] | None = None) -> None:
        self.eng, self.sampling, self.n_predict = eng, sampling, n_predict
        self.stops = stops
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.formatted = ""

    def turn(self, user: str) -> str:
        tok = self.eng.tokenizer
        self.messages.append({"role": "user", "content": user})
        full = tok.render(self.messages, add_generation_prompt=True)
        new = full[len(self.formatted):] if full.startswith(self.formatted) else full
        if not full.startswith(self.formatted):  # the template rewrote history: start over
            self.eng.reset()
        first = self.eng.cache.n_used == 0
        ids = tok.encode(new, add_bos=tok.add_bos and first)
        n = self.n_predict if self.n_predict >= 0 else \
            max(self.eng.cfg.n_ctx - self.eng.cache.n_used - len(ids), 0)
        out = TextStream(self.eng, self.stops)
        stream(self.eng, ids, n, self.sampling, out)
        print(flush=True)
        answer = out.text()
        self.messages.append({"role": "assistant", "content": answer})
        self.formatted = tok.render(self.messages, add_generation_prompt=False)
        return answer

    def loop(self, first: str | None = None, lines: Iterator[str] | None = None,
             single_turn: bool = False) -> int:
        src = lines if lines is not None else _stdin_lines()
        try:
            if first:
                print(f"> {first}")
                self.turn(first)
                if single_turn:
                    return 0
            for line in src:
                line = line.rstrip("\n")
                if line.strip() in ("/exit", "/quit"):
                    break
                if not line.strip():
                    continue
                self.turn(line)
                if single_turn:
                    break
        except ValueError as e:  # the context is full: say so, as llama-cli does
            print(flush=True)
            fail("run", e)
            return 1
        return 0


def _stdin_lines() -> Iterator[str]:
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def perf_lines(eng: Any, load_s: float) -> list[str]:
    """llama.cpp's llama_perf_context_print lines: load, prompt eval, eval, total."""
    t = eng.timings
    p_ms, g_ms = t.prompt_s * 1e3, t.gen_s * 1e3

    def rate(ms: float, n: int) -> str:
        per = ms / n if n else 0.0
        tps = 1e3 * n / ms if ms else 0.0
        return f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

    total = load_s * 1e3 + p_ms + g_ms
    return [
        f"llama_perf_context_print:        load time = {load_s * 1e3:10.2f} ms",
        f"llama_perf_context_print: prompt eval time = {p_ms:10.2f} ms / {t.prompt_tokens:5d} "
        f"tokens {rate(p_ms, t.prompt_tokens)}",
        f"llama_perf_context_print:        eval time = {g_ms:10.2f} ms / {t.gen_tokens:5d} "
        f"runs   {rate(g_ms, t.gen_tokens)}",
        f"llama_perf_context_print:       total time = {total:10.2f} ms / "
        f"{t.prompt_tokens + t.gen_tokens:5d} tokens",
    ]

