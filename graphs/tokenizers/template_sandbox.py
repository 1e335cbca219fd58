"""The sandbox chat templates compile and render in: jinja2's immutable sandbox with a bound
on the size of every value a template builds (graphs/tokenizers/tokenizer.py owns the template itself).

jinja2's sandbox keeps a template away from Python's internals, not from building a string of
10^11 characters or an integer of 10^9 digits in one C call, which no time limit can stop: the
tokenizer's deadline is checked between template lines, and the allocation alone can take the
machine's memory. So each way of making a big value is checked before the value is made, and a
template that tries is stopped with a SecurityError naming what it tried:

- `*` and `+` on strings, lists and tuples (repetition, concatenation) past MAX_VALUE items;
  `*` and `**` on integers past MAX_BITS bits; `%` formatting with a width past MAX_VALUE;
- `~` (jinja's string concatenation, compiled by _BoundedCodeGenerator into one checked join);
- filters that make values of a size given as an integer, and string and list methods, given
  an integer past MAX_VALUE (`center(10**9)`, `slice(10**9)`, `'x'.ljust(10**9)`), a format
  string with such a width (`format`, `str.format`), and `replace`, `join` and `indent` whose
  result would pass MAX_VALUE characters.

Jinja evaluates filters on constants while compiling, so the bounds hold at compile time too.
"""
from __future__ import annotations

import functools
import re
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_VALUE = 1 << 20   # items or characters one operation may build
MAX_BITS = 1 << 16    # bits of an integer product or power (about 20,000 digits)

# the numbers of a %-conversion (width, precision) and of a str.format field's spec
_PERCENT = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_BRACES = re.compile(r"\{[^{}]*:[^{}\d]*(\d*)[^{}\d]*(\d*)")


def _check_format(fmt: Any, what: str) -> None:
    if not isinstance(fmt, str):
        return
    for pattern in (_PERCENT, _BRACES):
        for m in pattern.finditer(fmt):
            for g in m.groups():
                if g and len(g) > 7 or g and int(g) > MAX_VALUE:
                    raise SecurityError(f"{what} with a field width of {g[:20]}")


def _check_ints(what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_VALUE:
            raise SecurityError(f"{what} with an argument of {v if v < 10**30 else 'a huge number'}")


def _check_size(what: str, n: int) -> None:
    if n > MAX_VALUE:
        raise SecurityError(f"{what} making {n} characters")


def _replaced_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    s, old, new = str(s), str(old), str(new)
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


# filters whose integer arguments are sizes of what they make (a width, a count of parts)
_SIZED = frozenset({"center", "indent", "wordwrap", "slice", "batch", "format", "tojson",
                    "truncate", "replace"})


def _bounded_filter(name: str, fn: Any) -> Any:
    """fn, checked before it runs: integer arguments (not the value it filters) and what
    replace, join, indent and format would make."""
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    what = f"the filter {name}"

    @functools.wraps(fn)   # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        lead = 0
        while lead < len(args) and isinstance(args[lead], (Context, EvalContext, Environment)):
            lead += 1
        if lead == len(args):
            return fn(*args, **kwargs)
        value, rest = args[lead], args[lead + 1:]
        if name in _SIZED:
            _check_ints(what, rest, kwargs)
        if name == "replace":
            _check_size(what, _replaced_size(value, *rest[:3]))
        elif name == "format":
            _check_format(value, what)
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            _check_size(what, len(value) + (value.count("\n") + 1) *
                        (len(width) if isinstance(width, str) else int(width)))
        elif name == "join" and len(rest) < 2 and "attribute" not in kwargs:
            items = list(value)
            sep = rest[0] if rest else kwargs.get("d", "")
            _check_size(what, sum(len(str(x)) for x in items) +
                        len(str(sep)) * max(len(items) - 1, 0))
            args = args[:lead] + (items,) + rest
        return fn(*args, **kwargs)
    return bounded


def bounded_join(items: Any) -> str:
    """`a ~ b ~ c`: one join, its size checked first."""
    parts = [str(x) for x in items]
    _check_size("a concatenation with ~", sum(map(len, parts)))
    return "".join(parts)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `~` into environment.bounded_join((...)) instead of jinja's unchecked join
    (the sandbox does not intercept it). Templates render without autoescaping, where jinja's
    own join is plain string concatenation too."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every value a template builds bounded. Filters added
    after construction go through `set_filter` to be bounded too."""
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.filters = {k: _bounded_filter(k, f) for k, f in self.filters.items()}
        self.bounded_join = bounded_join

    def set_filter(self, name: str, fn: Any) -> None:
        self.filters[name] = _bounded_filter(name, fn)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
        ints = [x for x in (left, right) if isinstance(x, int) and not isinstance(x, bool)]
        if op == "*" and sizes and ints and sizes[0] * max(ints[0], 0) > MAX_VALUE:
            raise SecurityError(f"a repetition of {sizes[0]} x {ints[0]} items")
        if op == "+" and len(sizes) == 2 and sum(sizes) > MAX_VALUE:
            raise SecurityError(f"a concatenation of {sum(sizes)} items")
        if op == "**" and isinstance(right, (int, float)) and abs(right) > 1024 and \
                isinstance(left, (int, float)) and abs(left) > 1:
            raise SecurityError(f"a power with exponent {right}")
        if len(ints) == 2 and op in ("*", "**") and abs(left) > 1:
            bits = left.bit_length() + right.bit_length() if op == "*" else \
                left.bit_length() * max(right, 0)
            if bits > MAX_BITS:
                raise SecurityError(f"an integer {'product' if op == '*' else 'power'} of "
                                    f"about {bits} bits")
        if op == "%" and isinstance(left, str):
            _check_format(left, "% formatting")
            if "*" in left:   # widths taken from the arguments
                _check_ints("% formatting", right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, op, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__, f"str.{value.__name__}")
        return wrapped

    def call(__self, __context: Any, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        name = getattr(__obj, "__name__", type(__obj).__name__)
        owner = getattr(__obj, "__self__", None)
        what = f"a call of {name}"
        if isinstance(owner, (str, list, tuple)):   # ljust(10**9), zfill, expandtabs, ...
            _check_ints(what, args, kwargs)
        if isinstance(owner, str) and name == "replace" and len(args) >= 2:
            _check_size(what, _replaced_size(owner, *args[:3]))
        elif isinstance(owner, str) and name == "join" and args:
            items = list(args[0])
            _check_size(what, sum(len(str(x)) for x in items) +
                        len(owner) * max(len(items) - 1, 0))
            args = (items, *args[1:])
        return super().call(__context, __obj, *args, **kwargs)
