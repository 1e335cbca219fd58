"""GBNF written for llguidance (graphs/grammar/lark.py) accepts exactly the texts llama.cpp's
grammar does, on a vocabulary of single bytes: the cases where a rule-for-rule translation with
greedy multi-character lexemes (llguidance's own gbnf_to_lark) refuses what GBNF accepts, and
the repetition, class and escape forms."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("llguidance", reason="the grammar engine is the ggraph[grammar] extra")

from ggraph.graphs.grammar.constraint import compile_grammar  # noqa: E402


@dataclass(eq=False)   # kept by identity, like a tokenizer
class Bytes:
    """A vocabulary of the 256 bytes and an end token (256)."""
    eog_ids: frozenset = frozenset({256})
    bos: None = None
    pieces: list = field(default_factory=lambda: [bytes([i]) for i in range(256)] + [b"</s>"])

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    def piece(self, token: int, special: bool = True) -> bytes:
        return self.pieces[token]

    def encode(self, text, add_bos=None, special=True, add_eos=None, max_tokens=None):
        return list(text.encode("utf-8"))


VOCAB = Bytes()


def accepts(grammar: str, text: str) -> bool:
    st = compile_grammar(grammar, VOCAB).start()
    for b in text.encode("utf-8"):
        if not st.allows(b):
            return False
        st.accept(b)
    return st.allows(256)


@pytest.mark.parametrize("grammar, yes, no", [
    # greedy lexing would take "ab" and fail; GBNF backtracks
    ('root ::= ("a" | "ab") "bc"', ["abc", "abbc"], ["ab", "abcc"]),
    # greedy [a-z]* would eat the "b"
    ('root ::= x "b"\nx ::= [a-z]*', ["ab", "abb", "b"], ["a", ""]),
    ('root ::= num num\nnum ::= [0-9]+', ["12", "123"], ["1"]),
    ('root ::= "ab"* "a"', ["a", "aba", "ababa"], ["ab", "b"]),          # literal repeats whole
    ('root ::= "a"{2,3}', ["aa", "aaa"], ["a", "aaaa"]),
    ('root ::= "a"{2,} "b"', ["aab", "aaaaab"], ["ab"]),
    ('root ::= "a"{1,5000}', ["a", "a" * 3000], [""]),                    # > 2000: unbounded
    ('root ::= [^a-c\\n] "x"', ["dx", "éx", "\U0001F600x"], ["ax", "\nx"]),
    ('root ::= . .', ["\n\n", "é😀"], ["a"]),
    ('root ::= "\\u00e9\\x41\\t"', ["éA\t"], ["eA\t"]),
    ('root ::= [] "a" [^] ""', ["a"], ["", "aa"]),                       # empty = nothing
    ('root ::= [z-a] "b" | "c"', ["c"], ["b", "zb"]),                    # reversed range: none
    ('root ::= "a" ws "b"\nws ::= | " " | "\\n" [ \\t]{0,2}', ["ab", "a b", "a\n\t b"],
     ["a  b", "a\n   b"]),
])
def test_same_language_as_gbnf(grammar, yes, no):
    for text in yes:
        assert accepts(grammar, text), (grammar, text)
    for text in no:
        assert not accepts(grammar, text), (grammar, text)


def test_end_only_when_complete_and_never_by_text():
    st = compile_grammar('root ::= "<" [a-z/]* ">"', VOCAB).start()
    assert not st.allows(256)
    for b in b"</s":
        st.accept(b)
    assert not st.allows(256)     # the end token's text continues the grammar; still refused
    st.accept(ord(">"))
    assert st.allows(256) and st.complete


def test_partial_characters_follow_llama_cpp():
    # llama.cpp lets a token end inside a character at [^...] only if no character it could
    # complete to is excluded: E2 80 could become U+2028, so it is refused there
    vocab = Bytes(pieces=[bytes([i]) for i in range(256)] + [b"</s>", b"\xe2\x80", b"\xc3"])
    st = compile_grammar('root ::= [^\\u2028]+', vocab).start()
    assert not st.allows(257)
    assert st.allows(258)          # C3 completes to U+00C0..U+00FF: nothing excluded there
    st2 = compile_grammar('root ::= [\\u2000-\\u2030]+', vocab).start()
    assert st2.allows(257)         # a positive class: refused only with [^...] in the grammar


def test_token_references():
    """<[id]> takes exactly that token, !<[id]> any other one (llama.cpp's token elements)."""
    st = compile_grammar('root ::= <[65]> !<[66]> "x"', VOCAB).start()
    assert st.allows(65) and not st.allows(ord("a"))
    st.accept(65)
    assert not st.allows(66) and st.allows(ord("c"))
    m = st.mask()
    assert not m[66] and not m[256] and m[ord("c")]   # not the end token either
    st.accept(ord("c"))
    assert st.allows(ord("x"))
    st.accept(ord("x"))
    assert st.allows(256)
