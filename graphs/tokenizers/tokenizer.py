"""Tokenizer and chat template from a GGUF's metadata, giving llama.cpp's token ids.

Owns the Tokenizer (encode, decode, chat) and the chat template. Encoding follows llama.cpp's
llama_vocab::tokenize: the text is cut around special tokens (tokenizer_vocab.partition), each
text piece goes through the model (tokenizer_models: byte-level BPE with the pre-tokenizer of
`tokenizer.ggml.pre`, or SentencePiece with "▁" for spaces and a space prefix after the start and
after each special token when `tokenizer.ggml.add_space_prefix`), and BOS/EOS are added as the
file asks. Every key is checked first (tokenizer_vocab.check_vocab). The template is Jinja run in
jinja2's immutable sandbox with the settings and helpers Hugging Face transformers uses, so it
can read its arguments but never reach Python internals. A file without a template gets ChatML.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from ggraph.graphs.gguf.gguf_reader import GGUFError
from ggraph.graphs.tokenizers.pretokenize import pre_type
from ggraph.graphs.tokenizers.tokenizer_models import SPACE, build_bpe, build_spm, piece
from ggraph.graphs.tokenizers.special_tokens import SpecialIds, read_special_ids
from ggraph.graphs.tokenizers.text_pieces import PIECE_CHARS, bpe_cutter, pieces, spm_cutter, valid_text
from ggraph.graphs.tokenizers.tokenizer_vocab import check_vocab, one_line as _one_line, partition, what as _what

_TEMPLATE = "tokenizer.chat_template"


def _compile_template(source: str, path: str) -> Any:
    """Compile in the sandbox as transformers' _compile_jinja_template does, so templates
    written for Hugging Face render the same text; None when jinja2 is absent (ChatML)."""
    try:
        import jinja2
        import jinja2.ext
    except ImportError:
        return None
    import json

    def raise_exception(message: object) -> None:
        raise _TemplateRaised(str(message))

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; transformers replaces it with plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    from ggraph.graphs.tokenizers.template_sandbox import BoundedSandbox

    # every value a template builds is bounded (graphs/tokenizers/template_sandbox.py)
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.set_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        with _deadline():   # compiling costs about 10 us a character: a huge template is slow
            return env.from_string(source)
    except _TemplateTimeout:
        raise GGUFError(f"{path}: {_TEMPLATE} ({len(source)} characters) was still compiling "
                        f"after {_RENDER_SECONDS:.0f} s and was stopped") from None
    except jinja2.TemplateSyntaxError as e:
        raise GGUFError(f"{path}: {_TEMPLATE} does not parse (line {e.lineno}: "
                        f"{_one_line(e.message)})") from None
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting
        raise GGUFError(f"{path}: {_TEMPLATE} does not compile ({type(e).__name__}: "
                        f"{_one_line(e)})") from None


class _TemplateRaised(Exception):
    """raise_exception(msg) from a template; the message is the template's."""


class _TemplateTimeout(BaseException):
    """A template still rendering after _RENDER_SECONDS (a hostile loop). Not an Exception:
    an `except Exception` in code it passes through would swallow it, and the tracer that
    raised it is dropped by Python once it raises, so the deadline would be gone."""


_RENDER_SECONDS = 5.0      # a real chat template renders in milliseconds


class _TemplateTooLong(Exception):
    """A template's output passed the cap its caller gave (what a context can hold)."""


@contextlib.contextmanager
def _deadline() -> Iterator[None]:
    """Raise _TemplateTimeout in the code run inside once _RENDER_SECONDS have passed: Jinja
    compiles templates to Python, so a trace function sees every line of a loop and can end
    it (a single C call is bounded by graphs/tokenizers/template_sandbox.py instead)."""
    deadline = time.monotonic() + _RENDER_SECONDS
    # raised only in the template's code, Jinja's and the sandbox's: raised in a callback that
    # runs inside them (a garbage-collection hook, as hypothesis installs), the exception is
    # swallowed, Python drops the trace function with it, and the deadline is gone
    jinja, sandbox = (sys.modules.get(m) for m in
                      ("jinja2", "ggraph.graphs.tokenizers.template_sandbox"))
    jinja_dir = os.path.dirname(jinja.__file__) if jinja is not None and jinja.__file__ else "<>"
    own = ("<template>", getattr(sandbox, "__file__", "<template>"))

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            name = frame.f_code.co_filename
            if name in own or name.startswith(jinja_dir):
                raise _TemplateTimeout()
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def _render_bounded(template: Any, max_chars: int | None = None, **kw: Any) -> str:
    """template.render(**kw), stopped after _RENDER_SECONDS, or once its output passes
    max_chars (generate() hands the output over as it is made)."""
    out: list[str] = []
    size = 0
    with _deadline():
        for part in template.generate(**kw):
            out.append(part)
            size += len(part)
            if max_chars is not None and size > max_chars:
                raise _TemplateTooLong()
        return "".join(out)


def _template_line(e: BaseException) -> str:
    # Jinja rewrites tracebacks so the template's own frames carry its line numbers
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if f.filename == "<template>"]
    return f" at line {lines[-1]}" if lines else ""


def _flag(md: dict[str, Any], key: str, default: bool, path: str) -> bool:
    v = md.get(key, default)
    if not isinstance(v, bool):
        raise GGUFError(f"{path}: {key} must be a bool, got {_what(v)}")
    return v


class TooManyTokens(ValueError):
    """encode(max_tokens=N) met a text of more than N tokens (args: message, N)."""

    def __str__(self) -> str:  # the message, not the args tuple a second arg would print
        return str(self.args[0]) if self.args else ""


class Tokenizer:
    """A GGUF's tokenizer (byte-level BPE or SentencePiece) and chat template; construction
    checks every key it reads and needs only the header, never the weights."""

    def __init__(self, metadata: dict[str, Any], path: str = "") -> None:
        v = check_vocab(metadata, path)
        self.vocab = v
        self.tokens: list[str] = v.tokens
        self.model: str = v.model
        spm = v.model == "llama"
        if spm:  # llama.cpp's SentencePiece defaults: BOS and a space prefix
            self.pre, pre = "default", None
            clean, add_bos_default = False, True
        else:
            self.pre, found = pre_type(metadata, path)
            pre = found
            clean, add_bos_default = found.clean_spaces, bool(found.add_bos)
        self.clean_spaces: bool = clean
        # every special id range-checked, and the end-of-generation set (special_tokens.py)
        self.special: SpecialIds = read_special_ids(metadata, v.tokens, v.model, path)
        self.bos: int | None = self.special.bos
        self.eos: int | None = self.special.eos
        self.add_bos: bool = _flag(metadata, "tokenizer.ggml.add_bos_token", add_bos_default,
                                   path)
        self.add_eos: bool = _flag(metadata, "tokenizer.ggml.add_eos_token", False, path)
        self.add_space_prefix: bool = _flag(metadata, "tokenizer.ggml.add_space_prefix", spm,
                                            path)
        template = metadata.get(_TEMPLATE)
        if template is not None and not isinstance(template, str):
            raise GGUFError(f"{path}: {_TEMPLATE} must be a string, got {_what(template)}")
        self.template: str | None = template
        self.path = path
        # compiled now so a template that does not parse fails the load, not the first chat()
        self._template = _compile_template(template, path) if template else None
        self._model = build_bpe(v, pre) if pre is not None else build_spm(v)
        self._specials = v.specials()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        # text longer than this is tokenized in pieces (graphs/tokenizers/text_pieces.py)
        self.piece_chars = PIECE_CHARS
        self._cutter: Any = None
        self.max_token_chars = max(len(t) for t in v.tokens)
        # the tokens that end generation, as llama.cpp's llama_vocab_is_eog answers
        self.eog_ids: frozenset[int] = self.special.eog

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True,
               add_eos: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text` as llama.cpp's llama_tokenize gives them. `special`: control
        tokens written in the text are matched (llama.cpp's parse_special; user-defined tokens
        always are). `add_bos`/`add_eos`: None follows the file; a BOS/EOS the vocabulary lacks
        is never added. Long text is tokenized in pieces that give the same ids
        (graphs/tokenizers/text_pieces.py); with `max_tokens`, a text of more tokens is a ValueError as
        soon as that is known. Lone surrogates (bytes that were not UTF-8) read as U+FFFD."""
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"encode: max_tokens={max_tokens} must be at least 0")
        parts = partition(valid_text(text), self._specials[special])
        if self.model == "llama":
            # a space before the text and after each special token when the file asks for it
            prev_special = True
            for i, p in enumerate(parts):
                if isinstance(p, str):
                    s = " " + p if self.add_space_prefix and prev_special else p
                    parts[i] = s.replace(" ", SPACE)
                prev_special = not isinstance(p, str)
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos is not None:
            ids.append(self.bos)
        batch: list[str] = []   # text pieces encoded together, about piece_chars at a time

        def flush() -> None:
            if batch:
                for enc in self._model.encode_batch(batch, add_special_tokens=False):
                    ids.extend(enc.ids)
                batch.clear()
            if max_tokens is not None and len(ids) > max_tokens:
                raise TooManyTokens(f"the text is more than {max_tokens} tokens long "
                                    f"(tokenizing stopped there)", max_tokens)

        size = 0
        for p in parts:
            if not isinstance(p, str):
                flush()
                ids.append(p)
                continue
            for chunk in pieces(p, self._find_cut, self.piece_chars):
                batch.append(chunk)
                size += len(chunk)
                if size >= self.piece_chars:
                    flush()
                    size = 0
        flush()
        if (self.add_eos if add_eos is None else add_eos) and self.eos is not None:
            ids.append(self.eos)
        return ids

    def _find_cut(self, text: str, start: int, limit: int) -> int | None:
        """Where a long text piece may be cut (text_pieces: made on the first long text)."""
        if self._cutter is None:
            self._cutter = spm_cutter(self.tokens) if self.model == "llama" else \
                bpe_cutter(self._model.pre_tokenizer)
        return self._cutter(text, start, limit)

    def chars_for(self, n_tokens: int) -> int:
        """The most characters text of n_tokens tokens can have (no token is longer than the
        vocabulary's longest): a cap on what a chat template may render for a context."""
        return n_tokens * self.max_token_chars

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token as llama.cpp's llama_token_to_piece gives them (control
        tokens empty unless `special`); a multi-byte character may span tokens."""
        i = operator.index(token)  # numpy integers too; a float is a TypeError
        if not 0 <= i < len(self.tokens):
            raise ValueError(f"token id {i} is out of range for a vocabulary of "
                             f"{len(self.tokens)} ({self.path})")
        key = (i, special)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = piece(self.vocab, i, special)
        return got

    def decode(self, ids: Iterable[int], special: bool = True,
               clean_spaces: bool = False) -> str:
        """Text of token ids as llama.cpp's llama_detokenize writes it: the pieces joined, the
        leading space of the text dropped when the file adds a space prefix, and with
        `clean_spaces` the vocabulary's clean-up of spaces before punctuation (where its
        pre-tokenizer asks for it). Bytes that are not UTF-8 become U+FFFD."""
        ids = list(ids)
        parts = [self.piece(x, special) for x in ids]
        # the space encode() put before the text: on the first token, or on the one after a
        # leading BOS (as llama-cpp-python's detokenize drops it)
        first = 1 if ids and ids[0] == self.bos and len(ids) > 1 else 0
        if self.add_space_prefix and parts and parts[first].startswith(b" "):
            parts[first] = parts[first][1:]
        text = b"".join(parts).decode("utf-8", "replace")
        return _clean(text) if clean_spaces and self.clean_spaces else text

    def chat(self, user: str, system: str | None = None, max_chars: int | None = None) -> str:
        """One user message (after an optional system message) in the chat template, with
        the assistant's turn opened."""
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        return self.render(messages, max_chars=max_chars)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               max_chars: int | None = None) -> str:
        """A conversation in the file's chat template (ChatML without one, as llama.cpp's
        default); rendered in a sandbox with a time limit (the template is untrusted), and
        stopped once it passes max_chars characters (chars_for(n_ctx): more than a context
        can hold)."""
        too_long = GGUFError(f"{self.path}: {_TEMPLATE} rendered more than {max_chars} "
                             f"characters, more than the context holds, and was stopped")
        if self._template is None:
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                           for m in messages) + \
                ("<|im_start|>assistant\n" if add_generation_prompt else "")
            if max_chars is not None and len(text) > max_chars:
                raise too_long
            return text
        from jinja2.exceptions import SecurityError

        try:
            # tools and documents None as transformers passes them: `tools is none` holds
            return _render_bounded(
                self._template, max_chars, messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.tokens[self.bos] if self.bos is not None else "",
                eos_token=self.tokens[self.eos] if self.eos is not None else "")
        except _TemplateTimeout:
            raise GGUFError(f"{self.path}: {_TEMPLATE} was still rendering after "
                            f"{_RENDER_SECONDS:.0f} s and was stopped") from None
        except _TemplateTooLong:
            raise too_long from None
        except _TemplateRaised as e:
            raise GGUFError(f"{self.path}: {_TEMPLATE} raised an error{_template_line(e)}: "
                            f"{_one_line(e)}") from None
        except SecurityError as e:
            raise GGUFError(f"{self.path}: {_TEMPLATE} tried an unsafe operation"
                            f"{_template_line(e)} and was stopped (SecurityError: "
                            f"{_one_line(e)})") from None
        except Exception as e:  # noqa: BLE001 - undefined names, type errors, recursion
            raise GGUFError(f"{self.path}: {_TEMPLATE} failed while rendering"
                            f"{_template_line(e)} ({type(e).__name__}: {_one_line(e)})") \
                from None


def _clean(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces, its three passes in order: no space before
    ? ! . , ; " ' " becomes "'"; no space before 's 'm 're 've."""
    t = list(text)
    out = t[:1]
    for i in range(1, len(t)):
        if t[i - 1] == " " and t[i] in "?!.,":
            out.pop()
        out.append(t[i])
    t, out, i = out, out[:1], 1
    while i < len(t):
        x = t[i]
        if x == "'" and i + 1 < len(t) and t[i - 1] == " " and t[i + 1] == " ":
            out.pop()
            t[i + 1] = ""  # the space after is dropped too
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    t, out = out, out[:1]
    for i in range(1, len(t)):
        if t[i - 1] == " " and t[i] == "'" and i + 1 < len(t):
            nxt = "".join(t[i + 1:i + 3])
            if nxt[:1] in ("s", "m") or nxt in ("re", "ve"):
                out.pop()
        out.append(t[i])
    return "".join(out)
