"""graphs/grammar/json_schema.py writes the grammar llama.cpp's json_schema_to_grammar writes.

Conformance: the cases of llama.cpp's own tests/test-json-schema-to-grammar.cpp, read from its
source tree at test time (GGRAPH_LLAMACPP_SRC, default ~/.cache/llamacpp-tools/src; skipped
without it): a SUCCESS case's grammar must equal the expected one after the C++ test's trim, a
FAILURE case must raise SchemaError. Then our own cases, which run everywhere: their expected
grammars were written by llama.cpp's converter (the llama.cpp that llama-cpp-python 0.3.36
vendors), and every grammar made here must be read by llama.cpp's grammar parser where
llama-cpp-python is installed (llama_sampler_init_grammar with no vocabulary parses the text
and checks it for undefined rules and left recursion; LlamaGrammar.from_string only keeps the
text in this version).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from ggraph.graphs.grammar import json_schema
from ggraph.graphs.grammar.json_schema import (SchemaError, SchemaWarning, schema_to_gbnf,
                                               schema_to_gbnf_with_warnings)

SPACE = r'space ::= | " " | "\n"{1,2} [ \t]{0,20}'
CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'
STRING = r'string ::= "\"" char* "\""'


# -- llama.cpp's grammar parser, where llama-cpp-python is installed ---------------------------

def llama_parses(text: str) -> bool | None:
    """Whether llama.cpp reads the grammar (root `root`); None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    sampler = llama_cpp.llama_sampler_init_grammar(None, text.encode(), b"root")
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def grammar(schema, **kw) -> str:
    """The grammar, which llama.cpp's parser must also read."""
    text = schema_to_gbnf(schema, **kw)
    assert llama_parses(text) in (True, None), text
    return text


def lines(*rules: str) -> str:
    return "".join(f"{r}\n" for r in rules)


# -- conformance with llama.cpp's own test cases -----------------------------------------------

LLAMACPP_SRC = Path(os.environ.get("GGRAPH_LLAMACPP_SRC",
                                   "~/.cache/llamacpp-tools/src")).expanduser()
CASES_FILE = LLAMACPP_SRC / "tests" / "test-json-schema-to-grammar.cpp"
NOT_HERE = "llama.cpp's source is not here; run ../shared/tools/llamacpp-tools.sh"

# name -> why our output differs from the expected one (none so far)
EXPECTED_DIFFERENCES: dict[str, str] = {}

# one argument of test({...}): a raw string R"""(...)""" or a plain C string "..."
_ARG = r'(?:R"""\((?P<{0}_raw>.*?)\)"""|"(?P<{0}_str>(?:[^"\\]|\\.)*)")'
_CASE = re.compile(r'\btest\(\{\s*(?P<status>SUCCESS|FAILURE),\s*'
                   r'"(?P<name>(?:[^"\\]|\\.)*)",\s*' + _ARG.format("schema") + r",\s*"
                   + _ARG.format("grammar") + r"\s*\}\);", re.S)
_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}


@dataclass(frozen=True)
class Case:
    ok: bool
    name: str
    schema: str
    grammar: str


def _c_string(m: re.Match, arg: str) -> str:
    raw = m.group(f"{arg}_raw")
    if raw is not None:
        return raw
    return re.sub(r"\\(.)", lambda e: _C_ESCAPES.get(e.group(1), e.group(1)),
                  m.group(f"{arg}_str"))


def llamacpp_cases() -> list[Case]:
    text = CASES_FILE.read_text()
    return [Case(m.group("status") == "SUCCESS", m.group("name"), _c_string(m, "schema"),
                 _c_string(m, "grammar")) for m in _CASE.finditer(text)]


def trim(text: str) -> str:
    """The C++ test's comparison form: stripped, each line's leading blanks removed."""
    return re.sub(r"(^|\n)[ \t]+", r"\1", text.strip(" \n\r\t"))


CASES = llamacpp_cases() if CASES_FILE.is_file() else []


def test_every_llamacpp_case_is_read():
    if not CASES:
        pytest.skip(NOT_HERE)
    calls = len(re.findall(r"\btest\(\{", CASES_FILE.read_text()))
    assert len(CASES) == calls, "a test({...}) entry of llama.cpp's file was not understood"
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES or [None], ids=lambda c: c.name if c else "absent")
def test_llamacpp_case(case: Case | None):
    if case is None:
        pytest.skip(NOT_HERE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SchemaWarning)
            out = schema_to_gbnf(case.schema)
    except SchemaError as e:
        assert not case.ok, f"llama.cpp converts this schema; we refused it: {e}"
        return
    assert case.ok, f"llama.cpp refuses this schema; we wrote:\n{out}"
    if case.name in EXPECTED_DIFFERENCES:
        assert trim(out) != trim(case.grammar), "now equal: drop it from EXPECTED_DIFFERENCES"
        return
    assert trim(out) == trim(case.grammar)
    assert llama_parses(out) in (True, None)


# -- our own cases: expected grammars from llama.cpp's converter ----------------------------------

def test_required_and_optional_properties_enum_array_and_bounds():
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]},
                 "minItems": 1, "maxItems": 3}},
        "required": ["name", "age"], "additionalProperties": False}
    assert grammar(schema) == lines(
        'age ::= ([0-9] | ([1-8] [0-9] | [9] [0-9]) | "1" ([0-4] [0-9] | [5] "0"))',
        'age-kv ::= "\\"age\\"" space ":" space age',
        CHAR,
        'email-kv ::= "\\"email\\"" space ":" space string',
        'email-rest ::= ( "," space tags-kv )?',
        'name ::= "\\"" char{1,40} "\\""',
        'name-kv ::= "\\"name\\"" space ":" space name',
        'root ::= "{" space name-kv "," space age-kv ( "," space ( email-kv email-rest | '
        'tags-kv ) )? space "}"',
        SPACE, STRING,
        'tags ::= "[" space tags-item ("," space tags-item){0,2} space "]"',
        'tags-item ::= ("\\"a\\"" | "\\"b\\"" | "3" | "null")',
        'tags-kv ::= "\\"tags\\"" space ":" space tags')


def test_nested_object_and_formats():
    schema = {"type": "object", "required": ["owner"], "properties": {"owner": {
        "type": "object", "required": ["id"], "properties": {
            "id": {"type": "string", "format": "uuid"},
            "since": {"type": "string", "format": "date"}}}}}
    assert grammar(schema) == lines(
        'date ::= [0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | '
        '"3" [0-1] )',
        'date-string ::= "\\"" date "\\""',
        'owner ::= "{" space owner-id-kv ( "," space ( owner-since-kv ) )? space "}"',
        'owner-id-kv ::= "\\"id\\"" space ":" space uuid',
        'owner-kv ::= "\\"owner\\"" space ":" space owner',
        "owner-since ::= date-string",
        'owner-since-kv ::= "\\"since\\"" space ":" space owner-since',
        'root ::= "{" space owner-kv space "}"',
        SPACE,
        'uuid ::= "\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
        '[0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\""')


def test_pattern():
    schema = {"type": "string", "pattern": r"^[A-Z]{2}-[0-9]{3}(x|y)*\.$"}
    assert grammar(schema) == lines(
        'root ::= "\\"" (root-1{2,2} "-" root-2{3,3} ("x" | "y")* ".") "\\""',
        "root-1 ::= [A-Z]", "root-2 ::= [0-9]", SPACE)


def test_dotall_lets_dot_match_line_breaks():
    schema = {"type": "string", "pattern": "^a.$"}
    assert r"dot ::= [^\x0A\x0D]" in grammar(schema)
    assert r"dot ::= [\U00000000-\U0010FFFF]" in grammar(schema, dotall=True)


def test_unsupported_pattern_accepts_any_string_with_a_warning():
    schema = {"properties": {"p": {"type": "string", "pattern": r"^[A-Z]{2}\d$"}}}
    text, notes = schema_to_gbnf_with_warnings(schema)
    assert "p ::= string" in text and "root-1" not in text     # partial rules dropped
    assert notes == ['schema at /properties/p: pattern "^[A-Z]{2}\\\\d$" is not supported '
                     "(unsupported escape: \\d), accepting any string"]
    with pytest.warns(SchemaWarning, match="incomplete: schema at /properties/p"):
        assert schema_to_gbnf(schema) == text


def test_integer_bounds():
    schema = {"type": "array", "prefixItems": [
        {"type": "integer", "exclusiveMinimum": -1, "exclusiveMaximum": 1000},
        {"type": "integer", "maximum": -3}]}
    assert grammar(schema) == lines(
        'root ::= "[" space tuple-0 "," space tuple-1 space "]"', SPACE,
        "tuple-0 ::= ([0-9] | ([1-8] [0-9] | [9] [0-9]) | ([1-8] [0-9]{2} | [9] ([0-8] "
        "[0-9] | [9] [0-9])))",
        'tuple-1 ::= ("-" ([0-2] [0-9]{1,15} | [3-9] [0-9]{0,15}))')
    # a fractional bound is rounded inwards
    assert (schema_to_gbnf({"type": "integer", "minimum": 2.5, "maximum": 7.9})
            == schema_to_gbnf({"type": "integer", "minimum": 3, "maximum": 7}))


def test_ref_to_defs():
    schema = {"$ref": "#/$defs/point", "$defs": {"point": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"]}}}
    assert grammar(schema) == lines(
        "decimal-part ::= [0-9]{1,16}",
        "integral-part ::= [0] | [1-9] [0-9]{0,15}",
        'number ::= ("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
        'ref-defs-point ::= "{" space ref-defs-point-x-kv "," space ref-defs-point-y-kv '
        'space "}"',
        'ref-defs-point-x-kv ::= "\\"x\\"" space ":" space number',
        'ref-defs-point-y-kv ::= "\\"y\\"" space ":" space number',
        "root ::= ref-defs-point", SPACE)


def test_ref_cycle_is_a_rule_naming_itself():
    schema = {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "required": ["value"], "additionalProperties": False,
        "properties": {"value": {"type": "integer"},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    assert grammar(schema) == lines(
        'integer ::= ("-"? integral-part)',
        "integral-part ::= [0] | [1-9] [0-9]{0,15}",
        'ref-defs-node ::= "{" space ref-defs-node-value-kv ( "," space ( '
        'ref-defs-node-children-kv ) )? space "}"',
        'ref-defs-node-children ::= "[" space (ref-defs-node-children-item ("," space '
        'ref-defs-node-children-item)*)? space "]"',
        "ref-defs-node-children-item ::= ref-defs-node",
        'ref-defs-node-children-kv ::= "\\"children\\"" space ":" space '
        "ref-defs-node-children",
        'ref-defs-node-value-kv ::= "\\"value\\"" space ":" space integer',
        "root ::= ref-defs-node", SPACE)


def test_type_list_and_values_as_llama_cpp_writes_json():
    assert grammar({"type": ["string", "null"], "maxLength": 2}) == lines(
        'alternative-0 ::= "\\"" char{0,2} "\\""', CHAR, 'null ::= "null"',
        "root ::= alternative-0 | null", SPACE)
    # nlohmann's number forms (exponent from 1e15 on), UTF-8 kept, compact JSON
    values = [1e15, 1.5, 1e-5, 100000000000000.0, 123456789012345678901, -0.0,
              "\u00e9\n\"", {"k": [True, None]}]
    assert grammar({"enum": values}) == lines(
        'root ::= ("1e+15" | "1.5" | "1e-05" | "100000000000000.0" | '
        '"1.2345678901234568e+20" | "-0.0" | "\\"é\\\\n\\\\\\"\\"" | "{\\"k\\":[true,null]}")',
        SPACE)


def test_json_text_parsed_value_true_and_empty_schema_agree():
    schema = {"type": "object", "properties": {"a": {"const": 1}}}
    assert schema_to_gbnf(json.dumps(schema)) == schema_to_gbnf(schema)
    anything = grammar({})
    assert "root ::= value" in anything
    assert schema_to_gbnf(True) == schema_to_gbnf("true") == anything
    assert grammar({"type": "object"}).startswith("array ::= ")


def test_prop_order_puts_named_properties_first():
    schema = {"properties": {"a": {"type": "null"}, "b": {"type": "null"},
                             "c": {"type": "null"}}, "required": ["a", "b", "c"]}
    assert 'root ::= "{" space a-kv "," space b-kv "," space c-kv' in grammar(schema)
    assert ('root ::= "{" space c-kv "," space a-kv "," space b-kv'
            in grammar(schema, prop_order=["c", "x"]))


def test_additional_properties_exclude_the_named_keys():
    text = grammar({"properties": {"ab": {"type": "null"}, "ac": {"type": "null"}},
                    "additionalProperties": {"type": "integer"}})
    assert ('additional-k ::= ["] ( [a] ([b] char+ | [c] char+ | [^"bc] char*) | '
            '[^"a] char* )? ["]') in text


# -- refusals, each with its message --------------------------------------------------------------

def refused(schema, **kw) -> str:
    with pytest.raises(SchemaError) as e:
        schema_to_gbnf(schema, **kw)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_json_names_line_and_column():
    assert refused('{"type": "string",\n "x": }') == (
        "the schema is not valid JSON: Expecting value (line 2, column 7)")
    assert "NaN is not a JSON number" in refused('{"const": NaN}')
    assert "nested too deeply" in refused("[" * 100_000 + "]" * 100_000)


def test_unresolved_and_remote_refs():
    assert refused({"properties": {"a": {"$ref": "#/$defs/missing"}}, "$defs": {}}) == (
        "schema at /properties/a: cannot resolve $ref #/$defs/missing, missing not found")
    assert refused({"$ref": "#/$defs/list/5", "$defs": {"list": [{}]}}) == (
        "schema at the root: cannot resolve $ref #/$defs/list/5, 5 is out of range")
    assert refused({"$ref": "https://example.com/s.json#/a"}) == (
        "schema at the root: remote $ref https://example.com/s.json#/a is not supported: "
        "schemas are never fetched, only #/... pointers into this document are followed")
    # inside a $ref's target the pointer is where the target sits
    assert refused({"$ref": "#/$defs/a", "$defs": {"a": {"properties": {
        "x": {"type": "kaboom"}}}}}) == ("schema at /$defs/a/properties/x: unrecognized type "
                                         "kaboom")


def test_deep_nesting_is_refused_not_a_recursion_error():
    deep = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    message = refused(deep)
    assert message.endswith(f"schemas are nested more than {json_schema.MAX_DEPTH} levels deep")
    assert message.startswith("schema at .../") and len(message) < 250   # the pointer's end
    alts = {"type": "null"}
    for _ in range(200):
        alts = {"anyOf": [alts, {"type": "string"}]}
    assert "nested more than" in refused(alts)
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(200)}
    defs["d200"] = {}
    assert "nested more than" in refused({"$ref": "#/$defs/d0", "$defs": defs})
    assert "levels deep" in refused({"const": json.loads("[" * 400 + "]" * 400)})


def test_invalid_patterns_are_errors_joined():
    message = refused({"properties": {"p": {"type": "string", "pattern": "^(a$"},
                                      "q": {"type": "string", "pattern": "^a**[b$"}}})
    assert message == ('schema at /properties/p: invalid pattern "^(a$": unbalanced '
                       'parentheses; schema at /properties/q: invalid pattern "^a**[b$": '
                       "unterminated character class")


def test_counts_and_bounds_out_of_range():
    assert refused({"items": {}, "minItems": -1}) == (
        "schema at the root: minItems must be a non-negative integer")
    assert refused({"type": "string", "maxLength": 10**12}) == (
        "schema at the root: maxLength 1000000000000 is too large (at most 2147483647)")
    # the repetition's text does not grow with the count
    assert len(grammar({"items": {"type": "null"}, "minItems": 2000})) < 300
    assert "outside the 64-bit integers" in refused({"type": "integer", "minimum": 2**64})
    assert "cannot be written" in refused({"type": "integer", "minimum": -(2**63) + 1})


def test_hostile_shapes_are_bounded():
    cycle = {"allOf": [{"$ref": "#/$defs/a"}],
             "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    assert refused(cycle) == "schema at the root: allOf follows a $ref cycle through #/$defs/b"
    # every allOf level doubles the same subtree: the steps are counted, not the output
    defs = {f"d{i}": {"type": "object", "properties": {
        "x": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 4}}} for i in range(12)}
    defs["d12"] = {"type": "object", "properties": {"y": {"type": "null"}}}
    assert "steps" in refused({"$ref": "#/$defs/d0", "$defs": defs})
    wide = {"properties": {f"p{i}" * 40: {"type": "null"} for i in range(3000)}}
    assert "the grammar would be over 1048576 characters" in refused(wide)


def test_other_refusals():
    assert refused({"type": "kaboom"}) == "schema at the root: unrecognized type kaboom"
    assert refused({"type": 123}) == (
        "schema at the root: type must be a string or an array of strings")
    assert refused(False) == "schema at the root: the schema false accepts no value"
    assert refused({"items": [True, False]}) == (
        "schema at /items/1: the schema false accepts no value")
    assert refused({"enum": []}) == "schema at the root: enum must be a non-empty array"
    assert refused({"anyOf": {}}) == "schema at /anyOf: must be an array of schemas"
    assert refused('{"const": "\\ud800"}') == (
        "schema at /const: a string holds a lone UTF-16 surrogate")
    with pytest.raises(TypeError):
        schema_to_gbnf({}, prop_order="abc")
