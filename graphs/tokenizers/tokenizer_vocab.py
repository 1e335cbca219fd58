"""A GGUF's vocabulary, checked, with llama.cpp's token attributes and special-token splitting.

Owns reading and checking the tokenizer keys (a GGUF is hostile input: every malformed key is a
one-line GGUFError naming the file and the key, and the index of a bad element, found before any
value reaches the Rust `tokenizers` library, which panics on bad merges), the attribute of each
token as llama.cpp computes it (its token type, then the fixes llama.cpp applies by token text),
and llama.cpp's partition of a text around special tokens (tokenizer_st_partition): every
USER_DEFINED token is cut out of the text before tokenizing, CONTROL and UNKNOWN ones only when
parsing specials; the longest tokens are cut first, each across the whole text.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from ggraph.graphs.gguf.gguf_reader import GGUFError

MODEL = "tokenizer.ggml.model"
TOKENS = "tokenizer.ggml.tokens"
TYPES = "tokenizer.ggml.token_type"
SCORES = "tokenizer.ggml.scores"
MERGES = "tokenizer.ggml.merges"
MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece


class Attr(IntFlag):
    """llama.cpp's llama_token_attr bits (the ones tokenizing and detokenizing read)."""
    UNDEFINED = 0
    UNKNOWN = 1
    UNUSED = 2
    NORMAL = 4
    CONTROL = 8
    USER_DEFINED = 16
    BYTE = 32


# GGUF token types (llama_token_type) -> attributes; any other value is UNDEFINED, as in llama.cpp
_TYPE_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED,
              5: Attr.UNUSED, 6: Attr.BYTE}

# Texts llama.cpp makes CONTROL whatever their type says, because they end generation or mark
# fill-in-the-middle (llama_vocab::impl::load); as CONTROL they are not matched in plain text.
# (llama.cpp marks only the first FIM token of each kind it meets; ggraph marks all of them.)
_FORCED_CONTROL = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
    "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
    "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
    "\u2581<MID>", "<|code_middle|>", "<|middle|>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
])
_ALWAYS_USER_DEFINED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])


def one_line(text: object, limit: int = 300) -> str:
    """Collapse whitespace (messages span lines) and cap the length (a hostile file chooses
    its own strings)."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit] + "..."


def what(value: Any) -> str:
    """A short description of a value for an error message."""
    if value is None:
        return "missing or unreadable"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {one_line(repr(value), 60)}"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # the loader decodes bools as bool


def _first_bad(items: list[Any], ok: Callable[[Any], bool],
               fine: frozenset[type] = frozenset()) -> int | None:
    """The index of the first item `ok` refuses, or None. Items whose exact type is in
    `fine` (types `ok` accepts every value of) need no call: a list of them all is passed in
    one pass at C speed (151k tokens 3 ms, against 40 ms calling `ok`); any other list is
    walked, and only a refused one is enumerated to name the index."""
    if fine and set(map(type, items)) <= fine:
        return None
    if all(ok(x) for x in items):
        return None
    return next(i for i, x in enumerate(items) if not ok(x))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_STR, _INT, _NUMBER = frozenset({str}), frozenset({int}), frozenset({int, float})


@dataclass
class Vocab:
    """The checked vocabulary: token texts, llama.cpp attributes, SentencePiece scores (zeros
    when absent) and the BPE merges split into pairs (empty for SentencePiece)."""
    model: str
    tokens: list[str]
    attrs: list[Attr]
    scores: list[float]
    merges: list[tuple[str, str]]
    path: str

    def specials(self) -> dict[bool, list[tuple[str, int]]]:
        """For parse_special True and False, the (text, id) pairs partition() cuts out,
        longest first as llama.cpp sorts them (by UTF-8 length; ids break ties, which
        llama.cpp's unstable sort leaves open): one pass over the vocabulary for both."""
        key = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)
        skip = int(Attr.CONTROL | Attr.UNKNOWN)
        # plain int arithmetic: IntFlag's & makes a flag object per token (150k of them)
        found = [(t, i, a) for i, (t, a) in enumerate(zip(self.tokens, self.attrs))
                 if int.__and__(a, key)]
        found.sort(key=lambda p: (-len(p[0].encode("utf-8")), p[1]))
        return {True: [(t, i) for t, i, _ in found],
                False: [(t, i) for t, i, a in found if not int.__and__(a, skip)]}


def check_vocab(md: dict[str, Any], path: str) -> Vocab:
    """Read and check the tokenizer keys; every problem is a GGUFError naming the key."""
    model = md.get(MODEL)
    if not isinstance(model, str):
        raise GGUFError(f"{path}: {MODEL} must be a string, got {what(model)}")
    if model not in MODELS:
        raise GGUFError(f"{path}: tokenizer model {one_line(repr(model), 60)} is not supported "
                        f"(ggraph reads {MODEL} 'gpt2', byte-level BPE, and 'llama', "
                        f"SentencePiece)")
    tokens = md.get(TOKENS)
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path}: {TOKENS} must be a non-empty list of strings, "
                        f"got {what(tokens)}")
    if (i := _first_bad(tokens, lambda t: isinstance(t, str), _STR)) is not None:
        raise GGUFError(f"{path}: {TOKENS}[{i}] must be a string, got {what(tokens[i])}")
    if len(set(tokens)) != len(tokens):  # llama.cpp asserts on this; name the repeat instead
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise GGUFError(f"{path}: {TOKENS}[{i}] {one_line(repr(t), 60)} repeats "
                                f"{TOKENS}[{seen[t]}]")
            seen[t] = i
    types = md.get(TYPES)
    if types is not None:
        if not isinstance(types, list):
            raise GGUFError(f"{path}: {TYPES} must be a list of integers, got {what(types)}")
        if (i := _first_bad(types, is_int, _INT)) is not None:
            raise GGUFError(f"{path}: {TYPES}[{i}] must be an integer, got {what(types[i])}")
        if len(types) != len(tokens):
            raise GGUFError(f"{path}: {TYPES} has {len(types)} entries but {TOKENS} has "
                            f"{len(tokens)}")
    scores = md.get(SCORES)
    if scores is None:
        scores = [0.0] * len(tokens)
    elif not isinstance(scores, list) or len(scores) != len(tokens):
        raise GGUFError(f"{path}: {SCORES} must be a list of {len(tokens)} numbers (one per "
                        f"token), got {what(scores)}")
    elif (i := _first_bad(scores, _is_number, _NUMBER)) is not None:
        raise GGUFError(f"{path}: {SCORES}[{i}] must be a number, got {what(scores[i])}")
    merges = _check_merges(md, set(tokens), path) if model == "gpt2" else []
    return Vocab(model, tokens, _attrs(tokens, types), [float(s) for s in scores], merges, path)


def _check_merges(md: dict[str, Any], vocab: set[str], path: str) -> list[tuple[str, str]]:
    merges = md.get(MERGES)
    if merges is None:  # llama.cpp refuses a BPE vocabulary without merges, so do we
        raise GGUFError(f"{path}: {MERGES} is missing (a 'gpt2' BPE vocabulary needs merges)")
    if not isinstance(merges, list):
        raise GGUFError(f"{path}: {MERGES} must be a list of strings, got {what(merges)}")
    # the whole list checked at once (150k merges: a loop of Python checks took 0.5 s); any
    # problem is named by the loop below
    cuts = [m.find(" ", 1) if type(m) is str else -1 for m in merges]
    if all(0 < c < len(m) - 1 for m, c in zip(merges, cuts)):
        pairs = [(m[:c], m[c + 1:]) for m, c in zip(merges, cuts)]
        if {p for a, b in pairs for p in (a, b, a + b)} <= vocab:
            return pairs
    pairs = []
    for i, m in enumerate(merges):
        if not isinstance(m, str):
            raise GGUFError(f"{path}: {MERGES}[{i}] must be a string, got {what(m)}")
        cut = m.find(" ", 1)  # llama.cpp: word.find(' ', 1), so a part may start with a space
        if cut < 1 or cut == len(m) - 1:
            raise GGUFError(f"{path}: {MERGES}[{i}] {one_line(repr(m), 60)} is not two "
                            f"non-empty parts separated by a space")
        a, b = m[:cut], m[cut + 1:]
        for part in (a, b, a + b):
            if part not in vocab:
                raise GGUFError(f"{path}: {MERGES}[{i}] {one_line(repr(m), 60)} makes or uses "
                                f"{one_line(repr(part), 60)}, which is not in {TOKENS}")
        pairs.append((a, b))
    return pairs


def _attrs(tokens: list[str], types: list[int] | None) -> list[Attr]:
    """Attributes as llama.cpp derives them: NORMAL without types, else from the type; then
    end-of-generation and FIM texts become CONTROL, CONTROL texts naming "unused" UNUSED too,
    and gpt-oss's channel markers USER_DEFINED."""
    if types is None:
        attrs = [Attr.NORMAL] * len(tokens)
    else:
        attrs = [_TYPE_ATTR.get(t, Attr.UNDEFINED) for t in types]
    for i, t in enumerate(tokens):
        a = attrs[i]
        if t in _FORCED_CONTROL:
            a |= Attr.CONTROL
        if "unused" in t and a & Attr.CONTROL:   # the cheap test first: 150k tokens
            a |= Attr.UNUSED
        if t in _ALWAYS_USER_DEFINED:
            a = Attr.USER_DEFINED
        attrs[i] = a
    return attrs


def partition(text: str, specials: list[tuple[str, int]]) -> list[str | int]:
    """`text` cut around the special tokens: text pieces (str) and token ids (int), in order.
    Like llama.cpp, each special token, longest first, is found in every text piece left by the
    ones before it; a token that does not occur in the whole text is skipped at once."""
    pieces: list[str | int] = [text] if text else []
    for tok, tid in specials:
        if not tok or tok not in text:
            continue
        out: list[str | int] = []
        for p in pieces:
            if isinstance(p, int) or tok not in p:
                out.append(p)
                continue
            parts = p.split(tok)
            for j, part in enumerate(parts):
                if j:
                    out.append(tid)
                if part:
                    out.append(part)
        pieces = out
    return pieces
