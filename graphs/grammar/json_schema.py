"""A JSON Schema as the GBNF grammar llama.cpp's json_schema_to_grammar writes for it: the
same rules, named the same, each with the same text, sorted by name as llama.cpp's std::map
sorts them, so that a grammar from ggraph and one from llama.cpp
(common/json-schema-to-grammar.cpp, with common/json-schema.cpp reading the schema) are one
grammar.

Two passes, as llama.cpp makes them. The first, graphs/grammar/schema_read.py, reads the
JSON into schema nodes and refuses what falls outside the subset (listed there) with a
one-line `SchemaError` naming the JSON pointer and what is wrong. This module owns the
second, `_Writer`, and the entry points `schema_to_gbnf` and `schema_to_gbnf_with_warnings`.
The writer names each rule after where it sits (`a-kv`, `item`, `ref-defs-node`); a `$ref`
cycle is a rule that names itself; allOf merges objects and intersects enums. A pattern the
grammar cannot express (graphs/grammar/schema_pattern.py) accepts any string and gives a
warning; an invalid one is an error, several joined by "; ".

Where llama.cpp's output is odd, so is this one (a property named "" takes the rule name
`root`, a property name holding `"` or `]` breaks the additionalProperties key rule), since
being the same grammar is the point. Hostile input is refused where llama.cpp would
overflow its stack (an allOf reaching itself through a $ref) or run long: rules nested more
than MAX_DEPTH levels (a followed `$ref` counts as one), grammars over MAX_GRAMMAR_CHARS,
conversions over MAX_STEPS steps; schema_read.py refuses the rest before this pass.
"""
from __future__ import annotations

import json
import re
import warnings
from typing import Sequence

from ggraph.graphs.grammar.schema_pattern import (BUILTINS, INT64_MAX, INT64_MIN, RESERVED,
                                                  SPACE_RULE, UNBOUNDED, InvalidPattern,
                                                  UnsupportedPattern, UnwritableBounds,
                                                  gbnf_literal, int_range, json_text,
                                                  not_strings, pattern_to_rule, repetition)
# callers (the server, the tools, the tests) import SchemaError, SchemaWarning and MAX_DEPTH
# from here, as they did before the first pass moved out, so this module re-exports them
from ggraph.graphs.grammar.schema_read import (MAX_DEPTH, MAX_GRAMMAR_CHARS, MAX_STEPS,
                                               AllOfNode, AnyNode, AnyOfNode, ArrayNode,
                                               ConstNode, EnumNode, IntegerNode, Node,
                                               ObjectNode, Reader, RefNode, SchemaError,
                                               SchemaWarning, SimpleNode, StringNode,
                                               TupleNode, check_json, error_at, load_schema,
                                               location)

_NAME_BREAKS = re.compile(r"[^a-zA-Z0-9-]+")


def _shown(pattern: str) -> str:
    """A pattern quoted for a message, cut at 80 characters (a schema's can be long)."""
    return json.dumps(pattern if len(pattern) <= 80 else pattern[:80] + "...",
                      ensure_ascii=False)


# -- second pass: nodes to rules -------------------------------------------------------------

class _Writer:
    """llama.cpp's SchemaConverter: rules by name, the first holder of a name keeping it and
    a different rule under the same name taking the first free `name0`, `name1`, ..."""

    def __init__(self, prop_order: Sequence[str], dotall: bool) -> None:
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.size = len("space ::= \n") + len(SPACE_RULE)
        self.order = {name: i for i, name in enumerate(prop_order)}
        self.dotall = dotall
        self.open_refs: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.depth = self.steps = 0
        self.at = ""

    def text(self) -> str:
        return "".join(f"{name} ::= {rule}\n" for name, rule in sorted(self.rules.items()))

    def add_rule(self, name: str, rule: str) -> str:
        key = _NAME_BREAKS.sub("-", name)
        if key in self.rules and self.rules[key] != rule:
            i = 0
            while f"{key}{i}" in self.rules and self.rules[f"{key}{i}"] != rule:
                i += 1
            key = f"{key}{i}"
        if key not in self.rules:
            self.size += len(key) + len(rule) + len(" ::= \n")
            if self.size > MAX_GRAMMAR_CHARS:
                raise error_at(self.at, f"the grammar would be over {MAX_GRAMMAR_CHARS} "
                                     "characters")
            self.rules[key] = rule
        return key

    def builtin(self, name: str, kind: str) -> str:
        text, deps = BUILTINS[kind]
        added = self.add_rule(name, text)
        for dep in deps:
            if dep not in self.rules:
                self.builtin(dep, dep)
        return added

    def visit(self, node: Node, name: str) -> str:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise error_at(node.at, f"the conversion takes over {MAX_STEPS} steps (allOf "
                                 "repeating the same schemas?)")
        self.depth += 1
        outer, self.at = self.at, node.at
        try:
            if self.depth > MAX_DEPTH:
                raise error_at(node.at, f"schemas are nested more than {MAX_DEPTH} levels deep "
                                     "($refs followed included)")
            return self.rule_for(node, name)
        finally:
            self.depth -= 1
            self.at = outer

    def rule_for(self, node: Node, name: str) -> str:
        rule_name = f"{name}-" if name in RESERVED else name or "root"
        prefix = f"{name}-" if name else ""
        match node:
            case RefNode():
                return self.add_rule(rule_name, self.reference(node))
            case AnyOfNode():
                return self.add_rule(rule_name, " | ".join(
                    self.visit(alt, f"{name}-{i}" if name else f"alternative-{i}")
                    for i, alt in enumerate(node.children)))
            case AllOfNode():
                return self.all_of(node, name, rule_name)
            case ConstNode():
                return self.add_rule(rule_name, gbnf_literal(json_text(node.value)))
            case EnumNode():
                return self.add_rule(rule_name, "(" + " | ".join(
                    gbnf_literal(json_text(v)) for v in node.values) + ")")
            case ObjectNode():
                if not node.properties and isinstance(node.additional, AnyNode):
                    return self.add_rule(rule_name, self.builtin("object", "object"))
                return self.add_rule(rule_name, self.object_rule(
                    [(p.name, p.schema) for p in node.properties],
                    {p.name for p in node.properties if p.required}, name, node.additional))
            case TupleNode():
                items = ' "," space '.join(self.visit(x, f"{prefix}tuple-{i}")
                                           for i, x in enumerate(node.items))
                return self.add_rule(rule_name, f'"[" space {items} space "]"')
            case ArrayNode():
                if (isinstance(node.items, AnyNode) and node.min_items == 0
                        and node.max_items < 0):
                    return self.primitive(rule_name, "array")
                item = self.visit(node.items, f"{prefix}item")
                hi = UNBOUNDED if node.max_items < 0 else node.max_items
                return self.add_rule(rule_name, '"[" space ' + repetition(
                    item, node.min_items, hi, '"," space') + ' space "]"')
            case StringNode():
                return self.string(node, rule_name)
            case IntegerNode():
                if node.lo == INT64_MIN and node.hi == INT64_MAX:
                    return self.primitive(rule_name, "integer")
                try:
                    return self.add_rule(rule_name, f"({int_range(node.lo, node.hi)})")
                except UnwritableBounds as e:
                    raise error_at(node.at, f"{e} cannot be written (nor can llama.cpp)"
                                   ) from None
            case SimpleNode():
                return self.primitive(rule_name, node.kind)
        return self.add_rule(rule_name, self.builtin("value", "value"))   # AnyNode

    def primitive(self, rule_name: str, kind: str) -> str:
        return self.builtin("root" if rule_name == "root" else kind, kind)

    def reference(self, node: RefNode) -> str:
        fragment = node.ref.split("#", 1)[1]
        ref_name = "ref" + _NAME_BREAKS.sub("-", fragment)
        # a $ref already written, or one being written further up (a cycle), is its name
        if ref_name not in self.rules and node.ref not in self.open_refs:
            self.open_refs.add(node.ref)
            ref_name = self.visit(node.target, ref_name)
            self.open_refs.discard(node.ref)
        return ref_name

    def all_of(self, node: AllOfNode, name: str, rule_name: str) -> str:
        """The objects among the parts merged into one (properties of the anyOf parts
        optional); if the parts are enums, the values all of them list."""
        props: list[tuple[str, Node]] = []
        required: set[str] = set()
        counts: dict[str, int] = {}

        def add(part: Node, is_required: bool) -> None:
            seen: set[Node] = set()
            # llama.cpp recurses here without end on a cycle
            while isinstance(part, RefNode):
                if part in seen:
                    raise error_at(node.at, f"allOf follows a $ref cycle through {part.ref}")
                seen.add(part)
                part = part.target
            if isinstance(part, ObjectNode):
                for p in part.properties:
                    props.append((p.name, p.schema))
                    if is_required:
                        required.add(p.name)
            elif isinstance(part, EnumNode):
                for v in part.values:
                    key = gbnf_literal(json_text(v))
                    counts[key] = counts.get(key, 0) + 1

        for child in node.children:
            if isinstance(child, AnyOfNode):
                for alt in child.children:
                    add(alt, False)
            else:
                add(child, True)
        common = [k for k in sorted(counts) if counts[k] == len(node.children)]
        if common:
            return self.add_rule(rule_name, "(" + " | ".join(common) + ")")
        return self.add_rule(rule_name, self.object_rule(props, required, name, None))

    def object_rule(self, props: list[tuple[str, Node]], required: set[str], name: str,
                    additional: Node | None) -> str:
        """Required properties in order, then the optional ones (and '*': any other key),
        each optional one allowed to start the rest; rule `k-rest` is what may follow k."""
        prefix = f"{name}-" if name else ""
        if self.order:
            last = len(self.order)
            ranked = sorted(enumerate(props), key=lambda ip: (self.order.get(ip[1][0], last),
                                                               ip[0]))
            props = [p for _, p in ranked]
        kv: dict[str, str] = {}
        must: list[str] = []
        may: list[str] = []
        for prop_name, schema in props:
            value = self.visit(schema, prefix + prop_name)
            key = gbnf_literal(json_text(prop_name))
            kv[prop_name] = self.add_rule(f"{prefix}{prop_name}-kv",
                                          f'{key} space ":" space {value}')
            (must if prop_name in required else may).append(prop_name)
        if additional is not None:
            sub = f"{prefix}additional"
            value = (self.builtin("value", "value") if isinstance(additional, AnyNode)
                     else self.visit(additional, f"{sub}-value"))
            if props:
                char = self.builtin("char", "char")
                key = self.add_rule(f"{sub}-k", not_strings([p for p, _ in props], char))
            else:
                key = self.builtin("string", "string")
            kv["*"] = self.add_rule(f"{sub}-kv", f'{key} ":" space {value}')
            may.append("*")
        if not must and not may:
            return '"{" space "}"'

        def comma(k: str) -> str:
            return f'( "," space {kv[k]} )'

        # rest[j]: what may follow may[j]; written from the last back, the order in which
        # llama.cpp's recursion first adds them (later adds find the same rules)
        rest = [""] * len(may)
        for j in range(len(may) - 2, -1, -1):
            k = may[j + 1]
            text = comma(k) + ("*" if k == "*" else "?")
            if j + 1 < len(may) - 1:
                text += f" {rest[j + 1]}"
            rest[j] = self.add_rule(f"{prefix}{may[j]}-rest", text)
        rule = '"{" space ' + ' "," space '.join(kv[k] for k in must)
        if may:
            starts = []
            for i, k in enumerate(may):
                start = kv[k] + (f" {comma(k)}*" if k == "*" else "")
                starts.append(f"{start} {rest[i]}" if i < len(may) - 1 else start)
            rule += " (" + (' "," space ( ' if must else "") + " | ".join(starts)
            rule += (" )" if must else "") + " )?"
        return rule + ' space "}"'

    def string(self, node: StringNode, rule_name: str) -> str:
        if node.pattern:
            return self.pattern(node, rule_name)
        if node.format == "uuid":
            return self.primitive(rule_name, "uuid")
        if node.format:
            return self.add_rule(rule_name, self.builtin(node.format, node.format))
        if node.min_len > 0 or node.max_len >= 0:
            char = self.builtin("char", "char")
            hi = UNBOUNDED if node.max_len < 0 else node.max_len
            return self.add_rule(rule_name, f'"\\"" {repetition(char, node.min_len, hi)} "\\""')
        return self.primitive(rule_name, "string")

    def pattern(self, node: StringNode, rule_name: str) -> str:
        # the pattern only adds rules, so dropping the ones added since is a rollback
        n_rules, size = len(self.rules), self.size
        shown = _shown(node.pattern)
        try:
            return pattern_to_rule(node.pattern, rule_name, self.add_rule, self.dotall)
        except UnsupportedPattern as e:
            self.rollback(n_rules, size)
            self.warnings.append(f"schema {location(node.at)}: pattern {shown} is not "
                                 f"supported ({e}), accepting any string")
            return self.add_rule(rule_name, self.builtin("string", "string"))
        except InvalidPattern as e:
            self.rollback(n_rules, size)
            self.errors.append(f"schema {location(node.at)}: invalid pattern {shown}: {e}")
            return ""

    def rollback(self, n_rules: int, size: int) -> None:
        while len(self.rules) > n_rules:
            self.rules.popitem()
        self.size = size


# -- entry points ----------------------------------------------------------------------------

def schema_to_gbnf_with_warnings(schema: dict | bool | str, *, prop_order: Sequence[str] = (),
                                 dotall: bool = False) -> tuple[str, list[str]]:
    """The grammar and the warnings (parts of the schema it accepts anything for).

    `schema`: JSON text or the parsed value. `prop_order`: properties named here come
    first, in this order (llama.cpp's --prop-order); `dotall`: `.` in a pattern matches line
    breaks too. Raises SchemaError."""
    if isinstance(prop_order, str):
        raise TypeError("prop_order is a sequence of property names, not one string")
    value = load_schema(schema)
    check_json(value)
    root = Reader(value).read()
    writer = _Writer(prop_order, dotall)
    writer.visit(root, "")
    if writer.errors:
        raise SchemaError("; ".join(writer.errors))
    return writer.text(), writer.warnings


def schema_to_gbnf(schema: dict | bool | str, *, prop_order: Sequence[str] = (),
                   dotall: bool = False) -> str:
    """The GBNF grammar llama.cpp writes for `schema` (root rule `root`). A part it cannot
    enforce gives a SchemaWarning (see schema_to_gbnf_with_warnings); raises SchemaError."""
    text, notes = schema_to_gbnf_with_warnings(schema, prop_order=prop_order, dotall=dotall)
    if notes:
        warnings.warn("JSON schema conversion was incomplete: " + "; ".join(notes),
                      SchemaWarning, stacklevel=2)
    return text