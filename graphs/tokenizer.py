"""Tokenizer and chat template from a GGUF's metadata.

Owns checking the tokenizer keys, building the byte-level BPE (`tokenizers`) from the vocabulary
and merges, and rendering the chat template. A GGUF is hostile input from the internet: every
malformed key is a one-line GGUFError naming the file and the key (and the index of a bad
element), checked before any value reaches the Rust library (which panics on bad merges), and
the template is Jinja run in jinja2's immutable sandbox with the settings and helpers Hugging
Face transformers uses, so it can read its arguments but never reach Python internals. A file
without a template gets ChatML.
"""
from __future__ import annotations

import operator
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from .gguf_file import GGUFError

_MODEL = "tokenizer.ggml.model"
_TOKENS = "tokenizer.ggml.tokens"
_TYPES = "tokenizer.ggml.token_type"
_MERGES = "tokenizer.ggml.merges"
_TEMPLATE = "tokenizer.chat_template"
_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: never produced from plain text


def _one_line(text: object, limit: int = 300) -> str:
    """Collapse whitespace (template messages and Jinja errors span lines) and cap the length
    (a hostile template chooses its own message)."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit] + "..."


def _what(value: Any) -> str:
    if value is None:
        return "missing or unreadable"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {_one_line(repr(value), 60)}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # the loader decodes bools as bool


def _first_bad(items: list[Any], ok: Callable[[Any], bool]) -> int | None:
    # one cheap pass over a 50k-entry vocabulary; enumerate only to name the bad index
    if all(ok(x) for x in items):
        return None
    return next(i for i, x in enumerate(items) if not ok(x))


def _check_vocab(md: dict[str, Any], path: str) -> tuple[list[str], list[tuple[str, str]],
                                                         list[int]]:
    """The vocabulary, the merges split into pairs, and the token types, each checked."""
    model = md.get(_MODEL)
    if not isinstance(model, str):
        raise GGUFError(f"{path}: {_MODEL} must be a string, got {_what(model)}")
    if model != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {model!r} is not supported (ggraph builds "
                        f"byte-level BPE, 'gpt2')")
    tokens = md.get(_TOKENS)
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path}: {_TOKENS} must be a non-empty list of strings, "
                        f"got {_what(tokens)}")
    if (i := _first_bad(tokens, lambda t: isinstance(t, str))) is not None:
        raise GGUFError(f"{path}: {_TOKENS}[{i}] must be a string, got {_what(tokens[i])}")
    types = md.get(_TYPES)
    if types is None:
        types = []
    elif not isinstance(types, list):
        raise GGUFError(f"{path}: {_TYPES} must be a list of integers, got {_what(types)}")
    elif (i := _first_bad(types, _is_int)) is not None:
        raise GGUFError(f"{path}: {_TYPES}[{i}] must be an integer, got {_what(types[i])}")
    elif len(types) != len(tokens):
        raise GGUFError(f"{path}: {_TYPES} has {len(types)} entries but {_TOKENS} has "
                        f"{len(tokens)}")
    merges = md.get(_MERGES)
    if merges is None:  # llama.cpp refuses a BPE vocabulary without merges, so do we
        raise GGUFError(f"{path}: {_MERGES} is missing (a 'gpt2' BPE vocabulary needs merges)")
    if not isinstance(merges, list):
        raise GGUFError(f"{path}: {_MERGES} must be a list of strings, got {_what(merges)}")
    vocab = set(tokens)
    pairs: list[tuple[str, str]] = []
    for i, m in enumerate(merges):
        if not isinstance(m, str):
            raise GGUFError(f"{path}: {_MERGES}[{i}] must be a string, got {_what(m)}")
        cut = m.find(" ", 1)  # llama.cpp: word.find(' ', 1), so a part may start with a space
        if cut < 1 or cut == len(m) - 1:
            raise GGUFError(f"{path}: {_MERGES}[{i}] {_one_line(repr(m), 60)} is not two "
                            f"non-empty parts separated by a space")
        a, b = m[:cut], m[cut + 1:]
        for part in (a, b, a + b):
            if part not in vocab:
                raise GGUFError(f"{path}: {_MERGES}[{i}] {_one_line(repr(m), 60)} makes or uses "
                                f"{_one_line(repr(part), 60)}, which is not in {_TOKENS}")
        pairs.append((a, b))
    return tokens, pairs, types


def _token_id(md: dict[str, Any], key: str, n_vocab: int, path: str) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if not _is_int(v) or not 0 <= v < n_vocab:
        raise GGUFError(f"{path}: {key} must be a token id in [0, {n_vocab}), got {_what(v)}")
    return v


def _compile_template(source: str, path: str) -> Any:
    """Compile in the sandbox as transformers' _compile_jinja_template does, so templates
    written for Hugging Face render the same text; None when jinja2 is absent (ChatML)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    from jinja2.exceptions import SecurityError

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox stops code execution, not a template building a string of 10^11
        characters or a number of 10^9 digits: cap what `*`, `**` and `+` may make."""
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
            counts = [x for x in (left, right) if isinstance(x, int)]
            if op == "*" and sizes and counts and sizes[0] * max(counts[0], 0) > _MAX_VALUE:
                raise SecurityError(f"a repetition of {sizes[0]} x {counts[0]} items")
            if op == "+" and len(sizes) == 2 and sum(sizes) > _MAX_VALUE:
                raise SecurityError(f"a concatenation of {sum(sizes)} items")
            if op == "**" and isinstance(right, int) and abs(right) > 1024 and \
                    isinstance(left, (int, float)) and abs(left) > 1:
                raise SecurityError(f"a power with exponent {right}")
            return super().call_binop(context, op, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise GGUFError(f"{path}: {_TEMPLATE} does not parse (line {e.lineno}: "
                        f"{_one_line(e.message)})") from None
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError on absurd nesting
        raise GGUFError(f"{path}: {_TEMPLATE} does not compile ({type(e).__name__}: "
                        f"{_one_line(e)})") from None


class _TemplateRaised(Exception):
    """raise_exception(msg) from a template; the message is the template's."""


class _TemplateTimeout(Exception):
    """A template still rendering after _RENDER_SECONDS (a hostile loop)."""


_MAX_VALUE = 1 << 20       # items a template may build with one `*` or `+`
_RENDER_SECONDS = 5.0      # a real chat template renders in milliseconds


def _render_bounded(template: Any, **kw: Any) -> str:
    """template.render(**kw), stopped after _RENDER_SECONDS: Jinja compiles templates to
    Python, so a trace function sees every line of a loop and can end it."""
    deadline = time.monotonic() + _RENDER_SECONDS

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _TemplateTimeout()
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return template.render(**kw)
    finally:
        sys.settrace(previous)


def _template_line(e: BaseException) -> str:
    # Jinja rewrites tracebacks so the template's own frames carry its line numbers
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if f.filename == "<template>"]
    return f" at line {lines[-1]}" if lines else ""


class Tokenizer:
    """A GGUF's byte-level BPE and chat template; construction checks every key it reads."""

    def __init__(self, metadata: dict[str, Any], path: str = "") -> None:
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, \
            pre_tokenizers

        tokens, merges, types = _check_vocab(metadata, path)
        self.tokens: list[str] = tokens
        self.bos: int | None = _token_id(metadata, "tokenizer.ggml.bos_token_id", len(tokens),
                                         path)
        self.eos: int | None = _token_id(metadata, "tokenizer.ggml.eos_token_id", len(tokens),
                                         path)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise GGUFError(f"{path}: tokenizer.ggml.add_bos_token must be a bool, "
                            f"got {_what(add_bos)}")
        self.add_bos: bool = add_bos
        template = metadata.get(_TEMPLATE)
        if template is not None and not isinstance(template, str):
            raise GGUFError(f"{path}: {_TEMPLATE} must be a string, got {_what(template)}")
        self.template: str | None = template
        self.path = path
        # compiled now so a template that does not parse fails the load, not the first chat()
        self._template = _compile_template(template, path) if template else None
        vocab = {t: i for i, t in enumerate(tokens)}
        try:
            tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                         use_regex=True)
            tok.decoder = decoders.ByteLevel()
            specials = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
            if specials:
                tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
        except BaseException as e:  # a Rust panic is a BaseException (pyo3's PanicException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise GGUFError(f"{path}: the tokenizers library rejects the vocabulary "
                            f"({type(e).__name__}: {_one_line(e)})") from None
        self._tok = tok

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos is not None:
            ids = [self.bos] + ids
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        checked = []
        for x in ids:
            i = operator.index(x)  # numpy integers too; a float is a TypeError
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is out of range for a vocabulary of "
                                 f"{len(self.tokens)} ({self.path})")
            checked.append(i)
        return self._tok.decode(checked, skip_special_tokens=False)

    def chat(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        if self._template is None:
            return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                           for m in messages) + "<|im_start|>assistant\n"
        from jinja2.exceptions import SecurityError

        try:
            # tools and documents None as transformers passes them: `tools is none` holds
            return _render_bounded(
                self._template, messages=messages, tools=None, documents=None, add_generation_prompt=True,
                bos_token=self.tokens[self.bos] if self.bos is not None else "",
                eos_token=self.tokens[self.eos] if self.eos is not None else "")
        except _TemplateTimeout:
            raise GGUFError(f"{self.path}: {_TEMPLATE} was still rendering after "
                            f"{_RENDER_SECONDS:.0f} s and was stopped") from None
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
