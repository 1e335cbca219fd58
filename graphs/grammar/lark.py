"""A parsed GBNF grammar written in llguidance's Lark dialect, accepting exactly the same texts.

Owns: `to_lark(grammar)`.

Why every lexeme is one character: llguidance runs an Earley parser over lexemes that its lexer
matches greedily, the longest match first. A GBNF grammar has no lexer; llama.cpp keeps every
way of matching at once. Written rule for rule with multi-character lexemes (as llguidance's own
gbnf_to_lark does) the two differ: `x ::= [a-z]*` then `root ::= x "b"` refuses "ab", and
`("a" | "ab") "bc"` refuses "abc". With every literal and class a one-character lexeme no
lexeme is a proper prefix of another (UTF-8 is prefix-free), so greedy matching never has a
choice to get wrong, and all ambiguity is left to the Earley parser, which keeps every
parse as llama.cpp's stacks do. tests/graphs/grammar/test_lark.py checks both cases.
The cost is a parser step per character instead of per lexeme; the mask benchmark measures it.
"""
from __future__ import annotations

from .gbnf import AnyChar, Chars, Grammar, Group, Item, Literal, Repeat, RuleRef, TokenRef

# no_forcing: where the grammar forces bytes, llguidance otherwise allows only the canonical
# tokenization of them (after "c" in "char" only "har", not "h"); llama.cpp allows every token
# whose text fits
_HEADER = '%llguidance {"no_forcing": true}'
_PLAIN = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ")


def _cp(c: int) -> str:
    ch = chr(c)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{c:X}}}"


def _char(c: int) -> str:
    ch = chr(c)
    return f'"{ch}"' if ch in _PLAIN else f"/\\x{{{c:X}}}/"


def _chars(c: Chars) -> str:
    parts = []
    for lo, hi in c.ranges:
        if lo > hi:      # llama.cpp's range test never matches; a regex would refuse it
            continue
        parts.append(_cp(lo) if lo == hi else f"{_cp(lo)}-{_cp(hi)}")
    if not parts:        # every range empty: nothing matches, or with ^ anything does
        return "/(?s:.)/" if c.negated else "/[^\\x{0}-\\x{10FFFF}]/"
    return f"/[{'^' if c.negated else ''}{''.join(parts)}]/"


class _Writer:
    def __init__(self, grammar: Grammar) -> None:
        # Lark rule names are lowercase identifiers; GBNF names may hold '-' and capitals
        self.names = {name: f"r{i}" for i, name in enumerate(grammar.rules)}

    def item(self, it: Item) -> tuple[str, bool]:
        """The item's text and whether it is one atom (a repetition can follow it bare)."""
        if isinstance(it, Chars):
            return _chars(it), True
        if isinstance(it, Literal):
            text = " ".join(_char(c) for c in it.chars)
            return text, len(it.chars) == 1
        if isinstance(it, AnyChar):
            return "/(?s:.)/", True
        if isinstance(it, RuleRef):
            return self.names[it.name], True
        if isinstance(it, TokenRef):
            return f"<[{'^' if it.negated else ''}{it.token}]>", True
        if isinstance(it, Group):
            return f"({self.alts(it.alts)})", True
        if isinstance(it, Repeat):
            inner, atom = self.item(it.item)
            if it.hi == 0:
                return '""', True
            if not atom:
                inner = f"({inner})"
            lo, hi = it.lo, it.hi
            if (lo, hi) == (0, None):
                op = "*"
            elif (lo, hi) == (1, None):
                op = "+"
            elif (lo, hi) == (0, 1):
                op = "?"
            elif hi is None:
                op = f"{{{lo},}}"
            elif lo == hi:
                op = f"{{{lo}}}"
            else:
                op = f"{{{lo},{hi}}}"
            return f"{inner}{op}", False
        raise TypeError(f"unknown grammar item {it!r}")

    def seq(self, items: tuple[Item, ...]) -> str:
        return " ".join(self.item(it)[0] for it in items) if items else '""'

    def alts(self, alts: tuple[tuple[Item, ...], ...]) -> str:
        return " | ".join(self.seq(s) for s in alts)


def to_lark(grammar: Grammar) -> str:
    """The grammar in llguidance's Lark dialect (`start` is the root rule)."""
    w = _Writer(grammar)
    lines = [_HEADER, f"start: {w.names[grammar.root]}"]
    for name, alts in grammar.rules.items():
        lines.append(f"{w.names[name]}: {w.alts(alts)}")
    return "\n".join(lines) + "\n"
