"""The text side of `ggraph run` (tools/run.py): streaming generated text as whole UTF-8
characters, generation that shifts the context when it fills (or stops, as llama-cli does),
the interactive chat loop, and llama_perf's timing lines."""
from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

from ggraph.tools.common.cli_text import fail
from ggraph.graphs.tokenizers.tokenizer import TooManyTokens

FOREVER = sys.maxsize  # -n -1: until an end-of-generation token


class TextStream:
    """Prints tokens as text as they come, holding back an incomplete UTF-8 character; `done`
    once the text ends with one of the stop strings (llama-cli's -r). Each token costs its
    own piece: the text so far is never decoded again."""

    def __init__(self, eng: Any, stops: list[str] | None = None) -> None:
        self.tok = eng.tokenizer
        self.ids: list[int] = []
        self.stops = [s for s in (stops or []) if s]
        self.keep = max((len(s) for s in self.stops), default=0)
        self.tail = ""   # the last characters shown, as many as the longest stop string
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.done = False

    def add(self, tok: int) -> None:
        self.ids.append(tok)
        piece = self.tok.piece(tok)
        # decode()'s rule: the space a space prefix put before the text is not shown
        first = len(self.ids) == 1 and tok != self.tok.bos or \
            len(self.ids) == 2 and self.ids[0] == self.tok.bos
        if first and self.tok.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        text = self.decoder.decode(piece)
        if text:
            print(text, end="", flush=True)
            self.tail = (self.tail + text)[-self.keep:] if self.keep else ""
            self.done = any(self.tail.endswith(s) for s in self.stops)

    def text(self) -> str:
        return self.tok.decode(self.ids)


@dataclass
class Limits:
    """How long one generation goes on: n_predict (llama-cli's -n: -1 until an
    end-of-generation token, -2 until the context is full) and the context shift (n_keep
    tokens kept; None: --no-context-shift)."""
    n_predict: int
    n_keep: int | None

    def tokens(self) -> int:
        return FOREVER if self.n_predict < 0 else self.n_predict

    def shift_keep(self) -> int | None:
        return None if self.n_predict == -2 else self.n_keep


def stream(eng: Any, prompt: list[int], limits: Limits, sampling: Any,
           out: TextStream, observe: Any = None) -> None:
    """Generate after `prompt` (continuing the KV cache) until the limits, an
    end-of-generation token or a stop string; each kept token goes to out. A context that
    fills shifts, or ends the generation with llama-cli's message. `observe`: an Observer
    (backends/observe.py) watching every graph the generation runs (--dump-tensors)."""
    from ggraph.graphs.runtime.sampling import Sampler

    ends = eng.eog  # llama.cpp's end-of-generation set (graphs/tokenizers/special_tokens.py)
    for tok in eng.generate(prompt, limits.tokens(), stop_at_eos=False,
                            sampler=Sampler(sampling, eng.tokenizer), n_keep=limits.shift_keep(),
                            observe=observe):
        if tok in ends:
            break
        out.add(tok)
        if out.done:
            break
    if eng.stop_reason == "context full":
        why = ("n_predict == -2" if limits.n_predict == -2 else
               "context shift is disabled" if limits.n_keep is None else
               f"{eng.file.arch} cannot shift its context" if not eng.can_shift else
               f"nothing is left to discard after the {limits.n_keep} tokens kept")
        print(flush=True)
        print(f"\ncontext full and {why} => stopping", file=sys.stderr, flush=True)


def prompt_ids(eng: Any, path: str, user: str, text: str) -> list[int]:
    """The prompt's tokens; a prompt with none, or more than the context holds (llama-cli:
    n_ctx - 4), is an error (checked before anything runs)."""
    n_ctx = eng.cfg.n_ctx
    try:
        prompt = eng.tokenizer.encode(text, max_tokens=n_ctx - 4)
    except TooManyTokens:
        raise ValueError(f"prompt is too long (more than {n_ctx - 4} tokens; a context of "
                         f"{n_ctx} holds at most n_ctx - 4, as llama-cli allows)") from None
    if not prompt:  # llama.cpp: "input is empty" unless the model adds a BOS token
        what = "the prompt is empty" if not user else f"the prompt {user[:60]!r} has no tokens"
        raise ValueError(f"{what} and {path} adds no BOS token "
                         f"(tokenizer.ggml.add_bos_token is false), so there is nothing to "
                         f"evaluate; give a prompt with -p (llama.cpp refuses it too)")
    return prompt


def stream_speculative(spec: Any, prompt: list[int], limits: Limits, sampling: Any,
                       out: TextStream) -> None:
    """`stream` with a draft model (graphs/runtime/speculative.py's Speculator): the same
    text, the context never shifting (generation stops when it is full). The timings go to
    the engine's, as llama_perf counts a verify batch's tokens as generated."""
    from ggraph.graphs.runtime.sampling import Sampler

    eng = spec.target
    ends = eng.eog
    t0 = time.perf_counter()
    first = True
    for tok in spec.generate(prompt, limits.tokens(), Sampler(sampling, eng.tokenizer),
                              stop_at_eos=False):
        now = time.perf_counter()
        if first:   # the prompt's share: up to the first token
            eng.timings.prompt_tokens += len(prompt)
            eng.timings.prompt_s += now - t0
            first = False
        else:
            eng.timings.gen_tokens += 1
            eng.timings.gen_s += now - t0
        t0 = now
        if tok in ends:
            break
        out.add(tok)
        if out.done:
            break


def generate_text(eng: Any, user: str, prompt: list[int], limits: Limits, sampling: Any,
                  echo: bool, stops: list[str] | None = None, spec: Any = None,
                  observe: Any = None) -> int:
    """One prompt: print it (unless it is wrapped in a chat template), then the generated
    text (with a draft model when `spec` is given; watched by `observe`, an Observer,
    without). The exit status."""
    print(user if echo else "", end="", flush=True)
    if spec is not None:
        stream_speculative(spec, prompt, limits, sampling, TextStream(eng, stops))
    else:
        stream(eng, prompt, limits, sampling, TextStream(eng, stops), observe)
    print("\n", flush=True)
    return 0


class Conversation:
    """llama-cli's -cnv: read a user turn, render the whole chat with the template and
    evaluate only what is new since the last turn (the KV cache keeps the rest), generate the
    answer, repeat until end of input or /exit. A turn that cannot fit the context (even
    after shifting it) is refused with a message, and the chat goes on."""

    def __init__(self, eng: Any, sampling: Any, system: str | None, limits: Limits,
                 stops: list[str] | None = None) -> None:
        self.eng, self.sampling, self.limits = eng, sampling, limits
        self.stops = stops
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.formatted = ""

    def turn(self, user: str) -> str | None:
        """The answer to `user`; None when the turn was refused."""
        eng, tok = self.eng, self.eng.tokenizer
        n_ctx = eng.cfg.n_ctx
        self.messages.append({"role": "user", "content": user})
        full = tok.render(self.messages, add_generation_prompt=True, max_chars=self.cap())
        rewrote = not full.startswith(self.formatted)
        new = full if rewrote else full[len(self.formatted):]
        first = rewrote or eng.cache.n_used == 0
        try:
            ids = tok.encode(new, add_bos=tok.add_bos and first, max_tokens=n_ctx - 4)
        except TooManyTokens:
            return self.refuse(f"this turn is more than {n_ctx - 4} tokens, more than a "
                               f"context of {n_ctx} holds (n_ctx - 4)")
        if rewrote:  # the template rewrote history: start over
            eng.reset()
        if not eng.make_room(len(ids), self.limits.shift_keep()):
            return self.refuse(f"this turn's {len(ids)} tokens do not fit: {eng.cache.n_used} "
                               f"of the context's {n_ctx} are used and "
                               + ("context shift is disabled (--no-context-shift)"
                                  if self.limits.shift_keep() is None else
                                  "the context cannot shift further"))
        out = TextStream(eng, self.stops)
        stream(eng, ids, self.limits, self.sampling, out)
        print(flush=True)
        answer = out.text()
        self.messages.append({"role": "assistant", "content": answer})
        self.formatted = tok.render(self.messages, add_generation_prompt=False,
                                    max_chars=self.cap())
        return answer

    def cap(self) -> int:
        """The most characters the template may render for this chat: what a context holds,
        per message (the history is rendered whole each turn, while the context shifts)."""
        return self.eng.tokenizer.chars_for(self.eng.cfg.n_ctx) * max(len(self.messages), 1)

    def refuse(self, why: str) -> None:
        self.messages.pop()
        print(f"ggraph run: warning: {why}; the turn is skipped, the chat goes on",
              file=sys.stderr, flush=True)
        return None

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
        except ValueError as e:  # e.g. a template that fails: say so, as llama-cli does
            print(flush=True)
            fail("run", e)
            return 1
        return 0


def _stdin_lines() -> Iterator[str]:
    """Lines of standard input as text: bytes that are not UTF-8 become U+FFFD, as -f reads a
    file (a str with lone surrogates reaches no tokenizer)."""
    raw = getattr(sys.stdin, "buffer", None)
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = raw.readline() if raw is not None else sys.stdin.readline()
        if not line:
            return
        yield line.decode("utf-8", "replace") if isinstance(line, bytes) else line


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

