"""The grammar engine per sequence: which tokens may come next, accept, rollback.

Owns: `Vocab` (a vocabulary as the grammar sees it: each token's bytes as llama.cpp's
token_to_piece(special=true) gives them, and the end-of-generation set), `CompiledGrammar`
(a grammar checked and compiled once for a vocabulary) and `GrammarState` (one sequence's
position in it), `compile_grammar` and `engine_missing`.

The engine is llguidance (the `ggraph[grammar]` extra; docs/grammar.md says why that one),
imported on first use. Its answers are made to be llama.cpp's (llama_grammar_apply_impl): an
end-of-generation token is allowed exactly when the grammar is complete, whatever its text;
every other token by its text alone, control tokens included (llama.cpp matches their text
too); a token whose text is empty or starts with a NUL byte never is.
"""
from __future__ import annotations

import functools
import importlib.util
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .gbnf import Chars, Grammar, GrammarError, TokenRef, items, parse_gbnf
from .lark import to_lark

EXTRA_HINT = "pip install 'ggraph[grammar]' (the llguidance engine)"


def engine_missing() -> str | None:
    """Why grammars cannot run here (the engine is not installed), or None."""
    if importlib.util.find_spec("llguidance") is None:
        return f"grammars need the llguidance package: {EXTRA_HINT}"
    return None


def _engine() -> Any:
    why = engine_missing()
    if why:
        raise GrammarError(why)
    import llguidance
    return llguidance


class PieceSource(Protocol):
    """What a vocabulary is read from: ggraph's Tokenizer has these."""
    eog_ids: frozenset[int]
    bos: int | None

    @property
    def n_vocab(self) -> int: ...

    def piece(self, token: int, special: bool = True) -> bytes: ...

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True,
               add_eos: bool | None = None, max_tokens: int | None = None) -> list[int]: ...


@dataclass
class Vocab:
    pieces: list[bytes]
    eog: tuple[int, ...]
    never: np.ndarray          # bool per token: llama.cpp never allows it (empty or NUL-led)
    token_of_text: Any         # "<text>" -> its one token id, for GBNF token references
    encode: Any                # text -> token ids (no BOS, control tokens as text)
    # tokens ending inside a character: (token, code point bits so far, bytes still missing)
    partial: list[tuple[int, int, int]] = field(default_factory=list)
    _engine_tok: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, tok: PieceSource) -> "Vocab":
        pieces = [tok.piece(i, True) for i in range(tok.n_vocab)]
        eog = tuple(sorted(tok.eog_ids))
        never = np.fromiter(((not p or p[0] == 0) for p in pieces), bool, len(pieces))
        never[list(eog)] = False

        def token_of_text(text: str) -> int:
            ids = tok.encode(text, add_bos=False, special=True)
            if len(ids) != 1:
                raise ValueError(f"token {text!r} is {len(ids)} tokens in this vocabulary, "
                                 "not one")
            return ids[0]

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_bos=False, special=False, add_eos=False)
        partial = [(i, *tp) for i, p in enumerate(pieces) if p and (tp := _trailing(p))]
        return cls(pieces, eog, never, token_of_text, encode, partial)

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    @functools.cached_property
    def eog_set(self) -> frozenset[int]:
        return frozenset(self.eog)

    def engine_tokenizer(self) -> Any:
        """llguidance's tokenizer for these pieces (built once: ~0.5 s at 150k tokens)."""
        with self._lock:
            if self._engine_tok is None:
                L = _engine()
                if not self.eog:
                    raise GrammarError("the vocabulary has no end-of-generation token, which "
                                       "a grammar needs to finish")
                # an end-of-generation token is allowed by completeness alone, never by its
                # text (llguidance would match "<|endoftext|>" inside a JSON string)
                eog = set(self.eog)
                pieces = [b"" if self.never[i] or i in eog else p
                          for i, p in enumerate(self.pieces)]

                encode = self.encode

                class _Wrap:
                    # the names llguidance reads; it tokenizes the bytes a grammar forces
                    # (through str: raising on bytes makes it pass text)
                    tokens = pieces
                    eos_token_id = self.eog[0]
                    bos_token_id = None

                    def __call__(self, s: Any) -> list[int]:
                        if not isinstance(s, str):
                            raise TypeError("text only")
                        return encode(s)
                # no slices: llguidance's shortcut for long lexemes (a JSON string's body)
                # finds none in one-character lexemes and only adds work (measured on
                # Qwen2.5's vocabulary: p90 8.7 ms a mask with them, 6.6 without)
                self._engine_tok = L.LLTokenizer(L.TokenizerWrapper(_Wrap()),
                                                 n_vocab=len(pieces), eos_token=list(self.eog),
                                                 slices=[])
            return self._engine_tok


def _trailing(piece: bytes) -> tuple[int, int] | None:
    """The character a piece ends inside, as llama.cpp's decode_utf8 leaves it: (its bits so
    far, bytes still to come), or None when the piece ends on a whole character."""
    value, remain = 0, 0
    for b in piece:
        if remain:
            if b >> 6 != 2:
                return None            # invalid; llama.cpp refuses the token anyway
            value, remain = (value << 6) | (b & 0x3F), remain - 1
            continue
        n = (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 3, 4)[b >> 4]
        if n == 0:
            return None
        value, remain = b & ((1 << (8 - n)) - 1), n - 1
    return (value, remain) if remain else None


def _fragile(grammar: Grammar, vocab: Vocab) -> np.ndarray:
    """Tokens llama.cpp refuses where llguidance would not: llama.cpp lets a token end inside a
    character at a negated class only when no character it could complete to is excluded
    (llama_grammar_match_partial_char), so `[^\u2028]` refuses a token ending in E2 80, while
    llguidance allows it since E2 80 80 could follow. These are refused everywhere: every
    output is then one llama.cpp accepts, and the masks differ only where a positive class at
    the same place would take such a token (docs/grammar.md)."""
    excluded = [(lo, hi) for alts in grammar.rules.values() for rng in _negated(alts)
                for lo, hi in rng if hi >= 0x80]
    out = np.zeros(vocab.n_vocab, dtype=bool)
    if not excluded:
        return out
    for tok, value, remain in vocab.partial:
        if remain == 1 and value < 2:
            continue                   # an overlong lead; refused by both already
        low = value << (remain * 6)
        high = low | ((1 << (remain * 6)) - 1)
        if low == 0:
            low = {2: 1 << 11, 3: 1 << 16}.get(remain, low)
        if any(lo <= high and low <= hi for lo, hi in excluded):
            out[tok] = True
    return out


def _negated(alts: Any) -> list[tuple[tuple[int, int], ...]]:
    return [it.ranges for it in items(alts) if isinstance(it, Chars) and it.negated]


_VOCABS: "weakref.WeakKeyDictionary[Any, Vocab]" = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocab_of(tok: PieceSource) -> Vocab:
    """The grammar's view of a tokenizer, built once per tokenizer object."""
    with _VOCABS_LOCK:
        v = _VOCABS.get(tok)
        if v is None:
            v = _VOCABS[tok] = Vocab.of(tok)
        return v


@dataclass
class CompiledGrammar:
    grammar: Grammar
    lark: str
    vocab: Vocab
    refused: np.ndarray        # bool per token: never allowed under this grammar

    def start(self) -> "GrammarState":
        L = _engine()
        m = L.LLMatcher(self.vocab.engine_tokenizer(), L.LLMatcher.grammar_from_lark(self.lark),
                        log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar: the engine refused it: {m.get_error().strip()}")
        return GrammarState(self, m)


def compile_grammar(text: str, tok: PieceSource, root: str = "root") -> CompiledGrammar:
    """Parse GBNF `text` as llama.cpp does and compile it for `tok`'s vocabulary; the first
    state is started here too, so an engine refusal is an error now, not at the first token."""
    vocab = vocab_of(tok)
    g = parse_gbnf(text, root, token_of=vocab.token_of_text)
    for name, alts in g.rules.items():
        _check_tokens(alts, vocab.n_vocab, name)
    cg = CompiledGrammar(g, to_lark(g), vocab, vocab.never | _fragile(g, vocab))
    cg.start()
    return cg


_COMPILED: "dict[tuple[str, int], CompiledGrammar]" = {}
_COMPILED_MAX = 32


def start_grammar(text: str, tok: PieceSource) -> "GrammarState":
    """A new state of `text` compiled for `tok` (compiled grammars are kept for the last
    few texts, so the n choices of a request or the slots of a server share one)."""
    vocab = vocab_of(tok)
    key = (text, id(vocab))
    with _VOCABS_LOCK:
        cg = _COMPILED.pop(key, None)
    if cg is None or cg.vocab is not vocab:
        cg = compile_grammar(text, tok)
    with _VOCABS_LOCK:
        _COMPILED[key] = cg
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
    return cg.start()


def _check_tokens(alts: Any, n_vocab: int, rule: str) -> None:
    for it in items(alts):
        if isinstance(it, TokenRef) and not 0 <= it.token < n_vocab:
            raise GrammarError(f"grammar rule '{rule}': token <[{it.token}]> is outside the "
                               f"vocabulary of {n_vocab}")


class GrammarState:
    """One sequence's place in a grammar: what may come next, and the tokens taken so far."""

    def __init__(self, compiled: CompiledGrammar, matcher: Any) -> None:
        self.compiled = compiled
        self._m = matcher
        n = compiled.vocab.n_vocab
        self._bits = np.zeros((n + 31) // 32, dtype=np.int32)
        self.n_accepted = 0

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (llama.cpp's single-candidate check)."""
        if not 0 <= token < self.compiled.refused.size or self.compiled.refused[token]:
            return False
        if token in self.compiled.vocab.eog_set:   # llguidance's check says no to these
            return bool(self._m.is_accepting())
        return self._m.validate_tokens([int(token)]) == 1

    def mask(self) -> np.ndarray:
        """A bool per token: may it come next."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise GrammarError(f"grammar: {self._m.get_error().strip()}")
        n = self.compiled.vocab.n_vocab
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:n].astype(bool)
        allowed &= ~self.compiled.refused
        # the end only when complete, whatever the grammar says of tokens (a negated token
        # reference, !<[id]>, would let llguidance take the end token mid-way)
        allowed[list(self.compiled.vocab.eog)] = bool(self._m.is_accepting())
        return allowed

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            err = self._m.get_error().strip()
            raise GrammarError(f"token {int(token)} does not continue the grammar ({err})")
        self.n_accepted += 1

    def rollback(self, n: int) -> None:
        """Forget the last `n` accepted tokens (a rejected draft)."""
        if n:
            if n > self.n_accepted or not self._m.rollback(int(n)):
                raise GrammarError(f"grammar: cannot roll back {n} of {self.n_accepted} tokens")
            self.n_accepted -= n

    def reset(self) -> None:
        self._m.reset()
        self.n_accepted = 0

    @property
    def complete(self) -> bool:
        """The grammar is satisfied: an end-of-generation token may come now."""
        return bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but an end-of-generation token may come now."""
        return bool(self._m.is_stopped())

