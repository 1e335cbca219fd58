"""GBNF, llama.cpp's grammar language, parsed as llama.cpp's llama_grammar_parser parses it.

Owns: the parsed form (`Grammar`: named rules of alternatives of items — `Chars`, `AnyChar`,
`RuleRef`, `TokenRef`, `Group`, `Repeat`), `parse_gbnf` and `GrammarError`.

The same texts are accepted and refused as llama.cpp's parser and llama_grammar_init_impl do
(src/llama-grammar.cpp): rules end at a newline unless inside parentheses or after `|`; a
literal repeats as a whole (`"ab"*` is `("ab")*`); `[]`, `[^]` and `""` match the empty string
and are not an item a repetition can follow; a bound above 2000 means no bound and a minimum
above 2000 is refused, as is a repetition whose generated rules times those of what it repeats
exceed 2000; a rule defined twice keeps the last definition; every referenced rule must be
defined, `root` must exist, and left recursion is refused, found the way llama.cpp finds it
(over the rules its parser generates for groups and repetitions, where a rule "may be empty"
only when one of its own alternatives is empty). Beyond llama.cpp, for hostile input: a NUL
character is refused (llama.cpp would stop reading there), the text is bounded, and nesting of
parentheses is bounded (llama.cpp recurses without a limit). Errors are one line with the line
and column and the text there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Union

MAX_REPETITION = 2000          # llama.cpp's MAX_REPETITION_THRESHOLD
MAX_GRAMMAR_CHARS = 4 << 20    # a JSON schema's grammar is far smaller; bounds hostile input
MAX_NESTING = 256              # parentheses inside parentheses


class GrammarError(ValueError):
    """A grammar llama.cpp would refuse (or that is too large), with where and why."""


@dataclass(frozen=True)
class Chars:
    """One character from `ranges` (inclusive code point pairs), or with `negated` one not in
    them; a literal "abc" is three of these."""
    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def matches(self, cp: int) -> bool:
        return any(lo <= cp <= hi for lo, hi in self.ranges) != self.negated


@dataclass(frozen=True)
class AnyChar:
    """`.`: any one character."""


@dataclass(frozen=True)
class RuleRef:
    name: str


@dataclass(frozen=True)
class TokenRef:
    """`<[id]>` / `<text>`: exactly that token; with `negated` (`!<...>`) any other token."""
    token: int
    negated: bool = False


@dataclass(frozen=True)
class Literal:
    """A quoted string: its characters in order (repeated as a whole)."""
    chars: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    alts: tuple[tuple["Item", ...], ...]


@dataclass(frozen=True)
class Repeat:
    """`item{lo,hi}`; hi None = no bound (`*`, `+`, `{n,}`)."""
    item: "Item"
    lo: int
    hi: int | None


Item = Union[Chars, AnyChar, RuleRef, TokenRef, Literal, Group, Repeat]
Alts = tuple[tuple[Item, ...], ...]


@dataclass
class Grammar:
    """Rules by name, in the order llama.cpp gives them symbol ids; `root` is where it starts."""
    rules: dict[str, Alts]
    root: str = "root"
    text: str = ""


def items(alts: Alts) -> Iterator[Item]:
    """Every item of a rule's alternatives, those inside groups and repetitions too."""
    stack = [it for seq in alts for it in seq]
    while stack:
        it = stack.pop()
        yield it
        if isinstance(it, Group):
            stack.extend(x for seq in it.alts for x in seq)
        elif isinstance(it, Repeat):
            stack.append(it.item)


def _is_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


# What the repetition check and the left-recursion check see: llama.cpp's flattened rules
# (a symbol id per name and per generated rule; a sequence is refs and terminals).
_T = -1  # a terminal element in a flat sequence


@dataclass
class _Flat:
    ids: dict[str, int] = field(default_factory=dict)
    rules: dict[int, list[list[int]]] = field(default_factory=dict)
    n_symbols: int = 0

    def name_id(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self.n_symbols
            self.n_symbols += 1
        return self.ids[name]

    def new_id(self) -> int:
        self.n_symbols += 1
        return self.n_symbols - 1


class _Parser:
    def __init__(self, src: str, token_of: Callable[[str], int] | None) -> None:
        self.src = src
        self.n = len(src)
        self.token_of = token_of
        self.flat = _Flat()
        self.rules: dict[str, Alts] = {}
        self.depth = 0

    # -- errors and characters -------------------------------------------------------------
    def fail(self, pos: int, what: str) -> GrammarError:
        line = self.src.count("\n", 0, pos) + 1
        col = pos - (self.src.rfind("\n", 0, pos) + 1) + 1
        at = self.src[pos:pos + 24]
        where = f"at {at!r}" if at else "at the end"
        return GrammarError(f"grammar line {line} col {col}: {what} {where}")

    def ch(self, pos: int) -> str:
        return self.src[pos] if pos < self.n else ""

    def space(self, pos: int, newline_ok: bool) -> int:
        while pos < self.n:
            c = self.src[pos]
            if c == "#":
                while pos < self.n and self.src[pos] not in "\r\n":
                    pos += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            else:
                break
        return pos

    def name_end(self, pos: int) -> int:
        end = pos
        while end < self.n and _is_word(self.src[end]):
            end += 1
        if end == pos:
            raise self.fail(pos, "expecting a rule name")
        return end

    def int_end(self, pos: int) -> int:
        end = pos
        while end < self.n and self.src[end].isascii() and self.src[end].isdigit():
            end += 1
        if end == pos:
            raise self.fail(pos, "expecting an integer")
        return end

    def hex(self, pos: int, size: int) -> tuple[int, int]:
        digits = self.src[pos:pos + size]
        if len(digits) != size or any(c not in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail(pos, f"expecting {size} hex digits")
        return int(digits, 16), pos + size

    def char(self, pos: int) -> tuple[int, int]:
        """One character of a literal or class, escapes as llama.cpp's parse_char reads them."""
        if pos >= self.n:
            raise self.fail(pos, "unexpected end of input")
        c = self.src[pos]
        if c != "\\":
            return ord(c), pos + 1
        e = self.ch(pos + 1)
        if e in ("x", "u", "U"):
            return self.hex(pos + 2, {"x": 2, "u": 4, "U": 8}[e])
        simple = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
        if e in simple:
            return simple[e], pos + 2
        raise self.fail(pos, "unknown escape")

    # -- the grammar -----------------------------------------------------------------------
    def parse(self) -> None:
        pos = self.space(0, True)
        while pos < self.n:
            pos = self.rule(pos)

    def rule(self, pos: int) -> int:
        end = self.name_end(pos)
        name = self.src[pos:end]
        rid = self.flat.name_id(name)
        pos = self.space(end, False)
        if self.src[pos:pos + 3] != "::=":
            raise self.fail(pos, "expecting ::=")
        pos = self.space(pos + 3, True)
        alts, flat, pos = self.alternates(pos, name, False)
        self.rules[name] = alts      # a second definition replaces the first, as in llama.cpp
        self.flat.rules[rid] = flat
        if self.src.startswith("\r\n", pos):
            pos += 2
        elif self.ch(pos) in ("\r", "\n"):
            pos += 1
        elif pos < self.n:
            raise self.fail(pos, "expecting newline or end")
        return self.space(pos, True)

    def alternates(self, pos: int, name: str, nested: bool
                   ) -> tuple[Alts, list[list[int]], int]:
        seqs, flats = [], []
        seq, flat, pos = self.sequence(pos, name, nested)
        seqs.append(seq)
        flats.append(flat)
        while self.ch(pos) == "|":
            pos = self.space(pos + 1, True)
            seq, flat, pos = self.sequence(pos, name, nested)
            seqs.append(seq)
            flats.append(flat)
        return tuple(seqs), flats, pos

    def sequence(self, pos: int, name: str, nested: bool
                 ) -> tuple[tuple[Item, ...], list[int], int]:
        items: list[Item] = []
        flat: list[int] = []
        # the last item and where its flat elements start (None: no item a repetition can take)
        last: int | None = None
        last_flat = 0
        n_prev_rules = 1
        while pos < self.n:
            c = self.src[pos]
            start = pos
            if c == '"':
                pos += 1
                chars = []
                while self.ch(pos) != '"':
                    if pos >= self.n:
                        raise self.fail(start, "unterminated string")
                    cp, pos = self.char(pos)
                    chars.append(cp)
                pos = self.space(pos + 1, nested)
                last, n_prev_rules = None, 1
                if chars:
                    items.append(Literal(tuple(chars)))
                    last, last_flat = len(items) - 1, len(flat)
                    flat.append(_T)
            elif c == "[":
                pos += 1
                negated = self.ch(pos) == "^"
                pos += negated
                ranges = []
                while self.ch(pos) != "]":
                    if pos >= self.n:
                        raise self.fail(start, "unterminated character class")
                    lo, pos = self.char(pos)
                    hi = lo
                    if self.ch(pos) == "-" and self.ch(pos + 1) != "]":
                        if pos + 1 >= self.n:
                            raise self.fail(start, "unterminated character class")
                        hi, pos = self.char(pos + 1)
                    ranges.append((lo, hi))
                pos = self.space(pos + 1, nested)
                last, n_prev_rules = None, 1
                if ranges:
                    items.append(Chars(tuple(ranges), negated))
                    last, last_flat = len(items) - 1, len(flat)
                    flat.append(_T)
            elif c in "<!":
                negated = c == "!"
                pos += negated
                tok, pos = self.token(pos)
                items.append(TokenRef(tok, negated))
                last, last_flat, n_prev_rules = len(items) - 1, len(flat), 1
                flat.append(_T)
                pos = self.space(pos, nested)
            elif _is_word(c):
                end = self.name_end(pos)
                ref = self.src[pos:end]
                flat_id = self.flat.name_id(ref)
                items.append(RuleRef(ref))
                last, last_flat, n_prev_rules = len(items) - 1, len(flat), 1
                flat.append(flat_id)
                pos = self.space(end, nested)
            elif c == "(":
                self.depth += 1
                if self.depth > MAX_NESTING:
                    raise self.fail(pos, f"parentheses nested deeper than {MAX_NESTING}")
                pos = self.space(pos + 1, True)
                before = self.flat.n_symbols
                gid = self.flat.new_id()
                alts, gflat, pos = self.alternates(pos, name, True)
                self.flat.rules[gid] = gflat
                n_prev_rules = max(1, self.flat.n_symbols - before)
                if self.ch(pos) != ")":
                    raise self.fail(pos, "expecting ')'")
                self.depth -= 1
                items.append(Group(alts))
                last, last_flat = len(items) - 1, len(flat)
                flat.append(gid)
                pos = self.space(pos + 1, nested)
            elif c == ".":
                items.append(AnyChar())
                last, last_flat, n_prev_rules = len(items) - 1, len(flat), 1
                flat.append(_T)
                pos = self.space(pos + 1, nested)
            elif c in "*+?{":
                if c == "{":
                    lo, hi, pos = self.braces(pos, nested)
                else:
                    lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                    pos = self.space(pos + 1, nested)
                if last is None:
                    raise self.fail(start, "expecting an item before the repetition")
                n_prev_rules = self.repeat(start, flat, last_flat, lo, hi, n_prev_rules)
                items[last] = Repeat(items[last], lo, hi)
            else:
                break
        return tuple(items), flat, pos

    def braces(self, pos: int, nested: bool) -> tuple[int, int | None, int]:
        pos = self.space(pos + 1, nested)
        if not (self.ch(pos).isascii() and self.ch(pos).isdigit()):
            raise self.fail(pos, "expecting an int")
        end = self.int_end(pos)
        lo = int(self.src[pos:end])
        hi: int | None = None
        pos = self.space(end, nested)
        if self.ch(pos) == "}":
            hi = lo
        elif self.ch(pos) == ",":
            pos = self.space(pos + 1, nested)
            if self.ch(pos).isascii() and self.ch(pos).isdigit():
                end = self.int_end(pos)
                hi = int(self.src[pos:end])
                pos = self.space(end, nested)
            if self.ch(pos) != "}":
                raise self.fail(pos, "expecting '}'")
        else:
            raise self.fail(pos, "expecting ','")
        pos = self.space(pos + 1, nested)
        if lo > MAX_REPETITION:
            raise self.fail(pos, f"a repetition minimum above {MAX_REPETITION}")
        if hi is not None and hi > MAX_REPETITION:
            hi = None            # llama.cpp: a bound above the threshold means no bound
        if hi is not None and hi < lo:
            # llama.cpp's count of optional copies underflows here and it never finishes
            raise self.fail(pos, f"a repetition maximum ({hi}) below its minimum ({lo})")
        return lo, hi, pos

    def repeat(self, at: int, flat: list[int], start: int, lo: int, hi: int | None,
               n_prev_rules: int) -> int:
        """llama.cpp's rewrite of the last item into generated rules, on the flat form (only
        what the checks need: which rules come first and which may be empty)."""
        total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
        if n_prev_rules * total > MAX_REPETITION:
            raise self.fail(at, f"the repetition generates more than {MAX_REPETITION} rules "
                            f"({n_prev_rules} x {total})")
        prev = flat[start:]
        if lo == 0:
            del flat[start:]
        # (further copies of prev for lo > 1 change neither check)
        n_opt = 1 if hi is None else hi - lo
        last_rec = None
        for i in range(n_opt):
            rid = self.flat.new_id()
            body = list(prev)
            if hi is None:
                body.append(rid)
            elif i > 0:
                body.append(last_rec)
            self.flat.rules[rid] = [body, []]
            last_rec = rid
        if n_opt > 0:
            flat.append(last_rec)
        return n_prev_rules * total

    def token(self, pos: int) -> tuple[int, int]:
        if self.ch(pos) != "<":
            raise self.fail(pos, "expecting '<'")
        if self.ch(pos + 1) == "[":
            end = self.int_end(pos + 2)
            tok = int(self.src[pos + 2:end])
            if tok > 0xFFFFFFFF:
                raise self.fail(pos, "token id is too big")
            if self.ch(end) != "]":
                raise self.fail(end, "expecting ']'")
            if self.ch(end + 1) != ">":
                raise self.fail(end + 1, "expecting '>'")
            return tok, end + 2
        close = self.src.find(">", pos)
        if close < 0:
            raise self.fail(pos, "expecting '>'")
        text = self.src[pos:close + 1]
        if self.token_of is None:
            raise self.fail(pos, "a token written as text needs the model's vocabulary")
        try:
            return self.token_of(text), close + 1
        except ValueError as e:
            raise self.fail(pos, str(e)) from None


def _left_recursive(rules: dict[int, list[list[int]]]) -> int | None:
    """The first symbol (by id) from which llama.cpp's left-recursion check finds recursion."""
    n = max(rules, default=-1) + 1
    visited, in_progress, may_be_empty = [False] * n, [False] * n, [False] * n

    def walk(r: int) -> bool:
        # an explicit stack would read worse; depth is bounded by the number of rules, and
        # the caller raises the recursion limit to match
        if in_progress[r]:
            return True
        in_progress[r] = True
        alts = rules.get(r, [])
        if any(not alt for alt in alts):
            may_be_empty[r] = True
        for alt in alts:
            for el in alt:
                if el == _T:
                    break
                # a rule walked before cannot reach one in progress now without having
                # reached it then, so its answer stands (llama.cpp walks it again)
                if not visited[el] and walk(el):
                    return True
                if not may_be_empty[el]:
                    break
        in_progress[r] = False
        visited[r] = True
        return False

    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * n + 1000))
    try:
        for r in range(n):
            if not visited[r] and walk(r):
                return r
    finally:
        sys.setrecursionlimit(old)
    return None


def parse_gbnf(text: str, root: str = "root",
               token_of: Callable[[str], int] | None = None) -> Grammar:
    """Parse `text` as llama.cpp does, or raise GrammarError. `token_of` maps a `<text>` token
    reference to its id (the model's tokenizer: exactly one token, else ValueError)."""
    if not isinstance(text, str):
        raise GrammarError(f"a grammar is text, got {type(text).__name__}")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the grammar has {len(text)} characters; at most "
                           f"{MAX_GRAMMAR_CHARS} are read")
    nul = text.find("\0")
    if nul >= 0:
        raise _Parser(text, None).fail(nul, "a NUL character in the grammar")
    p = _Parser(text, token_of)
    p.parse()
    for name, rid in p.flat.ids.items():
        if rid not in p.flat.rules:
            raise GrammarError(f"grammar: undefined rule '{name}'")
    if root not in p.rules:
        raise GrammarError(f"grammar does not contain a '{root}' rule")
    bad = _left_recursive(p.flat.rules)
    if bad is not None:
        names = {v: k for k, v in p.flat.ids.items()}
        what = f"rule '{names[bad]}'" if bad in names else f"a group or repetition (symbol {bad})"
        raise GrammarError(f"grammar: left recursion at {what}; llama.cpp's grammars do not "
                           "allow it")
    return Grammar(p.rules, root, text)
