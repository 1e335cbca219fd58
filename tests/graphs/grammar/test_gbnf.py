"""GBNF parsed as llama.cpp parses it (graphs/grammar/gbnf.py): its grammar files, the texts it
refuses (with the line, column and reason), and, live, the same accept/refuse answer as
llama.cpp's own parser on a list of edge cases."""
from __future__ import annotations

import pytest

from grammar_files import grammar_files
from ggraph.graphs.grammar.gbnf import (Chars, Group, Literal, Repeat, RuleRef, GrammarError,
                                        parse_gbnf)
from llama_cpp_ref import live


def test_llama_cpp_grammar_files_parse():
    files = grammar_files()
    if not files:
        pytest.skip("neither llama.cpp's source tree nor llama-cpp-python is here")
    for name, text in files.items():
        g = parse_gbnf(text)
        assert "root" in g.rules, name
        assert all(alts for alts in g.rules.values()), name


def test_structure():
    g = parse_gbnf('root ::= "ab"* [^a-c\\n] x{2,3}\nx ::= ("y" | ) # comment\n')
    (seq,) = g.rules["root"]
    assert seq[0] == Repeat(Literal((97, 98)), 0, None)     # the literal repeats as a whole
    assert seq[1] == Chars(((97, 99), (10, 10)), negated=True)
    assert seq[2] == Repeat(RuleRef("x"), 2, 3)
    assert g.rules["x"] == ((Group(((Literal((121,)),), ())),),)


def test_rules_continue_after_bar_and_inside_parentheses():
    g = parse_gbnf('root ::= "a" |\n  "b"\nother ::= (\n "c"\n "d")\n')
    assert len(g.rules["root"]) == 2
    assert g.rules["other"][0][0] == Group(((Literal((99,)), Literal((100,))),))


def test_llama_cpp_bounds():
    # a bound above 2000 means none; a minimum above it is refused
    assert parse_gbnf('root ::= "a"{1,5000}').rules["root"][0][0] == Repeat(Literal((97,)), 1, None)
    with pytest.raises(GrammarError, match="minimum above 2000"):
        parse_gbnf('root ::= "a"{2001}')
    with pytest.raises(GrammarError, match="more than 2000 rules"):
        parse_gbnf('root ::= ("a"{0,100}){0,100}')


@pytest.mark.parametrize("text, message", [
    ('root ::= "a', "line 1 col 10: unterminated string"),
    ('root ::= [ab', "unterminated character class"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "expecting 2 hex digits"),
    ('root ::= *', "expecting an item before the repetition"),
    ('root ::= ""*', "expecting an item before the repetition"),
    ('root ::= "a"{,3}', "expecting an int"),
    ('root ::= "a"{3,1}', "maximum (1) below its minimum (3)"),
    ('root ::= ("a"', "expecting ')'"),
    ('root := "a"', "expecting ::="),
    ('root ::= "a" )', "expecting newline or end"),
    ('root ::= x', "undefined rule 'x'"),
    ('start ::= "a"', "does not contain a 'root' rule"),
    ('root ::= root "a"', "left recursion at rule 'root'"),
    ('root ::= x "a"\nx ::= "" | root', "left recursion"),
    ('root ::= ("a" | "")*', "left recursion"),          # llama.cpp refuses this too
    ('root ::= <hello>', "needs the model's vocabulary"),
    ('root ::= "a\0"', "NUL character"),
    ('root ::= ' + "(" * 300 + '"a"' + ")" * 300, "nested deeper than 256"),
])
def test_refused(text, message):
    with pytest.raises(GrammarError) as e:
        parse_gbnf(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_errors_say_where():
    with pytest.raises(GrammarError, match=r"line 3 col 12: unknown escape at '\\\\z"):
        parse_gbnf('root ::= a\na ::= "x"\nb ::= "y" "\\z"\n')


def test_token_references():
    g = parse_gbnf('root ::= <[42]> !<[7]> <x>', token_of=lambda t: {"<x>": 5}[t])
    seq = g.rules["root"][0]
    assert [(s.token, s.negated) for s in seq] == [(42, False), (7, True), (5, False)]

    def one_token(text):
        raise ValueError(f"token {text!r} is 2 tokens in this vocabulary, not one")
    with pytest.raises(GrammarError, match="is 2 tokens"):
        parse_gbnf('root ::= <ab>', token_of=one_token)


# Grammars at the edges of llama.cpp's parser, each accepted or refused by both
EDGES = [
    'root ::= "a"', 'root ::= [] "a"', 'root ::= [^] "a"', 'root ::= "" "a"',
    'root ::= "a"{0}', 'root ::= "a"{0,0} "b"', 'root ::= "a"{2000}', 'root ::= "a"{2001}',
    'root ::= "a"{1,2001}', 'root ::= ("a"{0,100}){0,100}', 'root ::= ("a"{0,40}){0,40}',
    'root ::= "a"**', 'root ::= "a"*+?', 'root ::= x\nx ::= "a"\nx ::= "b"',
    'root ::= x y\nx ::= "" | "a"\ny ::= x root', 'root ::= x "a"\nx ::= [a-z]*',
    'root ::= [z-a] "b"', 'root ::= "\\u00e9\\U0001F600\\x41"', 'root ::= .',
    'root ::= "a"\r\nb ::= "c"\r\n', 'root ::= "a"   # trailing comment', '# only\nroot ::= "a"',
    'root ::= a\na ::= "x" |\n\n  "y"', 'root ::= ( "a"\n\n | "b" )', 'root ::= "a" "b"\n  "c"',
    'root ::= "a" {2}', 'root ::= "a"{ 2 , 3 }', 'root ::= "a"{2,}', 'root ::= x\nx ::= x',
    'root ::= <[3]> "a"', 'root ::= !<[3]>', 'root ::= [a-]', 'root ::= [-a]', 'root ::= [\\]]',
    'root ::= "\\-"', 'root ::= "a"|', 'root ::= | "a"', 'ro-ot ::= "a"\nroot ::= ro-ot',
    'root ::= "a" # c\n| "b"', 'root ::= (x)* \nx ::= "" | "a"',
]


def test_same_answer_as_llama_cpp_parser():
    llama_cpp = live()
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed (the reference parser)")
    from llama_grammar_ref import LlamaGrammarRef
    from ggraph.graphs.gguf.fetch import default_model

    ref = LlamaGrammarRef(llama_cpp, str(default_model()))
    try:
        for text in EDGES:
            try:
                parse_gbnf(text)
                ours = True
            except GrammarError:
                ours = False
            s = llama_cpp.llama_sampler_init_grammar(ref.vocab, text.encode(), b"root")
            theirs = bool(s)
            if s:
                llama_cpp.llama_sampler_free(s)
            assert ours == theirs, (text, ours, theirs)
    finally:
        ref.close()
