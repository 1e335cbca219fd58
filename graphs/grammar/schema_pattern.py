"""The GBNF text of single JSON Schema values, as llama.cpp's json_schema_to_grammar writes
it; graphs/grammar/json_schema.py puts the pieces together into rules.

- `pattern_to_rule`: a `pattern` (a regular expression) as a rule (llama.cpp's
  _visit_pattern). Only an anchored pattern (`^...$`) becomes a grammar: literals, `.`,
  groups (capturing or `(?:...)`), alternation, character classes and the quantifiers
  `* + ? {n} {n,} {n,m}`. Anything else is `UnsupportedPattern` (a valid regex with no
  grammar here: lookaround, `\\d`, an inner anchor, ...; the caller then accepts any string
  and warns, as llama.cpp does) or `InvalidPattern` (no regex at all: unbalanced
  parentheses, a dangling quantifier, ...; an error).
- `repetition`: `x{n,m}` for minItems/maxItems, minLength/maxLength and pattern counts.
- `int_range`: integer minimum/maximum as digit rules (llama.cpp's build_min_max_int).
- `not_strings`: an additionalProperties key that is none of the named properties.
- `json_text`, `gbnf_literal`: a const or enum value as the literal llama.cpp writes.
- `BUILTINS`: llama.cpp's rules for the primitive types and string formats.

The text is llama.cpp's to the character, also where it is odd: a quantifier after an
escaped character repeats the whole literal before it (`a\\.+` is `"a."+`), and a count of
2147483647 is no bound at all.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

# llama.cpp keeps counts in a C int and writes INT_MAX for "no upper bound", so a schema or
# pattern that asks for exactly 2147483647 gets no bound either; the same sentinel keeps the
# text identical. Integer bounds are int64, the extremes meaning "unbounded" likewise.
UNBOUNDED = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_PATTERN_DEPTH = 100        # nested groups, past which the pattern is unsupported

# characters that end a run of literal text, and those a backslash makes literal again
_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_REGEX_ONLY_ESCAPES = frozenset("^$.[]()|{}*+?")
# escapes GBNF reads itself (llama.cpp's parse_char), kept as written; hex digits after x/u/U
_GBNF_ESCAPES = frozenset('trn\\"[]-')
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_HEX = frozenset("0123456789abcdefABCDEF")
# what C's strtol accepts before it stops: blanks, a sign, decimal digits
_C_INT = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_SPECIALS = re.compile(r'[\r\n"\\]')


# -- llama.cpp's builtin rules ----------------------------------------------------------------

SPACE_RULE = r'| " " | "\n"{1,2} [ \t]{0,20}'
# name -> (text, rules it uses); llama.cpp's primitive and string-format rules
BUILTINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string ":" space value ("," space string ":" space value)* )? '
               'space "}"', ("string", "value")),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": (r'"\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} '
             r'"-" [0-9a-fA-F]{12} "\""', ()),
    "char": (r'[^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": (r'"\"" char* "\""', ("char",)),
    "null": ('"null"', ()),
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" '
             '( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )', ()),
    "time": ('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
             '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )', ()),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": (r'"\"" date "\""', ("date",)),
    "time-string": (r'"\"" time "\""', ("time",)),
    "date-time-string": (r'"\"" date-time "\""', ("date-time",)),
}
# a schema named like one of these gets a '-' appended, so that its rule keeps its own name
RESERVED = frozenset(BUILTINS) | {"root"}
FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string",
           "uuid": "uuid", **{f"uuid{i}": "uuid" for i in range(1, 6)}}


# -- patterns and repetitions -----------------------------------------------------------------

class UnsupportedPattern(Exception):
    """A regex the grammar cannot express: the string becomes any string, with a warning."""


class InvalidPattern(Exception):
    """Not a regex at all: the schema is refused."""


def repetition(item: str, lo: int, hi: int, separator: str = "") -> str:
    """`item` lo..hi times (hi UNBOUNDED: no limit), each after the first preceded by
    `separator` when one is given; the empty string for hi == 0."""
    bounded = hi != UNBOUNDED
    if hi == 0:
        return ""
    if lo == 0 and hi == 1:
        return f"{item}?"
    if not separator:
        if lo == 1 and not bounded:
            return f"{item}+"
        if lo == 0 and not bounded:
            return f"{item}*"
        return f"{item}{{{lo},{hi if bounded else ''}}}"
    rest = repetition(f"({separator} {item})", lo - 1 if lo else 0, hi - 1 if bounded else hi)
    text = f"{item} {rest}"
    return f"({text})?" if lo == 0 else text


def gbnf_escape_length(text: str, pos: int) -> int:
    """Length of the escape at text[pos] that GBNF reads as one character, 0 if there is none
    (then the regex escape has no grammar equivalent)."""
    if pos + 1 >= len(text) or text[pos] != "\\":
        return 0
    kind = text[pos + 1]
    if kind in _GBNF_ESCAPES:
        return 2
    n_hex = _HEX_DIGITS.get(kind, 0)
    if not n_hex or pos + 2 + n_hex > len(text):
        return 0
    if not all(h in _HEX for h in text[pos + 2:pos + 2 + n_hex]):
        return 0
    return 2 + n_hex


def _c_int(text: str) -> int:
    """std::stoi: leading blanks and a sign, then digits; trailing text ignored."""
    m = _C_INT.match(text)
    if not m:
        raise UnsupportedPattern("invalid number in curly brackets")
    value = int(m.group(1))
    if not -2**31 <= value <= 2**31 - 1:
        raise UnsupportedPattern("invalid number in curly brackets")
    return value


class _PatternReader:
    """One pass over the pattern's inside (between ^ and $): each group read by a recursive
    call, a sequence as (text, is_literal) pieces whose neighbouring literals merge."""

    def __init__(self, body: str, name: str, add_rule: Callable[[str, str], str],
                 dotall: bool) -> None:
        self.body, self.name, self.add_rule, self.dotall = body, name, add_rule, dotall
        self.i = 0
        self.depth = 0
        # a repeated non-literal becomes its own rule, one per distinct text, numbered from 1
        self.sub_rules: dict[str, str] = {}

    def dot(self) -> str:
        return self.add_rule("dot", "[\\U00000000-\\U0010FFFF]" if self.dotall
                             else "[^\\x0A\\x0D]")

    def sequence(self) -> str:
        """Read up to the closing parenthesis of this group (or the end); its GBNF text."""
        body, n = self.body, len(self.body)
        seq: list[tuple[str, bool]] = []
        while self.i < n:
            c = body[self.i]
            if c == ".":
                seq.append((self.dot(), False))
                self.i += 1
            elif c == "(":
                self.i += 1
                if self.i < n and body[self.i] == "?":
                    if self.i + 1 < n and body[self.i + 1] == ":":
                        self.i += 2      # (?:...) is a plain group here
                    else:
                        raise UnsupportedPattern("unsupported group syntax")
                self.depth += 1
                if self.depth > MAX_PATTERN_DEPTH:
                    raise UnsupportedPattern("pattern nesting too deep")
                seq.append((f"({self.sequence()})", False))
            elif c == ")":
                self.i += 1
                if self.depth == 0:
                    raise InvalidPattern("unbalanced parentheses")
                self.depth -= 1
                return _join(seq)
            elif c in "^$":
                raise UnsupportedPattern("anchor inside the pattern")
            elif c == "[":
                seq.append((self.char_class(), False))
            elif c == "|":
                seq.append(("|", False))
                self.i += 1
            elif c in "*+?":
                if not seq:
                    raise InvalidPattern("nothing to repeat")
                seq[-1] = (_as_rule(seq[-1]) + c, False)
                self.i += 1
            elif c == "{":
                self.curly(seq)
            else:
                seq.append((self.literal(c), True))
        return _join(seq)

    def char_class(self) -> str:
        body, n = self.body, len(self.body)
        out = ["["]
        self.i += 1
        while self.i < n and body[self.i] != "]":
            if body[self.i] == "\\":
                size = gbnf_escape_length(body, self.i)
                if not size:
                    raise UnsupportedPattern("unsupported escape in character class: "
                                             + body[self.i:self.i + 2])
                out.append(body[self.i:self.i + size])
                self.i += size
            else:
                out.append(body[self.i])
                self.i += 1
        if self.i >= n:
            raise InvalidPattern("unterminated character class")
        self.i += 1
        return "".join(out) + "]"

    def curly(self, seq: list[tuple[str, bool]]) -> None:
        body = self.body
        end = body.find("}", self.i + 1)
        if end < 0:
            raise UnsupportedPattern("unterminated curly brackets")
        nums = body[self.i + 1:end].split(",")
        self.i = end + 1
        if len(nums) not in (1, 2):
            raise UnsupportedPattern("wrong number of values in curly brackets")
        if len(nums) == 1:
            lo = hi = _c_int(nums[0])
        else:
            lo = _c_int(nums[0]) if nums[0] else 0
            hi = _c_int(nums[1]) if nums[1] else UNBOUNDED
        if not seq:
            raise InvalidPattern("nothing to repeat")
        text, literal = seq[-1]
        if literal:
            item = f'"{text}"'
        else:
            if text not in self.sub_rules:
                self.sub_rules[text] = ""          # numbered counting itself, as llama.cpp
                self.sub_rules[text] = self.add_rule(f"{self.name}-{len(self.sub_rules)}",
                                                     text)
            item = self.sub_rules[text]
        seq[-1] = (repetition(item, lo, hi), False)

    def literal(self, first: str) -> str:
        """A run of literal characters, escapes resolved. A character directly before a
        quantifier is left for the next run, so that the quantifier repeats it alone."""
        body, n = self.body, len(self.body)
        out = ""
        while self.i < n:
            c = body[self.i]
            if c == "\\":
                if self.i == n - 1:
                    raise InvalidPattern("trailing backslash")
                nxt = body[self.i + 1]
                if nxt in _REGEX_ONLY_ESCAPES:
                    out += nxt
                    self.i += 2
                else:
                    size = gbnf_escape_length(body, self.i)
                    if not size:
                        raise UnsupportedPattern("unsupported escape: "
                                                 + body[self.i:self.i + 2])
                    out += body[self.i:self.i + size]
                    self.i += size
            elif c == '"':
                out += '\\"'
                self.i += 1
            elif c not in _NON_LITERAL and (self.i == n - 1 or not out
                                            or body[self.i + 1] == "."
                                            or body[self.i + 1] not in _NON_LITERAL):
                out += c
                self.i += 1
            else:
                break
        if not out:      # nothing taken: a stray ']' or '}'
            raise UnsupportedPattern(f"unsupported character: {first}")
        return out


def _as_rule(piece: tuple[str, bool]) -> str:
    text, literal = piece
    return f'"{text}"' if literal else text


def _join(seq: list[tuple[str, bool]]) -> str:
    """The sequence's text: neighbouring literals as one quoted string."""
    parts: list[str] = []
    run = ""
    for text, literal in seq:
        if literal:
            run += text
            continue
        if run:
            parts.append(f'"{run}"')
            run = ""
        parts.append(text)
    if run:
        parts.append(f'"{run}"')
    return " ".join(parts)


def pattern_to_rule(pattern: str, name: str, add_rule: Callable[[str, str], str],
                    dotall: bool = False) -> str:
    """Add the rule for a JSON string matching `pattern` (with its helper rules, through
    `add_rule(name, text) -> the name given`); return its name. Raises UnsupportedPattern or
    InvalidPattern, after which the caller drops the helper rules added so far."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        raise UnsupportedPattern("not anchored with '^' and '$'")
    reader = _PatternReader(pattern[1:-1], name, add_rule, dotall)
    text = reader.sequence()
    if reader.depth:
        raise InvalidPattern("unbalanced parentheses")
    return add_rule(name, f'"\\"" ({text}) "\\""')


# -- integer bounds as digit rules ------------------------------------------------------------

class UnwritableBounds(ValueError):
    """Bounds llama.cpp's build_min_max_int gives up on."""


def _neg(x: int) -> int:
    return INT64_MIN if x == INT64_MIN else -x     # two's complement, as in C++


def _digits(out: list[str], lo: str, hi: str) -> None:
    out.append(f"[{lo}]" if lo == hi else f"[{lo}-{hi}]")


def _more_digits(out: list[str], lo: int, hi: int) -> None:
    out.append("[0-9]")
    if lo == hi == 1:
        return
    upper = "" if hi == lo else "," + ("" if hi == UNBOUNDED else str(hi))
    out.append(f"{{{lo}{upper}}}")


def _same_length_range(out: list[str], lo: str, hi: str) -> None:
    """Numbers from lo to hi written with as many digits as they have."""
    i = 0
    while i < len(lo) and i < len(hi) and lo[i] == hi[i]:
        i += 1
    if i:
        out.append(f'"{lo[:i]}"')
    if i >= len(lo) or i >= len(hi):
        return
    if i:
        out.append(" ")
    rest = len(lo) - i - 1
    if not rest:
        out.append(f"[{lo[i]}-{hi[i]}]")
        return
    lo_rest, hi_rest, zeros, nines = lo[i + 1:], hi[i + 1:], "0" * rest, "9" * rest
    below, above = chr(ord(hi[i]) - 1), chr(ord(lo[i]) + 1)
    hi_done = False
    out.append("(")
    if lo_rest == zeros:
        _digits(out, lo[i], below)
        out.append(" ")
        _more_digits(out, rest, rest)
    else:
        out.append(f"[{lo[i]}] (")
        _same_length_range(out, lo_rest, nines)
        out.append(")")
        if lo[i] < below:
            out.append(" | ")
            hi_done = hi_rest == nines
            _digits(out, above, hi[i] if hi_done else below)
            out.append(" ")
            _more_digits(out, rest, rest)
    if not hi_done:
        out.append(" | ")
        _digits(out, hi[i], hi[i])
        out.append(" ")
        _same_length_range(out, zeros, hi_rest)
    out.append(")")


def _int_range(out: list[str], lo: int, hi: int, decimals: int = 16, top: bool = True) -> None:
    """The digits of the integers in [lo, hi] (INT64_MIN / INT64_MAX: unbounded), as
    llama.cpp's build_min_max_int writes them; `decimals` caps an unbounded number's digits,
    `top` is false inside a number (where leading zeros are digits like any other)."""
    has_lo, has_hi = lo != INT64_MIN, hi != INT64_MAX
    if has_lo and has_hi:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            _int_range(out, _neg(hi), _neg(lo), decimals, True)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            _int_range(out, 0, _neg(lo), decimals, True)
            out.append(") | ")
            lo = 0
        lo_s, hi_s = str(lo), str(hi)
        for width in range(len(lo_s), len(hi_s)):
            _same_length_range(out, lo_s, "9" * width)
            lo_s = "1" + "0" * width
            out.append(" | ")
        _same_length_range(out, lo_s, hi_s)
        return
    fewer = max(decimals - 1, 1)
    if has_lo:
        if lo < 0:
            out.append('"-" (')
            _int_range(out, INT64_MIN, _neg(lo), decimals, False)
            out.append(") | [0] | [1-9] ")
            _more_digits(out, 0, decimals - 1)
        elif lo == 0:
            if top:
                out.append("[0] | [1-9] ")
                _more_digits(out, 0, fewer)
            else:
                _more_digits(out, 1, decimals)
        elif lo <= 9:
            c, start = str(lo), "1" if top else "0"
            if c > start:
                _digits(out, start, chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, 1, fewer)
                out.append(" | ")
            _digits(out, c, "9")
            out.append(" ")
            _more_digits(out, 0, fewer)
        else:
            lo_s = str(lo)
            c = lo_s[0]
            if c > "1":
                _digits(out, "1" if top else "0", chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, len(lo_s), fewer)
                out.append(" | ")
            _digits(out, c, c)
            out.append(" (")
            _int_range(out, int(lo_s[1:]), INT64_MAX, fewer, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                _digits(out, chr(ord(c) + 1), "9")
                out.append(" ")
                _more_digits(out, len(lo_s) - 1, fewer)
        return
    if has_hi:
        if hi >= 0:
            if top:
                out.append('"-" [1-9] ')
                _more_digits(out, 0, fewer)
                out.append(" | ")
            _int_range(out, 0, hi, decimals, True)
        else:
            out.append('"-" (')
            _int_range(out, _neg(hi), INT64_MAX, decimals, False)
            out.append(")")
        return
    # only reached through a bound of -9223372036854775807, whose negation is "unbounded"
    raise UnwritableBounds("integer bounds at the edge of the 64-bit range")


def int_range(lo: int, hi: int) -> str:
    """The integers in [lo, hi] as digit rules (INT64_MIN / INT64_MAX: no bound on that
    side), as llama.cpp's build_min_max_int writes them. Raises UnwritableBounds."""
    out: list[str] = []
    _int_range(out, lo, hi)
    return "".join(out)


# -- keys other than the named properties ----------------------------------------------------

class _Trie:
    __slots__ = ("children", "end")

    def __init__(self) -> None:
        self.children: dict[str, _Trie] = {}
        self.end = False


def not_strings(names: list[str], char: str) -> str:
    """A JSON string that is none of `names` (`char`: the rule for one string character), by
    a trie of their characters, children in code point order. Written without recursion, as
    a name can be long. Like llama.cpp's, it writes the characters into brackets unescaped
    and lets a name that is a prefix of another one through."""
    root = _Trie()
    for word in names:
        node = root
        for c in word:
            node = node.children.setdefault(c, _Trie())
        node.end = True
    out = ['["] ( ']
    stack = [(root, iter(sorted(root.children.items())), [])]
    while stack:
        node, todo, rejects = stack[-1]
        nxt = next(todo, None)
        if nxt is None:
            stack.pop()
            if node.children:
                out.append(f' | [^"{"".join(rejects)}] {char}*')
            if stack:
                out.append(")")
            continue
        c, child = nxt
        if rejects:
            out.append(" | ")
        rejects.append(c)
        out.append(f"[{c}]")
        if child.children:
            out.append(" (")
            stack.append((child, iter(sorted(child.children.items())), []))
        else:
            out.append(f" {char}+")
    out.append(" )" if root.end else " )?")
    return "".join(out) + ' ["]'


# -- JSON text as llama.cpp (nlohmann::json) writes it ---------------------------------------

def _double_text(x: float) -> str:
    """nlohmann's shortest form: fixed point while the decimal point sits within 15 digits
    (Python switches at 16), else d.ddde+XX."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    # value = 0.<digits> * 10**point
    point = len(whole) + int(exp or 0) - (len(whole + frac) - len(digits))
    digits = digits.rstrip("0")
    k, sign = len(digits), "-" if x < 0 else ""
    if k <= point <= 15:
        return f"{sign}{digits}{'0' * (point - k)}.0"
    if 0 < point <= 15:
        return f"{sign}{digits[:point]}.{digits[point:]}"
    if -4 < point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    e = point - 1
    body = digits[0] + (f".{digits[1:]}" if k > 1 else "")
    return f"{sign}{body}e{'-' if e < 0 else '+'}{abs(e):02d}"


def json_text(v: Any) -> str:
    """Compact JSON as llama.cpp dumps it: UTF-8 as is, nlohmann's number forms (an integer
    outside 64 bits was read as a double)."""
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int):
        return str(v) if -2**63 <= v < 2**64 else _double_text(float(v))
    if isinstance(v, float):
        return _double_text(v)
    if isinstance(v, list):
        return "[" + ",".join(json_text(x) for x in v) + "]"
    return "{" + ",".join(f"{json_text(k)}:{json_text(x)}" for k, x in v.items()) + "}"


def gbnf_literal(text: str) -> str:
    """A GBNF string literal matching `text`."""
    return '"' + _LITERAL_SPECIALS.sub(lambda m: _LITERAL_ESCAPES[m.group()], text) + '"'
