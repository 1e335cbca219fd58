"""The first pass of the JSON Schema to GBNF conversion (graphs/grammar/json_schema.py
writes the rules): the schema's JSON read into schema nodes, as llama.cpp's
common/json-schema.cpp reads it, and refused where it falls outside the subset.

It owns the errors (`SchemaError`: one line naming the JSON pointer and what is wrong;
`SchemaWarning`), the nodes (`Node` and its kinds, `Property`), `Reader`, `load_schema` (the
JSON text), `check_json` (only JSON values) and the limits, which the writer shares.

The subset: type (a list of types is anyOf), const, enum, anyOf/oneOf, allOf (kept as
`AllOfNode`; the writer merges objects and intersects enums), properties/required/
additionalProperties, local `$ref` (`#/...` JSON pointers; a remote one is refused, nothing is
ever fetched), items/prefixItems and min/maxItems, min/maxLength, pattern (kept as text; the
writer makes it rules), format (date, time, date-time, uuid..uuid5), integer bounds. `true`
is accepted as the schema that allows anything (llama.cpp wants an object there); `false` is
refused.

Hostile input is refused where llama.cpp would overflow its stack or wrap numbers: schemas
nested more than MAX_DEPTH levels, JSON values more than MAX_JSON_DEPTH, counts beyond a C
int, integer bounds beyond 64 bits. MAX_GRAMMAR_CHARS and MAX_STEPS bound the writer.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ggraph.graphs.grammar.schema_pattern import FORMATS, INT64_MAX, INT64_MIN, UNBOUNDED

MAX_DEPTH = 64                 # nested schemas, a followed $ref counting as one
MAX_JSON_DEPTH = 256           # nested JSON values (a deep const or enum value included)
MAX_GRAMMAR_CHARS = 1 << 20    # the grammar's text
MAX_STEPS = 50_000             # schemas visited: allOf can repeat a subtree exponentially

_SURROGATE = re.compile("[\ud800-\udfff]")
_C_UINT = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")


class SchemaError(ValueError):
    """A schema this converter refuses: where (a JSON pointer) and what, on one line."""


class SchemaWarning(UserWarning):
    """Part of a schema the grammar does not enforce (an unsupported pattern)."""


def location(at: str) -> str:
    """`at /a/b` (or `at the root`) for a message; the writer's messages use it too."""
    if len(at) > 160:       # a hostile schema's pointer can be long; its end says where
        tail = at[-150:]
        at = "..." + tail[max(tail.find("/"), 0):]
    return f"at {at}" if at else "at the root"


def error_at(at: str, what: str) -> SchemaError:
    """The SchemaError for what is wrong at the JSON pointer `at` (raised by the caller)."""
    return SchemaError(f"schema {location(at)}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pointer_part(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# -- schema nodes: what the first pass keeps of the JSON -------------------------------------

@dataclass(eq=False)
class Node:
    at: str                       # JSON pointer of the schema, for messages


@dataclass(eq=False)
class AnyNode(Node):
    pass


@dataclass(eq=False)
class SimpleNode(Node):
    kind: str = "null"            # null, boolean or number: a builtin rule each


@dataclass(eq=False)
class RefNode(Node):
    ref: str = ""
    target: Node | None = None   # set once every $ref is read, so that cycles can close


@dataclass(eq=False)
class AnyOfNode(Node):
    children: list[Node] = field(default_factory=list)


@dataclass(eq=False)
class AllOfNode(Node):
    children: list[Node] = field(default_factory=list)


@dataclass(eq=False)
class ConstNode(Node):
    value: Any = None


@dataclass(eq=False)
class EnumNode(Node):
    values: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class IntegerNode(Node):
    lo: int = INT64_MIN           # inclusive; the sentinels mean unbounded
    hi: int = INT64_MAX


@dataclass(eq=False)
class StringNode(Node):
    pattern: str = ""
    format: str = ""              # a FORMATS value, "" for none
    min_len: int = 0
    max_len: int = -1


@dataclass(eq=False)
class ArrayNode(Node):
    items: Node | None = None
    min_items: int = 0
    max_items: int = -1


@dataclass(eq=False)
class TupleNode(Node):
    items: list[Node] = field(default_factory=list)


@dataclass(eq=False)
class Property:
    name: str
    schema: Node
    required: bool


@dataclass(eq=False)
class ObjectNode(Node):
    properties: list[Property] = field(default_factory=list)   # in the schema's order
    additional: Node | None = None                              # None: not allowed


# -- first pass: JSON to nodes ---------------------------------------------------------------

class Reader:
    """Reads the schema into nodes in llama.cpp's order of keywords; the first problem found
    is raised."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.refs: dict[str, Node | None] = {}
        self.pending: list[RefNode] = []
        self.depth = 0

    def read(self) -> Node:
        node = self.node(self.root, "")
        for ref in self.pending:
            ref.target = self.refs[ref.ref]
        return node

    def node(self, s: Any, at: str) -> Node:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise error_at(at, f"schemas are nested more than {MAX_DEPTH} levels deep")
            return self.schema(s, at)
        finally:
            self.depth -= 1

    def schema(self, s: Any, at: str) -> Node:
        if s is True:
            s = {}
        if s is False:
            raise error_at(at, "the schema false accepts no value")
        if not isinstance(s, dict):
            raise error_at(at, "schema must be an object")
        if "$ref" in s:
            return self.reference(s["$ref"], at)
        if "oneOf" in s or "anyOf" in s:
            key = "oneOf" if "oneOf" in s else "anyOf"
            return AnyOfNode(at, self.alternatives(s[key], f"{at}/{key}"))
        kind = s.get("type")
        if isinstance(kind, list):      # {"type": [a, b], ...} is anyOf [{type: a, ...}, ...]
            if not kind:
                raise error_at(at, "type must not be empty")
            return AnyOfNode(at, [self.node({**s, "type": t}, f"{at}/type/{i}")
                               for i, t in enumerate(kind)])
        if "const" in s:
            return ConstNode(at, s["const"])
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise error_at(at, "enum must be a non-empty array")
            return EnumNode(at, list(s["enum"]))
        if kind is not None and not isinstance(kind, str):
            raise error_at(at, "type must be a string or an array of strings")
        has_properties = "properties" in s or (
            "additionalProperties" in s and s["additionalProperties"] is not True)
        if not kind:
            # without a type the keywords decide, in llama.cpp's order
            if has_properties:
                return self.object(s, at)
            if "allOf" in s:
                return AllOfNode(at, self.alternatives(s["allOf"], f"{at}/allOf"))
            if "items" in s or "prefixItems" in s:
                return self.array(s, at)
            if ("pattern" in s or "minLength" in s or "maxLength" in s
                    or self.format(s, at)):
                return self.string(s, at)
            return AnyNode(at)
        if kind == "object":
            if not has_properties and "allOf" in s:
                return AllOfNode(at, self.alternatives(s["allOf"], f"{at}/allOf"))
            return self.object(s, at)
        if kind == "string":
            if "allOf" in s:
                return AllOfNode(at, self.alternatives(s["allOf"], f"{at}/allOf"))
            return self.string(s, at)
        if kind == "array":
            return self.array(s, at)
        if kind == "integer":
            return self.integer(s, at)
        if kind in ("number", "boolean", "null"):
            return SimpleNode(at, kind)
        raise error_at(at, f"unrecognized type {kind}")

    def reference(self, ref: Any, at: str) -> Node:
        if not isinstance(ref, str):
            raise error_at(at, "$ref must be a string")
        if not ref.startswith("#/"):
            if ref.startswith("#"):
                raise error_at(at, f"unsupported $ref {ref}: only JSON pointers into this "
                                "document (#/...) are supported")
            raise error_at(at, f"remote $ref {ref} is not supported: schemas are never "
                            "fetched, only #/... pointers into this document are followed")
        if ref not in self.refs:
            self.refs[ref] = None     # taken before reading, so that a cycle back stops here
            self.refs[ref] = self.node(self.resolve(ref, at), ref[1:])
        node = RefNode(at, ref)
        self.pending.append(node)
        return node

    def resolve(self, ref: str, at: str) -> Any:
        """The value a `#/a/b/0` pointer names, its parts taken literally (as llama.cpp
        does: no ~0/~1 unescaping)."""
        target = self.root
        for part in ref[2:].split("/"):
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list):
                m = _C_UINT.match(part)      # std::stoull, as llama.cpp reads an index
                index = int(m.group(2)) if m else len(target)
                if m and m.group(1) == "-" and index:
                    index = len(target)
                if index >= len(target):
                    raise error_at(at, f"cannot resolve $ref {ref}, {part} is out of range")
                target = target[index]
            else:
                raise error_at(at, f"cannot resolve $ref {ref}, {part} not found")
        return target

    def alternatives(self, alts: Any, at: str) -> list[Node]:
        if not isinstance(alts, list):
            raise error_at(at, "must be an array of schemas")
        if not alts:
            raise error_at(at, "must not be empty")
        return [self.node(alt, f"{at}/{i}") for i, alt in enumerate(alts)]

    def object(self, s: dict, at: str) -> Node:
        node = ObjectNode(at)
        required = s.get("required")
        required = {n for n in required if isinstance(n, str)} if isinstance(
            required, list) else set()
        if "properties" in s:
            props = s["properties"]
            if not isinstance(props, dict):
                raise error_at(at, "properties must be an object")
            for name, sub in props.items():
                node.properties.append(Property(
                    name, self.node(sub, f"{at}/properties/{_pointer_part(name)}"),
                    name in required))
        if "additionalProperties" in s:
            extra = s["additionalProperties"]
            if isinstance(extra, bool):
                node.additional = AnyNode(at) if extra else None
            elif isinstance(extra, dict):
                node.additional = self.node(extra, f"{at}/additionalProperties")
            else:
                raise error_at(at, "additionalProperties must be a boolean or a schema")
        elif "properties" not in s:
            node.additional = AnyNode(at)     # {"type": "object"} alone: any object
        return node

    def array(self, s: dict, at: str) -> Node:
        if "items" in s or "prefixItems" in s:
            key = "items" if "items" in s else "prefixItems"   # items wins, as in llama.cpp
            items = s[key]
            if isinstance(items, list):
                return TupleNode(at, [self.node(x, f"{at}/{key}/{i}")
                                   for i, x in enumerate(items)])
            item = self.node(items, f"{at}/{key}")
        else:
            item = AnyNode(at)
        return ArrayNode(at, item, self.count(s, "minItems", at, 0),
                      self.count(s, "maxItems", at, -1))

    def string(self, s: dict, at: str) -> Node:
        pattern = s.get("pattern", "")
        if not isinstance(pattern, str):
            raise error_at(at, "pattern must be a string")
        return StringNode(at, pattern, self.format(s, at), self.count(s, "minLength", at, 0),
                       self.count(s, "maxLength", at, -1))

    def integer(self, s: dict, at: str) -> Node:
        node = IntegerNode(at)
        # a fractional bound is rounded inwards; an exclusive one moves one step in
        if "minimum" in s:
            node.lo = self.bound(s, "minimum", at, math.ceil)
        elif "exclusiveMinimum" in s:
            node.lo = self.bound(s, "exclusiveMinimum", at, math.floor, +1)
        if "maximum" in s:
            node.hi = self.bound(s, "maximum", at, math.floor)
        elif "exclusiveMaximum" in s:
            node.hi = self.bound(s, "exclusiveMaximum", at, math.ceil, -1)
        return node

    @staticmethod
    def format(s: dict, at: str) -> str:
        if "format" not in s:
            return ""
        if not isinstance(s["format"], str):
            raise error_at(at, "format must be a string")
        return FORMATS.get(s["format"], "")

    @staticmethod
    def count(s: dict, key: str, at: str, default: int) -> int:
        if key not in s:
            return default
        v = s[key]
        if not _is_int(v) or v < 0:
            raise error_at(at, f"{key} must be a non-negative integer")
        # llama.cpp keeps counts in a C int (the repetition's text does not grow with it)
        if v > UNBOUNDED:
            raise error_at(at, f"{key} {v} is too large (at most {UNBOUNDED})")
        return v

    @staticmethod
    def bound(s: dict, key: str, at: str, rounding: Any, step: int = 0) -> int:
        v = s[key]
        if not (_is_int(v) or isinstance(v, float)):
            raise error_at(at, f"{key} must be a number")
        b = (v if _is_int(v) else rounding(v)) + step
        if not INT64_MIN <= b <= INT64_MAX:
            raise error_at(at, f"{key} {v} is outside the 64-bit integers")
        return b


# -- the JSON itself: text to a value, and only JSON values ----------------------------------

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_schema(schema: dict | bool | str) -> Any:
    """The schema's value: JSON text parsed (NaN and Infinity refused), any other value as
    it is."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise SchemaError(f"the schema is not valid JSON: {e.msg} (line {e.lineno}, column "
                          f"{e.colno})") from None
    except RecursionError:
        raise SchemaError("the schema is not valid JSON: nested too deeply to read") from None
    except ValueError as e:
        raise SchemaError(f"the schema is not valid JSON: {e}") from None


def check_json(value: Any) -> None:
    """Only JSON values, at most MAX_JSON_DEPTH deep, no lone surrogates (llama.cpp's JSON
    parser refuses those); a walk without recursion, since the value can be hostile."""
    todo: list[tuple[Any, tuple | None, int]] = [(value, None, 0)]

    def where(path: tuple | None) -> str:
        parts = []
        while path is not None:
            path, key = path
            parts.append(_pointer_part(str(key)))
        return "".join(f"/{p}" for p in reversed(parts))

    while todo:
        v, path, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise error_at(where(path), f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise error_at(where(path), f"object key {k!r} is not a string")
                if _SURROGATE.search(k):
                    raise error_at(where(path), f"key {k!r} holds a lone UTF-16 surrogate")
                todo.append((x, (path, k), depth + 1))
        elif isinstance(v, list):
            todo.extend((x, (path, i), depth + 1) for i, x in enumerate(v))
        elif isinstance(v, str):
            if _SURROGATE.search(v):
                raise error_at(where(path), "a string holds a lone UTF-16 surrogate")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise error_at(where(path), f"{v} is not a JSON number")
        elif v is not None and not isinstance(v, (bool, int)):
            raise error_at(where(path), f"a {type(v).__name__} is not a JSON value")

